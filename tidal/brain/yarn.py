"""Baseline: Apache YARN's capacity scheduler in FIFO mode with gang scheduling (YARN-CS).

The scheduler Microsoft Philly ran (Jeon et al., ATC'19) and the baseline of EasyScale (section
5.2) and GoldMiner (section 5.6): jobs start in submission order; a job starts only when *all*
its workers can be placed at once (gang); the first job that cannot be placed blocks every job
behind it (strict FIFO, no backfilling). All workers of a job get GPUs of one type. Placement
packs compactly (GoldMiner 5.6: "jobs are placed to machines with less free resource"): each
job goes whole to the fullest machine that holds it; otherwise each worker goes to the fitting
machine with the fewest free GPUs, then the fewest free CPUs, so a job fills machines before it
spreads and large holes stay open for large jobs.

``YarnCapacityFifo`` is a ``ClusterAllocator`` (``tidal.brain.api``): ``allocate(queue,
machines) -> [GangGrant]``, one grant per started job in the order they started.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidal.api import ConfigError

__all__ = ["GangGrant", "GangRequest", "Machine", "Placement", "YarnCapacityFifo"]

#: machine name -> (GPUs, CPUs) a job gets there
Placement = dict[str, tuple[int, float]]


@dataclass(frozen=True)
class Machine:
    """A machine's *free* resources and its GPU type."""

    name: str
    gpu_type: str
    gpus: int
    cpus: float = 0.0


@dataclass(frozen=True)
class GangRequest:
    """A job waiting for all of its ``workers``.

    Attributes:
        job_id: the job.
        order: submission order (smaller first).
        workers: number of workers, all needed at once.
        gpus_per_worker: GPUs of one worker (on one machine).
        cpus_per_worker: CPUs of one worker, on the worker's machine.
        types: allowed GPU types in preference order; ``None``: any, fastest-first is the
            caller's order of ``machines``.
    """

    job_id: str
    order: float
    workers: int
    gpus_per_worker: int = 1
    cpus_per_worker: float = 0.0
    types: tuple[str, ...] | None = None


@dataclass(frozen=True)
class GangGrant:
    """A started job and where its workers run (machine name -> GPUs, CPUs it gets there)."""

    job_id: str
    placement: Placement


class YarnCapacityFifo:
    """FIFO gang scheduler over machines (``allocate(queue, machines) -> grants``)."""

    name = "yarn-cs"

    def place(self, req: GangRequest, machines: Sequence[Machine]) -> Placement | None:
        """Best-fit placement of all workers of ``req`` on one GPU type, or ``None``.

        Raises:
            ConfigError: a request with no workers or negative resources.
        """
        if req.workers < 1 or req.gpus_per_worker < 0 or req.cpus_per_worker < 0:
            raise ConfigError(f"job {req.job_id}: bad gang request {req}")
        types = req.types or tuple(dict.fromkeys(m.gpu_type for m in machines))
        need_g, need_c = req.workers * req.gpus_per_worker, req.workers * req.cpus_per_worker
        for t in types:
            whole = [m for m in machines if m.gpu_type == t and m.gpus >= need_g and m.cpus >= need_c - 1e-9]
            if whole:  # the fullest single machine that holds the whole job
                m = min(whole, key=lambda m: (m.gpus, m.cpus, m.name))
                return {m.name: (need_g, need_c)}
            free = {m.name: [m.gpus, m.cpus] for m in machines if m.gpu_type == t}
            placed: Placement = {}
            for _ in range(req.workers):
                fits = [n for n, (g, c) in free.items()
                        if g >= req.gpus_per_worker and c >= req.cpus_per_worker - 1e-9]
                if not fits:
                    break
                name = min(fits, key=lambda n: (free[n][0], free[n][1], n))
                free[name][0] -= req.gpus_per_worker
                free[name][1] -= req.cpus_per_worker
                g, c = placed.get(name, (0, 0.0))
                placed[name] = (g + req.gpus_per_worker, c + req.cpus_per_worker)
            else:
                return placed
        return None

    def allocate(self, jobs: Sequence[GangRequest], machines: Sequence[Machine]) -> list[GangGrant]:
        """Start queued jobs in submission order until the first one that does not fit.

        ``jobs`` is the queue, ``machines`` their free resources; the grants come in the order
        the jobs started (submission order).

        Raises:
            ConfigError: a request with no workers or negative resources.
        """
        free = {m.name: m for m in machines}
        out: list[GangGrant] = []
        for req in sorted(jobs, key=lambda r: r.order):
            placed = self.place(req, list(free.values()))
            if placed is None:
                break
            out.append(GangGrant(req.job_id, placed))
            for name, (g, c) in placed.items():
                m = free[name]
                free[name] = Machine(m.name, m.gpu_type, m.gpus - g, m.cpus - c)
        return out
