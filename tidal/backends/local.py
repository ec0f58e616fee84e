"""The local backend: a job's nodes are processes of this machine, started by the master.

Why it is built the way it is:

* Each node runs in its own session, so that a Ctrl-C meant for ``tidal run`` reaches the master
  (which then stops the job) rather than every node at once, and so that nodes keep running if
  the master dies: a restarted master adopts them by pid (``adopt``).
* Output goes to the spec's log file, never a pipe: a pipe would fill, and block the node, the
  moment the master that reads it is gone.
* A thread per child waits for its exit, so the exit status is read as soon as it exists and
  ``poll`` never blocks. A node adopted from an earlier master is not our child: its status cannot
  be read, so a thread polls psutil until it is gone and reports it with ``exit_code`` None.
* A launch that fails for want of descriptors, processes, memory or disk is reported as
  retryable: the machine is at fault, not the script, and the same launch can succeed a moment
  later.
* A Python node is forked from a fork server that has imported torch once
  (``tidal.backends.forkserver``): it starts in milliseconds where ``exec`` takes seconds of
  imports. The first launch starts the server, and what is launched before it is ready waits
  for it (on two cores that is no slower than starting each with ``exec``). The server is the
  forked node's parent and reports its exit status; a node the server cannot fork starts with
  ``exec``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import psutil

from tidal.backends import forkserver
from tidal.backends.api import (
    BackendError,
    BackendState,
    NodeError,
    NodeExit,
    NodeHandle,
    NodeSpec,
    RequestIds,
    Resources,
)

log = logging.getLogger(__name__)

# A launch that fails with one of these failed for want of descriptors, processes, memory or disk:
# the machine is at fault, not the script, and the same launch can succeed a moment later.
RETRYABLE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EAGAIN, errno.ENOMEM})

# psutil computes a create time from the boot time and the process's start in clock ticks: two
# readings of one process may differ by rounding, two processes on one pid differ by far more.
CREATE_TIME_TOLERANCE_S = 1.0


@dataclass
class _Node:
    proc: subprocess.Popen[bytes] | psutil.Process  # a Popen: our child; a psutil.Process: adopted
    handle: NodeHandle
    resources: Resources


class LocalBackend:
    """Nodes as processes of this machine (``tidal.backends.api.Backend``).

    ``resources`` are recorded, not enforced: ``cpus`` and ``memory_mb`` set no limit on this
    machine, and ``gpus`` is not acted on here, because the master hands out the GPUs itself by
    setting ``CUDA_VISIBLE_DEVICES`` in the node's ``env``.

    Args:
        poll_interval_s: how often the watcher of an adopted node looks whether it is gone.
        fork: start Python nodes from a fork server (the default unless the environment has
            ``TIDAL_FORKSERVER=0``).

    Raises:
        BackendError: ``poll_interval_s`` is not positive.
    """

    name = "local"

    def __init__(self, poll_interval_s: float = 0.05, fork: bool | None = None) -> None:
        if not poll_interval_s > 0:
            raise BackendError(f"poll_interval_s must be positive, got {poll_interval_s}")
        self._poll_interval_s = poll_interval_s
        self._fork = os.environ.get("TIDAL_FORKSERVER", "1") != "0" if fork is None else fork
        self._server: forkserver.ForkServer | None = None
        self._forking: dict[str, NodeSpec] = {}  # asked of the fork server, no pid yet
        self._kill_on_start: set[str] = set()  # terminated while being forked
        self._forked: dict[int, str] = {}  # pid -> node id of the nodes the server reports on
        self._lock = threading.Lock()  # the state below, shared with the waiter and watcher threads
        self._nodes: dict[str, _Node] = {}  # running, by node id
        self._gone: set[str] = set()  # node ids whose end was reported (or queued): never twice
        self._ended: list[NodeExit] = []  # not yet returned by poll
        self._errors: list[NodeError] = []  # not yet returned by poll
        # launch and adopt run one at a time: a node id is checked and then started or watched,
        # and another call in between must not start or watch it a second time
        self._start_lock = threading.Lock()
        self._requests = RequestIds()
        self._closed = threading.Event()
        self._watchers: list[threading.Thread] = []

    # ------------------------------------------------------------------------------ launch
    def launch(self, specs: list[NodeSpec], request_id: str) -> None:
        """Start the nodes. A node id already running starts nothing (it runs, as asked); one that
        ran and ended is reported as a ``NodeError`` (a node id names one process, once)."""
        with self._start_lock:
            if not self._requests.first("launch", request_id):
                return
            for spec in specs:
                with self._lock:
                    if spec.node_id in self._nodes or spec.node_id in self._forking:
                        continue
                    if spec.node_id in self._gone:
                        self._errors.append(NodeError(spec.node_id, f"node {spec.node_id} already ran and ended; "
                                                      "a node id is launched once"))
                        continue
                if not spec.argv:
                    self._fail(NodeError(spec.node_id, "cannot start a node with an empty argv"))
                    continue
                if not self._fork_node(spec):
                    self._exec_node(spec)

    def _exec_node(self, spec: NodeSpec) -> None:
        try:
            proc = _spawn(spec)
        except OSError as exc:
            self._fail(launch_error(spec, exc))
            return
        except (ValueError, subprocess.SubprocessError) as exc:  # e.g. a NUL byte in argv
            self._fail(NodeError(spec.node_id, f"cannot start {spec.argv[0]}: {exc}"))
            return
        try:
            create_time: float = psutil.Process(proc.pid).create_time()
        except psutil.Error:  # cannot happen to an unreaped child; a guess beats no handle
            create_time = time.time()
        handle = NodeHandle(spec.node_id, proc.pid, create_time)
        with self._lock:
            self._nodes[spec.node_id] = _Node(proc, handle, spec.resources)
        log.info("node %s started: pid %d, %s", spec.node_id, proc.pid, spec.resources)
        threading.Thread(target=self._wait_child, args=(spec.node_id, proc), daemon=True,
                         name=f"tidal-wait-{spec.node_id}").start()

    # ------------------------------------------------------------------------------ fork server
    def _fork_node(self, spec: NodeSpec) -> bool:
        """Ask the fork server for the node; False when it must start with ``exec``."""
        if not self._fork or any("\0" in a for a in spec.argv) or forkserver.plan(spec.argv) is None:
            return False  # exec reports a NUL byte in argv
        env = {**os.environ, **spec.env}
        server = self._server
        if server is None:
            job = {"TIDAL_JOB_ID": env["TIDAL_JOB_ID"]} if "TIDAL_JOB_ID" in env else {}
            log_dir = os.path.dirname(spec.log_path) if spec.log_path else None
            server = forkserver.ForkServer(
                {**os.environ, **job}, os.path.join(log_dir, "forkserver.log") if log_dir else None,
                started=self._forked_started, failed=self._forked_failed, exited=self._forked_exited,
                gone=self._server_gone)
            try:
                server.start()
            except OSError as exc:  # the machine is short of something: the next launch tries again
                log.warning("cannot start the fork server (%s): this node starts with exec", exc)
                return False
            self._server = server
        if not server.accepts(env):
            return False
        with self._lock:
            self._forking[spec.node_id] = spec
        if server.submit(spec.node_id, spec, spec.argv, env, spec.cwd, spec.log_path):
            return True
        with self._lock:
            self._forking.pop(spec.node_id, None)
        return False

    def _forked_started(self, node_id: str, pid: int) -> None:
        try:
            found = psutil.Process(pid)
            proc: psutil.Process | None = found
            create_time = found.create_time()
        except psutil.Error:  # it has ended already: the server's report of its exit follows
            proc, create_time = None, time.time()
        with self._lock:
            spec = self._forking.pop(node_id, None)
            self._forked[pid] = node_id
            kill = node_id in self._kill_on_start
            self._kill_on_start.discard(node_id)
            if proc is not None and spec is not None:
                self._nodes[node_id] = _Node(proc, NodeHandle(node_id, pid, create_time), spec.resources)
        log.info("node %s forked: pid %d", node_id, pid)
        if kill and proc is not None:
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def _forked_failed(self, node_id: str, exc: OSError) -> None:
        with self._lock:
            spec = self._forking.pop(node_id, None)
            self._kill_on_start.discard(node_id)
        if spec is not None:
            self._fail(launch_error(spec, exc))

    def _forked_exited(self, pid: int, code: int) -> None:
        with self._lock:
            node_id = self._forked.pop(pid, None)
        if node_id is not None:
            self._finish(node_id, code)

    def _server_gone(self, unsent: list[NodeSpec]) -> None:
        """The fork server ended (or never got ready): its nodes are watched as adopted ones (their
        status is lost with it), and what it was never sent starts with ``exec``."""
        with self._lock:
            orphans = [(n, self._nodes[n].proc) for n in self._forked.values() if n in self._nodes]
            self._forked.clear()
        for node_id, proc in orphans:
            if isinstance(proc, psutil.Process):
                self._watch(node_id, proc)
        with self._start_lock:
            for spec in unsent if not self._closed.is_set() else []:
                with self._lock:
                    self._forking.pop(spec.node_id, None)
                    killed = spec.node_id in self._kill_on_start
                    self._kill_on_start.discard(spec.node_id)
                if killed:
                    self._finish(spec.node_id, -signal.SIGKILL)
                else:
                    self._exec_node(spec)

    def _fail(self, error: NodeError) -> None:
        log.warning("node %s did not start: %s", error.node_id, error.message)
        with self._lock:
            self._errors.append(error)

    def _wait_child(self, node_id: str, proc: subprocess.Popen[bytes]) -> None:
        self._finish(node_id, proc.wait())  # negative for a signal, as NodeExit wants

    # ------------------------------------------------------------------------------ terminate
    def terminate(self, node_ids: list[str], request_id: str) -> None:
        """SIGKILL the nodes. Our child, or a forked node, is reported with its status (-9); an
        adopted node, not our child, with None; a node the fork server has not been asked for yet
        never starts (reported -9). Unknown and ended ids are ignored."""
        with self._lock:
            if not self._requests.first("terminate", request_id):
                return
            procs = [(n, self._nodes[n].proc) for n in node_ids if n in self._nodes]
            forking = [n for n in node_ids if n in self._forking]
        for node_id in forking:
            server = self._server
            if server is not None and server.cancel(node_id):  # never sent: it never runs
                with self._lock:
                    self._forking.pop(node_id, None)
                self._finish(node_id, -signal.SIGKILL)
                continue
            with self._lock:  # sent: killed as soon as its pid is known (or now, if it just came)
                if node_id in self._forking:
                    self._kill_on_start.add(node_id)
                elif node_id in self._nodes:
                    procs.append((node_id, self._nodes[node_id].proc))
        for node_id, proc in procs:
            log.info("node %s: SIGKILL to pid %d", node_id, proc.pid)
            try:
                if isinstance(proc, subprocess.Popen):
                    proc.send_signal(signal.SIGKILL)  # does nothing once the waiter reaped it
                else:
                    proc.kill()  # psutil refuses a pid that now belongs to another process
            except (OSError, psutil.Error):
                pass  # already gone: its watcher reports it

    # ------------------------------------------------------------------------------ adopt
    def adopt(self, handles: list[NodeHandle], request_id: str) -> None:
        """Watch processes an earlier master started. Idempotent: a master that reloads its
        journal adopts the same nodes again, and a second watcher would report an end twice."""
        with self._start_lock:
            if not self._requests.first("adopt", request_id):
                return
            for handle in handles:
                self._adopt_one(handle)

    def _adopt_one(self, handle: NodeHandle) -> None:
        with self._lock:
            node = self._nodes.get(handle.node_id)
            if handle.node_id in self._gone:
                return  # its end was reported already
        if node is not None:
            if node.handle.pid != handle.pid:
                log.warning("node %s runs as pid %d: not adopting pid %d under its id",
                            handle.node_id, node.handle.pid, handle.pid)
            return  # launched here, or adopted before
        try:
            if handle.pid <= 0:  # never a node's (psutil shows Linux's idle task as pid 0)
                raise psutil.NoSuchProcess(handle.pid)
            proc = psutil.Process(handle.pid)
            create_time = proc.create_time()
            reused = (handle.create_time is not None
                      and abs(create_time - handle.create_time) > CREATE_TIME_TOLERANCE_S)
            gone = reused or proc.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            gone = True
        if gone:
            log.info("node %s (pid %d) is gone: not adopted", handle.node_id, handle.pid)
            self._finish(handle.node_id, None)
            return
        with self._lock:
            self._nodes[handle.node_id] = _Node(proc, NodeHandle(handle.node_id, handle.pid, create_time), Resources())
        log.info("node %s adopted: pid %d", handle.node_id, handle.pid)
        self._watch(handle.node_id, proc)

    def _watch(self, node_id: str, proc: psutil.Process) -> None:
        """Poll a process that is not our child (adopted, or a fork server's) until it is gone."""
        watcher = threading.Thread(target=self._watch_adopted, args=(node_id, proc), daemon=True,
                                   name=f"tidal-watch-{node_id}")
        self._watchers.append(watcher)
        watcher.start()

    def _watch_adopted(self, node_id: str, proc: psutil.Process) -> None:
        while not self._closed.is_set():
            try:
                # is_running() is False once the pid belongs to another process (psutil compares
                # create times); a zombie has ended, its parent just has not reaped it yet
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:
                break
            self._closed.wait(self._poll_interval_s)
        else:
            return  # closed: the node keeps running for the next master to adopt
        self._finish(node_id, None)  # not our child: its exit status is not ours to read

    # ------------------------------------------------------------------------------ poll
    def _finish(self, node_id: str, code: int | None) -> None:
        with self._lock:
            self._nodes.pop(node_id, None)
            if node_id in self._gone:
                return
            self._gone.add(node_id)
            self._ended.append(NodeExit(node_id, code, time.time()))
        log.info("node %s ended: exit code %s", node_id, code)

    def poll(self) -> BackendState:
        with self._lock:
            state = BackendState({n: node.handle for n, node in self._nodes.items()}, self._ended, self._errors)
            self._ended, self._errors = [], []
        return state

    def close(self) -> None:
        """Stop the watchers of adopted nodes and the fork server (the nodes keep running; the
        ends of forked ones are no longer reported). The waiters of our own children stay: each
        ends when its child does, and reaps it."""
        self._closed.set()
        if self._server is not None:
            self._server.close()
        for watcher in self._watchers:
            watcher.join()

    # ------------------------------------------------------------------------------ helpers


def _spawn(spec: NodeSpec) -> subprocess.Popen[bytes]:
    env = {**os.environ, **spec.env}
    with contextlib.ExitStack() as stack:  # the log file is closed even if Popen fails
        out = stack.enter_context(open(spec.log_path, "ab")) if spec.log_path else subprocess.DEVNULL
        return subprocess.Popen(
            spec.argv, env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )


def launch_error(spec: NodeSpec, exc: OSError) -> NodeError:
    """``retryable`` when the machine ran short (RETRYABLE_ERRNOS), not when the script is wrong
    (a missing interpreter, a bad working directory)."""
    code = errno.errorcode.get(exc.errno or 0, "no errno")
    retryable = exc.errno in RETRYABLE_ERRNOS
    hint = "; the machine is short of resources, not the script at fault" if retryable else ""
    return NodeError(spec.node_id, f"cannot start {spec.argv[0]}: {exc} ({code}){hint}", retryable=retryable)
