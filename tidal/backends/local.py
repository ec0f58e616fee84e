"""The local backend: workers are subprocesses of the master on this machine."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import signal
import subprocess
import threading
import time

import psutil

from tidal.backends.api import BackendEvent, LaunchError, WorkerSpec

log = logging.getLogger(__name__)

# A launch that fails with one of these failed for want of descriptors, processes, memory or disk:
# the machine is at fault, not the script, and the same launch can succeed a moment later.
RETRYABLE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EAGAIN, errno.ENOMEM})


class LocalBackend:
    """Subprocesses with their output in log files and a thread per process waiting for its exit.

    Processes are started in their own session so that a Ctrl-C meant for ``tidal run`` reaches
    the master (which then stops the job) rather than every worker at once, and so that they
    keep running if the master dies: a restarted master adopts them by pid.
    """

    def __init__(self, poll_interval_s: float = 0.05) -> None:
        self._procs: dict[int, subprocess.Popen[bytes] | psutil.Process] = {}
        self._create_times: dict[int, float] = {}
        self._events: queue.SimpleQueue[BackendEvent] = queue.SimpleQueue()
        self._requests: set[str] = set()
        self._lock = threading.Lock()
        self._poll_interval_s = poll_interval_s
        self._closed = threading.Event()

    def launch(self, specs: list[WorkerSpec], request_id: str) -> list[LaunchError]:
        with self._lock:
            if request_id in self._requests:
                return []
            self._requests.add(request_id)
        errors = []
        for spec in specs:
            try:
                proc = self._spawn(spec)
            except OSError as exc:
                errors.append(launch_error(spec, exc))
                continue
            with self._lock:
                self._procs[spec.worker_id] = proc
                try:
                    self._create_times[spec.worker_id] = psutil.Process(proc.pid).create_time()
                except psutil.Error:
                    self._create_times[spec.worker_id] = time.time()
            threading.Thread(target=self._wait_child, args=(spec.worker_id, proc), daemon=True,
                             name=f"tidal-wait-{spec.worker_id}").start()
        return errors

    @staticmethod
    def _spawn(spec: WorkerSpec) -> subprocess.Popen[bytes]:
        env = {**os.environ, **spec.env}
        with contextlib.ExitStack() as stack:  # the log file is closed even if Popen fails
            log_file = stack.enter_context(open(spec.log_path, "ab")) if spec.log_path else subprocess.DEVNULL
            return subprocess.Popen(
                spec.argv, env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def _wait_child(self, worker_id: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        self._finish(worker_id, code)

    def _watch_adopted(self, worker_id: int, proc: psutil.Process) -> None:
        while not self._closed.is_set():
            try:
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:
                break
            time.sleep(self._poll_interval_s)
        else:
            return
        self._finish(worker_id, None)  # not our child: its exit code is not ours to read

    def _finish(self, worker_id: int, code: int | None) -> None:
        with self._lock:
            self._procs.pop(worker_id, None)
            self._create_times.pop(worker_id, None)
        self._events.put(BackendEvent(worker_id, code, time.time()))

    def adopt(self, worker_id: int, pid: int, create_time: float | None) -> bool:
        """Idempotent: a master that reloads its state adopts the same processes again, and a
        second watcher would report the process's end twice."""
        with self._lock:
            watched = self._procs.get(worker_id)
        if watched is not None and watched.pid == pid:
            return True
        try:
            proc = psutil.Process(pid)
            if create_time is not None and abs(proc.create_time() - create_time) > 1.0:
                return False  # the pid was reused by another process
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            return False
        with self._lock:
            watched = self._procs.get(worker_id)
            if watched is not None and watched.pid == pid:
                return True  # adopted meanwhile by another caller
            self._procs[worker_id] = proc
            self._create_times[worker_id] = proc.create_time()
        threading.Thread(target=self._watch_adopted, args=(worker_id, proc), daemon=True,
                         name=f"tidal-watch-{worker_id}").start()
        return True

    def terminate(self, worker_ids: list[int], request_id: str) -> None:
        for worker_id in worker_ids:
            with self._lock:
                proc = self._procs.get(worker_id)
            if proc is None:
                continue
            try:
                if isinstance(proc, subprocess.Popen):
                    proc.send_signal(signal.SIGKILL)
                else:
                    proc.kill()
            except (OSError, psutil.Error):
                pass

    def pids(self) -> dict[int, tuple[int, float]]:
        with self._lock:
            return {w: (p.pid, self._create_times.get(w, 0.0)) for w, p in self._procs.items()}

    def poll_events(self) -> list[BackendEvent]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closed.set()


def launch_error(spec: WorkerSpec, exc: OSError) -> LaunchError:
    """``retryable`` when the machine ran short (RETRYABLE_ERRNOS), not when the script is wrong
    (a missing interpreter, a bad working directory)."""
    code = errno.errorcode.get(exc.errno or 0, "no errno")
    retryable = exc.errno in RETRYABLE_ERRNOS
    hint = "; the machine is short of resources, not the script at fault" if retryable else ""
    return LaunchError(spec.worker_id, f"cannot start {spec.argv[0]}: {exc} ({code}){hint}", retryable=retryable)
