"""The job master's configuration and errors.

Errors map to HTTP statuses in tidal.master.service: each carries its own ``status``, so a
handler never invents one and nothing the master raises on purpose becomes a 500.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tidal.api import ConfigError, PermanentError, RetryableError, StaleRoundError, TidalError


class MasterError(TidalError):
    status = 400


class BadRequestError(MasterError, ConfigError):
    status = 400


class UnknownWorkerError(MasterError, PermanentError):
    status = 404


class WorkerGoneError(MasterError, PermanentError):
    """The worker was declared failed or told to leave; it must exit."""

    status = 410


class StaleRoundMasterError(MasterError, StaleRoundError):
    status = 409


class JobNotRunningError(MasterError, PermanentError):
    status = 409


class NotExhaustedError(MasterError, PermanentError):
    """A worker said training is over while the master knows samples that were never trained."""

    status = 409


class InvalidTransitionError(MasterError, PermanentError):
    """A state change the transition table forbids (a worker record, a shard): the request that
    asked for it conflicts with the state, or the master has a bug; it never passes silently."""

    status = 409


class JournalUnavailableError(MasterError, RetryableError):
    """The journal (or the ledger beside it) cannot be written: disk full, I/O error.

    The master changes no state it cannot journal: it pauses the job, answers 503 (workers
    retry with backoff and keep their records) and reloads its state from the journal once a
    write succeeds again (DESIGN.md 4, "No false success").
    """

    status = 503


@dataclass
class JobSpec:
    """Everything needed to run (and, from the journal, to resume) one job."""

    job_id: str
    argv: list[str]  # the worker command: python, script, args
    min_workers: int
    max_workers: int
    token: str
    job_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    ledger_path: str | None = None
    initial_workers: int | None = None  # start below MAX (the demo starts with 1 of 1:2)
    planner: str = "max"
    planner_interval_s: float = 1.0  # how often the planner is asked for a target
    # the finished jobs a planner warm-starts from, and where this one is recorded (None: neither)
    history_path: str | None = None
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    start_timeout_s: float = 180.0
    start_grace_s: float = 5.0  # how long the first round waits for slow starters once MIN joined
    collective_timeout_s: float = 60.0
    # liveness by progress (DESIGN.md 4, "No false success"): a re-form that has not closed this
    # long after it began fails the members that never reached the rendezvous ...
    round_timeout_s: float = 60.0
    # ... and a member that applies no step this long while its peers do is replaced
    progress_timeout_s: float = 300.0
    # how long a job may stay paused on an unwritable journal before the master gives up (the
    # journal still holds every committed step: ``tidal master --resume`` carries on from it)
    journal_patience_s: float = 300.0
    max_restarts: int = 20
    # rounds in a row that fail (a collective or a group that failed, reported by a member) before
    # any step is applied: the runtime's crash loop, e.g. NCCL refusing the group every time
    round_failure_limit: int = 10
    crash_loop_limit: int = 3  # consecutive start failures of one worker slot (reset once it trains)
    straggler_factor: float = 2.0  # slower per sample than the peers' median by this much ...
    straggler_window_s: float = 2.0  # ... for this long
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    gpus: list[str] = field(default_factory=list)  # GPU ids the local backend hands out, one per worker slot
    # where the nodes run, by name in tidal.backends.registry; journaled with the spec, so a
    # resumed master uses the backend that started the nodes it adopts
    backend: str = "local"
    # options of that backend, journaled too (the ray backend's address, namespace, placement)
    backend_options: dict[str, Any] = field(default_factory=dict)
    # GPUs each worker asks the backend for where the backend places them (ray); the local
    # backend hands out ``gpus`` above instead
    gpus_per_worker: int = 0
    # the URL the job's nodes reach the master at, when not http://HOST:PORT: a TLS-terminating
    # proxy in front of the master (``tidal run --public-url https://...``)
    public_url: str | None = None
    # a stream job (``tidal run --stream URL``): the workers read it (the master never talks to
    # the stream system); ``stop_when_drained_s``: end the job once every partition is drained
    # and nothing new arrived for that long (None: run until stopped)
    stream_url: str | None = None
    stop_when_drained_s: float | None = None
    trim_after_commit: bool = False  # workers delete committed records from the stream
    # the stream's time runs this many times faster than the trace it replays (``tidal produce
    # --speedup``): a stream planner sees trace time (its intervals, lags and rates scaled)
    time_scale: float = 1.0
    # a stream job's lag SLO, trace time (``--lag-slo``; Kale's 20 minutes), scored as the simulator does
    lag_slo_s: float = 1200.0
    # kale's knobs for a lag far below the SLO (``--load-headroom``, ``--lag-price``; 1 and 0: off)
    load_headroom: float = 1.0
    lag_price: float = 0.0
    planned_lag_s: float | None = None  # ``--planned-lag``: the lag kale acts before (None: a quarter of the SLO)
    # ``--program-hours`` and its price: kale plans over this long with each lag-minute priced (None: Eq. 10);
    # the price in worker-minutes a lag-minute (None: kale's), or set against a shadow HPA's lag at the ratio
    program_horizon_s: float | None = None
    program_lag_price: float | None = None
    program_lag_ratio: float | None = None
    # the stream's past traffic (``--traffic-history``): records per interval of
    # ``traffic_history_interval_s`` trace seconds, oldest first; kept in the spec (and so in the
    # journal) so that a master that takes over seeds its planner with it again
    traffic_history: list[float] = field(default_factory=list)
    traffic_history_interval_s: float = 60.0
    # parameter servers (``tidal run --ps N|MIN:MAX``): how many at the start (MIN), the most
    # ``tidal scale --ps`` may ask for (0: ``ps``), and the virtual shards their rows hash to
    ps: int = 0
    ps_max: int = 0
    ps_shards: int = 64
    # bytes of rows and optimizer state one server may hold (``--ps-memory``; 0: no limit), and
    # whether the master adds servers before a server would pass it (DLRover-RM 5.3)
    ps_memory: int = 0
    ps_oom_prevention: bool = True
    ps_hot_balance: bool = True  # move virtual shards off a hot server (tidal.brain.hotps)
    ps_oom_horizon_s: float = 3600.0  # a stream job's out-of-memory prediction looks this far ahead
    # data workers (``tidal run --data-workers N|MIN:MAX``, tidal.data): how many at the start (MIN)
    # and the most ``tidal scale --data-workers`` or the tuner may ask for; -1: the job has none
    data_workers: int = -1
    data_workers_max: int = 0
    data_tuner: bool = False  # GoldMiner 3.4.1's job-level tuner decides their number (MIN != MAX)

    @property
    def data_range(self) -> tuple[int, int]:
        """``--data-workers MIN:MAX`` (MAX is MIN for ``--data-workers N``)."""
        return max(self.data_workers, 0), max(self.data_workers, self.data_workers_max)

    @property
    def ps_range(self) -> tuple[int, int]:
        """``--ps MIN:MAX`` (MAX is MIN for ``--ps N``)."""
        return self.ps, max(self.ps, self.ps_max)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def node_url(self) -> str:
        """Where the job's nodes (workers, servers, data workers) reach the master."""
        return self.public_url or f"http://{self.host}:{self.port}"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobSpec:
        return cls(**data)
