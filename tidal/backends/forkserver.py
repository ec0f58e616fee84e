"""A fork server for the local backend: one process imports torch once, and every node forks from it.

Why: a worker is a Python process that imports torch, numpy and tidal, and its first optimizer
imports ``torch._dynamo``: 5-6 CPU seconds on the 2-core VM before it can join, every time. A
scale-out by four there took 20 wall seconds (bench/RESULTS.md, the eighteenth live run), a
replacement after a failure 6-9. Forked from a process that has already imported them, a node
starts in milliseconds and shares those pages copy-on-write. Python's ``multiprocessing``
forkserver with ``set_forkserver_preload`` does the same for its own children; this one starts
arbitrary scripts (``tidal run``'s argv) with their own environment, session and log.

How a node started this way is made to look like one started by ``exec``:

* its own session (``setsid``), stdin from /dev/null, stdout and stderr appended to its log file;
* its environment replaced (``os.environ``, so the C library's ``getenv`` too), its working
  directory, ``sys.argv`` and ``sys.path[0]`` as the interpreter would set them, stdout unbuffered
  under ``-u`` or ``PYTHONUNBUFFERED``, numpy's global generator and torch's default CPU generator
  reseeded from the OS as a fresh process's are (the ``random`` module reseeds itself after a
  fork);
* ``/proc/PID/cmdline`` and ``/proc/PID/environ`` show the node's own argv and environment: the
  server starts with a padded command line and environment (``PAD_BYTES`` each) and a node
  writes its own over them (its command line in setproctitle form: arguments joined by spaces);
* its exit status (negative for a signal, as ``subprocess.Popen`` gives it) is reported by the
  server, which is its parent and reaps it.

A node whose argv is not ``[sys.executable, (-u), script | -m module | -c code, ...]``, or whose
environment differs from the server's in a variable read only when a process starts
(``EXEC_ONLY_PREFIXES``: ``PYTHON*``, ``LD_*``, ``OMP_*`` ...), is started with ``exec`` as
before (``eligible``). So is every node while the server is still importing, and all of them if
it cannot start. ``TIDAL_FORKSERVER=0`` turns it off.

Protocol: one JSON object per line. The backend writes ``{"node", "argv", "env", "cwd", "log"}``;
the server answers ``{"ready": pid}`` once, then ``{"node", "pid"}`` or ``{"node", "error",
"errno"}`` per request and ``{"exited": pid, "code": c}`` per node that ends. The server exits when
its stdin closes (the master is gone); its nodes keep running, as nodes started with ``exec`` do.
It never initializes CUDA: a process that did could not give its children the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: what the server imports before it forks anything (a node's own imports of them are then free)
PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.distributed", "tidal.worker")
#: bytes of command line and of environment the server starts with, for a node's own to replace
PAD_BYTES = 32 * 1024
PAD_ENV = "TIDAL_FORKSERVER_PAD"
#: environment variables read when a process starts (by the interpreter, the loader, OpenMP or
#: torch's import): a node whose value differs from the server's cannot be forked from it
EXEC_ONLY_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH_",
                      "PYTORCH_")
#: ... except these, which a forked node applies itself
APPLIED_AFTER_FORK = frozenset({"PYTHONUNBUFFERED", "PYTHONPATH"})
READY_TIMEOUT_S = 120.0  # a server that has not imported torch by then is given up


@dataclass(frozen=True)
class Plan:
    """What a node's argv asks the interpreter to run."""

    mode: str  # "script", "module" or "code"
    target: str  # the script's path, the module's name or the code
    args: list[str]  # what follows it
    unbuffered: bool  # -u


def plan(argv: list[str]) -> Plan | None:
    """How a forked node runs ``argv``; None when only ``exec`` can (another interpreter, or
    interpreter options other than ``-u``)."""
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    i, unbuffered = 1, False
    while i < len(argv) and argv[i] == "-u":
        i, unbuffered = i + 1, True
    if i >= len(argv):
        return None
    if argv[i] in ("-m", "-c"):
        if i + 1 >= len(argv):
            return None
        return Plan("module" if argv[i] == "-m" else "code", argv[i + 1], argv[i + 2:], unbuffered)
    if argv[i].startswith("-"):
        return None
    return Plan("script", argv[i], argv[i + 1:], unbuffered)


