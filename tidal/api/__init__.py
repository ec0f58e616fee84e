"""Wire types shared by every part of tidal, and the exception hierarchy.

Everything that crosses a process boundary on the control plane is one of the pydantic models
below, serialised as JSON. Models reject unknown fields (``extra="forbid"``) so a typo in a
client is a 422 with a message, not a silently ignored value. This package imports nothing
else of tidal (enforced by import-linter).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.api.errors import (
    ConfigError,
    FrameError,
    PermanentError,
    RetryableError,
    StaleRoundError,
    TidalError,
)

__all__ = [
    "DATA_ERROR_EXIT",
    "MAX_BODY_BYTES",
    "MAX_RECORDS_PER_REQUEST",
    "MAX_STORE_KEYS_PER_REQUEST",
    "MAX_STORE_KEY_CHARS",
    "MAX_STORE_VALUE_BYTES",
    "MAX_STORE_VALUE_CHARS",
    "MAX_STORE_WAIT_S",
    "ConfigError",
    "DataQueueStatus",
    "DataWorkerInfo",
    "DataWorkerObservation",
    "DataWorkerReport",
    "DatasetRequest",
    "Event",
    "FinishRequest",
    "FrameError",
    "JobObservation",
    "JobState",
    "JoinRequest",
    "JoinResponse",
    "LeaseRequest",
    "LeaseResponse",
    "PSObservation",
    "PauseObservation",
    "PauseReport",
    "PermanentError",
    "PlannerDecision",
    "PlannerStatus",
    "RendezvousRequest",
    "RendezvousResponse",
    "ReportRequest",
    "ReportResponse",
    "ResourcePlan",
    "RestoreFailure",
    "RetryableError",
    "ScaleRequest",
    "ServerInfo",
    "ServerReport",
    "Shard",
    "ShardCounts",
    "StaleRoundError",
    "StatusResponse",
    "StepRecord",
    "StoreAddRequest",
    "StoreAddResponse",
    "StoreCompareSetRequest",
    "StoreDeleteRequest",
    "StoreDeleteResponse",
    "StoreGetRequest",
    "StoreKeysRequest",
    "StoreKeysResponse",
    "StoreNumKeysRequest",
    "StoreNumKeysResponse",
    "StoreSetRequest",
    "StoreSetResponse",
    "StoreValueResponse",
    "StreamLagStatus",
    "StreamObservation",
    "StreamPartitionStatus",
    "ThroughputPoint",
    "TidalError",
    "TimelinePoint",
    "TimelineResponse",
    "WorkerInfo",
    "WorkerObservation",
    "WorkerState",
    "parse_every",
]

def parse_every(text: str) -> tuple[str, float]:
    """``--checkpoint-every``: ``("steps", n)`` for a number of steps ("500"), ``("seconds", s)``
    for a duration ("90s", "5m", "1h").

    Raises:
        ConfigError: anything else, or not positive.
    """
    value = text.strip().lower()
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    try:
        if value[-1:] in units:
            seconds = float(value[:-1]) * units[value[-1]]
            if seconds > 0 and seconds == seconds and seconds != float("inf"):
                return "seconds", seconds
        elif value.isdigit() and int(value) > 0:
            return "steps", float(int(value))
    except ValueError:
        pass
    raise ConfigError(f"--checkpoint-every takes a number of steps (500) or a duration (90s, 5m, 1h), got {text!r}")


# Control-plane limits: the master answers 413 above MAX_BODY_BYTES, 422 above the list limits.
MAX_BODY_BYTES = 16 << 20
MAX_RECORDS_PER_REQUEST = 65536
PS_OUT_OF_MEMORY_EXIT = 3  # a parameter server's exit status when its tables passed --ps-memory
DATA_ERROR_EXIT = 4  # a training worker's exit status when a batch cannot be built (tidal.data.batches): the job fails
PS_WATERMARK = "tidal.ps"  # the key of the parameter servers' watermark in a worker's ``state.extras``
MAX_PAUSES_PER_REPORT = 64
_I64 = 2**63 - 1
_NonNegI64 = Annotated[int, Field(ge=0, le=_I64)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class WorkerState(StrEnum):
    """Lifecycle of a worker process as the master sees it (transitions in tidal.master.membership)."""

    LAUNCHING = "launching"  # process started by the backend, not yet registered
    JOINED = "joined"  # registered, has not asked for a round yet
    WAITING = "waiting"  # at the rendezvous, waiting for the next round
    ACTIVE = "active"  # member of the current round, training
    LEAVING = "leaving"  # told to leave (scale-in); exits cleanly
    SUCCEEDED = "succeeded"  # exited 0
    FAILED = "failed"  # exited non-zero, was killed, or missed its heartbeat lease


class JobState(StrEnum):
    RUNNING = "running"
    FINISHING = "finishing"  # training loop done; waiting for processes to exit
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class StepRecord(_Wire):
    """The samples one worker contributed to one committed optimizer step: ``[start, end)``.

    In a stream job (``tidal run --stream``) ``epoch`` is the partition and the range is of
    packed record ids (``tidal.api.streams``): ``start`` the position read after (the previous
    committed record), ``first`` and ``end`` the first and last record trained, both included.
    """

    step: int = Field(ge=0, le=_I64)
    worker: int = Field(ge=0, le=_I64)
    epoch: int = Field(ge=0, le=_I64)
    start: int = Field(ge=0, le=_I64)
    end: int = Field(ge=0, le=_I64)
    first: int = Field(default=0, ge=0, le=_I64)
    samples: int = Field(default=0, ge=0, le=_I64)  # a stream job's records in the range (ids are sparse)


class Shard(_Wire):
    """A lease on dataset indices ``[start, end)`` of one epoch, read in batches of ``batch_size``."""

    epoch: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    batch_size: int = Field(ge=1)


class JoinRequest(_Wire):
    worker_id: int = Field(ge=0, le=_I64)
    pid: int = Field(ge=0, le=2**31)
    host: str = Field(default="127.0.0.1", max_length=255)


class JoinResponse(_Wire):
    job_id: str
    round: int
    heartbeat_interval_s: float
    collective_timeout_s: float
    # the master process the worker joined: its reports are complete for it from the first one
    # (a worker that trains and finishes before its first report must not wait to learn it)
    incarnation: str = ""


class RestoreFailure(_Wire):
    """The source of a round that resumes from a checkpoint could not load the one it was told.

    ``fatal``: the checkpoint was read but does not fit the script's state (another model shape,
    another optimizer): no other checkpoint of the job will, and the master fails the job.
    Otherwise (a torn, corrupt or missing checkpoint) the master tries the previous one.
    """

    step: int = Field(ge=0, le=_I64)
    lineage: int = Field(default=0, ge=0, le=_I64)  # the checkpoint's, as the round named it
    problem: str = Field(max_length=1000)
    fatal: bool = False


class RendezvousRequest(_Wire):
    """A worker asks to be placed in the next round.

    ``after_round`` is the last round the worker trained in (-1 for none): a request whose
    ``after_round`` is older than the current round is a re-poll for an assignment already made.
    ``records`` are the step records the worker holds for steps the master has not yet
    finalized; the member with the highest ``applied_step`` becomes the source of state and its
    records are finalized when the round closes.
    """

    worker_id: int = Field(ge=0, le=_I64)
    after_round: int = Field(ge=-1, le=_I64)
    applied_step: int = Field(ge=-1, le=_I64)
    records: list[StepRecord] = Field(default_factory=list, max_length=MAX_RECORDS_PER_REQUEST)
    failure: str = Field(default="", max_length=1000)  # why it left: a collective or group that failed
    restore_failed: RestoreFailure | None = None
    stream_partitions: list[int] = Field(default_factory=list, max_length=65536)  # a stream job's, as seen
    # [round, step, total] of the applied step's parameter-server watermark (``state.extras[PS_WATERMARK]``):
    # the master settles the servers at it before it moves virtual shards (tidal.master.servers)
    ps_watermark: list[int] | None = Field(default=None, min_length=3, max_length=3)


class RendezvousResponse(_Wire):
    status: Literal["waiting", "ready", "leave", "finished"]
    round: int = -1
    rank: int = -1
    world_size: int = 0
    store_host: str = ""
    store_port: int = 0
    source_rank: int = 0
    sync_state: bool = False
    applied_step: int = -1  # the step the round resumes after (the source's applied step)
    # every worker holding the model was lost: the round resumes from the job's flash checkpoint of
    # ``applied_step`` taken in lineage ``restore_lineage``, which its source loads
    # (tidal.worker.flash.load_step) before the state broadcast; with ``applied_step`` -1 there was
    # none and the source's fresh model is broadcast
    restore: bool = False
    restore_lineage: int = 0
    lineage: int = 0  # the job's rollbacks so far: workers write it into their checkpoints (tidal.master.checkpoints)
    # a stream job: this worker's partitions and, for each, the packed id of its last committed
    # record (tidal.api.streams; 0: none yet), which it reads after
    stream: dict[int, int] = Field(default_factory=dict)
    # and, per partition, the ranges committed beyond that position ([after, last] packed ids, in
    # order; global shuffling commits forwarded ranges out of order): read up to ``after``, then on
    # after ``last``
    stream_skip: dict[int, list[list[int]]] = Field(default_factory=dict)
    # the job's parameter servers (``--ps``): address of server i, and the server of each virtual shard
    ps: list[str] = Field(default_factory=list)
    ps_shard_map: list[int] = Field(default_factory=list)


class PauseReport(_Wire):
    round: int = Field(ge=0, le=_I64)
    seconds: float = Field(ge=0, le=1e7)


class ReportRequest(_Wire):
    """Heartbeat, progress and the worker's own step records, sent every ~100 ms."""

    worker_id: int = Field(ge=0, le=_I64)
    round: int = Field(ge=-1, le=_I64)
    applied_step: int = Field(ge=-1, le=_I64)
    records: list[StepRecord] = Field(default_factory=list, max_length=MAX_RECORDS_PER_REQUEST)
    compute_s_per_sample: float = Field(default=0.0, ge=0, le=1e6)
    samples_per_s: float = Field(default=0.0, ge=0, le=1e12)
    # where a step's time goes, seconds per step (running means; 0: not measured): between the
    # previous step's end and this one's begin (data), up to its collectives, the collectives
    data_s: float = Field(default=0.0, ge=0, le=1e6)
    compute_s: float = Field(default=0.0, ge=0, le=1e6)
    comm_s: float = Field(default=0.0, ge=0, le=1e6)
    pauses: list[PauseReport] = Field(default_factory=list, max_length=MAX_PAUSES_PER_REPORT)
    incarnation: str = Field(default="", max_length=64)  # the master these records are complete for
    # what the process uses (psutil; 0: not measured): percent of one core since its previous
    # measurement, resident memory
    cpu_percent: float = Field(default=0.0, ge=0, le=1e5)
    rss_bytes: int = Field(default=0, ge=0, le=_I64)
    # its newest flash checkpoint (the step in shared memory, -1: none) and the persister's
    # newest problem (a full or unwritable --checkpoint-dir), "" when none
    checkpoint_step: int = Field(default=-1, ge=-1, le=_I64)
    checkpoint_problem: str = Field(default="", max_length=1000)
    # a stream job: records waiting in this worker's partitions after what it has read (-1: not
    # measured), and the malformed records it skipped so far
    stream_backlog: int = Field(default=-1, ge=-1, le=_I64)
    stream_malformed: int = Field(default=0, ge=0, le=_I64)
    stream_lag: dict[int, int] = Field(default_factory=dict, max_length=65536)  # per partition it reads
    # the arrival time (ms since the epoch, from its id) of the oldest record waiting in its
    # partitions (0: none waits), and the share of the last second it was busy with records, each
    # step's time weighted by how full its batch was (-1: unknown)
    stream_oldest_ms: int = Field(default=0, ge=0, le=_I64)
    # the same per partition it reads, where a record waits; and when it looked (ms since the
    # epoch, its clock; 0: not said), so that the master ages the lag from then, not from the report
    stream_oldest_by_partition: dict[int, _NonNegI64] = Field(default_factory=dict, max_length=65536)
    stream_measured_ms: int = Field(default=0, ge=0, le=_I64)
    # records ever appended to each partition it reads, as it read them then (the master's
    # arrival rate; empty: not said)
    stream_appended: dict[int, _NonNegI64] = Field(default_factory=dict, max_length=65536)
    stream_busy: float = Field(default=-1.0, ge=-1.0, le=1.0)
    # records per second its steps trained while busy (the same steps as stream_busy, less the
    # round's first ones; -1: unknown; 0: the round's first steps are not over, not measured yet)
    stream_capacity: float = Field(default=-1.0, ge=-1.0, le=1e12)
    # with global shuffling (tidal.worker.shuffle): records in its local queue (-1: no shuffling),
    # and records it forwarded to others and received from them so far
    stream_queued: int = Field(default=-1, ge=-1, le=_I64)
    stream_forwarded_out: int = Field(default=0, ge=0, le=_I64)
    stream_forwarded_in: int = Field(default=0, ge=0, le=_I64)
    # records one of its steps takes, and its local queue's upper threshold with global shuffling
    # (0: not said / no shuffling): what a stream planner needs to price the queue's wait
    stream_batch: int = Field(default=0, ge=0, le=_I64)
    stream_queue_upper: int = Field(default=0, ge=0, le=_I64)
    # with global shuffling: the coefficient of variation of the records its partitions brought
    # between its last steps (tidal.worker.shuffle.ShuffleUnit.intake_spread; -1: not measured)
    stream_intake_spread: float = Field(default=-1.0, ge=-1.0, le=1e6)
    # with data workers (``--data-workers``; tidal.data.dispatch), counts so far: batches received
    # from data workers, built by this worker itself, consumed, re-dispatched, dropped (duplicates);
    # batches waiting in its queue now, and seconds it waited for one (-1 queued: no data workers)
    data_received: int = Field(default=0, ge=0, le=_I64)
    data_built_here: int = Field(default=0, ge=0, le=_I64)
    data_taken: int = Field(default=0, ge=0, le=_I64)
    data_redispatched: int = Field(default=0, ge=0, le=_I64)
    data_dropped: int = Field(default=0, ge=0, le=_I64)
    data_queued: int = Field(default=-1, ge=-1, le=_I64)
    data_wait_s: float = Field(default=0.0, ge=0, le=1e12)
    threads: int = Field(default=0, ge=0, le=4096)  # its torch intra-op threads (0: not said)


