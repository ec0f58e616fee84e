"""``tidal run``, ``tidal master``, ``tidal status``, ``tidal scale``, ``tidal demo``."""

from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import typer

from tidal import backends
from tidal.api import ConfigError, PlannerStatus, StatusResponse, StreamLagStatus, parse_every
from tidal.cli import app, fail

HOME_ENV = "TIDAL_HOME"

# The local backend starts every worker as a process of this machine: a MAX far above what one
# machine runs would only make the master build tables for workers that can never start.
MAX_LOCAL_WORKERS = 1024
# Each logical worker keeps its own RNG states and gradient in whichever process runs it.
MAX_LOGICAL_WORKERS = 1024
MAX_RESTARTS = 100_000
PORTS = (0, 65535)  # 0: any free port
# Seconds. Workers heartbeat every 0.5 s, so a heartbeat timeout under 1 s would declare healthy
# workers dead; above an hour a dead worker would hold its shards for longer than any job wants.
HEARTBEAT_TIMEOUT_S = (1.0, 3600.0)
COLLECTIVE_TIMEOUT_S = (1.0, 3600.0)
ROUND_TIMEOUT_S = (1.0, 3600.0)
PROGRESS_TIMEOUT_S = (1.0, 86400.0)  # a day: one step of a large model may take many minutes
PLANNER_INTERVAL_S = (0.1, 3600.0)


def backends_help() -> str:
    """``--backend``'s help: each registered backend and what it is."""
    return "Where the job's processes run: " + "; ".join(
        f"{name} ({backends.summary(name)})" if backends.summary(name) else name for name in backends.names()) + "."


LOAD_HEADROOM_HELP = (
    "kale plans on H times the forecast traffic (default 1: Eq. 10, the workers just keep up and run "
    "95-98% busy, so a forecast error below the traffic becomes a backlog; 1.15-1.2 keeps the lag far "
    "below the SLO for 15-20% more workers; see tidal.brain.kale.KalePlanner).")
PLANNED_LAG_HELP = (
    "kale scales out when, as things are, the lag would pass SECONDS (trace time) within the time an action "
    "takes (default a quarter of --lag-slo: 300 at the default SLO). A job whose lag must stay far below the "
    "SLO sets it lower: kale then acts on a smaller shortfall, for more workers.")
PROGRAM_HOURS_HELP = (
    "kale plans over HOURS of its forecast with each lag-minute priced (--program-lag-price) instead of sizing "
    "each 10-minute bin by Eq. 10: it sees a whole ramp and pays each move's pause where it falls, for a lag of "
    "a few minutes at a few more workers (3 is a good start; default off)")
PROGRAM_LAG_PRICE_HELP = (
    "with --program-hours: worker-minutes one lag-minute is worth (default kale's, 12; higher: less lag, more "
    "workers); with --program-lag-ratio, the price it starts at")
PROGRAM_LAG_RATIO_HELP = (
    "with --program-hours: kale sets its own price, keeping its accumulated lag at RATIO times what the "
    "Kubernetes HPA would accumulate on the same traffic (simulated beside the job on kale's belief; e.g. 0.3)")
LAG_PRICE_HELP = (
    "With --global-shuffle, kale weighs each minute a record waits in the busiest worker's local queue "
    "as WORKERS workers (default 0: off). A count that leaves one worker more partitions than it trains "
    "keeps a full queue there; a price makes kale take a count that does not, where that is worth it.")


def check_range(option: str, value: float, bounds: tuple[float, float], after: str = "") -> None:
    """Raise ConfigError unless ``value`` is finite and within ``bounds`` (both ends included).

    The one check behind every numeric option of ``tidal run``. Typer parses ``nan`` and ``inf``
    as floats and a NaN compares false with everything, so finiteness is checked first. ``after``
    follows the bounds in the message: a unit, or the reason for the limit.
    """
    low, high = bounds
    if not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"{option} must be between {low:g} and {high:g}{after}, got {value}")


def span(bounds: tuple[float, float]) -> str:
    """``bounds`` as the ``--help`` texts write them: ``1..3600``."""
    return f"{bounds[0]:g}..{bounds[1]:g}"


def tidal_home() -> Path:
    return Path(os.environ.get(HOME_ENV, ".tidal"))


