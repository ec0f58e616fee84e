"""The Ray backend: a job's nodes are Ray actors, placed by Ray on any machine of a Ray cluster.

Each node (a worker, parameter server or data worker) is one *detached, named* actor,
``NodeProcess``, in the job's namespace (``tidal-{job id}``), with the node's CPU, GPU and memory
as its Ray resources. The actor starts the node's argv as a child process on its machine and
reports on it; nothing of the training runs in Ray's own worker process. Why it is built this way:

* **The same process as on the local backend.** The user's script runs as ``python SCRIPT`` in its
  own session, with the node's env, exactly as ``tidal.backends.local`` starts it; a test (or a
  user) can SIGKILL it like any process, and the actor reports the exit status (-9).
* **A lost machine takes its nodes with it.** The child is started with ``PR_SET_PDEATHSIG``: when
  the actor's process dies (its raylet killed, the machine gone) the kernel kills the child too, so
  a dead node never trains on beside its replacement. Ray then fails every call on the actor with
  ``ActorDiedError``; the backend reports the node as ended with an unknown status (None).
  ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends: the actor is a plain
  synchronous actor, whose methods run on its process's main thread.
* **Nodes outlive the master.** The actors are detached and named by node id: a restarted master
  (``tidal master --resume``, on any machine of the cluster) finds them with ``ray.get_actor`` and
  adopts them (``adopt``), checking the pid and start time it journaled.
* **Logs reach the job directory.** The child writes to a file on its own machine; the backend's
  watcher thread reads what is new on every round (a few kB to 1 MB per call) and appends it to the
  node's log in the job directory, where ``tidal status`` and the master's log follower read it.
* **``poll`` never blocks.** One watcher thread asks every actor for its status and new output
  every ``poll_interval_s`` (about a millisecond per actor, all in flight at once) and queues what
  ended; ``launch`` and ``terminate`` only send requests.
* **Resources that no node has.** A node whose request no live node could ever hold (say, 4 GPUs
  where every node has 1) is an error at once, naming the resource and the nodes; with
  ``wait_for_resources_s`` it may wait that long for a node that can hold it to join. A node that
  fits a node of the cluster but finds no free room waits the same way, then fails as ``retryable``
  (the cluster is full, the script is not at fault), and the master tries again later.
* **No new node on a machine that is gone.** Ray's GCS declares a lost machine dead only after
  its health checks fail (seconds; tens of seconds for a machine that vanishes without closing
  its connections) and places new actors there meanwhile, where they hang. When an actor is lost
  and its machine's raylet refuses connections, the backend holds new nodes back until Ray
  agrees the machine is dead (at most ``SUSPECT_MAX_S``).
* **Loopback clusters stay on loopback.** Ray replaces 127.0.0.1 in an address with the machine's
  outside address; for a cluster on 127.0.0.1 (tests, one machine) the backend tells Ray not to.

Every machine of the cluster needs tidal and the script at the same paths (the argv is the
master's), as with torchrun or Ray Train's ``working_dir``-less jobs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from tidal.backends.local import CREATE_TIME_TOLERANCE_S, RETRYABLE_ERRNOS

log = logging.getLogger(__name__)

PLACEMENTS = ("spread", "pack")
LOG_CHUNK = 1 << 20  # bytes of a node's output read per status call
CONNECT_TIMEOUT_S = 5.0
STATUS_TIMEOUT_S = 5.0
NAME_FREED_S = 3.0
CLUSTER_GONE_S = 10.0  # the GCS not answering this long: the cluster is gone (Ray's own limit is 60 s)
GCS_CHECK_S = 1.0
SUSPECT_MAX_S = 60.0  # the longest new nodes wait for Ray to declare a machine seen gone dead  # a status call that takes longer is asked again on the next round
PR_SET_PDEATHSIG = 1


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise BackendError("the ray backend needs Ray on this machine: pip install 'tidal[ray]'") from None
    return ray


def resolve_address(address: str) -> str:
    """``HOST:PORT`` of the cluster's GCS: ``address`` itself, or for ``auto`` ``$RAY_ADDRESS`` or
    the cluster ``ray start`` last started on this machine.

    Raises:
        BackendError: ``auto`` found no cluster, or the address is not HOST:PORT.
    """
    if address == "auto":
        found = os.environ.get("RAY_ADDRESS") or _latest_local_cluster()
        if not found:
            raise BackendError("no Ray cluster found (--ray-address auto): start one with `ray start --head` "
                               "or pass --ray-address HOST:PORT")
        address = found
    address = address.removeprefix("ray://")  # Ray Client addresses are not supported: say so below
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BackendError(f"--ray-address takes auto or HOST:PORT (the head's GCS port), got {address!r}")
    return f"{host}:{port}"


def _latest_local_cluster() -> str | None:
    path = Path(tempfile.gettempdir(), "ray", "ray_current_cluster")
    with contextlib.suppress(OSError):
        return path.read_text().strip() or None
    return None


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connection to the GCS, so that an unreachable address is a one-line error in seconds
    (``ray.init`` retries for minutes).

    Raises:
        BackendError: nothing answers there.
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise BackendError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from None


def connect(address: str) -> Any:
    """Connect this process to the cluster at ``address`` (HOST:PORT) once; later calls reuse the
    connection. Returns the ``ray`` module.

    Raises:
        BackendError: no Ray, nothing answering, or a connection to another cluster already.
    """
    ray = import_ray()
    host = address.rpartition(":")[0]
    if is_loopback(host):
        # Ray swaps a loopback address for the machine's outside one (so that other machines can
        # reach it); a cluster on 127.0.0.1 must stay there
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    if ray.is_initialized():
        return ray
    check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING,
                 _node_ip_address="127.0.0.1" if is_loopback(host) else None)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise BackendError(f"cannot connect to the Ray cluster at {address}: {exc}") from None
    return ray


# ============================================================================ the actor
def _die_with_parent() -> None:  # runs in the child, between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the actor died before the call above: nobody would kill us later
        os._exit(137)


class NodeProcess:
    """The Ray actor that runs one node's process on its machine (see the module docstring)."""

    def __init__(self, node_id: str, argv: list[str], env: dict[str, str], cwd: str | None,
                 log_path: str | None, *, here: bool = False) -> None:
        """``here``: the actor runs on the machine of ``log_path`` (a detached master, placed on
        the machine ``tidal run`` ran on): the child writes its log itself, and once it ends the
        actor ends too (nobody watches it)."""
        self.node_id, self.argv, self.env, self.cwd, self.log_path = node_id, argv, env, cwd, log_path
        self.here = here
        self.proc: subprocess.Popen[bytes] | None = None
        self.local_log = ""

    def start(self) -> dict[str, Any]:
        """Start the child. Returns its pid and start time, or ``error`` (and ``retryable``)."""
        import psutil
        import ray

        env = {**os.environ, **self.env}
        if ray.get_gpu_ids():  # the GPUs Ray gave this actor, whatever the master guessed
            env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        host = ray.util.get_node_ip_address()
        if self.cwd and not os.path.isdir(self.cwd):
            return {"error": f"cannot start {self.argv[0]}: no directory {self.cwd} on node {host}",
                    "retryable": False}
        if self.here and self.log_path:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        else:
            fd, self.local_log = tempfile.mkstemp(prefix=f"tidal-{self.node_id}-", suffix=".log")
        try:
            self.proc = subprocess.Popen(self.argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=fd,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        except OSError as exc:
            retryable = exc.errno in RETRYABLE_ERRNOS
            return {"error": f"cannot start {self.argv[0]} on node {host}: {exc}", "retryable": retryable}
        except (ValueError, subprocess.SubprocessError) as exc:
            return {"error": f"cannot start {self.argv[0]} on node {host}: {exc}", "retryable": False}
        finally:
            os.close(fd)
        try:
            create_time = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        if self.here:
            threading.Thread(target=self._end_with_child, daemon=True).start()
        context = ray.get_runtime_context()
        return {"pid": self.proc.pid, "create_time": create_time, "host": host, "ray_node": context.get_node_id(),
                "assigned": context.get_assigned_resources()}

    def _end_with_child(self) -> None:
        assert self.proc is not None
        self.proc.wait()
        os._exit(0)  # a detached actor that nobody watches: end with the process it ran

    def describe(self) -> dict[str, Any]:
        """What a restarted master checks before it adopts the node."""
        import psutil

        if self.proc is None:
            return {"pid": 0}
        try:
            create_time = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            create_time = None
        import ray

        return {"pid": self.proc.pid, "create_time": create_time, "log_path": self.log_path,
                "ray_node": ray.get_runtime_context().get_node_id()}

    def status(self, offset: int) -> tuple[int | None, bytes]:
        """The child's exit status (None while it runs) and its output from ``offset`` on (at most
        ``LOG_CHUNK`` bytes). Read the status first: output written before the exit is then all in
        the file."""
        code = self.proc.poll() if self.proc is not None else None
        chunk = b""
        if self.local_log:
            with contextlib.suppress(OSError), open(self.local_log, "rb") as f:
                f.seek(offset)
                chunk = f.read(LOG_CHUNK)
        return code, chunk

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.send_signal(signal.SIGKILL)

    def forget(self) -> None:
        """The master has the whole log: remove the local copy (the actor is killed next)."""
        if self.local_log:
            with contextlib.suppress(OSError):
                os.unlink(self.local_log)


MASTERS_NAMESPACE = "tidal-masters"


def run_detached(address: str, argv: list[str], cwd: str, log_path: str) -> dict[str, Any]:
    """Run ``argv`` (a job's master: ``tidal run`` without ``--detach``) as a detached actor
    pinned to this machine (its job directory and script are here), outliving this process.
    Returns the actor's name and the master's pid.

    Raises:
        BackendError: no cluster, or the master could not start.
    """
    ray = connect(resolve_address(address))
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    name = f"master-{os.getpid()}-{int(time.time())}"
    actor = ray.remote(NodeProcess).options(
        name=name, namespace=MASTERS_NAMESPACE, lifetime="detached", max_restarts=0, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote("master", argv, dict(os.environ), cwd, log_path, here=True)
    try:
        info = ray.get(actor.start.remote(), timeout=60)
    except Exception as exc:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        raise BackendError(f"cannot start the detached master: {_first_line(exc)}") from None
    if "error" in info:
        ray.kill(actor, no_restart=True)
        raise BackendError(f"cannot start the detached master: {info['error']}")
    return {"actor": name, "namespace": MASTERS_NAMESPACE, "pid": info["pid"]}


# ============================================================================ the backend
@dataclass
class _Node:
    actor: Any  # None until the watcher has asked Ray for it
    log_path: str | None
    resources: Resources
    launched_at: float
    spec: NodeSpec | None = None  # queued by launch, until its actor is asked for
    feasible: bool = True
    start_ref: Any = None  # the pending ``start`` call (None once answered)
    handle: NodeHandle | None = None  # once it runs
    ray_node: str = ""  # the Ray machine it runs on, once it has said so
    target: str = ""  # the machine ``pack`` asked for (until ray_node is known)
    adopted: bool = False
    offset: int = 0  # bytes of its output already in log_path
    killed: bool = False
    ended: bool = False


class RayBackend:
    """Nodes as Ray actors (``tidal.backends.api.Backend``); see the module docstring.

    Args:
        address: the cluster, ``auto`` (``$RAY_ADDRESS``, else the one ``ray start`` started here)
            or ``HOST:PORT`` of the head's GCS.
        namespace: the Ray namespace of the job's actors (``tidal-{job id}``): node ids are names in it.
        placement: ``spread`` (Ray's SPREAD strategy: nodes on as many machines as possible) or
            ``pack`` (onto the machine that holds most of the job's nodes while it has room; the
            first onto the machine with the most CPUs).
        wait_for_resources_s: how long a node may wait for room (or for a machine that can hold it
            to join) before it is reported as not started; 0: a request no machine can hold fails at
            once, one that fits waits for room without limit.
        poll_interval_s: how often the watcher asks the actors for their status and output.

    Raises:
        BackendError: no Ray here, a bad option, or no cluster answering at ``address``.
    """

    name = "ray"

    def __init__(self, address: str = "auto", namespace: str = "tidal", placement: str = "spread",
                 wait_for_resources_s: float = 0.0, poll_interval_s: float = 0.25) -> None:
        if placement not in PLACEMENTS:
            raise BackendError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        if not wait_for_resources_s >= 0:
            raise BackendError(f"wait_for_resources_s must be 0 or more, got {wait_for_resources_s}")
        if not poll_interval_s > 0:
            raise BackendError(f"poll_interval_s must be positive, got {poll_interval_s}")
        self.address = resolve_address(address)
        self.namespace = namespace
        self.placement = placement
        self.wait_for_resources_s = wait_for_resources_s
        self._poll_interval_s = poll_interval_s
        self._ray = connect(self.address)
        self._actor_class = self._ray.remote(NodeProcess)
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}  # launched or adopted, until their end is reported
        self._gone: set[str] = set()
        self._ended: list[NodeExit] = []
        self._errors: list[NodeError] = []
        self._requests = RequestIds()
        self._closed = threading.Event()
        self._unreachable_since: float | None = None
        self._lost: str | None = None  # the cluster is gone: what poll raises
        self._suspects: dict[str, float] = {}  # Ray machines seen gone that Ray still counts alive
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="tidal-ray-watch")
        self._watcher.start()
        threading.Thread(target=self._watch_gcs, daemon=True, name="tidal-ray-gcs").start()

    # ------------------------------------------------------------------------------ launch
    def launch(self, specs: list[NodeSpec], request_id: str) -> None:
        """Queue the nodes: the watcher thread asks Ray for their actors (a call to a cluster that
        is gone would hang the master)."""
        if not self._requests.first("launch", request_id):
            return
        for spec in specs:
            with self._lock:
                if spec.node_id in self._nodes:
                    continue
                if spec.node_id in self._gone:
                    self._errors.append(NodeError(spec.node_id, f"node {spec.node_id} already ran and ended; "
                                                  "a node id is launched once"))
                    continue
                if spec.argv:
                    self._nodes[spec.node_id] = _Node(None, spec.log_path, spec.resources, time.monotonic(), spec=spec)
                    continue
            self._fail(NodeError(spec.node_id, "cannot start a node with an empty argv"))

    def _suspect(self, ray_node: str) -> None:
        """An actor on ``ray_node`` was lost: if its raylet no longer takes connections, the
        machine is gone, though Ray's GCS may take seconds (a machine that vanishes: tens of
        seconds) to declare it dead, and until then places new actors on it, where they hang."""
        machine = next((m for m in self.machines() if m["NodeID"] == ray_node), None)
        if machine is None:
            return  # declared dead already
        try:
            check_reachable(f"{machine['NodeManagerAddress']}:{machine['NodeManagerPort']}", timeout_s=1.0)
        except BackendError:
            log.warning("Ray machine %s is gone: no node is placed until Ray knows it", ray_node[:12])
            self._suspects[ray_node] = time.monotonic()

    def _placeable(self, machines: list[dict[str, Any]]) -> bool:
        """False while a machine known to be gone still counts as alive for Ray (at most
        ``SUSPECT_MAX_S``): an actor placed there would hang until Ray notices."""
        alive = {m["NodeID"] for m in machines}
        now = time.monotonic()
        for ray_node, since in list(self._suspects.items()):
            if ray_node not in alive or now - since > SUSPECT_MAX_S:
                del self._suspects[ray_node]
        return not self._suspects

    def _create_requested(self) -> None:
        """Ask Ray for the actors of the nodes ``launch`` queued (in the watcher thread)."""
        with self._lock:
            queued = [(n, node) for n, node in self._nodes.items() if node.spec is not None and not node.ended]
        if not queued:
            return
        machines = self.machines()
        if not self._placeable(machines):
            return
        for node_id, node in queued:
            spec = node.spec
            assert spec is not None
            node.feasible = any(_fits(spec.resources, m["Resources"]) for m in machines)
            if not node.feasible and self.wait_for_resources_s == 0:
                self._drop(node_id, NodeError(node_id, unplaceable(spec.resources, machines)))
                continue
            target = self._pack_target(spec.resources, machines) if self.placement == "pack" else ""
            try:
                actor = self._create(spec, target)
            except ValueError as exc:  # the name is taken: an actor of an earlier master, not adopted
                self._drop(node_id, NodeError(node_id, f"cannot create the actor of {node_id}: {_first_line(exc)}"))
                continue
            with self._lock:
                if node.ended:  # terminated meanwhile
                    self._kill_actor_of(actor)
                    continue
                node.actor, node.spec, node.target = actor, None, target
                node.start_ref = actor.start.remote()
            log.info("node %s: actor requested (%s)", node_id, spec.resources)

    def _drop(self, node_id: str, error: NodeError) -> None:
        """A node that will not start: forget it, report why (its id may be launched again)."""
        with self._lock:
            self._nodes.pop(node_id, None)
        self._fail(error)

    def _create(self, spec: NodeSpec, target: str) -> Any:
        """The node's actor. Its name is the node id: one that failed to start was killed a moment
        ago, and Ray frees a dead actor's name shortly after; so a name taken is asked again for up
        to ``NAME_FREED_S``."""
        deadline = time.monotonic() + NAME_FREED_S
        while True:
            try:
                return self._actor_class.options(
                    name=spec.node_id, namespace=self.namespace, lifetime="detached", max_restarts=0,
                    num_cpus=spec.resources.cpus, num_gpus=spec.resources.gpus,
                    memory=spec.resources.memory_mb * 2**20 if spec.resources.memory_mb else None,
                    scheduling_strategy=self._strategy(target),
                ).remote(spec.node_id, list(spec.argv), dict(spec.env), spec.cwd, spec.log_path)
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def machines(self) -> list[dict[str, Any]]:
        """The live machines (Ray nodes) of the cluster, as ``ray.nodes()`` gives them."""
        return [m for m in self._ray.nodes() if m.get("Alive")]

    def _strategy(self, target: str) -> Any:
        if not target:
            return "SPREAD"
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # soft: once that machine is full (or gone) Ray places the node elsewhere
        return NodeAffinitySchedulingStrategy(node_id=target, soft=True)

    def _pack_target(self, asked: Resources, machines: list[dict[str, Any]]) -> str:
        """``pack``: the machine that holds (or was asked for) most of the job's live nodes, among
        those big enough for ``asked``; with none yet, the biggest (most CPUs): room for the most
        nodes beside it. Counting the machines asked for, not only those confirmed, keeps a batch
        of nodes launched at once together."""
        fitting = {m["NodeID"]: m for m in machines if _fits(asked, m["Resources"])}
        if not fitting:
            return ""  # wait_for_resources: no machine can hold it yet; Ray decides when one joins
        counts = dict.fromkeys(fitting, 0)
        with self._lock:
            for node in self._nodes.values():
                machine = node.ray_node or node.target
                if machine in counts and not node.ended:
                    counts[machine] += 1
        return max(fitting, key=lambda k: (counts[k], fitting[k]["Resources"].get("CPU", 0.0), k))

    def _fail(self, error: NodeError) -> None:
        log.warning("node %s did not start: %s", error.node_id, error.message)
        with self._lock:
            self._errors.append(error)  # the id may be launched again, by a new request

    # ------------------------------------------------------------------------------ terminate
    def terminate(self, node_ids: list[str], request_id: str) -> None:
        if not self._requests.first("terminate", request_id):
            return
        with self._lock:
            nodes = [(n, self._nodes[n]) for n in node_ids if n in self._nodes and not self._nodes[n].ended]
        for node_id, node in nodes:
            node.killed = True
            if node.handle is None:  # not started yet: withdraw the request
                log.info("node %s: withdrawn before it started", node_id)
                if node.actor is not None:
                    self._kill_actor(node)
                self._finish(node_id, -signal.SIGKILL)
            else:
                log.info("node %s: SIGKILL to pid %d", node_id, node.handle.pid)
                node.actor.kill.remote()

    def _kill_actor(self, node: _Node) -> None:
        self._kill_actor_of(node.actor)

    def _kill_actor_of(self, actor: Any) -> None:
        with contextlib.suppress(Exception):  # already dead: nothing to free
            self._ray.kill(actor, no_restart=True)

    # ------------------------------------------------------------------------------ adopt
    def adopt(self, handles: list[NodeHandle], request_id: str) -> None:
        if not self._requests.first("adopt", request_id):
            return
        found: list[tuple[NodeHandle, Any, Any]] = []
        for handle in handles:
            with self._lock:
                known = self._nodes.get(handle.node_id)
                if handle.node_id in self._gone:
                    continue
            if known is not None:
                if known.handle is not None and known.handle.pid != handle.pid:
                    log.warning("node %s runs as pid %d: not adopting pid %d under its id",
                                handle.node_id, known.handle.pid, handle.pid)
                continue
            try:
                actor = self._ray.get_actor(handle.node_id, namespace=self.namespace)
            except ValueError:  # no such actor: it ended (or its machine is gone)
                log.info("node %s is gone: not adopted", handle.node_id)
                self._finish(handle.node_id, None)
                continue
            found.append((handle, actor, actor.describe.remote()))
        for handle, actor, ref in found:
            try:
                info = self._ray.get(ref, timeout=STATUS_TIMEOUT_S)
            except Exception as exc:  # died, or not answering: either way not ours to watch
                log.info("node %s did not answer (%s): not adopted", handle.node_id, type(exc).__name__)
                self._finish(handle.node_id, None)
                continue
            created = info.get("create_time")
            if handle.pid == 0 or (info["pid"] == handle.pid and created is None):
                # its process ended, or the earlier master never learnt its pid (it died while the
                # node started): the actor is this job's (its namespace says so) and no round
                # counts on it, so it is freed, its process with it, and the node reported ended
                log.info("node %s (pid %s) is not adopted: ended or never known; its actor is freed",
                         handle.node_id, info["pid"])
                actor.forget.remote()
                self._kill_actor_of(actor)
                self._finish(handle.node_id, None)
                continue
            reused = (info["pid"] != handle.pid or created is None
                      or (handle.create_time is not None and abs(created - handle.create_time) > CREATE_TIME_TOLERANCE_S))
            if reused:
                log.info("node %s runs pid %s, not pid %d: not adopted", handle.node_id, info["pid"], handle.pid)
                self._finish(handle.node_id, None)
                continue
            log_path = info.get("log_path")
            offset = 0
            if log_path:
                with contextlib.suppress(OSError):
                    offset = os.path.getsize(log_path)  # what the earlier master had appended
            node = _Node(actor, log_path, Resources(), time.monotonic(), adopted=True, offset=offset,
                         handle=NodeHandle(handle.node_id, handle.pid, created))
            with self._lock:
                if handle.node_id not in self._nodes and handle.node_id not in self._gone:
                    self._nodes[handle.node_id] = node
            log.info("node %s adopted: pid %d", handle.node_id, handle.pid)

    # ------------------------------------------------------------------------------ the watcher
    def _watch(self) -> None:
        while not self._closed.wait(self._poll_interval_s):
            try:
                self._round()
            except Exception:  # a bug here must not silence every later report
                log.exception("ray backend: watcher round failed")

    def _round(self, create: bool = True) -> None:
        if self._unreachable_since is not None:
            return
        if create:
            self._create_requested()
        with self._lock:
            nodes = [(n, node) for n, node in self._nodes.items() if not node.ended and node.actor is not None]
        starting = [(n, node) for n, node in nodes if node.start_ref is not None]
        running = [(n, node) for n, node in nodes if node.start_ref is None and node.handle is not None]
        for node_id, node in starting:
            self._check_start(node_id, node)
        if not running:
            return
        refs = {node.actor.status.remote(node.offset): (node_id, node) for node_id, node in running}
        ready, _ = self._ray.wait(list(refs), num_returns=len(refs), timeout=STATUS_TIMEOUT_S)
        for ref in ready:
            node_id, node = refs[ref]
            try:
                code, chunk = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as exc:
                log.warning("node %s lost: %s", node_id, _first_line(exc))
                self._suspect(node.ray_node)
                self._finish(node_id, None)
                continue
            if chunk:
                self._append_log(node, chunk)
            if code is not None and len(chunk) < LOG_CHUNK:  # ended, and all its output is here
                node.actor.forget.remote()
                self._kill_actor(node)
                self._finish(node_id, None if node.adopted else code)

    def _watch_gcs(self) -> None:
        """Whether the cluster's GCS takes connections, every ``GCS_CHECK_S``, in a thread of its
        own: when it is gone Ray's calls hang (the watcher's with them) and after a minute Ray
        ends this process. After ``CLUSTER_GONE_S`` without it ``poll`` raises instead, and the
        master stops with its journal resumable."""
        while not self._closed.wait(GCS_CHECK_S):
            now = time.monotonic()
            try:
                check_reachable(self.address, timeout_s=GCS_CHECK_S)
            except BackendError:
                if self._unreachable_since is None:
                    self._unreachable_since = now
                    log.warning("the Ray cluster at %s is not answering", self.address)
                elif now - self._unreachable_since > CLUSTER_GONE_S and self._lost is None:
                    self._lost = (f"the Ray cluster at {self.address} is gone (not answering for "
                                  f"{CLUSTER_GONE_S:g} s); every committed step is in the journal: "
                                  "`tidal master --resume JOURNAL` goes on once the cluster is back")
                continue
            if self._unreachable_since is not None:
                log.warning("the Ray cluster at %s answers again", self.address)
            self._unreachable_since = None

    def _check_start(self, node_id: str, node: _Node) -> None:
        ready, _ = self._ray.wait([node.start_ref], timeout=0)
        if not ready:
            waited = time.monotonic() - node.launched_at
            if self.wait_for_resources_s and waited > self.wait_for_resources_s:
                self._kill_actor(node)
                message = (f"not started in {self.wait_for_resources_s:g} s (--wait-for-resources): "
                           + (f"no machine has room for {_describe(node.resources)}, or its process is slow "
                              "to start" if node.feasible
                              else unplaceable(node.resources, self.machines())))
                self._drop(node_id, NodeError(node_id, message, retryable=node.feasible))
            return
        node.start_ref = None
        try:
            info = self._ray.get(ready[0])
        except self._ray.exceptions.RayActorError as exc:  # its machine died before it started
            self._drop(node_id, NodeError(node_id, f"its Ray node died before it started: {_first_line(exc)}",
                                          retryable=True))
            return
        if "error" in info:
            self._kill_actor(node)
            self._drop(node_id, NodeError(node_id, info["error"], retryable=info["retryable"]))
            return
        node.ray_node = info["ray_node"]
        node.handle = NodeHandle(node_id, info["pid"], info["create_time"])
        self._append_log(node, b"")  # the log exists from the start, as on the local backend
        log.info("node %s started: pid %d on %s with %s", node_id, info["pid"], info["host"], info["assigned"])
        if node.killed:  # terminated while it was starting
            node.actor.kill.remote()

    def _append_log(self, node: _Node, chunk: bytes) -> None:
        node.offset += len(chunk)
        if node.log_path:
            try:
                with open(node.log_path, "ab") as out:
                    out.write(chunk)
            except OSError as exc:
                log.warning("cannot append to %s: %s", node.log_path, exc)

    # ------------------------------------------------------------------------------ poll
    def _finish(self, node_id: str, code: int | None) -> None:
        with self._lock:
            node = self._nodes.pop(node_id, None)
            if node is not None:
                node.ended = True
            if node_id in self._gone:
                return
            self._gone.add(node_id)
            self._ended.append(NodeExit(node_id, code, time.time()))
        log.info("node %s ended: exit code %s", node_id, code)

    def poll(self) -> BackendState:
        """Raises:
            BackendError: the cluster is gone (not the failure of a node: of everything).
        """
        if self._lost is not None:
            raise BackendError(self._lost)
        with self._lock:
            running = {n: node.handle for n, node in self._nodes.items() if node.handle is not None and not node.ended}
            state = BackendState(running, self._ended, self._errors)
            self._ended, self._errors = [], []
        return state

    def close(self) -> None:
        """Stop watching. The nodes that still run keep running (a restarted master adopts them by
        the pid it journaled). Detached actors would hold their CPUs in the cluster for good, so
        the others are freed: those that ended (a last round), those being killed, and those not
        started yet (no pid: nothing could adopt them). A watcher stuck in a call to a cluster that
        is gone is left behind (a daemon thread)."""
        self._closed.set()
        self._watcher.join(timeout=STATUS_TIMEOUT_S + 1)
        if self._watcher.is_alive() or self._unreachable_since is not None:
            return
        try:
            self._round(create=False)
        except Exception:
            log.exception("ray backend: the last round failed")
        with self._lock:
            unadoptable = [node for node in self._nodes.values()
                           if node.actor is not None and not node.ended and (node.killed or node.handle is None)]
        for node in unadoptable:
            self._kill_actor(node)  # its process, if any, dies with it (PR_SET_PDEATHSIG)