class ReportResponse(_Wire):
    round: int
    reform: bool  # a new round is being formed: stop at the next step boundary
    finalized_step: int  # every record of steps <= this is durable in the journal
    incarnation: str = ""  # changes when the master restarts: workers then resend unfinalized records
    stop: bool = False  # a stream job is over (drained, or `tidal stop`): finish at the next step boundary
    # ``--trim-after-commit``: the committed positions of the partitions this worker reads, up to
    # which it deletes records from the stream
    stream_committed: dict[int, int] = Field(default_factory=dict)
    data_workers: list[str] = Field(default_factory=list)  # the job's data workers' addresses, now
    threads: int = 0  # the torch threads a trainer should use (the data-worker tuner's; 0: as it is)
    # the flash checkpoint the master would resume from were every worker lost now (-1: none yet);
    # a persister's --checkpoint-keep never deletes it nor a newer one
    resume_step: int = -1


class LeaseRequest(_Wire):
    worker_id: int = Field(ge=0, le=_I64)
    round: int = Field(ge=0, le=_I64)
    epoch: int = Field(ge=0, le=1_000_000)
    dataset_size: int = Field(ge=1, le=_I64)
    batch_size: int = Field(ge=1, le=1 << 24)
    batches_per_shard: int = Field(default=16, ge=1, le=1 << 20)
    shuffle: bool = True
    seed: int = Field(default=0, ge=0, le=_I64)
    epochs: int | None = Field(default=None, ge=0, le=1_000_000)  # the job is done only after all of them