def parse_size(text: str, option: str) -> int:
    """Bytes of ``512M``, ``4G``, ``100K`` or a plain number of bytes (binary units)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (value[:-1], value[-1]) if value[-1:] in units and value[-1:] else (value, "")
    try:
        size = float(number) * units[unit]
    except ValueError:
        raise ConfigError(f"{option} takes a size such as 512M or 4G, got {text!r}") from None
    if not 2**16 <= size < 2**50:
        raise ConfigError(f"{option} must be between 64K and 1024T, got {text!r}")
    return int(size)


def parse_range(text: str, option: str, least: int = 1) -> tuple[int, int]:
    """``MIN:MAX`` or ``N`` (``N:N``), both at least ``least``."""
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"{option} must be MIN:MAX or N, got {text!r}") from None
    if low < least:
        raise ConfigError(f"{option} MIN must be at least {least}, got {low}")
    if low > high:
        raise ConfigError(f"{option} MIN ({low}) is greater than MAX ({high})")
    return low, high


def parse_workers(text: str, backend: str = "local") -> tuple[int, int]:
    low, high = parse_range(text, "--workers")
    if backend == "local":
        check_range("--workers MAX", high, (1, MAX_LOCAL_WORKERS),
                    " (MAX_LOCAL_WORKERS: the local backend runs every worker on this machine)")
    check_range("--workers MAX", high, (1, MAX_WORKERS))
    return low, high


def ray_options(backend: str, address: str, placement: str, wait_s: float, gpus_per_worker: int) -> dict[str, Any]:
    """The ray backend's options from ``tidal run``'s (a one-line error for bad ones, or for
    ray options given to another backend)."""
    given_ray = address != "auto" or placement != "spread" or wait_s != 0.0 or gpus_per_worker != 0
    if backend != "ray":
        if given_ray:
            raise fail("--ray-address, --placement, --wait-for-resources and --gpus-per-worker need --backend ray")
        return {}
    if placement not in ("spread", "pack"):
        raise fail(f"--placement must be spread or pack, got {placement!r}")
    check_range("--wait-for-resources", wait_s, (0.0, 86_400.0), " seconds")
    check_range("--gpus-per-worker", gpus_per_worker, (0, 64))
    from tidal.backends.ray import check_reachable, import_ray, resolve_address

    try:  # before the job exists: a missing Ray or a cluster that is not there is a one-line error
        import_ray()
        address = resolve_address(address)
        check_reachable(address)
    except backends.BackendError as exc:
        raise fail(str(exc)) from None
    return {"address": address, "placement": placement, "wait_for_resources_s": wait_s}


def make_job_dir(directory: Path) -> None:
    """Create the job directory (0700: it holds the journal and job.json, which hold the token).

    An existing directory keeps its mode; it only has to be one this user can create files in.
    """
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as exc:
        raise ConfigError(f"cannot use --job-dir {directory}: {exc.strerror}") from None


def check_ledger(path: Path | None) -> None:
    if path is None:
        return
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write ledger {path}: {exc.strerror}") from None



MAX_WORKERS = 4096  # worker processes of one job on any backend
MAX_PS = 64  # parameter servers of one job on the local backend
MAX_DATA_WORKERS = 256  # data workers of one job on the local backend

@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})
def run(
    ctx: typer.Context,
    script: Path = typer.Argument(..., help="The training script (run with this Python)."),
    workers: str = typer.Option(
        "1:1", "--workers", "-w", help=f"MIN:MAX worker processes (or N); MAX at most {MAX_LOCAL_WORKERS}."),
    initial: int | None = typer.Option(None, "--initial", help="Start with this many workers (default MAX)."),
    ledger: Path | None = typer.Option(None, "--ledger", help="Write one JSON line per committed sample range."),
    port: int = typer.Option(0, "--port", help=f"Control-plane port on 127.0.0.1, {span(PORTS)} (0: any free port)."),
    job_dir: Path | None = typer.Option(
        None, "--job-dir", help="Where the journal, logs and job.json go (created with mode 0700)."),
    heartbeat_timeout: float = typer.Option(
        5.0, "--heartbeat-timeout", metavar="SECONDS",
        help="Seconds without a heartbeat before a worker is declared dead and replaced "
             f"({span(HEARTBEAT_TIMEOUT_S)}; workers heartbeat every 0.5 s)."),
    collective_timeout: float = typer.Option(
        60.0, "--collective-timeout", metavar="SECONDS",
        help="How long one collective (gradient reduction, state broadcast) may block before the workers "
             f"give up on it and re-form without the peer that stalled it ({span(COLLECTIVE_TIMEOUT_S)})."),
    round_timeout: float = typer.Option(
        60.0, "--round-timeout", metavar="SECONDS",
        help="A re-form still open this long after it began fails the members that never reached the "
             f"rendezvous; the others carry on ({span(ROUND_TIMEOUT_S)})."),
    progress_timeout: float = typer.Option(
        300.0, "--progress-timeout", metavar="SECONDS",
        help="A worker that applies no step for this long while its peers do is replaced, even though it "
             f"still heartbeats ({span(PROGRESS_TIMEOUT_S)}; set it above your slowest step)."),
    max_restarts: int = typer.Option(
        20, "--max-restarts", help=f"Worker failures tolerated before the job fails ({span((0, MAX_RESTARTS))})."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not echo the workers' output."),
    logical_workers: int | None = typer.Option(
        None, "--logical-workers",
        help="Train N logical workers over however many processes run (bitwise the same for any count).",
    ),
    stream: str | None = typer.Option(
        None, "--stream", metavar="URL",
        help="Train online from a stream (redis://127.0.0.1:PORT/NAME or file:///DIR/NAME; the script reads it "
             "with job.loader(stream=..., decode=...)): the master assigns partitions to workers each round and "
             "journals, with every step, the last record it trained of each; --ledger lines name record ids."),
    stop_when_drained: float | None = typer.Option(
        None, "--stop-when-drained", metavar="SECONDS",
        help="With --stream: end the job once every partition is drained and nothing new arrived for SECONDS "
             "(tests and replays; without it a stream job runs until stopped)."),
    trim_after_commit: bool = typer.Option(
        False, "--trim-after-commit",
        help="With --stream: delete records from the stream once the step that trained them is committed "
             "(tidal deletes nothing otherwise; an audit against the stream then sees only what is left)."),
    global_shuffle: str | None = typer.Option(
        None, "--global-shuffle", metavar="LOWER:UPPER",
        help="With --stream: Kale's global shuffling (tidal.worker.shuffle). Each worker keeps a local queue "
             "of records read from its partitions; above UPPER records it forwards what it reads next to "
             "workers that accept (those whose queue fell below LOWER), over ZeroMQ on 127.0.0.1. Evens out "
             "uneven partitions; every record is still trained exactly once. A record waits behind what is queued "
             "before it, so keep UPPER at one step's batch and LOWER a fraction of it: e.g. 32:128 with a "
             "batch of 128 (bench/shuffle.py: p99 lag 0.25 s, against 0.32 s at 32:160 and 0.87 s at 128:512)."),
    ps_text: str | None = typer.Option(
        None, "--ps", metavar="N|MIN:MAX",
        help="Start N (or MIN) parameter servers (tidal.ps) for the script's embedding tables "
             "(tidal.ps.embedding.ServerEmbeddings): rows hash-partitioned over virtual shards, created on "
             "first use, updated on the servers in sync with every committed step. With MIN:MAX, "
             "`tidal scale --ps N` changes their number while training runs: new servers start, and the "
             f"virtual shards move at the next step boundary. At most {MAX_PS}. A server that dies is "
             "replaced and every server restored from the newest flash checkpoint (--checkpoint-every), the "
             "steps after it trained again; without checkpoints its loss fails the job."),
    data_workers_text: str | None = typer.Option(
        None, "--data-workers", metavar="N|MIN:MAX",
        help="Start N (or MIN) data workers (tidal.data): processes that run the script's "
             "`job.loader(dataset, ..., preprocess=fn)` part, building whole batches (fn applied) for the index "
             "ranges each trainer sends them, so that pre-processing scales apart from training (GoldMiner). "
             "Any number of them feed every trainer; a trainer consumes batches in order and drops duplicates, "
             "so a data worker's loss re-dispatches its batches and loses or repeats nothing. 0 is allowed (the "
             "trainers build their batches, as without the option). With MIN:MAX (MIN < MAX) GoldMiner's job-level "
             "tuner decides their number: it measures the job without data workers (MIN 0), then adds one at a "
             "time while the trainers wait for batches and each one still pays, and falls back to none if they "
             "do not help. `tidal scale --data-workers N` sets the number by hand (the tuner stops). "
             f"At most {MAX_DATA_WORKERS}."),
    data_prefetch: int = typer.Option(
        0, "--data-prefetch", metavar="N",
        help="With --data-workers: batches each trainer keeps in flight (0: two per data worker)."),
    ps_shards: int = typer.Option(
        64, "--ps-shards", metavar="V", help="Virtual shards the rows hash to (at least --ps, at most 4096)."),
    ps_memory_text: str | None = typer.Option(
        None, "--ps-memory", metavar="SIZE",
        help="The memory one parameter server's tables (rows and optimizer state) may hold, e.g. 512M or 4G: a "
             "server that passes it stops with an out-of-memory report, which fails the job. With --ps MIN:MAX "
             "the master predicts, from the rows the servers hold against the samples trained, whether they "
             "will pass it before the job ends, and adds servers before they do (DLRover-RM 5.3)."),
    no_ps_oom_prevention: bool = typer.Option(
        False, "--no-ps-oom-prevention",
        help="With --ps-memory: do not add servers before the tables outgrow them (they do by default)."),
    ps_oom_horizon: float = typer.Option(
        3600.0, "--ps-oom-horizon", metavar="SECONDS",
        help="With --ps-memory and --stream: how far ahead the out-of-memory prediction looks (a stream "
             "has no end): the records committed within it at the recent rate."),
    no_ps_hot_balance: bool = typer.Option(
        False, "--no-ps-hot-balance",
        help="With --ps N>1: do not move virtual shards off a server much busier than its peers (DLRover 4.2's "
             "hot PS; by default the master does, every 5 s, from the servers' busy time and rows per shard)."),
    resume_dir: Path | None = typer.Option(
        None, "--resume", metavar="JOBDIR",
        help="Continue the job of JOBDIR (its master and workers gone) instead of starting one: SCRIPT and its "
             "arguments must be the job's; every other option is the job's own (see `tidal resume`)."),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Final and on-demand checkpoints go here."),
    checkpoint_every: str | None = typer.Option(
        None, "--checkpoint-every", metavar="STEPS|DURATION",
        help="Also a flash checkpoint every STEPS applied steps (500) or DURATION (90s, 5m, 1h): the state is "
             "copied into shared memory at a step boundary and written to --checkpoint-dir by a background "
             "process (needs --checkpoint-dir)."),
    checkpoint_keep: int | None = typer.Option(
        None, "--checkpoint-keep", metavar="N",
        help="Keep the N newest flash checkpoints on disk, deleting older ones as new ones are written "
             "(default: keep every one; needs --checkpoint-every). The one the master would resume from is "
             "never deleted, even when it is older than the N newest (it learns of checkpoints late)."),
    determinism: str | None = typer.Option(
        None, "--determinism", help="D0, D1 (default with --logical-workers) or D2 (also across CPU types)."),
    comm_backend: str | None = typer.Option(
        None, "--comm-backend",
        help="Force the workers' process-group backend, gloo or nccl. Default: from the model's device "
             "(gloo on CPU; nccl on GPUs when each worker has its own, one GPU per worker from "
             "CUDA_VISIBLE_DEVICES or the machine's; gloo over CUDA where they must share)."),
    backend: str = typer.Option("local", "--backend", metavar="NAME", help=backends_help()),
    ray_address: str = typer.Option(
        "auto", "--ray-address", metavar="auto|HOST:PORT",
        help="With --backend ray: the Ray cluster (the head's GCS address); auto: $RAY_ADDRESS, else the "
             "cluster `ray start` started on this machine."),
    placement: str = typer.Option(
        "spread", "--placement", metavar="spread|pack",
        help="With --backend ray: spread the job's nodes over the cluster's machines (Ray's SPREAD strategy), "
             "or pack them onto the machine that already holds most of them while it has room (the first "
             "onto the machine with the most CPUs)."),
    wait_for_resources: float = typer.Option(
        0.0, "--wait-for-resources", metavar="SECONDS",
        help="With --backend ray: how long a node may wait for a machine with room. 0 (default): a request no "
             "machine of the cluster can hold (say 2 GPUs where each has 1) fails at once, naming the resource "
             "and the machines; one that fits waits without limit. N: either waits N seconds (for a machine to "
             "join, or room to free up) before the node counts as not started."),
    gpus_per_worker: int = typer.Option(
        0, "--gpus-per-worker", metavar="N",
        help="With --backend ray: GPUs each worker asks Ray for (Ray sets its CUDA_VISIBLE_DEVICES). The local "
             "backend gives each worker one of this machine's GPUs instead."),
    public_url: str | None = typer.Option(
        None, "--public-url", metavar="URL",
        help="The URL the job's workers reach the master at, when it is behind a TLS-terminating proxy "
             "(https://master.example:8443); default http://HOST:PORT."),
    detach: bool = typer.Option(
        False, "--detach",
        help="With --backend ray: run the master as a detached Ray actor on this machine, which outlives this "
             "command (and the terminal); prints the job directory and returns. Follow it with "
             "`tidal status --job-dir DIR`; its output goes to DIR/master.log."),
    host: str = typer.Option(
        "127.0.0.1", "--host",
        help="The address the master listens on. Workers on other machines (--backend ray) reach it there: give "
             "this machine's address on the cluster's network. Every request carries the job's bearer token; "
             "the README says how to put TLS in front."),
    planner: str | None = typer.Option(
        None, "--planner", metavar="NAME",
        help="The policy that sets the number of workers while the job runs: max, fixed, es, optimus, dlrover, "
             "dlrover-rm; for a --stream job also kale, hpa, autopilot, madu, adequate (see tidal.brain.planners; "
             "`tidal scale N` overrides it until `tidal scale --auto`). Default dlrover-rm (kale with --stream): "
             "measures the job at the counts it tries, refits its throughput model and settles on the fewest "
             "workers within 10% of the best throughput; warm-starts from --history."),
    time_scale: float = typer.Option(
        1.0, "--time-scale", metavar="X",
        help="With --stream: the stream replays a trace X times faster than it happened (tidal produce "
             "--speedup X); a stream planner then sees trace time (its intervals, lags and rates scaled by X)."),
    lag_slo: float | None = typer.Option(
        None, "--lag-slo", metavar="SECONDS",
        help="With --stream: the lag SLO in trace time (default 1200, Kale's 20 minutes; in wall time SECONDS / "
             "--time-scale). tidal status, /metrics and the dashboard show the lag against it, the share of "
             "the time over it and the accumulated lag (as `tidal sim online` scores them); kale plans for it."),
    load_headroom: float = typer.Option(
        1.0, "--load-headroom", metavar="H", help="With --stream: " + LOAD_HEADROOM_HELP),
    lag_price: float = typer.Option(0.0, "--lag-price", metavar="WORKERS", help=LAG_PRICE_HELP),
    planned_lag: float | None = typer.Option(
        None, "--planned-lag", metavar="SECONDS", help="With --stream: " + PLANNED_LAG_HELP),
    program_hours: float | None = typer.Option(
        None, "--program-hours", metavar="HOURS",
        help="With --stream: " + PROGRAM_HOURS_HELP + ". Arrivals counted more often than a minute (every "
             "--planner-interval) are summed into minutes for it."),
    program_lag_price: float | None = typer.Option(
        None, "--program-lag-price", metavar="WORKER_MIN", help=PROGRAM_LAG_PRICE_HELP),
    program_lag_ratio: float | None = typer.Option(
        None, "--program-lag-ratio", metavar="RATIO", help=PROGRAM_LAG_RATIO_HELP),
    traffic_history: Path | None = typer.Option(
        None, "--traffic-history", metavar="CSV",
        help="With --stream: the stream's past traffic, seeded into the planner's forecaster before its first "
             "decision (kale and madu keep an arrival history; other planners refuse it). A trace CSV as "
             "`tidal produce --trace` reads it (time, then a count per interval), in trace time and in the "
             "stream's records: e.g. the days before the one produced, scaled as it is. Kale fits its forecaster "
             "once two days of arrivals are known; until then it scales out by its threshold fallback alone and "
             "in to what the last 3 hours' busiest 20 minutes need."),
    traffic_column: str | None = typer.Option(
        None, "--traffic-column", metavar="NAME", help="The count column of --traffic-history (default: the second)."),
    history: str | None = typer.Option(
        None, "--history", metavar="PATH",
        help="SQLite file of finished jobs: a planner warm-starts from similar ones, and this job is added "
             "when it succeeds (default $TIDAL_HISTORY or ~/.tidal/history.sqlite; 'none': neither)."),
    planner_interval: float = typer.Option(
        1.0, "--planner-interval", metavar="SECONDS",
        help=f"How often the planner is asked for a target ({span(PLANNER_INTERVAL_S)})."),
) -> None:
    """Run SCRIPT [ARGS...] as an elastic job of worker processes (on this machine, or on a Ray cluster).

    Options of `tidal run` go before SCRIPT; everything after it is the script's.

    A job master keeps MIN..MAX workers alive, replaces failed ones without restarting the
    survivors, and hands out the dataset in shards so that every sample of every epoch is
    trained exactly once. Change the worker count while it runs with `tidal scale N`; watch it
    with `tidal status`. Exit status: 0 when the job succeeded, 1 when it failed, 2 on bad input.
    """
    if resume_dir is not None:
        _resume_job(resume_dir, quiet, [str(script.resolve()), *ctx.args])
    low, high = parse_workers(workers, backend)
    check_range("--port", port, PORTS)
    check_range("--heartbeat-timeout", heartbeat_timeout, HEARTBEAT_TIMEOUT_S, " seconds")
    check_range("--collective-timeout", collective_timeout, COLLECTIVE_TIMEOUT_S, " seconds")
    check_range("--round-timeout", round_timeout, ROUND_TIMEOUT_S, " seconds")
    check_range("--progress-timeout", progress_timeout, PROGRESS_TIMEOUT_S, " seconds")
    check_range("--max-restarts", max_restarts, (0, MAX_RESTARTS))
    check_range("--planner-interval", planner_interval, PLANNER_INTERVAL_S, " seconds")
    planner = planner or ("kale" if stream else "dlrover-rm")
    check_planner(planner)
    if time_scale != 1.0:
        if stream is None:
            raise fail("--time-scale needs --stream")
        check_range("--time-scale", time_scale, (0.001, 1e6))
    if stream is None and (lag_slo is not None or traffic_history is not None or traffic_column is not None):
        raise fail("--lag-slo, --traffic-history and --traffic-column need --stream")
    if lag_slo is not None:
        check_range("--lag-slo", lag_slo, (0.001, 1e9), " seconds")
    if stream is None and (load_headroom != 1.0 or lag_price != 0.0 or planned_lag is not None):
        raise fail("--load-headroom, --lag-price and --planned-lag need --stream")
    check_kale_knobs(load_headroom, lag_price, planner, planned_lag)
    if stream is None and program_hours is not None:
        raise fail("--program-hours needs --stream")
    check_program_knobs(program_hours, program_lag_price, program_lag_ratio, planner)
    if traffic_column is not None and traffic_history is None:
        raise fail("--traffic-column needs --traffic-history")
    seed: tuple[list[float], float] = ([], 60.0)
    if traffic_history is not None:
        check_history_planner(planner)
        seed = read_traffic_history(traffic_history, traffic_column)
    if backend not in backends.names():
        raise fail(f"unknown --backend {backend!r}; known: {', '.join(backends.names())}")
    backend_options = ray_options(backend, ray_address, placement, wait_for_resources, gpus_per_worker)
    if public_url is not None and not public_url.startswith(("http://", "https://")):
        raise fail(f"--public-url must start with http:// or https://, got {public_url!r}")
    if not script.is_file():
        raise fail(f"script {script} not found")
    if initial is not None and not low <= initial <= high:
        raise fail(f"--initial {initial} is outside --workers {low}:{high}")
    check_ledger(ledger)
    ps, ps_max = parse_range(ps_text, "--ps") if ps_text is not None else (0, 0)
    ps_memory = parse_size(ps_memory_text, "--ps-memory") if ps_memory_text is not None else 0
    if ps_memory and not ps:
        raise fail("--ps-memory needs --ps")
    check_range("--ps-oom-horizon", ps_oom_horizon, (1.0, 1e7))
    if ps:
        check_range("--ps MAX", ps_max, (1, MAX_PS))
        check_range("--ps-shards", ps_shards, (ps_max, 4096))
    env = logical_env(logical_workers, high, checkpoint_dir, determinism)
    data_low, data_high = (parse_range(data_workers_text, "--data-workers", least=0)
                           if data_workers_text is not None else (-1, 0))
    if data_workers_text is not None:
        check_range("--data-workers MAX", data_high, (0, MAX_DATA_WORKERS))
        check_range("--data-prefetch", data_prefetch, (0, 4096))
        if stream is not None:
            raise fail("--data-workers build batches of a dataset; a --stream job reads its records itself")
        env["TIDAL_DATA_WORKERS"] = "1"
        if data_prefetch:
            env["TIDAL_DATA_PREFETCH"] = str(data_prefetch)
    elif data_prefetch:
        raise fail("--data-prefetch needs --data-workers")
    if stream is not None:
        check_stream(stream, logical_workers)
        env["TIDAL_STREAM_URL"] = stream
        if trim_after_commit:
            env["TIDAL_STREAM_TRIM"] = "1"
        if global_shuffle is not None:
            lower, upper = shuffle_thresholds(global_shuffle)
            env["TIDAL_STREAM_SHUFFLE"] = f"{lower}:{upper}"
    elif stop_when_drained is not None or trim_after_commit or global_shuffle is not None:
        raise fail("--stop-when-drained, --trim-after-commit and --global-shuffle need --stream")
    if stop_when_drained is not None:
        check_range("--stop-when-drained", stop_when_drained, (0.0, 86_400.0), " seconds")
    if checkpoint_every is not None:
        if checkpoint_dir is None:
            raise fail("--checkpoint-every needs --checkpoint-dir")
        parse_every(checkpoint_every)  # a one-line error for a bad value
        env["TIDAL_CHECKPOINT_EVERY"] = checkpoint_every
    if checkpoint_keep is not None:
        if checkpoint_every is None:
            raise fail("--checkpoint-keep needs --checkpoint-every")
        check_range("--checkpoint-keep", checkpoint_keep, (1, 1_000_000))
        env["TIDAL_CHECKPOINT_KEEP"] = str(checkpoint_keep)
    gpus = visible_gpus() if backend == "local" else []
    if comm_backend is not None:
        if comm_backend not in ("gloo", "nccl"):
            raise fail(f"--comm-backend must be gloo or nccl, got {comm_backend!r}")
        if comm_backend == "nccl" and high > len(gpus) and not gpus_per_worker:
            raise fail(f"--comm-backend nccl needs a GPU per worker: --workers MAX is {high}, "
                       f"this machine shows {len(gpus)} GPU(s)")
        env["TIDAL_COMM_BACKEND"] = comm_backend
    if detach:
        if backend != "ray":
            raise fail("--detach needs --backend ray (the master then runs as a Ray actor)")
        _detach(str(script), job_dir, backend_options["address"])
        return
    # the master's modules (and their planners' numpy and scipy) once the options are known good
    from tidal.master.api import JobSpec
    from tidal.master.job import new_token
    from tidal.master.server import bind_socket, run_master

    sock = bind_socket(host, port)
    job_id = uuid.uuid4().hex[:8]
    if backend == "ray":
        backend_options["namespace"] = f"tidal-{job_id}"
    directory = (job_dir or tidal_home() / job_id).resolve()
    make_job_dir(directory)
    spec = JobSpec(
        job_id=job_id, argv=[sys.executable, str(script.resolve()), *ctx.args], min_workers=low,
        max_workers=high, token=new_token(), job_dir=str(directory), port=sock.getsockname()[1],
        ledger_path=str(ledger.resolve()) if ledger else None, initial_workers=initial,
        heartbeat_timeout_s=heartbeat_timeout, collective_timeout_s=collective_timeout,
        round_timeout_s=round_timeout, progress_timeout_s=progress_timeout, max_restarts=max_restarts,
        cwd=os.getcwd(), env=env, gpus=gpus, backend=backend, backend_options=backend_options,
        gpus_per_worker=gpus_per_worker, host=host, public_url=public_url, planner=planner,
        planner_interval_s=planner_interval, history_path=history_path(history),
        stream_url=stream, stop_when_drained_s=stop_when_drained, trim_after_commit=trim_after_commit,
        time_scale=time_scale, lag_slo_s=1200.0 if lag_slo is None else lag_slo,
        load_headroom=load_headroom, lag_price=lag_price, planned_lag_s=planned_lag,
        program_horizon_s=None if program_hours is None else program_hours * 3600.0,
        program_lag_price=program_lag_price, program_lag_ratio=program_lag_ratio,
        traffic_history=seed[0], traffic_history_interval_s=seed[1], ps=ps, ps_max=ps_max, ps_shards=ps_shards,
        ps_memory=ps_memory, ps_oom_prevention=not no_ps_oom_prevention, ps_hot_balance=not no_ps_hot_balance,
        ps_oom_horizon_s=ps_oom_horizon, data_workers=data_low, data_workers_max=data_high,
    )
    _point_current(directory)
    typer.echo(f"tidal: job {job_id} on http://{host}:{spec.port} (job dir {directory}); "
               f"dashboard: http://{host}:{spec.port}/dashboard?token={spec.token}", err=True)
    code, master = run_master(spec, directory / "journal.sqlite", sock=sock, follow_logs=not quiet)
    _print_summary(master)
    raise typer.Exit(code)


def _detach(script: str, job_dir: Path | None, address: str) -> None:
    """``tidal run --detach``: this same command without ``--detach``, as a detached Ray actor on
    this machine (tidal.backends.ray.run_detached)."""
    from tidal.backends.ray import run_detached

    directory = (job_dir or tidal_home() / f"detached-{uuid.uuid4().hex[:8]}").resolve()
    make_job_dir(directory)
    args = sys.argv[1:]
    at = args.index(script) if script in args else len(args)  # options before SCRIPT, the script's after
    options = [a for a in args[:at] if a != "--detach"]
    if "run" in options and job_dir is None:
        options.insert(options.index("run") + 1, f"--job-dir={directory}")
    argv = [sys.argv[0], *options, *args[at:]]
    try:
        started = run_detached(address, argv, os.getcwd(), str(directory / "master.log"))
    except backends.BackendError as exc:
        raise fail(str(exc)) from None
    _point_current(directory)
    typer.echo(f"tidal: the master runs detached (Ray actor {started['actor']} in namespace {started['namespace']}, "
               f"pid {started['pid']}); job dir {directory}; its output: {directory / 'master.log'}; "
               f"follow it with `tidal status --job-dir {directory}`", err=True)


def check_kale_knobs(load_headroom: float, lag_price: float, planner: str, planned_lag: float | None = None) -> None:
    """``--load-headroom``, ``--lag-price`` and ``--planned-lag``: in range, and only for kale, or
    a one-line error."""
    check_range("--load-headroom", load_headroom, (0.5, 10.0))
    check_range("--lag-price", lag_price, (0.0, 1e6), " workers a lag-minute")
    if planned_lag is not None:
        check_range("--planned-lag", planned_lag, (0.001, 1e9), " seconds")
    if planner != "kale" and (load_headroom != 1.0 or lag_price != 0.0):
        raise fail(f"--load-headroom and --lag-price are kale's; planner {planner} has neither")
    if planner != "kale" and planned_lag is not None:
        raise fail(f"--planned-lag is kale's; planner {planner} has none")


def check_program_knobs(hours: float | None, price: float | None, ratio: float | None, planner: str) -> None:
    """``--program-hours``, ``--program-lag-price`` and ``--program-lag-ratio``: in range, the last
    two only with the first, and only for kale, or a one-line error."""
    if hours is not None and not 0 < hours <= 24:
        raise fail(f"--program-hours must be in (0, 24], got {hours:g}")
    if price is not None and (hours is None or not price > 0):
        raise fail("--program-lag-price needs --program-hours and must be positive")
    if ratio is not None and (hours is None or not ratio > 0):
        raise fail("--program-lag-ratio needs --program-hours and must be positive")
    if planner != "kale" and hours is not None:
        raise fail(f"--program-hours is kale's; planner {planner} has none")


def shuffle_thresholds(text: str) -> tuple[int, int]:
    """``--global-shuffle LOWER:UPPER``, or a one-line error."""
    lower, sep, upper = text.partition(":")
    if not (sep and lower.isdigit() and upper.isdigit() and 0 <= int(lower) <= int(upper) and int(upper) > 0):
        raise fail(f"--global-shuffle takes LOWER:UPPER records with 0 <= LOWER <= UPPER and UPPER > 0, got {text!r}")
    return int(lower), int(upper)


def check_stream(url: str, logical_workers: int | None) -> None:
    """A one-line error for a stream the job could not read (a bad URL, an unreachable Redis)."""
    from tidal.data.streams import open_source

    if logical_workers is not None:
        raise ConfigError("--stream does not take --logical-workers yet")
    open_source(url).close()


def visible_gpus() -> list[str]:
    """The GPU ids workers may be given: ``CUDA_VISIBLE_DEVICES`` when set, else every NVIDIA GPU
    the driver lists (read from /proc, so that the master need not import torch or CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [g.strip() for g in listed.split(",") if g.strip()]
        # CUDA stops at the first invalid entry ("-1" hides every GPU)
        return list(itertools.takewhile(lambda g: g != "-1", ids))
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def logical_env(logical: int | None, max_workers: int, checkpoint_dir: Path | None,
                determinism: str | None) -> dict[str, str]:
    """The workers' environment for logical workers, checkpoints and determinism (tidal.worker.logical)."""
    env: dict[str, str] = {}
    if logical is not None:
        check_range("--logical-workers", logical, (1, MAX_LOGICAL_WORKERS))
        if max_workers > logical:
            raise ConfigError(f"--workers MAX ({max_workers}) is more processes than --logical-workers ({logical})")
        env["TIDAL_LOGICAL_WORKERS"] = str(logical)
    if determinism is not None:
        if determinism not in ("D0", "D1", "D2"):
            raise ConfigError(f"--determinism must be D0, D1 or D2, got {determinism!r}")
        env["TIDAL_DETERMINISM"] = determinism
        if determinism == "D2":
            # one ATen CPU kernel family on every x86 machine (set before torch is imported)
            env["ATEN_CPU_CAPABILITY"] = os.environ.get("ATEN_CPU_CAPABILITY", "avx2")
    if checkpoint_dir is not None:
        try:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create --checkpoint-dir {checkpoint_dir}: {exc.strerror}") from None
        env["TIDAL_CHECKPOINT_DIR"] = str(checkpoint_dir.resolve())
    return env


@app.command()
def fingerprint(
    directory: Path = typer.Argument(..., help="A --checkpoint-dir (its latest valid checkpoint) or one checkpoint."),
    as_json: bool = typer.Option(False, "--json", help="Print step, path and fingerprint as JSON."),
) -> None:
    """SHA-256 of a checkpoint's tensors in canonical order: equal for bitwise-equal models."""
    from tidal.worker.checkpoint import CheckpointError, latest_checkpoint, verify
    from tidal.worker.checkpoint import fingerprint as digest

    try:
        path = directory if (directory / "manifest.json").is_file() else latest_checkpoint(directory)
        value = digest(path)
        step = int(verify(path)["step"])
    except CheckpointError as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps({"fingerprint": value, "step": step, "path": str(path)}))
    else:
        typer.echo(f"{value}  {path}")