# ============================================================================ helpers
RESOURCE_KEYS: tuple[tuple[str, str, Callable[[Resources], float]], ...] = (
    ("CPU", "CPUs", lambda r: r.cpus),
    ("GPU", "GPUs", lambda r: float(r.gpus)),
    ("memory", "bytes of memory", lambda r: float(r.memory_mb) * 2**20),
)


def _fits(asked: Resources, total: dict[str, float]) -> bool:
    return all(get(asked) <= total.get(key, 0.0) for key, _, get in RESOURCE_KEYS)


def _describe(asked: Resources) -> str:
    parts = [f"{asked.cpus:g} CPU"]
    if asked.gpus:
        parts.append(f"{asked.gpus} GPU")
    if asked.memory_mb:
        parts.append(f"{asked.memory_mb} MiB of memory")
    return ", ".join(parts)


def unplaceable(asked: Resources, machines: list[dict[str, Any]]) -> str:
    """Which resource no machine has enough of, and what the machines have."""
    short = [what for key, what, get in RESOURCE_KEYS
             if get(asked) > max((m["Resources"].get(key, 0.0) for m in machines), default=0.0)]
    have = "; ".join(
        f"{m.get('NodeManagerAddress', '?')} ({m['Resources'].get('CPU', 0):g} CPU, "
        f"{m['Resources'].get('GPU', 0):g} GPU, {m['Resources'].get('memory', 0) / 2**30:.1f} GiB)"
        for m in machines) or "none"
    lacking = " and ".join(short) or "room"
    return f"no Ray node has the {lacking} asked for ({_describe(asked)}); nodes: {have}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return next((ln.strip() for ln in text if "died" in ln), text[0] if text else type(exc).__name__)