class DatasetRequest(_Wire):
    """Declare the dataset without leasing (logical workers follow a fixed data order)."""

    worker_id: int = Field(ge=0, le=_I64)
    round: int = Field(ge=0, le=_I64)
    dataset_size: int = Field(ge=1, le=_I64)
    batch_size: int = Field(ge=1, le=1 << 24)
    batches_per_shard: int = Field(default=1, ge=1, le=1 << 20)
    shuffle: bool = True
    seed: int = Field(default=0, ge=0, le=_I64)
    epochs: int | None = Field(default=None, ge=0, le=1_000_000)


class LeaseResponse(_Wire):
    status: Literal["ok", "empty"]  # empty: no TODO shard in this epoch now
    shard: Shard | None = None


class FinishRequest(_Wire):
    """The worker's training loop is over. The master accepts it only if no sample is left:
    ``records`` are the worker's records of steps up to ``applied_step`` that the master may not
    have finalized yet (every worker's, as the step headers gave them)."""

    worker_id: int = Field(ge=0, le=_I64)
    metrics: dict[str, float] = Field(default_factory=dict, max_length=64)
    applied_step: int = Field(default=-1, ge=-1, le=_I64)
    records: list[StepRecord] = Field(default_factory=list, max_length=MAX_RECORDS_PER_REQUEST)