@app.command()
def checkpoints(
    directory: Path = typer.Argument(..., help="A --checkpoint-dir."),
    as_json: bool = typer.Option(False, "--json", help="Print the list as JSON."),
) -> None:
    """The checkpoints in DIRECTORY, newest first: step, size, time, and whether each verifies
    (every file against its manifest's SHA-256); a failing one says why. A resume takes the
    newest that verifies. Exit status 0 when the newest verifies, 1 when it does not or there
    is none, 2 on bad input."""
    from tidal.worker.flash import list_checkpoints

    if not directory.is_dir():
        raise fail(f"{directory} is not a directory")
    found = list_checkpoints(directory)
    if as_json:
        typer.echo(json.dumps([{"step": c.step, "path": str(c.path), "bytes": c.bytes, "mtime": c.mtime, "ok": c.ok,
                                "problem": c.problem} for c in found]))
    else:
        if not found:
            typer.echo(f"no checkpoint in {directory}")
        for c in found:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.mtime))
            verdict = "ok" if c.ok else f"BAD: {c.problem}"
            typer.echo(f"step {c.step:>9}  {c.bytes / 1e6:>10.1f} MB  {stamp}  {verdict}")
    raise typer.Exit(0 if found and found[0].ok else 1)


@app.command()
def master(
    resume: Path = typer.Option(..., "--resume", help="The journal (job dir/journal.sqlite) of the job to take over."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not echo the workers' output."),
) -> None:
    """Restart a job's master from its journal; the running workers reconnect and carry on."""
    _resume_job(resume, quiet)


@app.command()
def resume(
    job_dir: Path = typer.Argument(..., help="The job's directory (or its journal.sqlite)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not echo the workers' output."),
) -> None:
    """Continue a job whose master is gone (killed, its machine lost), workers or not.

    Workers still running reconnect and carry on. When every worker is gone too, the master
    relaunches them from the job's newest flash checkpoint (`--checkpoint-every`: shared memory
    if it is still there and intact, else --checkpoint-dir; a torn or corrupt one is skipped for
    the one before it) and rolls the data back to it: the ledger gets `{"rollback_to_step": s}`,
    and the samples of the steps after s are trained again, once. Same as `tidal run --resume`.
    """
    _resume_job(job_dir, quiet)


def _journal_of(path: Path) -> Path:
    return path / "journal.sqlite" if path.is_dir() else path


def _load_spec(journal_path: Path) -> tuple[Any, dict[str, Any]]:
    """The job's spec and the master's state from its journal (one-line errors for anything else)."""
    from tidal.master.api import JobSpec
    from tidal.master.journal import SqliteJournal

    if not journal_path.is_file():
        raise fail(f"{journal_path} not found: give a job directory (or its journal.sqlite)")
    journal = SqliteJournal(journal_path, create=False)
    try:
        raw = journal.get_meta("spec")
        state = journal.get_meta("state", {}) or {}
    finally:
        journal.close()
    if raw is None:
        raise fail(f"{journal_path} is not a tidal journal")
    return JobSpec.from_json(raw), state


def _resume_job(path: Path, quiet: bool, argv: list[str] | None = None) -> None:
    """Serve the job of the journal at ``path`` again; ``argv``: the script and arguments the
    user gave (``tidal run --resume``), which must be the job's."""
    from tidal.master.server import bind_socket, run_master

    journal_path = _journal_of(path)
    spec, state = _load_spec(journal_path)
    if spec.backend not in backends.names():  # a job started by a program that registered its own
        raise fail(f"the job ran on backend {spec.backend!r}, unknown here; known: {', '.join(backends.names())}")
    if state.get("job_state", "running") != "running":
        why = f": {state['error']}" if state.get("error") else ""
        raise fail(f"job {spec.job_id} has already {state['job_state']}{why}; there is nothing to resume")
    if argv is not None and argv != spec.argv[1:]:
        raise fail(f"--resume: job {spec.job_id} ran {shlex.join(spec.argv[1:])}, not {shlex.join(argv)}")
    sock = bind_socket(spec.host, spec.port)
    typer.echo(f"tidal: resuming job {spec.job_id} on http://{spec.host}:{spec.port}", err=True)
    _point_current(Path(spec.job_dir))
    code, m = run_master(spec, journal_path, resume=True, sock=sock, follow_logs=not quiet)
    _print_summary(m)
    raise typer.Exit(code)


def _point_current(directory: Path) -> None:
    home = tidal_home()
    home.mkdir(parents=True, exist_ok=True)
    (home / "current").write_text(str(directory))


def _job_file(job_dir: Path | None) -> dict[str, Any]:
    directory = job_dir
    if directory is None:
        pointer = tidal_home() / "current"
        if not pointer.is_file():
            raise ConfigError(f"no job found: pass --job-dir or run from the directory of `tidal run` ({pointer} missing)")
        directory = Path(pointer.read_text().strip())
    path = directory / "job.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def _request(job_dir: Path | None, method: str, path: str, body: Any = None) -> Any:
    info = _job_file(job_dir)
    try:
        resp = httpx.request(method, info["url"] + path, json=body, timeout=10,
                             headers={"Authorization": f"Bearer {info['token']}"})
    except httpx.TransportError:
        raise ConfigError(f"the master of job {info['job_id']} at {info['url']} is not answering") from None
    if resp.status_code >= 400:
        raise ConfigError(f"master refused: {resp.json().get('detail', resp.text)}")
    return resp.json()


@app.command()
def status(
    as_json: bool = typer.Option(False, "--json", help="Print the master's status document as JSON."),
    job_dir: Path | None = typer.Option(None, "--job-dir", help="The job's directory (default: the latest job)."),
) -> None:
    """Workers (pid, state, step, samples/s), shards per epoch, membership round, recent events."""
    data = _request(job_dir, "GET", "/v1/status")
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    st = StatusResponse.model_validate(data)
    _render_status(st)


@app.command()
def scale(
    workers: int | None = typer.Argument(None, help="The new number of workers (within the job's MIN:MAX)."),
    auto: bool = typer.Option(False, "--auto", help="Hand the number of workers back to the job's planner."),
    ps: int | None = typer.Option(
        None, "--ps", metavar="N",
        help="The new number of parameter servers (within the job's --ps MIN:MAX): new ones start while "
             "training runs, then the virtual shards move at the next step boundary (a short pause)."),
    data_workers: int | None = typer.Option(
        None, "--data-workers", metavar="N",
        help="The new number of data workers (within the job's --data-workers MIN:MAX): new ones start at once; "
             "removed ones get no new batches and stop once theirs are delivered."),
    job_dir: Path | None = typer.Option(None, "--job-dir", help="The job's directory (default: the latest job)."),
) -> None:
    """Change a running job's number of workers (the planner stops deciding until --auto), of
    parameter servers (--ps), or of data workers (--data-workers)."""
    if sum((workers is not None, auto, ps is not None, data_workers is not None)) != 1:
        raise fail("give either a number of workers, --auto, --ps N or --data-workers N")
    if data_workers is not None:
        data = _request(job_dir, "POST", "/v1/scale", {"data_workers": data_workers})
        typer.echo(f"target: {data['target_data_workers']} data workers")
        return
    if ps is not None:
        data = _request(job_dir, "POST", "/v1/scale", {"ps": ps})
        typer.echo(f"target: {data['target_ps']} parameter servers")
        return
    body: dict[str, Any] = {"auto": True} if auto else {"workers": workers}
    data = _request(job_dir, "POST", "/v1/scale", body)
    typer.echo(f"target: {data['target_workers']} workers" + (" (planner)" if auto else ""))


@app.command()
def stop(
    job_dir: Path | None = typer.Option(None, "--job-dir", help="The job's directory (default: the latest job)."),
) -> None:
    """End a stream job (`tidal run --stream`): its workers finish at their next step boundary, every
    record they trained committed, and the job succeeds. A dataset job ends by itself once its
    data are trained; interrupt its `tidal run` to abort it."""
    data = _request(job_dir, "POST", "/v1/stop")
    typer.echo(f"stopping: {data['stream_stop']}")


@app.command()
def audit(
    ledger: Path = typer.Argument(..., help="A ledger written by `tidal run --ledger`."),
    size: int | None = typer.Option(None, "--size", help="Samples in the dataset (each epoch covers 0..SIZE-1)."),
    epochs: int | None = typer.Option(None, "--epochs", help="Epochs the job trained (default: those in the ledger)."),
    stream: str | None = typer.Option(None, "--stream", metavar="URL",
                                      help="A stream job's ledger: check it against the records of this stream "
                                           "(redis://HOST:PORT/NAME or file:///DIR/NAME)."),
) -> None:
    """Check that every sample of every epoch (--size) or every record of the stream (--stream) is
    in the ledger exactly once.

    Rollback lines (`{"rollback_to_step": s}`, written when a job resumed from a checkpoint of
    step s) void the earlier lines of steps above s. With --stream, each partition is checked
    from its first record up to its highest committed id. Exit status 0 when exactly once, 1
    when not, 2 on bad input.
    """
    from tidal.master.audit import audit_ledger, audit_stream

    if (size is None) == (stream is None):
        raise fail("give either --size (a dataset job's ledger) or --stream URL (a stream job's)")
    if size is not None and size <= 0:
        raise fail("--size must be positive")
    if epochs is not None and stream is not None:
        raise fail("--epochs goes with --size, not --stream")
    if epochs is not None and epochs <= 0:
        raise fail("--epochs must be positive")
    try:
        lines = ledger.read_text().splitlines()
    except OSError as exc:
        raise fail(f"cannot read ledger {ledger}: {exc.strerror}") from None
    try:
        result = audit_ledger(lines, size, epochs) if size is not None else audit_stream(lines, _stream_ids(stream))
    except ValueError as exc:
        raise fail(f"{ledger}: {exc}") from None
    typer.echo(result.summary())
    raise typer.Exit(0 if result.ok else 1)


def _stream_ids(url: str | None) -> dict[int, list[str]]:
    """Every partition's record ids, in order (a ConfigError names an unreachable stream)."""
    from tidal.data.api import FIRST, StreamUnavailableError
    from tidal.data.streams import open_source

    assert url is not None
    source = open_source(url)
    ids: dict[int, list[str]] = {}
    try:
        for partition in source.partitions():
            got = ids[partition] = []
            while page := source.read(partition, got[-1] if got else FIRST, 10_000):
                got.extend(r.id for r in page)
    except StreamUnavailableError as exc:
        raise fail(str(exc)) from None
    finally:
        source.close()
    return ids


def history_path(given: str | None) -> str | None:
    """``--history``: a path, 'none', or the default (tidal.history.default_path)."""
    from tidal.history import default_path

    if given is None:
        return str(default_path())
    if given.lower() == "none":
        return None
    path = Path(given).expanduser()
    if path.is_dir():
        raise fail(f"--history {given} is a directory; give a file (created if missing)")
    return str(path.resolve())


def check_planner(name: str) -> None:
    """A planner the registry knows, or a one-line error that lists them."""
    from tidal.brain import planners

    try:
        planners.get(name)
    except ConfigError as exc:
        raise fail(f"--planner: {exc}") from None


MAX_HISTORY_INTERVALS = 1_000_000  # a year of minutes and more: the spec (and the journal) carries them


def check_history_planner(name: str) -> None:
    """``--traffic-history`` for a planner that keeps an arrival history, or a one-line error."""
    from tidal.brain import planners

    if not hasattr(planners.get(name), "observe_history"):
        keeps = [n for n in planners.names() if hasattr(planners.get(n), "observe_history")]
        raise fail(f"--traffic-history: planner {name} keeps no arrival history ({', '.join(keeps)} do)")


def read_traffic_history(path: Path, column: str | None) -> tuple[list[float], float]:
    """``--traffic-history``: counts per interval and the interval (trace seconds), read as
    ``tidal produce`` and ``tidal sim online`` read a trace; a one-line error for a file that is
    missing or empty, a column it lacks, a count that is not a number or is negative."""
    from tidal.cli.sim import read_csv
    from tidal.sim.online import load_trace

    if not path.is_file():
        raise fail(f"--traffic-history {path}: no such file")
    rows = read_csv(path)
    try:
        counts, interval = load_trace(rows, column)
    except ConfigError as exc:
        raise fail(f"--traffic-history {path}: {exc}") from None
    index = 1 if column is None else [h.strip() for h in rows[0]].index(column)
    for line, row in enumerate(rows[1:], start=2):
        if float(row[index]) < 0:  # load_trace counts a negative as zero: here it is a mistake
            raise fail(f"--traffic-history {path}: line {line}: negative count {row[index].strip()}")
    if len(counts) > MAX_HISTORY_INTERVALS:
        raise fail(f"--traffic-history {path}: {len(counts)} intervals, at most {MAX_HISTORY_INTERVALS}")
    return [float(c) for c in counts], interval


def _planner_line(p: PlannerStatus) -> str:
    """The planner in a few lines: name, the user's override, the last decision and its model."""
    lines = [f"planner {p.name}" + (" (overridden by `tidal scale`; `tidal scale --auto` hands back)"
                                    if p.overridden_by_user else "") + f", {p.decisions} decision(s)"
             + (f", warm start {p.warm_start}" if p.warm_start else "")
             + (f", seeded with {p.history_bins} bins of {p.history_interval_s:g} s traffic history"
                if p.history_bins else "")]
    if p.last is not None:
        lines.append(f"  last: at {p.last.at_s:.1f}s {p.last.from_workers} -> {p.last.to_workers} workers: {p.last.reason}")
    if p.params:
        fitted = ", ".join(f"{k}={v:.4g}" for k, v in p.params.items())
        error = "" if p.error_pct is None else f", error {p.error_pct:.1f}% on the measured counts"
        lines.append(f"  model {p.model}: {fitted}{error}")
    return "\n".join(lines)


def _lag_line(lag: StreamLagStatus) -> str:
    """The stream's lag against its SLO, in trace time (as `tidal sim online` reports a policy)."""
    scale = f", wall time / {lag.time_scale:g}" if lag.time_scale != 1.0 else ""
    return (f"stream lag {lag.lag_s:.1f} s vs SLO {lag.slo_s:g} s (trace time{scale}): "
            f"{'OVER' if lag.lag_s > lag.slo_s else 'within'}; SLO violated {100 * lag.violation_ratio:.1f}% "
            f"of {lag.observed_s / 60:.1f} min, accumulated lag {lag.accumulated_lag_min:.1f} min"
            + (f"; arriving {lag.arrivals_per_s:g} records/s" if lag.arrivals_per_s is not None else ""))


def _render_status(st: StatusResponse) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"job [bold]{st.job_id}[/]  state {st.state.value}  round {st.round}"
                  f"{' (re-forming)' if st.reforming else ''}  target {st.target_workers} "
                  f"({st.min_workers}:{st.max_workers})  committed step {st.finalized_step}")
    if st.error:
        console.print(f"[red]error:[/] {st.error}")
    if st.paused:
        console.print(f"[yellow]paused:[/] {st.paused}")
    if st.planner is not None:
        console.print(_planner_line(st.planner), markup=False, highlight=False)
    if st.stream:
        console.print("stream partitions: " + "; ".join(
            f"{s.partition}: committed {s.committed}, worker {s.worker if s.worker is not None else '-'}, "
            f"lag {f'{s.lag} records / {s.lag_s:.1f} s' if s.lag >= 0 else '?'}" for s in st.stream)
            + (f" (stopping: {st.stream_stop})" if st.stream_stop else ""), markup=False, highlight=False)
    if st.stream_lag is not None:
        console.print(_lag_line(st.stream_lag), markup=False, highlight=False)
    shuffling = [w for w in st.workers if w.stream_queued >= 0]
    if shuffling:
        console.print("global shuffling (queued / forwarded out / in, records; the oldest record each holds): " + "; ".join(
            f"worker {w.worker_id}: {w.stream_queued} / {w.stream_forwarded_out} / {w.stream_forwarded_in}"
            + (f", {w.stream_lag_s:.1f} s" if w.stream_lag_s >= 0 else "")
            for w in shuffling), markup=False, highlight=False)
    if st.checkpoint_step >= 0 or st.checkpoint_problem:
        console.print(f"newest flash checkpoint: step {st.checkpoint_step}"
                      + (f"; problem: {st.checkpoint_problem}" if st.checkpoint_problem else ""),
                      markup=False, highlight=False)
    if st.servers:
        console.print(f"parameter servers: {len(set(st.ps_shard_map))} hold the {len(st.ps_shard_map)} virtual "
                      f"shards, target {st.ps_target} (range {':'.join(map(str, st.ps_range))})",
                      markup=False, highlight=False)
    for v in st.servers:
        console.print(f"parameter server {v.id}: pid {v.pid}, {v.state}, {v.address or 'not registered'}, "
                      f"{v.shards} shards, {v.rows} rows, {v.bytes / 2**20:.1f} MiB, step {v.applied_step}, "
                      f"{v.requests_per_s:.0f} requests/s ({v.latency_ms:.1f} ms each), busy {v.busy:.0%}, "
                      f"{v.cpu:.2f} cores, RSS {v.rss_bytes / 2**20:.0f} MiB"
                      + ("" if v.exit_code is None else f", exit {v.exit_code}"), markup=False, highlight=False)
    if st.data_range:
        q = st.data_queue
        console.print(f"data workers: {sum(d.state == 'running' for d in st.data_workers)} running, target "
                      f"{st.data_target} (range {':'.join(map(str, st.data_range))})"
                      + (f"; queue {q.queued} batches, enqueue {q.enqueue_per_s:.1f}/s, dequeue {q.dequeue_per_s:.1f}/s, "
                         f"built by trainers {q.built_by_trainers_per_s:.1f}/s, trainers waiting {q.wait_share:.0%}, "
                         f"{q.redispatched} re-dispatched" if q is not None else ""), markup=False, highlight=False)
    for line in st.data_decisions[-3:]:
        console.print(f"data-worker tuner: {line}", markup=False, highlight=False)
    for d in st.data_workers:
        if d.state != "exited":
            console.print(f"data worker {d.id}: pid {d.pid}, {d.state}, {d.address or 'not registered'}, "
                          f"{d.batches} batches ({d.batches_per_s:.1f}/s), busy {d.busy:.0%}, {d.cpu:.2f} cores",
                          markup=False, highlight=False)
    table = Table("worker", "pid", "state", "rank", "step", "samples/s", "straggler", "exit")
    for w in st.workers:
        table.add_row(str(w.worker_id), str(w.pid), w.state.value, str(w.rank) if w.rank >= 0 else "-",
                      str(w.applied_step), f"{w.samples_per_s:.0f}", "yes" if w.straggler else "",
                      "" if w.exit_code is None else str(w.exit_code))
    console.print(table)
    shards = Table("epoch", "todo", "doing", "done", "samples done")
    for s in st.shards:
        shards.add_row(str(s.epoch), str(s.todo), str(s.doing), str(s.done), f"{s.samples_done}/{s.samples_total}")
    console.print(shards)
    for ev in st.events[-15:]:
        console.print(f"{time.strftime('%H:%M:%S', time.localtime(ev.time))} {ev.kind:9} {ev.message}")


