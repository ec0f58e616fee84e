"""The job's data workers (``tidal run --data-workers N|MIN:MAX``): launch, registration, loss.

Data workers are stateless (tidal.data.worker): each runs the training script in the role
``data`` and serves the batches of the index ranges trainers send it. So the master's part is
small and no round ever waits for them:

- it keeps ``target`` of them launched (``tidal scale --data-workers N``, or the job-level tuner
  of ``tidal.brain.goldminer``), replacing any that ends while the job runs;
- a data worker registers with its first report (``POST /v1/data/report``, then every second),
  and from then on its address is in every trainer's report answer (``ReportResponse``); one that
  exits, is retired or stops reporting (``STALE_S``) leaves that list at once, and the trainers
  re-dispatch the batches it held (tidal.data.dispatch);
- retiring one (the target went down) takes it off the list first and stops it a little later
  (``RETIRE_GRACE_S``), so that the batches it is building still arrive.

Nothing of a data worker is needed to resume a job: the journal keeps the records only so that a
new master adopts (and can stop) the processes an earlier one started.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tidal.api import DataWorkerInfo, DataWorkerReport
from tidal.backends.api import Backend, NodeSpec, Resources, node_id
from tidal.master.api import JobSpec
from tidal.master.roles import EXITED, LAUNCHING, RETIRING, RUNNING, RoleProcesses

log = logging.getLogger(__name__)
START_FAILURES = 3  # data workers in a row that end before they register fail the job (a script that
# cannot get to its loader in the data role would otherwise be relaunched forever)
STALE_S = 5.0  # a data worker silent this long is taken off the trainers' list (it may hang)
RETIRE_GRACE_S = 2.0  # a retired data worker is stopped this long after it left the list


@dataclass
class DataWorkerRecord:
    data_worker_id: int
    state: str = LAUNCHING
    pid: int = 0
    address: str = ""
    exit_code: int | None = None
    retired_at: float = 0.0
    report: DataWorkerReport | None = None  # the last one (not journaled)
    reported_at: float = 0.0

    def to_row(self) -> dict[str, Any]:
        return {"data_worker_id": self.data_worker_id, "state": self.state, "pid": self.pid,
                "address": self.address, "exit_code": self.exit_code}


class DataWorkers(RoleProcesses[DataWorkerRecord]):
    def __init__(self, spec: JobSpec, backend: Backend) -> None:
        super().__init__(spec, backend, "data", DataWorkerRecord)
        self.target = spec.data_workers
        self.serving: list[str] = []  # what ``refresh`` found: every trainer's report answer carries it
        self.start_failures = 0  # in a row: ended before registering

    # ------------------------------------------------------------------ views
    def refresh(self, now: float) -> list[str]:
        """Where the trainers send tasks (``serving``): the registered data workers that reported
        lately. Once a tick and at every change, not per report (thousands a second)."""
        self.serving = [r.address for r in self.records.values()
                        if r.state == RUNNING and r.address and now - r.reported_at <= STALE_S]
        return self.serving

    def info(self) -> list[DataWorkerInfo]:
        out = []
        for r in sorted(self.records.values(), key=lambda r: r.data_worker_id):
            rep = r.report
            out.append(DataWorkerInfo(id=r.data_worker_id, pid=r.pid, state=r.state, address=r.address,
                                      exit_code=r.exit_code, batches=rep.batches if rep else 0,
                                      batches_per_s=rep.batches_per_s if rep else 0.0,
                                      busy=rep.busy if rep else 0.0, cpu=rep.cpu if rep else 0.0))
        return out

    # ------------------------------------------------------------------ journal
    def to_meta(self) -> dict[str, Any]:
        return {"data_workers": self.rows(), "data_target": self.target}

    def restore(self, meta: dict[str, Any], request_id: str, now: float) -> None:
        """Rebuild from the journal and watch the data workers an earlier master started (those
        that served stay on the trainers' lists: they report again within a second)."""
        self.records = {}
        for row in meta.get("data_workers", []):
            rec = DataWorkerRecord(**row)
            rec.reported_at = now
            self.records[rec.data_worker_id] = rec
        self.target = int(meta.get("data_target", self.target))
        self.adopt(request_id)

    # ------------------------------------------------------------------ changes
    def reconcile(self, now: float, journal_first: Any) -> tuple[list[int], list[int]]:
        """Launch data workers up to ``target``, retire those beyond it, stop the retired ones
        whose grace is over. Returns (launched, retired) ids."""
        up = sorted(i for i, r in self.records.items() if r.state in (LAUNCHING, RUNNING))
        launched: list[int] = []
        retired: list[int] = []
        if len(up) < self.target:
            launched = self.start(self.target - len(up), journal_first, "launch")
        elif len(up) > self.target:
            # the newest go first: a launching one has no batch in flight yet
            retired = sorted(up, reverse=True)[:len(up) - self.target]
            for i in retired:
                self.records[i].state, self.records[i].retired_at = RETIRING, now
            journal_first()
        due = [i for i, r in self.records.items() if r.state == RETIRING and now - r.retired_at >= RETIRE_GRACE_S
               and r.exit_code is None]
        if due:
            self.terminate(due, "retire")
            for i in due:
                self.records[i].exit_code = -1  # asked to stop: do not ask again
        return launched, retired

    def report(self, req: DataWorkerReport, now: float) -> DataWorkerRecord | None:
        """A data worker's report; returns its record when this one registered it (its first).

        Raises:
            KeyError: not a data worker of this job, or one retired or ended (it must exit).
        """
        rec = self.records.get(req.data_worker_id)
        if rec is None or rec.state in (EXITED, RETIRING):
            raise KeyError(req.data_worker_id)
        first = rec.state != RUNNING or rec.address != req.address
        if first:
            self.start_failures = 0
            # launched by an earlier master that died before it knew the pid: watch it from now on
            # (adopting a node the backend launched itself is a no-op)
            rec.pid = req.pid
            self.adopt(f"{self.spec.job_id}-data-{rec.data_worker_id}-{req.pid}", [rec.data_worker_id])
        rec.state, rec.pid, rec.address = RUNNING, req.pid, req.address
        rec.report, rec.reported_at = req, now
        return rec if first else None

    def node_spec(self, data_worker_id: int) -> NodeSpec:
        spec = self.spec
        env = {"TIDAL_MASTER_URL": spec.node_url, "TIDAL_TOKEN": spec.token,
               "TIDAL_JOB_ID": spec.job_id, "TIDAL_ROLE": "data", "TIDAL_DATA_WORKER_ID": str(data_worker_id),
               "PYTHONUNBUFFERED": "1", **spec.env}
        return NodeSpec(node_id("data", data_worker_id), "data", list(spec.argv), env, Resources(cpus=1.0),
                        spec.cwd, self.log_path(data_worker_id))