class ScaleRequest(_Wire):
    """A user's target: ``workers`` (the planner stops deciding until ``auto``), or ``auto``
    (the planner decides again). Exactly one of them."""

    workers: int | None = Field(default=None, ge=0, le=100_000)
    auto: bool = False
    ps: int | None = Field(default=None, ge=1, le=4096)  # parameter servers (within the job's --ps MIN:MAX)
    data_workers: int | None = Field(default=None, ge=0, le=4096)  # within the job's --data-workers MIN:MAX

    @model_validator(mode="after")
    def _one_of(self) -> ScaleRequest:
        if sum((self.workers is not None, self.auto, self.ps is not None, self.data_workers is not None)) != 1:
            raise ValueError("give exactly one of workers, auto=true, ps or data_workers")
        return self


class WorkerInfo(_Wire):
    worker_id: int
    pid: int
    state: WorkerState
    rank: int
    applied_step: int
    samples_per_s: float
    straggler: bool
    exit_code: int | None = None
    # a stream job: records waiting for it (in its partitions after what it read, and in its local
    # queue; -1: not reported); the share of its last second busy with records and the records/s
    # it trained while busy (-1: not reported); with global shuffling (--global-shuffle): records
    # in its local queue (-1: none), forwarded to other workers and received from them; the records
    # a step takes and its local queue's upper threshold (0: not said / no shuffling), as the
    # planner sees them; the spread of its steps' intake (-1: not measured); the age of the oldest
    # record waiting for it, forwarded ones in its queue too, trace s (the job's lag is the largest;
    # -1: not reported)
    stream_backlog: int = -1
    stream_busy: float = -1.0
    stream_capacity: float = -1.0
    stream_queued: int = -1
    stream_forwarded_out: int = 0
    stream_forwarded_in: int = 0
    stream_batch: int = 0
    stream_queue_upper: int = 0
    stream_intake_spread: float = -1.0
    stream_lag_s: float = -1.0