def _print_summary(master: Any) -> None:
    pauses = master.pauses()
    lines = [f"tidal: job {master.spec.job_id} {master.state.value}" + (f": {master.error}" if master.error else "")]
    shown = 20  # a long job re-forms thousands of times: the latest pauses, and how many there were
    if len(pauses) > shown:
        lines.append(f"tidal:   {len(pauses)} pauses, the last {shown}:")
    for ev in pauses[-shown:]:
        lines.append(f"tidal:   pause {ev.seconds:.3f}s  ({ev.cause})")
    for key, value in sorted(master.metrics.items()):
        lines.append(f"tidal:   {key} = {value:.4f}")
    typer.echo("\n".join(lines), err=True)


@app.command()
def demo(
    samples: int = typer.Option(600_000, help="Training samples per epoch."),
    epochs: int = typer.Option(2, help="Epochs."),
    keep: Path | None = typer.Option(None, "--keep", help="Keep the job directory and ledger here."),
) -> None:
    """An elastic job on this machine: 1 worker, scale out to 2, SIGKILL one, recover, finish.

    Prints samples/s, every pause with its cause, the final AUC against the known ceiling of
    the synthetic data, and the exactly-once audit of the ledger.
    """
    from tidal.cli.demo import run_demo

    raise typer.Exit(run_demo(samples=samples, epochs=epochs, keep=keep))
