"""The master's Prometheus metrics (tidal.master.metrics): a scrape shows the master's own state.

The state is driven as tests/test_master.py drives it (a fake clock, the fake backend, an
in-memory or SQLite journal); every scrape goes through the text format and prometheus_client's
own parser, as a Prometheus server would read it. Then a real ``tidal run`` master serves
``GET /metrics`` on 127.0.0.1, behind the job's token like every route.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from tests.test_control_plane import Master
from tests.test_master import form_round, journaled_round, lease, make_master, report
from tidal.api import (
    JobObservation,
    JoinRequest,
    PauseReport,
    RendezvousRequest,
    ReportRequest,
    ResourcePlan,
    StepRecord,
    WorkerState,
)
from tidal.master.job import JobMaster
from tidal.master.metrics import CONTENT_TYPE, PAUSE_BUCKETS, PAUSE_CAUSES, cause_kind, job_registry
from tidal.worker.reporter import Reporter
from tidal.worker.step import AppliedStep

T = TypeVar("T", bound=BaseModel)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

NAMES = {
    "tidal_samples_per_second", "tidal_workers", "tidal_target_workers", "tidal_step_seconds",
    "tidal_pause_seconds", "tidal_planner_decisions", "tidal_committed_samples",
}


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(master: JobMaster) -> Samples:
    return parse(generate_latest(job_registry(master)).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def ledger_samples(master: JobMaster) -> int:
    return sum(c.end - c.start for c in master.journal.load_ledger())


def steps(worker: int, start: int, count: int, first: int = 0) -> list[StepRecord]:
    """``count`` steps of 10 samples of ``worker``'s shard from ``start``."""
    return [StepRecord(step=first + s, worker=worker, epoch=0, start=start + 10 * s, end=start + 10 * s + 10)
            for s in range(count)]


class FixedPlanner:
    """Always asks for ``workers`` (the brain's ``Planner``, hand-written)."""

    name = "fixed"

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def plan(self, obs: JobObservation) -> ResourcePlan:
        return ResourcePlan(workers=self.workers, reason="fixed by the test")