class ServerReport(_Wire):
    """A parameter server's report (``POST /v1/ps/report``, every second): where it listens
    (its first report registers it), and its load."""

    server_id: int = Field(ge=0, le=_I64)
    address: str = Field(max_length=300, pattern=r"^tcp://[^\s]+:[0-9]{1,5}$")
    pid: int = Field(ge=0, le=_I64)
    rows: int = Field(default=0, ge=0, le=_I64)
    bytes: int = Field(default=0, ge=0, le=_I64)
    applied_step: int = Field(default=-1, ge=-1, le=_I64)
    requests_per_s: float = Field(default=0.0, ge=0, le=1e9)
    busy: float = Field(default=0.0, ge=0, le=1)  # share of the last interval spent serving
    latency_ms: float = Field(default=0.0, ge=0, le=1e9)  # mean time serving one request, last interval
    cpu: float = Field(default=0.0, ge=0, le=1e4)  # cores the process used over the last interval
    rss_bytes: int = Field(default=0, ge=0, le=_I64)  # the process's resident memory
    shard_hits: list[int] = Field(default_factory=list, max_length=1 << 16)  # rows pulled per virtual shard, so far


class ServerInfo(_Wire):
    """A parameter server as ``tidal status`` shows it."""

    id: int
    pid: int
    state: str  # launching, running, retiring (its shards moved away; stopped by the master), exited
    address: str = ""
    shards: int = 0  # virtual shards it holds in the current shard map
    rows: int = 0
    bytes: int = 0
    applied_step: int = -1
    requests_per_s: float = 0.0
    busy: float = 0.0
    latency_ms: float = 0.0
    cpu: float = 0.0
    rss_bytes: int = 0
    exit_code: int | None = None


class DataWorkerReport(_Wire):
    """A data worker's report (``POST /v1/data/report``, every second): where it listens (its
    first report registers it) and what it built (tidal.data.worker)."""

    data_worker_id: int = Field(ge=0, le=_I64)
    address: str = Field(max_length=300, pattern=r"^tcp://[^\s]+:[0-9]{1,5}$")
    pid: int = Field(ge=0, le=_I64)
    batches: int = Field(default=0, ge=0, le=_I64)
    samples: int = Field(default=0, ge=0, le=_I64)
    batches_per_s: float = Field(default=0.0, ge=0, le=1e9)
    busy: float = Field(default=0.0, ge=0, le=1)  # share of the last interval spent building batches
    cpu: float = Field(default=0.0, ge=0, le=1e4)  # cores the process used over the last interval


class DataWorkerInfo(_Wire):
    """A data worker as ``tidal status`` shows it."""

    id: int
    pid: int
    state: str  # launching, running, retiring (stopped by the master), exited
    address: str = ""
    batches: int = 0
    batches_per_s: float = 0.0
    busy: float = 0.0
    cpu: float = 0.0
    exit_code: int | None = None


class DataQueueStatus(_Wire):
    """The trainers' data queues together (GoldMiner 3.4's indicator): batches waiting, the rates
    the data workers fill them (enqueue) and the trainers empty them (dequeue), per second, and
    the share of the trainers' time spent waiting for a batch."""

    queued: int = 0
    enqueue_per_s: float = 0.0
    dequeue_per_s: float = 0.0
    built_by_trainers_per_s: float = 0.0
    wait_share: float = 0.0
    redispatched: int = 0


class ShardCounts(_Wire):
    epoch: int
    todo: int
    doing: int
    done: int
    samples_done: int
    samples_total: int


class Event(_Wire):
    seq: int = 0  # increasing per job
    time: float  # unix seconds
    kind: str  # join | leave | failure | pause | straggler | scale | launch | crash | job
    worker: int | None = None
    message: str = ""
    seconds: float | None = None  # pauses: how long training stood still
    cause: str | None = None  # pauses: what caused the new round


class StreamPartitionStatus(_Wire):
    """One partition of a stream job: the last committed record, its reader and the records
    waiting after what the reader has read (-1: not reported yet), and ``lag_s``, the age of the
    oldest of them in trace time (0: none waits; -1: not reported yet)."""

    partition: int
    committed: str
    worker: int | None = None
    lag: int = -1
    lag_s: float = -1.0


class StreamLagStatus(_Wire):
    """A stream job's lag against its SLO (``tidal run --lag-slo``), all in trace time (the
    stream replays its trace ``time_scale`` times faster), scored as ``tidal sim online`` scores
    a policy (Kale 4.1): ``violation_ratio`` is the share of the ``observed_s`` seconds whose lag
    exceeded ``slo_s``; ``accumulated_lag_min`` the integral of the lag (Eq. 11), in minutes of
    lag times minutes, the simulator's ``accumulated_lag_min``."""

    lag_s: float
    slo_s: float
    time_scale: float = 1.0
    observed_s: float = 0.0
    violation_ratio: float = 0.0
    accumulated_lag_min: float = 0.0
    # records per second arriving in the stream (trace time), from the records appended to its
    # partitions as their readers last counted them (None: not counted yet)
    arrivals_per_s: float | None = None


