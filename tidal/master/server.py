"""Runs a job master: the HTTP service (with the workers' rendezvous store), the reconcile loop.

``run_master`` is what ``tidal run``, ``tidal master --resume`` and ``tidal demo`` call. It
returns the job's exit status: 0 succeeded, 1 failed, 130 interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import Any, TextIO

import uvicorn

from tidal.api import ConfigError, JobState
from tidal.api.shm import SHM_DIR, job_slot_pattern
from tidal.backends import BackendError
from tidal.backends import get as get_backend
from tidal.brain import planners
from tidal.brain.api import Planner
from tidal.brain.dataparallel import SETTLE_S, efficient_count, history_params
from tidal.brain.history import InMemoryHistory, JobRecord
from tidal.brain.planners import PlannerContext
from tidal.history import HistoryError, SQLiteHistory
from tidal.master.api import JobSpec, JournalUnavailableError
from tidal.master.connections import (
    KEEP_ALIVE_S,
    ConnectionGuard,
    accept_batch,
    connection_cap,
    listen_queue,
    quiet_floods,
    raise_nofile_limit,
)
from tidal.master.job import JobMaster
from tidal.master.journal import SqliteJournal
from tidal.master.logs import LogFollower
from tidal.master.planning import ACTION_LEAD_S, ACTION_PAUSE_S, available_cpus
from tidal.master.service import ChangeNotifier, create_app

log = logging.getLogger(__name__)

TICK_S = 0.02


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the control-plane port now, so a port in use is a one-line error, not a traceback."""
    # IPPROTO_TCP, not 0: asyncio turns TCP_NODELAY on for accepted connections only when the
    # listening socket says TCP; without it Nagle holds every response body ~40 ms for the
    # client's delayed ACK (uvicorn sends headers and body separately).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def write_job_file(spec: JobSpec, journal_path: Path) -> None:
    """``job.json`` tells ``tidal status`` and ``tidal scale`` where the master is (mode 0600)."""
    path = Path(spec.job_dir) / "job.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"job_id": spec.job_id, "url": f"http://{spec.host}:{spec.port}", "token": spec.token,
                   "journal": str(journal_path), "master_pid": os.getpid()}, out)
    os.replace(tmp, path)


Scenario = Callable[[JobMaster], Coroutine[Any, Any, None]]


def run_master(
    spec: JobSpec,
    journal_path: Path,
    *,
    resume: bool = False,
    sock: socket.socket | None = None,
    follow_logs: bool = True,
    out: TextIO | None = None,
    scenario: Scenario | None = None,
) -> tuple[int, JobMaster]:
    """Serve the job until it ends. ``scenario`` (the demo) runs beside the master."""
    out = out or sys.stdout
    nofile = raise_nofile_limit()  # before anything opens descriptors: the cap is sized from it
    Path(spec.job_dir, "logs").mkdir(parents=True, exist_ok=True)
    sock = sock or bind_socket(spec.host, spec.port)
    spec.port = sock.getsockname()[1]
    try:
        backend = get_backend(spec.backend, **spec.backend_options)  # connects to a cluster: first
    except BackendError as exc:
        sock.close()
        raise ConfigError(str(exc)) from None
    journal = SqliteJournal(journal_path, create=not resume)

    # The workers' process groups rendezvous through the master's own control plane
    # (/v1/store, tidal.master.store): same socket, same token, no second listener.
    notifier_box: list[ChangeNotifier] = []
    planner, warm = planner_for(spec)
    master = JobMaster(
        spec, journal, backend, planner, time.time, spec.port,
        on_change=lambda: notifier_box[0].notify() if notifier_box else None,
    )
    master.planning.warm_start = warm
    try:
        if resume:
            master.resume()
        else:
            master.start()
        write_job_file(spec, journal_path)
    except (JournalUnavailableError, OSError) as exc:  # e.g. resumed while the disk is still full
        journal.close()
        sock.close()
        raise ConfigError(f"cannot start the master: {exc}") from None
    follower = LogFollower(Path(spec.job_dir) / "logs", out) if follow_logs else None

    async def main() -> int:
        tune_gc()
        notifier_box.append(ChangeNotifier())
        app = create_app(master, spec.token, notifier_box[0])
        guard = ConnectionGuard(connection_cap(nofile, spec.max_workers), job_id=spec.job_id)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                http=guard.protocol_class(), ws="none",
                                timeout_keep_alive=KEEP_ALIVE_S, backlog=accept_batch(nofile))
        server = _Server(config, listen_queue(nofile))
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        scenario_task = asyncio.create_task(scenario(master)) if scenario else None
        printed = 0
        interrupted = False
        try:
            while not master.done:
                if stop.is_set() or serve_task.done():
                    interrupted = True
                    break
                _guarded_tick(master)
                printed = _print_events(master, out, printed)
                if follower:
                    follower.poll()
                await asyncio.sleep(TICK_S)
            if interrupted:
                master.interrupt()
                deadline = time.time() + 5
                while not master.done and time.time() < deadline:
                    _guarded_tick(master)
                    await asyncio.sleep(TICK_S)
            _print_events(master, out, printed)
            if follower:
                follower.poll()
        finally:
            if scenario_task:
                scenario_task.cancel()
                with contextlib.suppress(BaseException):
                    await scenario_task
            server.should_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(serve_task, 5)
        if interrupted:
            return 130
        return 0 if master.state is JobState.SUCCEEDED else 1

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner, quiet_floods():
            code = runner.run(main())
        if master.state is JobState.SUCCEEDED:
            record_finished(master)
        if master.state in (JobState.SUCCEEDED, JobState.FAILED):
            remove_job_shm(spec.job_id)
    finally:
        master.close()
        backend.close()
        journal.close()
        sock.close()
    return code, master