def exec_only(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` a fork cannot change."""
    return {k: v for k, v in env.items()
            if k.startswith(EXEC_ONLY_PREFIXES) and k not in APPLIED_AFTER_FORK and k != PAD_ENV}


# ============================================================================ the backend's side
class ForkServer:
    """The master's handle on one fork server (``tidal.backends.local.LocalBackend`` uses it).

    ``start`` returns at once; requests made before the server is ready wait in a queue. What the
    server answers reaches the caller through the callbacks, on this object's reader thread:
    ``started(node_id, pid)``, ``failed(node_id, OSError)``, ``exited(pid, code)``, and
    ``gone(unsent)`` once when the server cannot start or has ended (``unsent``: the requests it
    never got, for the caller to start some other way; nodes already forked then end unreported).
    """

    def __init__(self, env: dict[str, str], log_path: str | None, *,
                 started: Callable[[str, int], None], failed: Callable[[str, OSError], None],
                 exited: Callable[[int, int], None], gone: Callable[[list[Any]], None]) -> None:
        self.env = {k: v for k, v in env.items() if k != PAD_ENV}
        self.log_path = log_path
        self._started, self._failed, self._exited, self._gone = started, failed, exited, gone
        self._lock = threading.Lock()
        self._queue: list[tuple[Any, dict[str, Any]]] = []  # (token, request) sent once ready
        self._sent: dict[str, Any] = {}  # node id -> token, awaiting the answer
        self._ready = False
        self._ended = False
        self._closing = False  # close() ended it: its end is no news
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid = 0

    def start(self) -> None:
        env = {**self.env, PAD_ENV: "x" * PAD_BYTES}
        argv = [sys.executable, "-m", "tidal.backends.forkserver", " " * PAD_BYTES]
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(open(self.log_path, "ab")) if self.log_path else subprocess.DEVNULL
            self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=out, start_new_session=True)
        self.pid = self._proc.pid
        threading.Thread(target=self._read, daemon=True, name="tidal-forkserver").start()
        timer = threading.Timer(READY_TIMEOUT_S, self._give_up)
        timer.daemon = True
        timer.start()

    def _give_up(self) -> None:
        """Not ready in time: kill it; the reader then hands what waits for it to exec."""
        if not self._ready and self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a node with this full environment can be forked from this server."""
        return (not self._ended and exec_only(env) == exec_only(self.env)
                and env.get("TIDAL_JOB_ID") == self.env.get("TIDAL_JOB_ID"))

    def submit(self, node_id: str, token: Any, argv: list[str], env: dict[str, str], cwd: str | None,
               log_path: str | None) -> bool:
        """Ask for a node (queued until the server is ready); False when the server has ended."""
        request = {"node": node_id, "argv": argv, "env": env, "cwd": cwd, "log": log_path}
        with self._lock:
            if self._ended:
                return False
            if not self._ready:
                self._queue.append((token, request))
                return True
            self._sent[node_id] = token
        return self._send([request])

    def cancel(self, node_id: str) -> bool:
        """Drop a request the server has not been sent yet; False when it was sent already."""
        with self._lock:
            kept = [(t, r) for t, r in self._queue if r["node"] != node_id]
            dropped = len(kept) != len(self._queue)
            self._queue = kept
        return dropped

    def _send(self, requests: list[dict[str, Any]]) -> bool:
        assert self._proc is not None and self._proc.stdin is not None
        data = b"".join(json.dumps(r).encode() + b"\n" for r in requests)
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (OSError, ValueError):
            return False  # it died: the reader sees the end and reports what was sent as failed
        return True

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                log.warning("fork server: unreadable answer %r", line[:200])
                continue
            if "ready" in msg:
                with self._lock:
                    self._ready = True
                    queued, self._queue = self._queue, []
                    for token, request in queued:
                        self._sent[request["node"]] = token
                log.info("fork server ready: pid %d", self.pid)
                if queued:
                    self._send([r for _, r in queued])
            elif "exited" in msg:
                self._exited(int(msg["exited"]), int(msg["code"]))
            elif "node" in msg:
                with self._lock:
                    self._sent.pop(msg["node"], None)
                if "pid" in msg:
                    self._started(msg["node"], int(msg["pid"]))
                else:
                    code = int(msg.get("errno") or 0)
                    self._failed(msg["node"], OSError(code, msg.get("error", "cannot start")))
        self._proc.stdout.close()
        code = self._proc.wait()
        with self._lock:
            self._ended = True
            unsent, self._queue = [t for t, _ in self._queue], []
            lost, self._sent = dict(self._sent), {}
        if not self._closing:
            log.warning("fork server (pid %d) ended with status %s%s", self.pid, code,
                        "" if self._ready else " before it was ready; nodes start without it")
        for node_id in lost:  # asked, never answered: whether it forked is not known
            self._failed(node_id, OSError(errno.EAGAIN, "the fork server ended before it answered"))
        self._gone(unsent)

    def close(self) -> None:
        """End the server (its stdin closes); the nodes it forked keep running."""
        with self._lock:
            self._ended = self._closing = True
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()


# ============================================================================ the server
def main() -> int:
    env = {k: v for k, v in os.environ.items() if k != PAD_ENV}
    os.environ.clear()  # the C library's environ no longer points into the area rewritten next
    _retitle(_areas(), [sys.executable, "-m", "tidal.backends.forkserver"], env)
    os.environ.update(env)
    # were an import to ask whether CUDA is there, NVML answers without initializing CUDA here
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        for name in PRELOAD:
            __import__(name)
        import torch

        if torch.cuda.is_initialized():
            raise RuntimeError("importing the preloaded modules initialized CUDA; a fork could not use it")
    except Exception as exc:
        print(f"tidal fork server: cannot preload: {exc!r}", file=sys.stderr, flush=True)
        return 1
    _answer({"ready": os.getpid()})
    child = _serve()
    if child is None:
        return 0
    return _run(*child)


def _answer(msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode() + b"\n"
    while data:
        data = data[os.write(1, data):]


def _serve() -> tuple[dict[str, Any], int] | None:
    """Answer requests until stdin closes (None) or, in a forked child, return its request and log fd."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buf = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            _reap()
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return None
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            child = _fork(json.loads(line))
            if child is not None:
                os.close(wake_r)
                os.close(wake_w)
                return child
        _reap()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(req: dict[str, Any]) -> tuple[dict[str, Any], int] | None:
    node = str(req.get("node", ""))
    try:
        if not (isinstance(req.get("argv"), list) and isinstance(req.get("env"), dict)):
            raise OSError(errno.EINVAL, "a request needs argv and env")
        cwd = req.get("cwd")
        if cwd is not None and not os.path.isdir(cwd):
            raise FileNotFoundError(errno.ENOENT, f"No such file or directory: {cwd!r}")
        log_fd = os.open(req.get("log") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
        try:
            pid = os.fork()
        except OSError:
            os.close(log_fd)
            raise
    except OSError as exc:
        _answer({"node": node, "error": exc.strerror or str(exc), "errno": exc.errno or 0})
        return None
    if pid == 0:
        return req, log_fd
    os.close(log_fd)
    _answer({"node": node, "pid": pid})
    return None


# ---------------------------------------------------------------------------- in a forked node
def _run(req: dict[str, Any], log_fd: int) -> int:
    """Become the node ``req`` asks for and run it; returns its exit status (or raises SystemExit
    as the script does), so that the interpreter ends as it would for ``python script.py``."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    argv: list[str] = [str(a) for a in req["argv"]]
    env = {str(k): str(v) for k, v in req["env"].items()}
    what = plan(argv)
    if what is None:  # the backend only sends what ``plan`` accepts
        print(f"tidal fork server: cannot run {argv!r}", file=sys.stderr, flush=True)
        return 1
    os.environ.clear()  # the C library's environ no longer points into the area rewritten next
    _retitle(_areas(), argv, env)
    os.environ.update(env)
    if req.get("cwd"):
        os.chdir(req["cwd"])
    _reopen_stdio(what.unbuffered or bool(env.get("PYTHONUNBUFFERED")))
    # a fresh process seeds these from the OS: forked ones would otherwise all draw the same numbers
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.seed()  # the CPU's (CUDA's start from a fixed seed anyway)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if what.mode == "script":
        script = os.path.abspath(what.target)
        if not os.path.isfile(script):
            print(f"{argv[0]}: can't open file {script!r}: [Errno 2] No such file or directory", file=sys.stderr)
            return 2
        sys.path[0:1] = [os.path.dirname(os.path.realpath(script)), *extra]
        sys.argv = [what.target, *what.args]
    else:
        sys.path[0:1] = [os.getcwd(), *extra]
        sys.argv = ["-c" if what.mode == "code" else what.target, *what.args]
    import runpy

    try:
        if what.mode == "script":
            runpy.run_path(what.target, run_name="__main__")
        elif what.mode == "module":
            runpy.run_module(what.target, run_name="__main__", alter_sys=True)
        else:
            main_module = types.ModuleType("__main__")
            sys.modules["__main__"] = main_module
            exec(compile(what.target, "<string>", "exec"), main_module.__dict__)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        return 1
    return 0


_OLD_STREAMS: list[Any] = []  # the server's stdio objects, kept so that collecting them closes nothing


def _reopen_stdio(unbuffered: bool) -> None:
    """stdout and stderr anew over descriptors 1 and 2 (now the log file), buffered as the node asks."""
    _OLD_STREAMS.extend([sys.stdin, sys.stdout, sys.stderr])
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"

    def stream(fd: int, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding=encoding, errors=errors, line_buffering=line_buffering,
                                write_through=unbuffered)

    streams = {"stdout": stream(1, "strict", False), "stderr": stream(2, "backslashreplace", True),
               "stdin": io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)}
    for name, new in streams.items():
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


@dataclass(frozen=True)
class _Areas:
    """Where the kernel reads ``/proc/self/cmdline`` and ``/proc/self/environ`` from."""

    arg_start: int
    arg_end: int
    env_start: int
    env_end: int


def _areas() -> _Areas | None:
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # fields[0] is the state, field 3 of proc(5): arg_start..env_end are fields 48-51
        return _Areas(*(int(fields[i - 3]) for i in (48, 49, 50, 51)))
    except (OSError, IndexError, ValueError):
        return None


def _retitle(areas: _Areas | None, argv: list[str], env: dict[str, str]) -> None:
    """Write ``argv`` (setproctitle form) and ``env`` over this process's command line and
    environment areas, as far as they fit (the ``TIDAL_*`` variables first)."""
    if areas is None:
        return
    size = areas.arg_end - areas.arg_start
    if size > 2:
        title = " ".join(argv).encode(errors="replace")[: size - 2]
        # the last byte not NUL: the kernel then reads the title up to its first NUL (setproctitle)
        data = title + b"\0" * (size - len(title) - 1) + b" "
        ctypes.memmove(areas.arg_start, data, size)
    size = areas.env_end - areas.env_start
    if size > 1:
        out = bytearray()
        for k, v in sorted(env.items(), key=lambda kv: not kv[0].startswith("TIDAL_")):
            entry = f"{k}={v}".encode(errors="replace") + b"\0"
            if len(out) + len(entry) < size:
                out += entry
        data = bytes(out) + b"\0" * (size - len(out))  # a double NUL ends the block for readers
        ctypes.memmove(areas.env_start, data, size)


if __name__ == "__main__":
    sys.exit(main())