class StatusResponse(_Wire):
    job_id: str
    state: JobState
    target_workers: int
    min_workers: int
    max_workers: int
    round: int
    reforming: bool
    finalized_step: int
    workers: list[WorkerInfo]
    shards: list[ShardCounts]
    events: list[Event]
    metrics: dict[str, float]
    error: str | None = None
    paused: str | None = None  # why the job stands still (e.g. the journal cannot be written)
    planner: PlannerStatus | None = None
    checkpoint_step: int = -1  # the newest flash checkpoint a worker reported (-1: none)
    checkpoint_problem: str | None = None  # the newest problem writing checkpoints
    stream: list[StreamPartitionStatus] = Field(default_factory=list)  # a stream job's partitions
    stream_stop: str | None = None  # why a stream job is ending (drained, `tidal stop`)
    stream_lag: StreamLagStatus | None = None  # a stream job's lag against its SLO, once a worker reported
    servers: list[ServerInfo] = Field(default_factory=list)  # parameter servers (``--ps``)
    ps_shard_map: list[int] = Field(default_factory=list)  # the server (id) of each virtual shard
    ps_target: int = 0  # the number of servers asked for (``tidal scale --ps``); the map follows at a re-form
    ps_range: list[int] = Field(default_factory=list)  # --ps MIN:MAX
    data_workers: list[DataWorkerInfo] = Field(default_factory=list)  # ``--data-workers``
    data_target: int = 0  # the number of data workers asked for (``tidal scale --data-workers``, the tuner)
    data_range: list[int] = Field(default_factory=list)  # --data-workers MIN:MAX
    data_queue: DataQueueStatus | None = None  # with data workers: the trainers' queues
    data_decisions: list[str] = Field(default_factory=list)  # the data-worker tuner's (GoldMiner 3.4.1)


class PlannerDecision(_Wire):
    """One decision of the job's planner, as journaled: when, what it saw and why.

    ``inputs`` is the part of the observation the decision rested on (workers, samples/s,
    the throughput points); ``params`` and ``error_pct`` the throughput model fitted then
    (empty and ``None`` while the planner has no model).
    """

    at_s: float
    planner: str
    from_workers: int
    to_workers: int
    reason: str
    inputs: dict[str, float | int | str | list[float] | list[list[float]]] = Field(default_factory=dict)
    params: dict[str, float] = Field(default_factory=dict)
    model: str = ""
    error_pct: float | None = None


class TimelinePoint(_Wire):
    """The job at one moment (``t_s``: seconds since the master started the job)."""

    t_s: float
    samples_per_s: float
    workers: int
    target: int
    lag_s: float | None = None  # a stream job: the lag in trace time (None: not known yet)
    busy: float | None = None  # a stream job: the members' mean busy share (None: not reported yet)
    ready: bool | None = None  # at its target, nothing starting, re-forming or leaving (None: not said)
    arrivals_per_s: float | None = None  # a stream job: records arriving per second, trace time (None: not counted)


class TimelineResponse(_Wire):
    """``GET /v1/timeline``: what the dashboard draws. Bounded: the newest points, pauses and
    decisions (one point per second for the last hour at most)."""

    job_id: str
    state: JobState
    planner: str
    points: list[TimelinePoint]
    pauses: list[PauseObservation]
    decisions: list[PlannerDecision]
    workers: list[WorkerObservation]
    lag_slo_s: float | None = None  # a stream job's lag SLO in trace time (the points' ``lag_s``)


class PlannerStatus(_Wire):
    """What ``tidal status`` shows of the planner: its name, whether the user overrides it,
    the last decision and the model fitted now."""

    name: str
    overridden_by_user: bool = False
    decisions: int = 0
    last: PlannerDecision | None = None
    model: str = ""
    params: dict[str, float] = Field(default_factory=dict)
    error_pct: float | None = None
    warm_start: str = ""
    history_bins: int = 0  # intervals of past traffic it was seeded with (``--traffic-history``)
    history_interval_s: float = 0.0  # their length, trace time


class ResourcePlan(_Wire):
    """What a planner decides for one job.

    ``workers`` is what the runtime acts on today; ``ps`` and ``data_workers`` are acted on
    once those roles run live. The per-pod sizes are for parameter-server jobs (the cluster
    simulator places them); ``None`` keeps the size the job has.
    """

    workers: int = Field(ge=0)
    ps: int = Field(default=0, ge=0)
    data_workers: int = Field(default=0, ge=0)
    worker_cpu: int | None = Field(default=None, ge=1)
    ps_cpu: int | None = Field(default=None, ge=1)
    worker_mem_gb: float | None = Field(default=None, gt=0)
    ps_mem_gb: float | None = Field(default=None, gt=0)
    hot_ps_cpu: int | None = Field(default=None, ge=0)
    reason: str = ""
    # the throughput model the decision rested on (empty while the planner has none)
    model: str = ""
    params: dict[str, float] = Field(default_factory=dict)
    error_pct: float | None = None


# ---------------------------------------------------------------------------- observations
# One type for every planner (tidal.brain.api.Planner): the master builds it from what it
# measures, the simulators from their models. Optional parts belong to one kind of job.


