"""Headless Chromium for tests, driven over the Chrome DevTools Protocol; standard library only.

``Browser`` starts ``chromium --headless=new --remote-debugging-port=0`` in a session of its
own, reads the DevTools address from its stderr, opens the browser's websocket (a minimal
RFC 6455 client below: text frames, masked as a client must, no extensions) and attaches to
its page in flat mode. It can ``navigate``, ``evaluate`` JavaScript and take a ``screenshot``;
``close`` (or leaving the ``with``) kills the browser's whole process group with SIGKILL.

    with Browser() as b:
        b.navigate("http://127.0.0.1:8000/")
        title = b.evaluate("document.title")

Only for 127.0.0.1: Chromium's DevTools endpoint listens there, and the tests browse their
own servers there.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = "chromium"
_LISTENING = re.compile(r"DevTools listening on (ws://127\.0\.0\.1:(\d+)(/\S+))")
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def available() -> bool:
    return shutil.which(CHROMIUM) is not None


class CDPError(RuntimeError):
    """A DevTools command failed, a script threw, or the browser went away."""


class WebSocket:
    """A blocking websocket client for one local DevTools connection."""

    def __init__(self, port: int, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        key = base64.b64encode(os.urandom(16))
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key.decode()}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise CDPError("DevTools closed the connection during the websocket handshake")
            head += chunk
        head, _, self._buf = head.partition(b"\r\n\r\n")
        self._parts: list[bytes] = []
        lines = head.decode("latin-1").split("\r\n")
        if not lines[0].startswith("HTTP/1.1 101"):
            raise CDPError(f"websocket handshake refused: {lines[0]}")
        accept = base64.b64encode(hashlib.sha1(key + _WS_GUID).digest()).decode()
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if headers.get("sec-websocket-accept") != accept:
            raise CDPError("websocket handshake: wrong Sec-WebSocket-Accept")

    def send(self, text: str) -> None:
        self._send_frame(0x1, text.encode())

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        mask = os.urandom(4)
        self.sock.sendall(head + mask + _mask_fast(payload, mask))

    def _fill(self, n: int) -> None:
        """Until ``n`` bytes are buffered; a timeout leaves the buffer whole (nothing is lost)."""
        while len(self._buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                raise CDPError("the browser closed its DevTools connection")
            self._buf += chunk

    def _frame(self) -> tuple[int, bytes, bool]:
        """The next whole frame: opcode, payload, FIN; consumed only once all of it is here."""
        self._fill(2)
        b0, b1 = self._buf[0], self._buf[1]
        n, at = b1 & 0x7F, 2
        if n == 126:
            self._fill(4)
            (n,) = struct.unpack("!H", self._buf[2:4])
            at = 4
        elif n == 127:
            self._fill(10)
            (n,) = struct.unpack("!Q", self._buf[2:10])
            at = 10
        mask = b""
        if b1 & 0x80:
            self._fill(at + 4)
            mask, at = self._buf[at:at + 4], at + 4
        self._fill(at + n)
        payload, self._buf = self._buf[at:at + n], self._buf[at + n:]
        return b0 & 0x0F, _mask_fast(payload, mask) if mask else payload, bool(b0 & 0x80)

    def recv(self, timeout: float) -> str:
        """The next text message (a fragmented one reassembled); answers pings on the way.
        TimeoutError when none comes in ``timeout`` seconds (call again: nothing is lost)."""
        self.sock.settimeout(max(timeout, 0.001))
        while True:
            opcode, payload, fin = self._frame()
            if opcode == 0x8:
                raise CDPError("the browser closed its DevTools connection")
            if opcode == 0x9:
                self._send_frame(0xA, payload)
                continue
            if opcode in (0x0, 0x1, 0x2):
                self._parts.append(payload)
                if fin:
                    text = b"".join(self._parts).decode()
                    self._parts = []
                    return text

    def close(self) -> None:
        try:
            self._send_frame(0x8, b"")
        except OSError:
            pass
        self.sock.close()


def _running_in_group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that still run (zombies are dead: init reaps them)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            out.append(int(entry.name))
    return out


def _wait_dead(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (left := _running_in_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    if left:
        raise CDPError(f"chromium processes {left} outlived SIGKILL")


def _mask_fast(payload: bytes, mask: bytes) -> bytes:
    """``payload`` XOR the 4-byte ``mask`` repeated (RFC 6455 5.3), as one big-integer XOR."""
    n = len(payload)
    if n == 0:
        return b""
    key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
    return (int.from_bytes(payload, "big") ^ key).to_bytes(n, "big")


class Browser:
    """One headless Chromium with one page; a context manager."""

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 20.0) -> None:
        self.width, self.height, self.timeout = width, height, timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.ws: WebSocket | None = None
        self.session = ""
        self.stderr: list[str] = []
        self.events: list[dict[str, Any]] = []
        self._next_id = 0
        self._profile = ""

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Browser:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._profile = tempfile.mkdtemp(prefix="tidal-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
             f"--user-data-dir={self._profile}", f"--window-size={self.width},{self.height}",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--metrics-recording-only", "--mute-audio", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            # chromium puts its singleton socket in a directory of its own under TMPDIR, which it
            # never removes after a SIGKILL: inside the profile, close() removes it too
            env={**os.environ, "TMPDIR": self._profile},
        )
        found = threading.Event()
        where: dict[str, str] = {}

        def drain() -> None:  # reads stderr to its end, so the browser never blocks on a full pipe
            assert self.proc is not None and self.proc.stderr is not None
            for raw in self.proc.stderr:
                line = raw.decode(errors="replace").rstrip()
                self.stderr.append(line)
                m = _LISTENING.search(line)
                if m and not found.is_set():
                    where["port"], where["path"] = m.group(2), m.group(3)
                    found.set()
            found.set()

        threading.Thread(target=drain, name="chromium-stderr", daemon=True).start()
        if not found.wait(self.timeout) or "port" not in where:
            raise CDPError("chromium did not open DevTools:\n" + "\n".join(self.stderr[-30:]))
        self.ws = WebSocket(int(where["port"]), where["path"], self.timeout)
        pages = [t for t in self.command("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        target = pages[0]["targetId"] if pages else self.command("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.command("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.page("Page.enable")
        self.page("Runtime.enable")
        self.page("Log.enable")

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
            _wait_dead(self.proc.pid, 10)
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            self.proc = None
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = ""

    # ------------------------------------------------------------------ protocol
    def command(self, method: str, session: str = "", **params: Any) -> dict[str, Any]:
        """Send one DevTools command (to the browser, or to ``session``) and wait for its answer;
        events that arrive meanwhile are kept in ``events``."""
        if self.ws is None:
            raise CDPError("the browser is not running")
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError(f"{method}: no answer in {self.timeout} s")
            try:
                reply = json.loads(self.ws.recv(left))
            except TimeoutError:
                raise CDPError(f"{method}: no answer in {self.timeout} s") from None
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            if "method" in reply:
                self.events.append(reply)

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.command(method, self.session, **params)

    def wait_event(self, method: str, timeout: float | None = None) -> dict[str, Any]:
        """The first kept or coming event ``method`` of the page (consumed)."""
        assert self.ws is not None
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            for i, ev in enumerate(self.events):
                if ev["method"] == method and ev.get("sessionId") == self.session:
                    del self.events[i]
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError(f"no {method} event in time")
            try:
                msg = json.loads(self.ws.recv(left))
            except TimeoutError:
                continue
            if "method" in msg:
                self.events.append(msg)

    # ------------------------------------------------------------------ what tests use
    def navigate(self, url: str) -> None:
        """Open ``url`` and wait for its load event."""
        self.events = [e for e in self.events if e["method"] != "Page.loadEventFired"]
        result = self.page("Page.navigate", url=url)
        if result.get("errorText"):
            raise CDPError(f"navigate {url}: {result['errorText']}")
        self.wait_event("Page.loadEventFired")

    def evaluate(self, js: str) -> Any:
        """The value of the expression ``js`` in the page (promises awaited), as JSON gives it."""
        result = self.page("Runtime.evaluate", expression=js, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CDPError(f"script threw: {text}")
        return result["result"].get("value")

    def wait_until(self, js: str, timeout: float = 20.0, interval: float = 0.2) -> Any:
        """Evaluate ``js`` until it is truthy; its value. CDPError when ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.evaluate(js)
            if value:
                return value
            time.sleep(interval)
        raise CDPError(f"{js!r} stayed {value!r} for {timeout} s")

    def errors(self) -> list[str]:
        """What went wrong in the page so far, as the DevTools console shows it: uncaught
        exceptions, ``console.error`` calls, and the browser's own errors (a resource that did
        not load, a content security policy violation)."""
        self.evaluate("0")  # reads what arrived before now
        out = []
        for ev in self.events:
            params = ev.get("params", {})
            if ev["method"] == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                out.append(details.get("exception", {}).get("description") or details.get("text", ""))
            elif ev["method"] == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif ev["method"] == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                out.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
        return out

    def screenshot(self, path: Path | str) -> Path:
        """A PNG of the page's whole document (not only the window)."""
        data = self.page("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        out = Path(path)
        out.write_bytes(base64.b64decode(data))
        return out
