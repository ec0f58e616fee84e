"""The master's metrics in the Prometheus text format (``GET /metrics``, tidal.master.service).

``MasterCollector`` reads the master's state when it is scraped: there is no second copy of the
state to keep in sync, and nothing to update on the hot paths. Each job has its own
``CollectorRegistry`` (``job_registry``); nothing is registered in prometheus_client's global one
(STYLE.md 11). The scrape runs on the master's event loop, like every handler, so it sees one
consistent state.

The metrics and where each comes from:

* ``tidal_samples_per_second``: the job's throughput, the samples/s its ACTIVE members report,
  summed over the active workers (what the planner sees as ``samples_per_s``);
* ``tidal_workers{state}``: the worker records in each ``WorkerState``, every state listed;
* ``tidal_target_workers``: the number of workers the job aims at (``JobMaster.target``);
* ``tidal_step_seconds{part}``: seconds per step spent on ``data`` (from the end of the
  worker's previous step to the begin of this one: the loader's lease and batch read, and the
  script's own work between steps; the loader begins a step once its batch is read),
  ``compute`` (from the step's begin to its collectives, the optimizer step included) and ``comm`` (the collectives), each the mean over the ACTIVE members that reported
  their split (``WorkerRecord.data_s``, ``compute_s``, ``comm_s``; tidal.worker.reporter);
* ``tidal_pause_seconds{cause}``: a histogram of the pauses of training, one per round, the
  longest any worker saw (``EventLog.pause_events``), by kind of cause (``cause_kind``);
* ``tidal_planner_decisions_total{planner}``: the target changes the planner made
  (``JobMaster.planner_decisions``);
* ``tidal_committed_samples_total``: the samples of every committed range, over every epoch:
  the committed prefixes of the shard table (``ShardManager.counts()``'s ``samples_done``).
  A commit moves a shard's prefix by exactly its range and a repeated commit moves nothing, so
  this is the ledger's sum; a restarted master rebuilds the prefixes from the journal's ledger
  (``ShardManager.restore``), so the count survives a restart too.

A stream job adds (``tidal.master.planning.StreamLag``; trace time, as ``tidal sim online`` scores):

* ``tidal_stream_lag_records{partition}``: records waiting in a partition after what its worker read;
* ``tidal_stream_partition_lag_seconds{partition}``: the age of the oldest of them, trace time;
* ``tidal_stream_lag_seconds``: the age of the oldest waiting record, and
  ``tidal_stream_lag_slo_seconds`` the SLO it is held to (``--lag-slo``);
  ``tidal_stream_arrivals_per_second``: the rate records arrive at (trace time);
* ``tidal_stream_slo_violation_ratio``: the share of the job's stream time whose lag exceeded the SLO;
* ``tidal_stream_accumulated_lag_minutes_total``: Kale's accumulated lag (Eq. 11), minutes of lag
  times minutes; like the ratio, journaled, so both survive a master failover;
* ``tidal_stream_queued_records{worker}`` and ``tidal_stream_forwarded_records_total{worker,
  direction}``: with global shuffling, each worker's local queue and the records it forwarded
  (``out``) and received (``in``).

A job with parameter servers (``--ps``; tidal.master.servers) adds, per server, from its last
report: ``tidal_ps_rows{server}`` (embedding rows held), ``tidal_ps_bytes{server}`` (those rows
and their optimizer state), ``tidal_ps_busy_ratio{server}`` (the share of the last second spent
serving requests), ``tidal_ps_request_ms{server}`` (its mean time per request) and
``tidal_ps_shards{server}`` (virtual shards the shard map gives it);
``tidal_ps_hot_moves_total`` counts the hot-PS planner's moves.

A job with data workers (``--data-workers``; tidal.master.dataworkers) adds
``tidal_data_workers`` (serving now) and ``tidal_data_workers_target``, per data worker
``tidal_data_worker_batches_per_second{data_worker}`` and ``tidal_data_worker_busy_ratio``,
and the trainers' queues (GoldMiner's indicator): ``tidal_data_queue_batches`` (arrived, not
consumed yet), ``tidal_data_enqueue_per_second``, ``tidal_data_dequeue_per_second``,
``tidal_data_trainer_wait_ratio`` and ``tidal_data_redispatched_total``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from tidal.api import Event, WorkerState
from tidal.master.job import JobMaster
from tidal.master.membership import WorkerRecord

# The text format this module writes: 0.0.4, which every Prometheus reads (the library's
# CONTENT_TYPE_LATEST is 1.0.0; tidal's metric names are valid in both).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Pauses range from a re-form that takes tens of milliseconds to a replacement worker that
# starts a large model for a minute.
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The kinds of causes a round forms for (its pause's ``cause`` label; a bounded set, whereas the
# causes themselves name workers and sizes).
PAUSE_CAUSES = ("start", "failure", "left", "scale-in", "scale-out", "re-form")
STEP_PARTS = ("data", "compute", "comm")


def cause_kind(cause: str | None) -> str:
    """The kind of a round's cause, as the master words it (``JobMaster._form_round``):
    ``start``; ``worker N failed``; ``worker N left the collective``; ``scale-in to N``;
    ``scale-out to N``; anything else is a ``re-form``."""
    text = cause or ""
    if text == "start":
        return "start"
    if text.startswith("scale-in"):
        return "scale-in"
    if text.startswith("scale-out"):
        return "scale-out"
    if text.startswith("worker ") and text.endswith(" failed"):
        return "failure"
    if text.startswith("worker ") and text.endswith(" left the collective"):
        return "left"
    return "re-form"


class MasterCollector(Collector):
    """Every tidal metric of one job master, read from its state at each scrape."""

    def __init__(self, master: JobMaster) -> None:
        self.master = master

    def collect(self) -> Iterator[Metric]:
        master = self.master
        active = [master.workers[m] for m in master.members
                  if m in master.workers and master.workers[m].state is WorkerState.ACTIVE]

        throughput = GaugeMetricFamily("tidal_samples_per_second",
                                       "Samples per second the job trains: the sum over its active workers.")
        throughput.add_metric([], sum(r.samples_per_s for r in active))
        yield throughput

        workers = GaugeMetricFamily("tidal_workers", "Worker processes by state.", labels=["state"])
        by_state = Counter(r.state for r in master.workers.values())
        for state in WorkerState:
            workers.add_metric([state.value], by_state[state])
        yield workers

        target = GaugeMetricFamily("tidal_target_workers", "The number of workers the job aims at.")
        target.add_metric([], master.target)
        yield target

        yield _step_seconds(active)
        yield _pause_histogram(master.pause_events.values())

        decisions = CounterMetricFamily("tidal_planner_decisions",
                                        "Changes of the target number of workers made by the planner.",
                                        labels=["planner"])
        decisions.add_metric([master.planner.name], master.planner_decisions)
        yield decisions

        committed = CounterMetricFamily("tidal_committed_samples",
                                        "Samples in committed ranges (trained by committed steps), over every epoch.")
        committed.add_metric([], master.committed_samples())
        yield committed

        partitions = master.stream_status()
        if partitions:  # a stream job
            lag = GaugeMetricFamily("tidal_stream_lag_records",
                                    "Records waiting in a partition after what its worker has read.",
                                    labels=["partition"])
            lag_s = GaugeMetricFamily("tidal_stream_partition_lag_seconds",
                                      "Age of the oldest record waiting in a partition, trace time.",
                                      labels=["partition"])
            for s in partitions:
                if s.lag >= 0:
                    lag.add_metric([str(s.partition)], s.lag)
                    lag_s.add_metric([str(s.partition)], s.lag_s)
            yield lag
            yield lag_s
            yield from _stream_slo(master)
            yield from _shuffle(active)
        yield from _servers(master)
        yield from _data_workers(master)


def _data_workers(master: JobMaster) -> Iterator[Metric]:
    """The data workers and the trainers' data queues (``--data-workers``)."""
    q = master.data_queue()
    if q is None:
        return
    yield GaugeMetricFamily("tidal_data_workers", "Data workers serving batches now.",
                            value=len(master.data.serving))
    yield GaugeMetricFamily("tidal_data_workers_target", "Data workers asked for (tidal scale, the tuner).",
                            value=master.data.target)
    rate = GaugeMetricFamily("tidal_data_worker_batches_per_second", "Batches a data worker built, last second.",
                             labels=["data_worker"])
    busy = GaugeMetricFamily("tidal_data_worker_busy_ratio", "Share of the last second a data worker spent "
                             "building batches.", labels=["data_worker"])
    for d in master.data.info():
        if d.state == "running":
            rate.add_metric([str(d.id)], d.batches_per_s)
            busy.add_metric([str(d.id)], d.busy)
    yield rate
    yield busy
    yield GaugeMetricFamily("tidal_data_queue_batches", "Batches arrived at the trainers and not consumed yet.",
                            value=q.queued)
    yield GaugeMetricFamily("tidal_data_enqueue_per_second", "Batches per second arriving from data workers.",
                            value=q.enqueue_per_s)
    yield GaugeMetricFamily("tidal_data_dequeue_per_second", "Batches per second the trainers consume.",
                            value=q.dequeue_per_s)
    yield GaugeMetricFamily("tidal_data_trainer_wait_ratio", "Share of the trainers' time spent waiting for "
                            "(or building) a batch.", value=q.wait_share)
    yield CounterMetricFamily("tidal_data_redispatched", "Batches re-dispatched after a data worker was lost or "
                              "silent.", value=q.redispatched)


