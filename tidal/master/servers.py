"""The job's parameter servers (``tidal run --ps N``): launch, registration, load, exits.

Servers start with the job, before any round forms: a server binds a port of its own choosing
and registers with its first report (``POST /v1/ps/report``), and the first round waits until
every server has registered, so every worker gets every server's address and the shard map
with its round (``RendezvousResponse.ps``). Each later report carries the server's rows, bytes
and load, shown by ``tidal status`` and ``/metrics``.

The number of servers is fixed while the job runs, and a server that exits while the job runs
fails the job with a message that says so: moving virtual shards between servers and restoring
a lost server from a checkpoint are not built yet (issue "Parameter servers"). Nothing is
trained with a server missing, so nothing is lost: the job stops instead of training on rows
that are gone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.api import ServerInfo, ServerReport
from tidal.backends.api import Backend, NodeHandle, NodeSpec, Resources, node_id
from tidal.master.api import JobSpec
from tidal.master.fleet import last_log_line

LAUNCHING, RUNNING, EXITED = "launching", "running", "exited"
LOAD = {"rows", "bytes", "applied_step", "requests_per_s", "busy"}  # what ServerInfo shows of a report


@dataclass
class ServerRecord:
    server_id: int
    state: str = LAUNCHING
    pid: int = 0
    address: str = ""
    exit_code: int | None = None
    report: ServerReport | None = None  # the last one (not journaled: the next comes within a second)

    def to_row(self) -> dict[str, Any]:
        return {"server_id": self.server_id, "state": self.state, "pid": self.pid, "address": self.address,
                "exit_code": self.exit_code}


class Servers:
    def __init__(self, spec: JobSpec, backend: Backend) -> None:
        self.spec = spec
        self.backend = backend
        self.records: dict[int, ServerRecord] = {}
        self.shard_map: list[int] = [v % spec.ps for v in range(spec.ps_shards)] if spec.ps else []
        self._seq = 0

    # ------------------------------------------------------------------ views
    @property
    def launched(self) -> bool:
        return len(self.records) >= self.spec.ps

    @property
    def ready(self) -> bool:
        """Every server registered its address (the first round may form)."""
        return all(r.state == RUNNING for r in self.records.values()) and self.launched

    def addresses(self) -> list[str]:
        return [self.records[i].address for i in sorted(self.records)]

    def alive(self) -> list[int]:
        return [i for i, r in self.records.items() if r.state != EXITED]

    def info(self) -> list[ServerInfo]:
        out = []
        for r in sorted(self.records.values(), key=lambda r: r.server_id):
            load = r.report.model_dump(include=LOAD) if r.report is not None else {}
            out.append(ServerInfo(id=r.server_id, pid=r.pid, state=r.state, address=r.address,
                                  exit_code=r.exit_code, **load))
        return out

    # ------------------------------------------------------------------ journal
    def to_meta(self) -> dict[str, Any]:
        return {"servers": [r.to_row() for r in self.records.values()], "ps_shard_map": self.shard_map}

    def restore(self, meta: dict[str, Any], request_id: str) -> None:
        """Rebuild from the journal and watch the servers an earlier master started."""
        self.records = {}
        for row in meta.get("servers", []):
            rec = ServerRecord(**row)
            self.records[rec.server_id] = rec
        self.shard_map = list(meta.get("ps_shard_map") or self.shard_map)
        handles = [NodeHandle(node_id("ps", r.server_id), r.pid) for r in self.records.values()
                   if r.state != EXITED and r.pid]
        if handles:
            self.backend.adopt(handles, request_id)

    # ------------------------------------------------------------------ changes
    def launch(self, journal_first: Any) -> list[int]:
        """Start the servers not started yet; returns their ids."""
        new = [i for i in range(self.spec.ps) if i not in self.records]
        if not new:
            return []
        for i in new:
            self.records[i] = ServerRecord(i)
        journal_first()
        self._seq += 1
        self.backend.launch([self.node_spec(i) for i in new], f"{self.spec.job_id}-ps-launch-{self._seq}")
        return new

    def node_spec(self, server_id: int) -> NodeSpec:
        spec = self.spec
        env = {"TIDAL_MASTER_URL": f"http://{spec.host}:{spec.port}", "TIDAL_TOKEN": spec.token,
               "TIDAL_JOB_ID": spec.job_id, "TIDAL_PS_ID": str(server_id), "TIDAL_PS_HOST": spec.host,
               "PYTHONUNBUFFERED": "1", **spec.env}
        log_path = str(Path(spec.job_dir) / "logs" / f"ps-{server_id}.log")
        return NodeSpec(node_id("ps", server_id), "ps", [sys.executable, "-m", "tidal.ps.server"], env,
                        Resources(cpus=1.0), spec.cwd, log_path)

    def report(self, req: ServerReport) -> ServerRecord | None:
        """A server's report; returns its record when this one registered it (its first)."""
        rec = self.records.get(req.server_id)
        if rec is None or rec.state == EXITED:
            return None
        first = rec.state != RUNNING or rec.address != req.address
        rec.state, rec.pid, rec.address = RUNNING, req.pid, req.address
        rec.report = req
        return rec if first else None

    def exited(self, server_id: int, code: int | None) -> ServerRecord | None:
        """A server's process ended; returns its record if it was not known to have ended."""
        rec = self.records.get(server_id)
        if rec is None or rec.state == EXITED:
            return None
        rec.state, rec.exit_code = EXITED, code
        return rec

    def kill(self, tag: str) -> None:
        alive = self.alive()
        if alive:
            self._seq += 1
            self.backend.terminate([node_id("ps", i) for i in alive], f"{self.spec.job_id}-ps-{tag}-{self._seq}")

    def log_tail(self, server_id: int) -> str:
        return last_log_line(Path(self.spec.job_dir) / "logs" / f"ps-{server_id}.log")