def remove_job_shm(job_id: str, shm_dir: str = SHM_DIR) -> None:
    """Once the job has ended (nothing will resume it), the flash-checkpoint slots its dead workers
    left in shared memory (a worker that closes removes its own): RAM, possibly gigabytes."""
    pattern = job_slot_pattern(job_id)
    with contextlib.suppress(OSError):
        for name in os.listdir(shm_dir):
            if pattern.fullmatch(name):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm_dir, name))


def job_features(spec: JobSpec) -> dict[str, str | float]:
    """The job's signature for the warm start: its script, its arguments and its range of workers
    (similarity per feature: strings equal or not, numbers by their relative difference)."""
    script = Path(spec.argv[1]).name if len(spec.argv) > 1 else ""
    return {"script": script, "args": " ".join(spec.argv[2:]), "min_workers": float(spec.min_workers),
            "max_workers": float(spec.max_workers)}


def planner_for(spec: JobSpec) -> tuple[Planner, str]:
    """The job's planner, built with its history when it has one; and where it warm-starts from.

    A history that cannot be read is logged and left out: the job starts cold, never fails for it.
    """
    history: InMemoryHistory | None = None
    note = ""
    if spec.history_path:
        try:
            with SQLiteHistory(spec.history_path) as store:
                history = InMemoryHistory(store.records())
        except (HistoryError, OSError) as exc:
            note = f"no warm start: {exc}"
            log.warning("job %s: %s", spec.job_id, note)
    planner = planners.get(spec.planner, PlannerContext(
        job_id=spec.job_id, features=job_features(spec), history=history, cpus=available_cpus(),
        lag_slo_s=spec.lag_slo_s, action_lead_s=ACTION_LEAD_S * spec.time_scale,
        action_pause_s=ACTION_PAUSE_S * spec.time_scale, load_headroom=spec.load_headroom, lag_price=spec.lag_price,
        planned_lag_s=spec.planned_lag_s, program_horizon_s=spec.program_horizon_s,
        program_lag_price=spec.program_lag_price, program_lag_ratio=spec.program_lag_ratio))
    warm = getattr(planner, "warm_from", "")
    return planner, (f"from {warm}" if warm else note)


def record_finished(master: JobMaster) -> None:
    """Add a succeeded job to the history: its signature, its efficient count (the fewest workers
    within 10% of the best throughput it measured, else the count it ended with), the throughput
    it measured per count and the model its planner fitted (if any)."""
    spec = master.spec
    if not spec.history_path:
        return
    planning = master.planning
    points = {p.workers: p.samples_per_s for p in planning.throughput() if p.seconds >= SETTLE_S}
    workers = efficient_count(points) or master.target
    record = JobRecord(spec.job_id, time.time(), job_features(spec), {"workers": float(workers)},
                       history_params(planning.last_plan, points))
    try:
        with SQLiteHistory(spec.history_path) as store:
            store.add(record)
    except (HistoryError, OSError) as exc:
        log.warning("job %s: not recorded in the history: %s", spec.job_id, exc)


def tune_gc() -> None:
    """Long-lived state (worker records, shard tables) would make every full collection walk
    thousands of objects mid-request: freeze what exists and collect the young less often."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (uvicorn[standard] brings it): about a third less CPU per request."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: on Ctrl-C or SIGTERM the master must first stop
    the workers (they run in sessions of their own and would outlive it), then exit with 130.
    ``listen_queue``: the kernel's accept queue, widened again after startup (see
    tidal.master.connections.listen_queue)."""

    def __init__(self, config: uvicorn.Config, listen_queue: int) -> None:
        super().__init__(config)
        self.listen_queue = listen_queue

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or []:
            sock.listen(self.listen_queue)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _guarded_tick(master: JobMaster) -> None:
    """One bad request must not take the master down: log a failed tick and carry on."""
    try:
        master.tick()
    except BackendError:
        raise  # the backend is gone (a Ray cluster lost): the master stops, its journal resumable
    except Exception:
        log.exception("job %s: reconcile step failed", master.spec.job_id)


def _print_events(master: JobMaster, out: TextIO, printed: int) -> int:
    """Print events newer than sequence number ``printed``; returns the newest printed."""
    for ev in list(master.events):
        if ev.seq <= printed:
            continue
        printed = ev.seq
        if ev.kind == "pause":
            continue  # pauses are summarised at the end (their length is refined as reports arrive)
        stamp = time.strftime("%H:%M:%S", time.localtime(ev.time))
        print(f"tidal {stamp} {ev.message}", file=out, flush=True)
    return printed
