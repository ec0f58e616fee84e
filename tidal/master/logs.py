"""Follows the workers' log files and echoes new lines with a ``[wN]`` prefix.

Workers write to files, never to a pipe held by the master: a worker must survive the master's
death (master failover), and a pipe whose reader died would kill it with SIGPIPE.
"""

from __future__ import annotations

from pathlib import Path
from typing import TextIO


class LogFollower:
    def __init__(self, directory: Path, out: TextIO) -> None:
        self.directory = directory
        self.out = out
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}

    def poll(self) -> None:
        for path in sorted(self.directory.glob("worker-*.log")):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read(1 << 20)
            except OSError:
                continue
            if not chunk:
                continue
            self._offsets[path] = offset + len(chunk)
            text = self._partial.pop(path, "") + chunk.decode(errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            tag = path.stem.replace("worker-", "w")
            for line in lines[:-1]:
                print(f"[{tag}] {line}", file=self.out, flush=True)