class ThroughputPoint(_Wire):
    """The throughput the job showed while it ran with ``workers`` workers (and ``ps`` servers).

    ``seconds`` of training were measured there (pauses excluded); ``samples_per_s`` is their
    mean. The master keeps one point per configuration, the newest measurement winning.
    """

    workers: int = Field(ge=1)
    ps: int = Field(default=0, ge=0)
    samples_per_s: float = Field(ge=0)
    seconds: float = Field(default=0.0, ge=0)


class WorkerObservation(_Wire):
    """One process of the job: where its step time goes and what it uses.

    ``data_s``/``compute_s``/``comm_s`` are seconds per step (running means): waiting for the
    batch, computing, in collectives. ``cpu_percent`` is of one core (200 = two cores busy);
    ``rss_bytes`` its resident memory. 0 means not measured yet.
    """

    worker_id: int
    role: str = "worker"
    step_s: float = 0.0
    data_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    samples_per_s: float = 0.0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    straggler: bool = False


class PauseObservation(_Wire):
    """One pause of training: when it ended (``at_s``, the job's clock), how long, and why."""

    at_s: float
    seconds: float
    cause: str


class StreamObservation(_Wire):
    """An online-training job's stream (Kale), observations since the previous decision.

    Attributes:
        interval_s: length of one arrivals interval.
        arrivals: samples that arrived in each interval since the previous call, oldest first.
        measured: ``(workers, samples/s)`` pairs measured since the previous call while
            training ran: the rate the workers reach when busy, not the rate of arrivals.
        backlog: samples waiting in the stream, not yet trained on.
        lag_s: age of the oldest waiting sample (Kale section 2.2), 0 when none waits.
        utilization: share of the time the workers were busy over the last interval (0..1).
        partitions: the stream's partitions (0: not known).
        queue_upper: with global shuffling (Kale 3.5), a worker's local queue's upper threshold
            in records (0: no shuffling, or not known).
        step_batch: records one step of a worker takes (0: not known).
        intake_spread: with global shuffling, the coefficient of variation of the records the
            partitions of a busiest worker (one reading the most) bring between its steps
            (``tidal.worker.shuffle.ShuffleUnit.intake_spread``; 0: not known, taken as clockwork).
    """

    interval_s: float = Field(default=60.0, gt=0)
    arrivals: list[float] = Field(default_factory=list)
    measured: list[tuple[float, float]] = Field(default_factory=list)
    backlog: float = 0.0
    lag_s: float = 0.0
    utilization: float = 0.0
    partitions: int = Field(default=0, ge=0)
    queue_upper: float = Field(default=0.0, ge=0)
    step_batch: float = Field(default=0.0, ge=0)
    intake_spread: float = Field(default=0.0, ge=0)


class PSObservation(_Wire):
    """A parameter-server job's side (DLRover, DLRover-RM): sizes now and what the pods use.

    Attributes:
        ps: parameter servers now (pods still starting included).
        worker_cpu, ps_cpu: cores of each worker / PS (DLRover-RM's lambda_w, lambda_p).
        worker_mem_gb, ps_mem_gb: memory of each worker / PS.
        hot_ps_cpu: cores of the PS that replaced a hot one; 0 when none was replaced.
        cpu_quota: the most cores the job may hold (DLRover's C_total).
        worker_cpu_used: cores a worker used on average (DLRover's w_hat).
        ps_cpu_used: cores each PS used, one entry per PS.
        ps_mem_used_gb: memory the largest PS uses now.
        oom_worker, oom_ps: an OOM killed a worker / a PS since the previous decision.
        free_cpus, free_mem_gb: what the cluster has unallocated now.
        history: ``(plan, steps/s)`` of the configurations the job ran with, oldest first.
    """

    ps: int = 0
    worker_cpu: int = 1
    ps_cpu: int = 1
    worker_mem_gb: float = 4.0
    ps_mem_gb: float = 8.0
    hot_ps_cpu: int = 0
    cpu_quota: int = 1 << 30
    worker_cpu_used: float = 0.0
    ps_cpu_used: list[float] = Field(default_factory=list)
    ps_mem_used_gb: float = 0.0
    oom_worker: bool = False
    oom_ps: bool = False
    free_cpus: float | None = None  # None: no limit known
    free_mem_gb: float | None = None
    history: list[tuple[ResourcePlan, float]] = Field(default_factory=list)


class DataWorkerObservation(_Wire):
    """Data workers feeding the trainers (GoldMiner 3.4, the data queue as the indicator).

    ``count``: data workers serving now; ``target``: asked for (they differ while some start);
    ``low``/``high``: the job's ``--data-workers MIN:MAX``; ``samples_per_s``: the trainers'
    throughput now; ``enqueue_per_s``/``dequeue_per_s``: batches per second arriving from data
    workers and consumed by trainers (``built_by_trainers_per_s`` of those they built
    themselves); ``wait_share``: the share of the trainers' time spent waiting for a batch.
    """

    count: int = 0
    target: int = 0
    low: int = 0
    high: int = 0
    samples_per_s: float = 0.0
    batches_per_s: float = 0.0
    enqueue_per_s: float = 0.0
    dequeue_per_s: float = 0.0
    built_by_trainers_per_s: float = 0.0
    wait_share: float = 0.0
    trainer_wait_s: float = 0.0
    # the trainers' CPUs (their torch threads; 0: not tunable, e.g. with logical workers, whose
    # results must not depend on them), the most they may use, and the cores one used lately
    trainer_threads: int = 0
    trainer_threads_max: int = 0
    trainer_cpu: float = 0.0


