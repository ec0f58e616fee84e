"""The job's parameter servers (``tidal run --ps N|MIN:MAX``): launch, registration, load, moves.

Servers start with the job, before any round forms: a server binds a port of its own choosing
and registers with its first report (``POST /v1/ps/report``), and the first round waits until
every server has registered, so every worker gets the servers' addresses and the shard map with
its round (``RendezvousResponse.ps``). Each later report carries the server's rows, bytes and
load, shown by ``tidal status`` and ``/metrics``.

**Changing the number of servers while training runs** (``tidal scale --ps N``; DLRover 5.3,
DLRover-RM 5.2). New servers start while the workers train on. Once they have registered, the
master re-forms the round, and before the next round forms (no step in flight) it moves the
virtual shards (``ShardMove``, a thread, so the master keeps answering):

1. every server of the old map applies the committed step's watermark (the round's source
   reports it with its rendezvous), so each holds exactly the committed model; new servers are
   configured with the tables and set to the same step;
2. each moving shard is dropped on its new holder (what a move that broke off left there),
   exported from its old holder page by page (rows and optimizer state) and loaded into the
   new one;
3. the master journals the new map and hands it out with the round; then the old holders drop
   the moved shards, and servers left without a shard are stopped.

A row's update depends on the step's contributions alone, never on the server holding it, so a
move changes no number of the model. Every request of a move is idempotent in that order, so a
move that breaks off (a master failover, a refused request) is done again, or the old map kept.

**A hot server** (DLRover 4.2): the servers report their busy share and rows pulled per virtual
shard; every few seconds the master asks ``tidal.brain.hotps`` whether one is much busier than
its peers, and moves the shards the planner names (``planned_map``) the same way, at a re-form.

**A server lost** (it exits on its own while the job runs). Its rows are gone, and the other
servers hold rows of steps it can no longer give back, so the job goes back to its newest flash
checkpoint (the tables are in it: rank 0 exports them at each checkpoint step). ``replace``
starts a new server in the lost one's place in the shard map; the master re-forms the round as
a *restore* from that checkpoint (``JobMaster._handle_server_exits``): the workers' steps after
it are rolled back and their samples trained again (the ledger's ``rollback_to_step``), and the
round's source resets every server of the map to the checkpoint's step and loads its rows
(``ServerEmbeddings.restore_tree``) before any member trains. Without ``--checkpoint-every`` (or
before the first checkpoint of a job that trained), nothing can restore the rows: the job fails
with a message that says so. Nothing is trained with a server missing, so nothing is lost.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.api import PSObservation, ServerInfo, ServerReport
from tidal.api.errors import TidalError
from tidal.api.rpc import Caller
from tidal.backends.api import Backend, NodeSpec, Resources, node_id
from tidal.brain.hotps import HotShardPlan, plan_hot_shards
from tidal.master.api import JobSpec
from tidal.master.roles import EXITED, LAUNCHING, RETIRING, RUNNING, RoleProcesses

log = logging.getLogger(__name__)

SERVER_CORES = 1  # a server's cores: it computes on one torch thread (TIDAL_PS_THREADS)
LOAD = {"rows", "bytes", "applied_step", "requests_per_s", "busy", "latency_ms", "cpu", "rss_bytes"}  # what ServerInfo shows of a report
MOVE_TIMEOUT_S = 120.0  # per request of a move (a page of rows)
WINDOW_REPORTS = 64  # a server's reports kept for the hot-PS planner (one a second; it reads the last 5 s)


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


def rebalanced(shard_map: list[int], servers: list[int]) -> list[int]:
    """A shard map over ``servers`` that moves as few virtual shards as it can: each server
    gets ``V // N`` or one more shards; shards stay where they are while their server is kept
    and under its share, the rest go to the servers short of theirs, in shard order."""
    if not servers:
        raise ValueError("a shard map needs at least one server")
    servers = sorted(servers)
    held = Counter(shard_map)
    base, extra = divmod(len(shard_map), len(servers))
    # the servers holding the most keep the extra shards (fewer moves), ties by id
    by_load = sorted(servers, key=lambda i: (-held.get(i, 0), i))
    quota = {i: base + (1 if rank < extra else 0) for rank, i in enumerate(by_load)}
    out = list(shard_map)
    kept: Counter[int] = Counter()
    orphans = []
    for v, i in enumerate(shard_map):
        if i in quota and kept[i] < quota[i]:
            kept[i] += 1
        else:
            orphans.append(v)
    short = [i for i in servers for _ in range(quota[i] - kept[i])]
    for v, i in zip(orphans, short, strict=True):
        out[v] = i
    return out


@dataclass
class ShardMove:
    """Moving virtual shards from ``old_map`` to ``new_map`` (steps 1 and 2 of the module's
    docstring), run by a thread of its own; ``finish`` (step 3) once the map is journaled."""

    old_map: list[int]
    new_map: list[int]
    addresses: dict[int, str]
    token: str
    watermark: list[int] | None  # [round, step, total] of the committed step, None: nothing trained
    started: float = field(default_factory=time.monotonic)
    rows: int = 0
    seconds: float = 0.0
    error: str | None = None
    void: str | None = None  # a server it involves was lost: whatever the thread did is void
    done: threading.Event = field(default_factory=threading.Event)

    def moves(self) -> dict[tuple[int, int], list[int]]:
        """(old holder, new holder) -> the shards it moves."""
        out: dict[tuple[int, int], list[int]] = {}
        for v, (a, b) in enumerate(zip(self.old_map, self.new_map, strict=True)):
            if a != b:
                out.setdefault((a, b), []).append(v)
        return out

    def start(self) -> None:
        threading.Thread(target=self._run, name="tidal-ps-move", daemon=True).start()

    def _run(self) -> None:
        callers: dict[int, Caller] = {}
        try:
            for i in set(self.old_map) | set(self.new_map):
                callers[i] = Caller(self.addresses[i], self.token, timeout_s=MOVE_TIMEOUT_S)
            self._move(callers)
        except (TidalError, OSError, KeyError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            for c in callers.values():
                c.close()
            self.seconds = time.monotonic() - self.started
            self.done.set()

    def _settle(self, caller: Caller, server_id: int) -> dict[str, Any]:
        meta = caller.call({"op": "stats", "commit": self.watermark}).meta or {}
        if self.watermark is not None and int(meta.get("applied_step", -2)) != self.watermark[1]:
            raise ValueError(f"parameter server {server_id} is at step {meta.get('applied_step')}, the job "
                             f"committed step {self.watermark[1]}")
        return meta

    def _move(self, callers: dict[int, Caller]) -> None:
        num_shards = len(self.new_map)
        specs: list[Any] = []
        for i in sorted(set(self.old_map)):
            specs = specs or list(self._settle(callers[i], i).get("specs") or [])
        for i in sorted(set(self.new_map) - set(self.old_map)):
            if specs:
                callers[i].call({"op": "hello", "tables": specs})
            self._settle(callers[i], i)
        if not specs:
            return  # no worker has declared a table yet: nothing to move
        moves = self.moves()
        for (_, dst), shards in moves.items():
            callers[dst].call({"op": "drop", "shards": shards, "num_shards": num_shards})
        for (src, dst), shards in moves.items():
            for spec in specs:
                start = 0
                while True:
                    msg = callers[src].call({"op": "export", "table": spec["name"], "start": start,
                                             "shards": shards, "num_shards": num_shards})
                    part, meta = msg.tensors, msg.meta or {}
                    if len(part.get("ids", ())):
                        callers[dst].call({"op": "load", "table": spec["name"], "shards": shards,
                                           "num_shards": num_shards}, dict(part))
                        self.rows += len(part["ids"])
                    start = int(meta.get("next", start))
                    if start >= int(meta.get("rows", 0)) or not len(part.get("ids", ())):
                        break

    def finish(self) -> None:
        """Drop the moved shards on their old holders (best effort, a thread: what is left is
        never read, since no client routes to it, and a later move there drops it first)."""
        def run() -> None:
            num_shards = len(self.new_map)
            for (src, _), shards in self.moves().items():
                if src not in self.new_map:
                    continue  # stopped anyway
                try:
                    with Caller(self.addresses[src], self.token, timeout_s=MOVE_TIMEOUT_S) as c:
                        c.call({"op": "drop", "shards": shards, "num_shards": num_shards})
                except (TidalError, OSError) as exc:
                    log.warning("parameter server %d: dropping moved shards failed: %s", src, exc)

        threading.Thread(target=run, name="tidal-ps-drop", daemon=True).start()


class Servers(RoleProcesses[ServerRecord]):
    def __init__(self, spec: JobSpec, backend: Backend) -> None:
        super().__init__(spec, backend, "ps", ServerRecord)
        self.shard_map: list[int] = [v % spec.ps for v in range(spec.ps_shards)] if spec.ps else []
        self.target = spec.ps  # how many servers the map should spread over
        self.move: ShardMove | None = None
        self.lost: str | None = None  # why the next round must restore the servers from a checkpoint
        self.planned_map: list[int] | None = None  # the hot-PS planner's map, moved to at the next re-form
        self.hot_moves = 0  # plans of the hot-PS planner carried out (a metric)
        self._window: dict[int, list[tuple[float, float, list[int]]]] = {}  # reports since the last check

    # ------------------------------------------------------------------ views
    @property
    def launched(self) -> bool:
        return bool(self.records) or not self.spec.ps

    @property
    def ready(self) -> bool:
        """Every server of the shard map registered its address (a round may form)."""
        return self.launched and all(self.records[i].state == RUNNING for i in set(self.shard_map))

    def in_map(self) -> list[int]:
        """The servers holding virtual shards, by id."""
        return sorted(set(self.shard_map))

    def addresses(self) -> list[str]:
        """Server ``i`` of the round's map (``RendezvousResponse.ps``)."""
        return [self.records[i].address for i in self.in_map()]

    def positions(self) -> list[int]:
        """The shard map by position in ``addresses()``, as workers read it."""
        index = {sid: k for k, sid in enumerate(self.in_map())}
        return [index[i] for i in self.shard_map]

    def bytes_held(self) -> int | None:
        """The bytes the servers of the map reported holding (None until each has reported)."""
        reports = [self.records[i].report for i in self.in_map()]
        return sum(r.bytes for r in reports if r is not None) if all(reports) else None

    def observation(self, workers: Sequence[float], cores: float) -> PSObservation | None:
        """The parameter-server side of the planner's observation (None: the job has none):
        the servers in the shard map, the cores each used over its last report (of the
        ``SERVER_CORES`` each is launched with), ``workers``' mean cores (their
        ``cpu_percent / 100``) and the job's ``cores`` as its quota."""
        held = self.in_map()
        if not self.spec.ps or not held:
            return None
        reports = [rec.report for rec in (self.records.get(i) for i in held) if rec is not None and rec.report]
        used = [r.cpu for r in reports]
        rss = [r.rss_bytes for r in reports]
        return PSObservation(ps=len(held), ps_cpu=SERVER_CORES, worker_cpu=1, cpu_quota=max(1, int(cores)),
                             worker_cpu_used=sum(workers) / len(workers) if workers else 0.0,
                             ps_cpu_used=used if len(used) == len(held) else [],
                             ps_mem_used_gb=max(rss, default=0) / 2**30)

    def info(self) -> list[ServerInfo]:
        held = Counter(self.shard_map)
        out = []
        for r in sorted(self.records.values(), key=lambda r: r.server_id):
            load = r.report.model_dump(include=LOAD) if r.report is not None else {}
            out.append(ServerInfo(id=r.server_id, pid=r.pid, state=r.state, address=r.address,
                                  exit_code=r.exit_code, shards=held.get(r.server_id, 0), **load))
        return out

    # ------------------------------------------------------------------ journal
    def to_meta(self) -> dict[str, Any]:
        return {"servers": self.rows(), "ps_shard_map": self.shard_map,
                "ps_target": self.target, "ps_lost": self.lost}

    def restore(self, meta: dict[str, Any], request_id: str) -> None:
        """Rebuild from the journal and watch the servers an earlier master started (a move in
        progress when it stopped is done again at the next re-form)."""
        self.records = {}
        for row in meta.get("servers", []):
            rec = ServerRecord(**row)
            self.records[rec.server_id] = rec
        self.shard_map = list(meta.get("ps_shard_map") or self.shard_map)
        self.target = int(meta.get("ps_target", len(self.in_map())))
        self.lost = meta.get("ps_lost")
        self.adopt(request_id)

    # ------------------------------------------------------------------ changes
    def launch(self, journal_first: Any) -> list[int]:
        """Start servers until ``target`` are up or starting; returns the ids started."""
        up = [i for i, r in self.records.items() if r.state in (LAUNCHING, RUNNING)]
        count = self.target - len(up)
        return self.start(count, journal_first, "launch") if count > 0 else []

    def wanted(self) -> list[int]:
        """The servers the map should spread over: the map's, less the newest beyond ``target``,
        plus the newest running ones not in it up to ``target``."""
        current = self.in_map()
        if self.target <= len(current):
            return current[:self.target]
        spare = sorted(i for i, r in self.records.items() if r.state == RUNNING and i not in current)
        return sorted(current + spare[:self.target - len(current)])

    def change_ready(self) -> bool:
        """A change of the map is wanted and every server it needs has registered."""
        if not self.spec.ps or not self.records:
            return False
        if self.target != len(self.in_map()):
            self.planned_map = None  # a change of the number of servers comes first
        if self.planned_map is not None:
            return self.planned_map != self.shard_map and all(self.records[i].state == RUNNING
                                                              for i in set(self.planned_map))
        wanted = self.wanted()
        return len(wanted) == self.target and wanted != self.in_map()

    def change_cause(self) -> str:
        if self.planned_map is not None:
            return "hot parameter server: moving virtual shards"
        return f"parameter servers {len(self.in_map())} -> {self.target}"

    def hot_plan(self, now: float, window_s: float) -> HotShardPlan | None:
        """The hot-PS planner on the reports of the last ``window_s`` (tidal.brain.hotps); None
        while the window is short or a change is under way. Starts the next window."""
        window, self._window = self._window, {}
        if self.move is not None or self.planned_map is not None or self.target != len(self.in_map()):
            return None
        busy, hits = {}, {}
        for i in self.in_map():
            reports = window.get(i, [])
            if len(reports) < 3 or reports[-1][0] - reports[0][0] < window_s * 0.5:
                return None
            (t0, _, first), (t1, _, last) = reports[0], reports[-1]
            if len(first) != len(self.shard_map) or len(last) != len(first):
                return None  # counted under another number of virtual shards
            busy[i] = sum(r[1] for r in reports[1:]) / (len(reports) - 1)
            hits[i] = [(b - a) / (t1 - t0) for a, b in zip(first, last, strict=True)]
        return plan_hot_shards(busy, hits, self.shard_map)

    def begin_move(self, watermark: list[int] | None) -> ShardMove:
        """Start moving shards to the planned map, or to the map over ``wanted()`` (see ShardMove)."""
        new_map = self.planned_map if self.planned_map is not None else rebalanced(self.shard_map, self.wanted())
        addresses = {i: self.records[i].address for i in set(self.shard_map) | set(new_map)}
        self.move = ShardMove(list(self.shard_map), new_map, addresses, self.spec.token, watermark)
        self.move.start()
        return self.move

    def end_move(self, journal: Any) -> list[int]:
        """The move finished: publish its map (journaled first), drop the moved shards on their
        old holders, stop the servers left without shards. Returns the stopped servers."""
        move, self.move = self.move, None
        assert move is not None and move.done.is_set() and move.error is None
        self.shard_map = move.new_map
        if self.planned_map is not None:
            self.hot_moves += 1
        self.planned_map = None
        self._window = {}  # the load before the move says nothing of the load after it
        # servers out of the map, unless the target grew during the move (those join the next one)
        spare = [i for i, r in self.records.items() if r.state in (LAUNCHING, RUNNING) and i not in self.shard_map
                 and len(self.in_map()) >= self.target]
        for i in spare:
            self.records[i].state = RETIRING
        journal()
        move.finish()
        if spare:
            self.terminate(spare, "retire")
        return spare

    def replace(self, lost: int, why: str, journal_first: Any) -> int:
        """Start a new server in the shard map's places of the ``lost`` one; the next round
        restores every server from a checkpoint (``why`` says what for). Returns the new id. A
        move in flight is void (the restore loads every server of the map anyway)."""
        self.lost = why
        new = max(self.records) + 1
        self.shard_map = [new if i == lost else i for i in self.shard_map]
        if self.move is not None:
            self.move.void = f"parameter server {lost} was lost during the move"
        return self.start(1, journal_first, "replace")[0]

    def node_spec(self, server_id: int) -> NodeSpec:
        spec = self.spec
        env = {"TIDAL_MASTER_URL": spec.node_url, "TIDAL_TOKEN": spec.token,
               "TIDAL_JOB_ID": spec.job_id, "TIDAL_PS_ID": str(server_id),
               "PYTHONUNBUFFERED": "1", **spec.env}
        if spec.ps_memory:
            env["TIDAL_PS_MEMORY_BYTES"] = str(spec.ps_memory)
        return NodeSpec(node_id("ps", server_id), "ps", [sys.executable, "-m", "tidal.ps.server"], env,
                        Resources(cpus=float(SERVER_CORES)), spec.cwd, self.log_path(server_id))

    def report(self, req: ServerReport, now: float) -> ServerRecord | None:
        """A server's report; returns its record when this one registered it (its first)."""
        rec = self.records.get(req.server_id)
        if rec is None or rec.state in (EXITED, RETIRING):
            return None
        first = rec.state != RUNNING or rec.address != req.address
        rec.state, rec.pid, rec.address = RUNNING, req.pid, req.address
        rec.report = req
        if req.shard_hits and self.spec.ps_hot_balance:
            window = self._window.setdefault(req.server_id, [])
            window.append((now, req.busy, req.shard_hits))
            del window[:-WINDOW_REPORTS]
        return rec if first else None