def _servers(master: JobMaster) -> Iterator[Metric]:
    """The parameter servers' last reports (``--ps``)."""
    servers = master.servers.info()
    if not servers:
        return
    shards = Counter(master.servers.shard_map)
    families = [
        (GaugeMetricFamily("tidal_ps_rows", "Embedding rows a parameter server holds.", labels=["server"]), "rows"),
        (GaugeMetricFamily("tidal_ps_bytes", "Bytes of a parameter server's rows and their optimizer state.",
                           labels=["server"]), "bytes"),
        (GaugeMetricFamily("tidal_ps_busy_ratio", "Share of the last second a parameter server spent serving.",
                           labels=["server"]), "busy"),
        (GaugeMetricFamily("tidal_ps_request_ms", "A parameter server's mean time serving one request, last second.",
                           labels=["server"]), "latency_ms"),
        (GaugeMetricFamily("tidal_ps_cpu_cores", "Cores a parameter server's process used, last second.",
                           labels=["server"]), "cpu"),
        (GaugeMetricFamily("tidal_ps_rss_bytes", "A parameter server process's resident memory.",
                           labels=["server"]), "rss_bytes"),
    ]
    held = GaugeMetricFamily("tidal_ps_shards", "Virtual shards the shard map gives a parameter server.",
                             labels=["server"])
    for v in servers:
        for family, field in families:
            family.add_metric([str(v.id)], getattr(v, field))
        held.add_metric([str(v.id)], shards[v.id])
    for family, _ in families:
        yield family
    yield held
    yield CounterMetricFamily("tidal_ps_hot_moves", "Moves of virtual shards off a hot parameter server "
                              "(tidal.brain.hotps).", value=master.servers.hot_moves)