# ----------------------------------------------------------------------------- the collector
def test_a_scrape_shows_the_masters_state(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "1:2")
    master.tick()
    form_round(master, [0, 1])  # round 0 ("start")
    a, b = lease(master, 0), lease(master, 1)
    split = {0: (0.01, 0.2, 0.05, 40.0), 1: (0.03, 0.4, 0.15, 20.0)}  # data, compute, comm, samples/s
    for w, start in ((0, a[0]), (1, b[0])):
        data, compute, comm, rate = split[w]
        master.report(ReportRequest(worker_id=w, round=0, applied_step=1, records=steps(w, start, 2),
                                    data_s=data, compute_s=compute, comm_s=comm, samples_per_s=rate,
                                    pauses=[PauseReport(round=0, seconds=0.3 if w == 0 else 0.2)],
                                    incarnation=master.incarnation))
    assert master.finalized_step == 1

    s = scrape(master)
    by_state = Counter(r.state for r in master.workers.values())
    assert by_state[WorkerState.ACTIVE] == 2
    for state in WorkerState:  # every state, zeros included
        assert value(s, "tidal_workers", state=state.value) == by_state[state]
    assert value(s, "tidal_target_workers") == master.target == 2
    assert value(s, "tidal_samples_per_second") == pytest.approx(60.0)
    assert value(s, "tidal_step_seconds", part="data") == pytest.approx(0.02)
    assert value(s, "tidal_step_seconds", part="compute") == pytest.approx(0.3)
    assert value(s, "tidal_step_seconds", part="comm") == pytest.approx(0.1)
    assert value(s, "tidal_committed_samples_total") == ledger_samples(master) == 40
    # the round's pause is the longest any worker saw
    assert value(s, "tidal_pause_seconds_count", cause="start") == 1
    assert value(s, "tidal_pause_seconds_sum", cause="start") == pytest.approx(0.3)
    assert value(s, "tidal_pause_seconds_bucket", cause="start", le="0.25") == 0
    assert value(s, "tidal_pause_seconds_bucket", cause="start", le="0.5") == 1
    assert value(s, "tidal_pause_seconds_count", cause="failure") == 0
    assert value(s, "tidal_planner_decisions_total", planner="max") == 0

    # worker 1 dies; its replacement (worker 2) joins worker 0 in round 1
    backend.exit("worker-1", -9)
    master.tick()
    clock.now += 0.2
    master.tick()  # launches the replacement
    master.join(JoinRequest(worker_id=2, pid=10_002))
    master.rendezvous(RendezvousRequest(worker_id=2, after_round=0, applied_step=-1))
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=1))
    assert (master.round, master.members) == (1, [0, 2])
    report(master, 2, 1, [])
    master.report(ReportRequest(worker_id=0, round=1, applied_step=1,
                                pauses=[PauseReport(round=1, seconds=2.0)], samples_per_s=40.0,
                                incarnation=master.incarnation))

    s = scrape(master)
    assert value(s, "tidal_workers", state="active") == 2
    assert value(s, "tidal_workers", state="failed") == 1
    assert value(s, "tidal_samples_per_second") == pytest.approx(40.0)  # worker 2 measured nothing yet
    # the mean over the active workers that measured their split: worker 0 alone (worker 1 is gone)
    assert value(s, "tidal_step_seconds", part="compute") == pytest.approx(0.2)
    assert value(s, "tidal_pause_seconds_count", cause="failure") == 1
    assert value(s, "tidal_pause_seconds_sum", cause="failure") == pytest.approx(2.0)
    assert value(s, "tidal_pause_seconds_bucket", cause="failure", le="1.0") == 0
    assert value(s, "tidal_pause_seconds_bucket", cause="failure", le="2.5") == 1
    assert value(s, "tidal_pause_seconds_bucket", cause="failure", le="+Inf") == 1
    assert value(s, "tidal_pause_seconds_count", cause="start") == 1  # the earlier pause stays
    assert value(s, "tidal_committed_samples_total") == ledger_samples(master) == 40

    # the planner lowers the target: one decision, counted under its name
    master.planning.planner = FixedPlanner(1)
    clock.now += master.spec.planner_interval_s
    master.tick()
    clock.now += master.spec.planner_interval_s
    master.tick()  # the same target again is no decision
    s = scrape(master)
    assert value(s, "tidal_target_workers") == master.target == 1
    assert value(s, "tidal_planner_decisions_total", planner="fixed") == 1


def test_committed_samples_are_the_ledgers_and_survive_a_restart(tmp_path: Path) -> None:
    first, successor, _, _, a, b = journaled_round(tmp_path, 2)
    report(first, 0, 0, steps(0, a[0], 1))
    report(first, 1, 0, steps(1, b[0], 1))
    report(first, 0, 1, steps(0, a[0] + 10, 1, first=1))  # applied by worker 0 only: not committed
    assert first.finalized_step == 0
    assert value(scrape(first), "tidal_committed_samples_total") == ledger_samples(first) == 20
    first.close()

    second = successor(2)
    second.resume()  # the shard table's committed prefixes are rebuilt from the journal's ledger
    assert value(scrape(second), "tidal_committed_samples_total") == ledger_samples(second) == 20
    second.close()


def test_pause_causes_are_a_bounded_set() -> None:
    assert [cause_kind(c) for c in ("start", "worker 7 failed", "worker 3 left the collective",
                                    "scale-in to 2", "scale-out to 16", "re-form", None, "anything else")] \
        == ["start", "failure", "left", "scale-in", "scale-out", "re-form", "re-form", "re-form"]
    assert set(PAUSE_CAUSES) == {"start", "failure", "left", "scale-in", "scale-out", "re-form"}
    assert list(PAUSE_BUCKETS) == sorted(PAUSE_BUCKETS) and PAUSE_BUCKETS[0] <= 0.01 and PAUSE_BUCKETS[-1] >= 60