class JobObservation(_Wire):
    """What every planner sees at one decision point.

    The master builds it from its state and the workers' reports, the simulators from their
    models: the same planner runs on both. Planners never read a clock; time comes in ``now_s``.

    Attributes:
        now_s: seconds since the job started (the caller's clock).
        current_workers: workers training now; ``target_workers`` what was last asked for.
        ready: every process of the current target runs (no scaling in progress).
        samples_per_s: the job's throughput now (all workers together).
        throughput: one point per configuration the job ran with so far (the data a
            throughput model is fitted on).
        batch_size: samples one worker trains per step (0: not known yet).
        committed_samples, total_samples: progress (``total_samples`` 0 when unbounded).
        workers: one entry per live process, with its step-time split, CPU and memory.
        pauses: pauses since the previous decision, oldest first.
        stream, ps, data: the parts of online, parameter-server and data-worker jobs.
        features: the job's signature for the warm start (model, dataset, sizes ...).
        cpus_available: cores the job's workers may use (the machine's, on the local backend).
    """

    job_id: str
    min_workers: int
    max_workers: int
    current_workers: int
    target_workers: int = 0
    now_s: float = 0.0
    ready: bool = True
    samples_per_s: float = 0.0
    applied_step: int = -1
    stragglers: int = 0
    throughput: list[ThroughputPoint] = Field(default_factory=list)
    batch_size: int = 0
    committed_samples: int = 0
    total_samples: int = 0
    steps_done: float = 0.0
    total_steps: float = 0.0
    workers: list[WorkerObservation] = Field(default_factory=list)
    pauses: list[PauseObservation] = Field(default_factory=list)
    stream: StreamObservation | None = None
    ps: PSObservation | None = None
    data: DataWorkerObservation | None = None
    features: dict[str, str | float] = Field(default_factory=dict)
    cpus_available: float = 0.0  # cores the job's workers may use (0: not known)


# --------------------------------------------------------------------------- rendezvous store
# The key-value store the workers' process groups (gloo, nccl) rendezvous through, served by the
# master on its control plane (tidal.master.store, tidal.worker.store). Values are base64 in JSON.
MAX_STORE_KEY_CHARS = 1024
MAX_STORE_VALUE_BYTES = 4 << 20  # an NCCL unique id is 128 bytes, a gloo address blob ~200
MAX_STORE_KEYS_PER_REQUEST = 4096
MAX_STORE_WAIT_S = 1.0  # one long-poll; the client loops until its own timeout
MAX_STORE_VALUE_CHARS = 4 * ((MAX_STORE_VALUE_BYTES + 2) // 3)  # in base64

_StoreKey = Annotated[str, Field(min_length=1, max_length=MAX_STORE_KEY_CHARS)]
_StoreValue = Annotated[str, Field(max_length=MAX_STORE_VALUE_CHARS)]
# Values in requests are base64 bounded only by MAX_BODY_BYTES: one over MAX_STORE_VALUE_BYTES is
# the store's 413 (tidal.master.service checks the length before decoding), not a 422.


class StoreSetRequest(_Wire):
    key: _StoreKey
    value: str = ""


class StoreSetResponse(_Wire):
    stored: bool = True


class StoreGetRequest(_Wire):
    """``wait_s``: how long the master may hold the request until the key exists."""

    key: _StoreKey
    wait_s: float = Field(default=0.0, ge=0, le=MAX_STORE_WAIT_S)


class StoreValueResponse(_Wire):
    found: bool
    value: _StoreValue = ""


class StoreAddRequest(_Wire):
    key: _StoreKey
    amount: int = Field(ge=-_I64, le=_I64)


class StoreAddResponse(_Wire):
    value: int


class StoreCompareSetRequest(_Wire):
    key: _StoreKey
    expected: str = ""
    desired: str = ""


class StoreKeysRequest(_Wire):
    """``check`` answers at once; ``wait`` holds the request up to ``wait_s`` until all exist."""

    keys: list[_StoreKey] = Field(min_length=1, max_length=MAX_STORE_KEYS_PER_REQUEST)
    wait_s: float = Field(default=0.0, ge=0, le=MAX_STORE_WAIT_S)


class StoreKeysResponse(_Wire):
    ready: bool


class StoreDeleteRequest(_Wire):
    key: _StoreKey


class StoreDeleteResponse(_Wire):
    deleted: bool


class StoreNumKeysRequest(_Wire):
    """Counts the keys under ``prefix`` (a round's prefix, as the keys themselves)."""

    prefix: _StoreKey


class StoreNumKeysResponse(_Wire):
    count: int
