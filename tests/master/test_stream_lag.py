"""A stream job's lag against its SLO (``tidal.master.planning.StreamLag``): scored as the simulator
scores a policy, shown in the status, on /metrics and in the timeline, journaled through a
master's failover; and the past traffic a planner is seeded with. Driven with a fake clock."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.test_master import FakeClock, make_master
from tidal.api import (
    JobObservation,
    JoinRequest,
    RendezvousRequest,
    ReportRequest,
    ResourcePlan,
)
from tidal.backends.fake import FakeBackend
from tidal.brain.dataparallel import FixedWorkers
from tidal.brain.kale import KalePlanner
from tidal.brain.planners import MaxWorkersPlanner
from tidal.master.api import JobSpec
from tidal.master.job import JobMaster
from tidal.master.journal import SqliteJournal
from tidal.master.metrics import job_registry, render
from tidal.master.planning import Planning, StreamLag
from tidal.sim.online import SLO_LAG_S, SimConfig, simulate


def test_the_live_score_is_the_simulators_on_the_same_lags() -> None:
    """One simulated day-part of a job held at 9 workers, too few for its peaks (lag at the end of
    each minute), replayed through the live bookkeeping at a 60x time scale (a minute of trace is
    a second of wall time): the same SLO violation rate and accumulated lag as the simulator
    reports."""
    rng = np.random.default_rng(3)
    arrivals = 2e6 * (1.0 + np.sin(np.linspace(0, 3 * np.pi, 360)) ** 2 + rng.uniform(0, 0.3, 360))
    result = simulate(arrivals, {"nine": lambda: FixedWorkers(9)}, SimConfig(peak_workers=12))["nine"]
    assert 0.0 < result.slo_violation_rate < 1.0  # the run has both sides of the SLO to score
    book = StreamLag(slo_s=SLO_LAG_S)
    book.observe(0.0, 0.0, time_scale=60.0)  # the clock starts here: nothing is scored yet
    assert book.observed_s == 0.0
    for minute, lag in enumerate(result.lag_s, start=1):
        book.observe(float(minute), float(lag), time_scale=60.0)
    assert book.observed_s == pytest.approx(60.0 * len(arrivals))
    assert book.violation_ratio == pytest.approx(result.slo_violation_rate)
    assert book.accumulated_lag_min == pytest.approx(result.accumulated_lag_min)


def test_each_interval_counts_with_the_lag_at_its_end() -> None:
    book = StreamLag(slo_s=100.0)
    book.observe(10.0, 50.0, time_scale=2.0)
    book.observe(12.0, 100.0, time_scale=2.0)  # 4 trace seconds at the SLO: not over it
    book.observe(13.0, 160.0, time_scale=2.0)  # 2 over it
    book.observe(13.0, 999.0, time_scale=2.0)  # no time passed: nothing scored, the lag shown
    book.observe(12.5, 999.0, time_scale=2.0)  # a clock that steps back scores nothing
    assert (book.observed_s, book.violated_s, book.violation_ratio) == (6.0, 2.0, pytest.approx(1 / 3))
    assert book.accumulated_lag_min == pytest.approx((100.0 * 4 + 160.0 * 2) / 3600)
    assert book.lag_s == 999.0 and book.last_at == 13.0
    again = StreamLag(slo_s=100.0)
    again.restore(book.to_meta())
    assert again == book
    assert StreamLag().status(1.0) is None  # no lag known yet


def stream_master(tmp_path: Path, clock: FakeClock, backend: FakeBackend, **spec_args: object) -> JobMaster:
    spec = JobSpec(job_id="t", argv=["python", "x.py"], min_workers=1, max_workers=2, token="tok",
                   job_dir=str(tmp_path), ledger_path=str(tmp_path / "ledger.jsonl"), start_grace_s=0.0,
                   stream_url="redis://127.0.0.1:1/clicks", time_scale=10.0, lag_slo_s=30.0, **spec_args)  # type: ignore[arg-type]
    return JobMaster(spec, SqliteJournal(tmp_path / "journal.sqlite"), backend, MaxWorkersPlanner(), clock,
                     store_port=1)


def report_lag(master: JobMaster, worker: int, oldest_s: float, measured_s: float = 0.0) -> None:
    """The worker's report: one partition, its oldest waiting record arrived at ``oldest_s`` (0:
    none waits), as it looked at ``measured_s`` (0: it does not say)."""
    master.report(ReportRequest(worker_id=worker, round=master.round, applied_step=-1, incarnation=master.incarnation,
                                stream_backlog=5 if oldest_s else 0, stream_lag={0: 5 if oldest_s else 0},
                                stream_oldest_ms=int(oldest_s * 1000),
                                stream_oldest_by_partition={0: int(oldest_s * 1000)} if oldest_s else {},
                                stream_measured_ms=int(measured_s * 1000), stream_busy=1.0))


def test_the_lag_is_the_age_when_the_worker_looked_until_that_goes_stale(tmp_path: Path) -> None:
    """A worker measures once a second and reports every 0.25 s: aging each measurement from the
    master's clock would add that delay to every lag (minutes of trace time under compression).
    The lag is held at its measured value for LAG_STALE_S, then ages (a worker that stalled)."""
    clock, backend = FakeClock(), FakeBackend()
    master = stream_master(tmp_path, clock, backend)  # time scale 10
    master.start()
    master.tick()
    master.join(JoinRequest(worker_id=0, pid=10_000))
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=-1, applied_step=-1, stream_partitions=[0]))
    master.tick()
    looked = clock.now
    report_lag(master, 0, oldest_s=looked - 0.5, measured_s=looked)  # 0.5 s old when it looked
    seen = []
    for _ in range(4):
        clock.now += 1.0
        master.tick()
        lag = master.status().stream_lag
        assert lag is not None
        seen.append(lag.lag_s)
        assert master.status().stream[0].lag_s == lag.lag_s
    assert seen == [5.0, 5.0, 15.0, 25.0]  # held 2 s, then aging: (0.5 + 1) x 10, (0.5 + 2) x 10
    master.close()


def test_the_master_scores_the_lag_shows_it_and_carries_it_through_failover(tmp_path: Path) -> None:
    clock, backend = FakeClock(), FakeBackend()
    master = stream_master(tmp_path, clock, backend)
    master.start()
    master.tick()
    master.join(JoinRequest(worker_id=0, pid=10_000))
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=-1, applied_step=-1, stream_partitions=[0]))
    master.tick()
    assert master.round == 0
    for _ in range(3):  # no report yet: the lag is unknown, nothing is scored
        clock.now += 1.0
        master.tick()
    assert master.status().stream_lag is None and master.timeline().points[-1].lag_s is None
    assert master.timeline().points[-1].busy is None
    oldest = clock.now
    report_lag(master, 0, oldest)
    for _ in range(5):  # the oldest record waits on: 10, 20, ... 50 trace seconds old
        clock.now += 1.0
        master.tick()
    st = master.status().stream_lag
    assert st is not None and (st.slo_s, st.time_scale, st.lag_s) == (30.0, 10.0, 50.0)
    assert st.observed_s == 40.0 and st.violation_ratio == pytest.approx(0.5)  # 40 and 50 s are over 30 s
    assert st.accumulated_lag_min == pytest.approx((20 + 30 + 40 + 50) * 10 / 3600)
    tl = master.timeline()
    assert tl.lag_slo_s == 30.0 and [p.lag_s for p in tl.points[-3:]] == [30.0, 40.0, 50.0]
    assert tl.points[-1].busy == 1.0  # the members' busy share, what a capacity is measured over
    text = render(job_registry(master)).decode()
    assert "tidal_stream_lag_seconds 50.0" in text and "tidal_stream_lag_slo_seconds 30.0" in text
    assert "tidal_stream_slo_violation_ratio 0.5" in text
    assert f"tidal_stream_accumulated_lag_minutes_total {st.accumulated_lag_min}" in text
    assert 'tidal_stream_lag_records{partition="0"} 5.0' in text
    assert 'tidal_stream_partition_lag_seconds{partition="0"} 50.0' in text
    (partition,) = master.status().stream
    assert (partition.partition, partition.worker, partition.lag, partition.lag_s) == (0, 0, 5, 50.0)
    master.close()

    # the master dies; 2 s later another takes over from the journal and the worker reports to
    # it: the outage is scored with the lag it then sees (70 trace seconds, over the SLO)
    clock.now += 2.0
    successor = stream_master(tmp_path, clock, backend.restarted())
    successor.resume()
    restored = successor.status().stream_lag
    assert restored is not None and restored.observed_s == 40.0 and restored.lag_s == 50.0
    report_lag(successor, 0, oldest)
    successor.tick()
    after = successor.status().stream_lag
    assert after is not None and after.observed_s == 60.0 and after.lag_s == 70.0
    assert after.violation_ratio == pytest.approx(40.0 / 60.0)
    report_lag(successor, 0, 0.0)  # drained: no lag
    clock.now += 1.0
    successor.tick()
    drained = successor.status().stream_lag
    assert drained is not None and drained.lag_s == 0.0 and drained.violation_ratio == pytest.approx(40.0 / 70.0)
    assert [(s.lag, s.lag_s) for s in successor.status().stream] == [(0, 0.0)]
    successor.close()


def test_a_dataset_job_has_no_stream_lag(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:1")
    master.tick()
    clock.now += 1.0
    master.tick()
    assert master.status().stream_lag is None and master.timeline().lag_slo_s is None
    assert "tidal_stream_lag" not in render(job_registry(master)).decode()


class HistoryPlanner:
    """A planner that keeps an arrival history (as kale and madu do), recording what it was fed."""

    name = "history"

    def __init__(self) -> None:
        self.fed: list[tuple[list[float], float]] = []

    def observe_history(self, arrivals: list[float], interval_s: float) -> None:
        self.fed.append((list(arrivals), interval_s))

    def plan(self, obs: JobObservation) -> ResourcePlan:
        return ResourcePlan(workers=1)


def test_the_planner_is_seeded_with_the_traffic_history_before_it_decides(tmp_path: Path) -> None:
    planner = HistoryPlanner()
    p = Planning(planner, started_at=0.0)
    assert p.seed_history([3.0, 4.0, 5.0], 60.0) == 3
    assert planner.fed == [([3.0, 4.0, 5.0], 60.0)]
    st = p.status(overridden=False)
    assert (st.history_bins, st.history_interval_s) == (3, 60.0)
    assert Planning(MaxWorkersPlanner(), started_at=0.0).seed_history([1.0], 60.0) == 0  # keeps no history

    # the master seeds it from the spec (journaled with it: a master that takes over seeds again)
    clock = FakeClock()
    kale = KalePlanner()
    spec = JobSpec(job_id="t", argv=["python", "x.py"], min_workers=1, max_workers=2, token="tok",
                   job_dir=str(tmp_path), stream_url="redis://127.0.0.1:1/c",
                   traffic_history=[100.0] * 1440, traffic_history_interval_s=60.0)
    master = JobMaster(spec, SqliteJournal(tmp_path / "journal.sqlite"), FakeBackend(), kale, clock, store_port=1)
    assert len(kale._bins) == 144  # a day of 10-minute planning bins, 100 records a minute each
    assert kale._bins[0] == pytest.approx(100.0 / 60)
    planner_status = master.status().planner
    assert planner_status is not None and planner_status.history_bins == 1440
    master.close()



def test_a_stream_jobs_capacity_is_measured_from_its_busy_share() -> None:
    """Busy share is the step time weighted by how full the batches were: two workers training
    600 records/s while half busy could train 1,200/s; a job a tenth busy shows too little."""
    from tidal.api import WorkerState
    from tidal.master.membership import WorkerRecord
    from tidal.master.planning import MEASURE_UTILIZATION

    planning = Planning(MaxWorkersPlanner(), 0.0)

    def members(busy: float) -> list[WorkerRecord]:
        out = []
        for w in range(2):
            r = WorkerRecord(worker_id=w, state=WorkerState.ACTIVE, launched_at=0.0)
            r.samples_per_s, r.stream_busy, r.stream_backlog = 300.0, busy, 0
            out.append(r)
        return out

    half = planning.observe_stream(10.0, 1.0, 2.0, 0, members(0.5), ready=True)
    assert half.measured == [(2.0, 600.0)] and half.utilization == 0.5  # 600 trace records/s at 2x
    assert planning.observe_stream(11.0, 1.0, 2.0, 0, members(MEASURE_UTILIZATION / 2), ready=True).measured == []
    assert planning.observe_stream(12.0, 1.0, 2.0, 0, members(1.0), ready=False).measured == []  # re-forming
    # workers that report the rate they trained at while busy (over the same steps as their busy
    # share): that is the capacity, whatever their smoothed rate says (it lags a ramp)
    ramp = members(0.5)
    for r in ramp:
        r.samples_per_s, r.stream_capacity = 120.0, 640.0
    assert planning.observe_stream(13.0, 1.0, 2.0, 0, ramp, ready=True).measured == [(2.0, 640.0)]
    # a member whose first steps of the round are not over (capacity 0: the master sets it when
    # the round forms, the worker says so until its steady steps): nothing is measured, neither
    # from the others' reports nor from the rate over the busy share
    joined = members(0.5)
    joined[0].stream_capacity, joined[1].stream_capacity = 640.0, 0.0
    assert planning.observe_stream(14.0, 1.0, 2.0, 0, joined, ready=True).measured == []
    # what a planner prices the local queues' wait with: the stream's partitions, and the step batch
    # and queue threshold the members report (0 where nobody said: no shuffling)
    assert (half.partitions, half.queue_upper, half.step_batch) == (0, 0.0, 0.0)
    shuffled = members(0.5)
    for r in shuffled:
        r.stream_batch, r.stream_queue_upper = 128, 160
    seen = planning.observe_stream(15.0, 1.0, 2.0, 0, shuffled, ready=True, partitions=list(range(8)))
    assert (seen.partitions, seen.queue_upper, seen.step_batch) == (8, 160.0, 128.0)


def test_the_arrival_rate_is_the_slope_of_what_was_appended() -> None:
    """``ArrivalMeter``: per partition, the slope of its reader's counts of the records ever
    appended over the last second (and the count before it); a new reader starts again (two
    workers' clocks are not compared), a report resent is ignored, and a partition nobody has
    counted for ``stale_s`` makes the rate unknown."""
    from tidal.master.planning import ArrivalMeter

    meter = ArrivalMeter(window_s=1.0, stale_s=3.0)
    assert meter.rate([0, 1], now=0.0) is None
    for i, t in enumerate([10.0, 10.5, 11.0, 11.5, 12.0]):
        meter.note(reader=0, at_s=t, appended={0: 100 * i, 1: 40 * i}, now=t)
    meter.note(reader=0, at_s=12.0, appended={0: 999, 1: 999}, now=12.1)  # resent: same time, ignored
    # partition 0: 100 records per half second, partition 1: 40
    assert meter.rate([0, 1], now=12.1) == pytest.approx(200.0 + 80.0)
    assert meter.rate([0], now=12.1) == pytest.approx(200.0)
    assert meter.rate([0, 1, 2], now=12.1) is None  # partition 2 not counted yet
    meter.note(reader=1, at_s=500.0, appended={1: 1000}, now=12.6)  # a new reader, another clock
    assert meter.rate([0, 1], now=12.6) is None  # no slope from it yet
    meter.note(reader=1, at_s=501.0, appended={1: 1030}, now=13.6)
    assert meter.rate([1], now=13.6) == pytest.approx(30.0)
    assert meter.rate([0, 1], now=15.2) is None  # partition 0's reader has said nothing for 3.2 s


def test_the_observed_arrivals_follow_the_appended_counts_not_the_commits(tmp_path: Path) -> None:
    """The arrivals a stream planner reads: from the records appended (reported by the readers)
    when they say it; the commits land a step's batch at a time, so read over one interval the
    older estimate (committed plus the growth of the backlog) swings by a batch either way."""
    from tidal.api import WorkerState
    from tidal.master.membership import WorkerRecord

    counted, uncounted = Planning(MaxWorkersPlanner(), 0.0), Planning(MaxWorkersPlanner(), 0.0)
    member = WorkerRecord(worker_id=0, state=WorkerState.ACTIVE, launched_at=0.0)
    member.stream_backlog = 0
    # 1,000 records/s arrive; the worker commits 512-record batches: 0, 512, 1536, 2048 at the calls
    seen, older = [], []
    for k, committed in enumerate([0, 512, 1536, 2048]):
        now = 10.0 + k
        counted.arrivals.note(0, now, {0: 1000 * k}, now)
        seen.append(counted.observe_stream(now, 1.0, 1.0, committed, [member], ready=True, partitions=[0]).arrivals)
        older.append(uncounted.observe_stream(now, 1.0, 1.0, committed, [member], ready=True, partitions=[0]).arrivals)
    assert seen == [[0.0], [1000.0], [1000.0], [1000.0]]  # no slope at the first call: the older estimate
    assert older == [[0.0], [512.0], [1024.0], [512.0]]  # workers that do not count: commits' batches