def test_each_master_has_a_registry_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, _, _ = make_master(tmp_path / "one", "1:2")
    two, _, _ = make_master(tmp_path / "two", "1:1")
    assert value(scrape(one), "tidal_target_workers") == 2
    assert value(scrape(two), "tidal_target_workers") == 1
    assert REGISTRY.get_sample_value("tidal_target_workers") is None  # nothing in the library's global one


# ----------------------------------------------------------------------------- the worker's split
class MasterAsClient:
    """The master's ``/v1/report`` without HTTP, as the reporter's ``ReportClient``."""

    def __init__(self, master: JobMaster) -> None:
        self.master = master

    def post(self, path: str, body: BaseModel, response: type[T], patience_s: float | None = None) -> T:
        assert path == "/v1/report" and isinstance(body, ReportRequest)
        return response.model_validate(self.master.report(body).model_dump())


def test_the_workers_step_split_reaches_the_metrics(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path, "1:1")
    master.tick()
    form_round(master, [0])
    now = 0.0
    applied = -1
    lock = threading.Lock()
    reporter = Reporter(MasterAsClient(master), 0, lock=lock, applied_step=lambda: applied, clock=lambda: now)
    reporter.new_round(0, -1)

    def step(started: float, compute: float, comm: float) -> None:
        """A step as the step runner publishes it: begun at ``started``, then ``compute`` seconds,
        then ``comm`` seconds of collectives (the optimizer step counts with the compute)."""
        nonlocal now, applied
        applied += 1
        now = started + compute + comm
        with lock:
            reporter.record_step(AppliedStep(step=applied, mine=4, total=4, records=[], started=started,
                                             finished=now, collective_s=comm, comm_s=comm))

    step(0.0, 0.3, 0.1)  # the first step: no previous one, so no data wait is measured
    step(0.4 + 0.05, 0.5, 0.3)  # the loader took 0.05 s between the two
    reporter.flush()
    s = scrape(master)
    assert value(s, "tidal_step_seconds", part="data") == pytest.approx(0.05)
    assert value(s, "tidal_step_seconds", part="compute") == pytest.approx(0.8 * 0.3 + 0.2 * 0.5)
    assert value(s, "tidal_step_seconds", part="comm") == pytest.approx(0.8 * 0.1 + 0.2 * 0.3)

    # the round re-forms: the time until the next round's first step is a pause, not a data wait
    reporter.left(pause=True)
    step(now + 3.0, 0.3, 0.1)
    reporter.flush()
    s = scrape(master)
    assert value(s, "tidal_step_seconds", part="data") == pytest.approx(0.05)
    assert value(s, "tidal_pause_seconds_sum", cause="start") == pytest.approx(3.4)


# ----------------------------------------------------------------------------- over HTTP
def test_metrics_over_http_need_the_token(master: Master) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": master.token}):
        r = httpx.get(master.url + "/metrics", headers=headers, timeout=10)
        assert r.status_code == 401, headers
        assert "tidal_" not in r.text
    r = httpx.get(master.url + "/metrics", params={"token": master.token}, timeout=10)
    assert r.status_code == 401


def test_metrics_over_http_are_the_text_format(master: Master) -> None:
    with master.client() as c:
        r = c.get("/metrics")
        status = c.get("/v1/status").json()
        doc = c.get("/openapi.json").json()
    assert r.status_code == 200
    assert r.headers["content-type"] == CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert NAMES <= set(families)
    assert {f.type for f in families.values() if f.name in NAMES} == {"gauge", "counter", "histogram"}
    s = parse(r.text)
    # the sleeper workers never join: both stay LAUNCHING, as the status says
    assert value(s, "tidal_workers", state="launching") == sum(w["state"] == "launching" for w in status["workers"]) == 2
    assert value(s, "tidal_target_workers") == status["target_workers"] == 2
    assert value(s, "tidal_planner_decisions_total", planner="max") == 0
    assert value(s, "tidal_committed_samples_total") == 0
    assert CONTENT_TYPE in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