def _shuffle(active: list[WorkerRecord]) -> Iterator[Metric]:
    """Global shuffling (``--global-shuffle``): each worker's local queue and what it forwarded."""
    shuffling = [r for r in active if r.stream_queued >= 0]
    if not shuffling:
        return
    queued = GaugeMetricFamily("tidal_stream_queued_records", "Records in a worker's local queue (global shuffling).",
                               labels=["worker"])
    forwarded = CounterMetricFamily("tidal_stream_forwarded_records",
                                    "Records a worker forwarded to other workers (out) or received from them (in).",
                                    labels=["worker", "direction"])
    for r in shuffling:
        queued.add_metric([str(r.worker_id)], r.stream_queued)
        forwarded.add_metric([str(r.worker_id), "out"], r.stream_forwarded_out)
        forwarded.add_metric([str(r.worker_id), "in"], r.stream_forwarded_in)
    yield queued
    yield forwarded


def _stream_slo(master: JobMaster) -> Iterator[Metric]:
    """The stream's lag against its SLO, once a worker has reported it (trace time)."""
    book = master.planning.lag
    slo = GaugeMetricFamily("tidal_stream_lag_slo_seconds",
                            "The stream lag the job is held to (--lag-slo), trace time.")
    slo.add_metric([], book.slo_s)
    yield slo
    if book.last_at is None:
        return
    lag = GaugeMetricFamily("tidal_stream_lag_seconds",
                            "Age of the oldest record waiting in the stream, trace time.")
    lag.add_metric([], book.lag_s)
    yield lag
    ratio = GaugeMetricFamily("tidal_stream_slo_violation_ratio",
                              "Share of the job's stream time (trace time) whose lag exceeded the SLO.")
    ratio.add_metric([], book.violation_ratio)
    yield ratio
    accumulated = CounterMetricFamily("tidal_stream_accumulated_lag_minutes",
                                      "Accumulated lag (Kale Eq. 11): the integral of the lag, "
                                      "minutes of lag times minutes, trace time.")
    accumulated.add_metric([], book.accumulated_lag_min)
    yield accumulated
    rate = master.stream_arrivals_per_s()
    if rate is not None:
        arrivals = GaugeMetricFamily("tidal_stream_arrivals_per_second",
                                     "Records arriving in the stream per second, trace time (from the "
                                     "records appended to its partitions).")
        arrivals.add_metric([], rate)
        yield arrivals


def _step_seconds(active: list[WorkerRecord]) -> GaugeMetricFamily:
    """The mean split of a step over the active workers that measured theirs."""
    family = GaugeMetricFamily("tidal_step_seconds",
                               "Seconds per step spent waiting for data, computing and communicating "
                               "(the mean over the active workers).", labels=["part"])
    measured = [r for r in active if r.compute_s or r.comm_s]
    parts = {
        "data": [r.data_s for r in measured],
        "compute": [r.compute_s for r in measured],
        "comm": [r.comm_s for r in measured],
    }
    for part in STEP_PARTS:
        values = parts[part]
        family.add_metric([part], sum(values) / len(values) if values else 0.0)
    return family


def _pause_histogram(pauses: Iterable[Event]) -> HistogramMetricFamily:
    """The pauses the master keeps (the latest ``tidal.master.events.MAX_PAUSES``), by kind of cause."""
    family = HistogramMetricFamily("tidal_pause_seconds",
                                   "Seconds training stood still before a round's first step, by kind of cause.",
                                   labels=["cause"])
    seconds: dict[str, list[float]] = {kind: [] for kind in PAUSE_CAUSES}
    for ev in pauses:
        if ev.seconds is not None:
            seconds[cause_kind(ev.cause)].append(ev.seconds)
    for kind in PAUSE_CAUSES:
        values = seconds[kind]
        buckets = [(str(b), float(sum(v <= b for v in values))) for b in PAUSE_BUCKETS]
        buckets.append(("+Inf", float(len(values))))
        family.add_metric([kind], buckets, sum_value=sum(values))
    return family


def job_registry(master: JobMaster) -> CollectorRegistry:
    """A registry of its own for one job master's metrics (never the library's global one)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(MasterCollector(master))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    """The registry's metrics in the text format ``CONTENT_TYPE`` names."""
    return generate_latest(reg)
