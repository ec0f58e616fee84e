"""GoldMiner's data-worker scheduling (Zhao et al., "GoldMiner", section 3.4).

Two levels, joined by one indicator, the state of the job's data queue (enqueue rate of its
data workers vs dequeue rate of its training workers):

* Job level (3.4.1), pure functions over what a job measured while it was tuned:
  ``use_data_workers`` (fall back to the monolithic mode when data workers do not reach the
  baseline), ``data_worker_size`` (CPUs of one data worker: grow from 1 until the queue is
  ideal or the speedup turns sublinear) and ``trainer_cpus`` (the fewest training-worker
  CPUs that keep the performance).
* Cluster level (3.4.2), ``DataWorkerAllocator``: while CPUs are free, give one data worker to
  the job with the best metric among those whose data rate is below their training rate,
  assuming the next step gains what the last one did (linear: data workers do not
  synchronise). Metrics (``metric``): MaxTP ``dt/dc * g`` (largest), SRTF
  ``n * (c + dc) / (t + dt)`` (smallest), Fair ``(t + dt) / t_i`` (smallest).
  Placement prefers the training workers' machines (local CPUs), then machines with fewer
  distributed jobs and remote data workers.

Throughputs here are *normalised* to the job's ideal training rate (``t / t_i``, 1.0 = the
queue is ideal): the jobs of a cluster train different models whose samples/s cannot be
added up, and every metric above is invariant to a per-job unit except MaxTP, which the
normalisation turns into "GPU-equivalents of training gained per CPU".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.api import ConfigError, DataWorkerObservation, JobObservation, ResourcePlan

__all__ = [
    "POLICIES",
    "DataJob",
    "DataWorkerAllocator",
    "DataWorkerGrant",
    "DataWorkerTuner",
    "MachineCpus",
    "data_worker_size",
    "metric",
    "trainer_cpus",
    "use_data_workers",
]

POLICIES = ("maxtp", "srtf", "fair")


def use_data_workers(baseline: float, with_data_workers: float, tolerance: float = 0.95) -> bool:
    """3.4.1 (i): keep data workers only if, after tuning, they reach ``tolerance`` x the baseline.

    ``baseline`` is the throughput profiled without data workers when the job started.
    """
    return with_data_workers >= tolerance * baseline


def data_worker_size(measured: Sequence[float], ideal: float, linear_tol: float = 0.9) -> int:
    """3.4.1 (ii): CPUs per data worker from throughputs measured with 1, 2, ... CPUs in one.

    Stops at the first CPU count whose throughput reaches ``ideal`` (the queue is ideal: the
    data worker keeps up with the training worker); else at the last count whose marginal gain
    is still at least ``linear_tol`` x the gain of the first CPU (linear speedup); else at the
    last measured count (it used up its CPUs).

    Raises:
        ConfigError: nothing measured.
    """
    if not measured:
        raise ConfigError("data_worker_size needs at least one measurement")
    first = measured[0]
    for k, tput in enumerate(measured, start=1):
        if tput >= ideal * (1 - 1e-9):
            return k
        if k > 1 and tput - measured[k - 2] < linear_tol * first:
            return k - 1
    return len(measured)


def trainer_cpus(measured: Sequence[tuple[int, float]], tolerance: float = 0.02) -> int:
    """3.4.1 (iii): the fewest training-worker CPUs keeping the throughput of the first row.

    ``measured`` lists ``(cpus, throughput)`` in the order tried, from the initial CPU count
    downwards; the search stops at the first drop beyond ``tolerance`` (and rolls back).

    Raises:
        ConfigError: nothing measured.
    """
    if not measured:
        raise ConfigError("trainer_cpus needs at least one measurement")
    keep = measured[0][0]
    for cpus, tput in measured:
        if tput < (1 - tolerance) * measured[0][1]:
            break
        keep = cpus
    return keep


@dataclass(frozen=True)
class DataJob:
    """What the cluster-level scheduler sees of one running job (normalised throughputs).

    Attributes:
        job_id: the job.
        gpus: ``g``, GPUs of its training workers.
        machines: machines of its training workers (local CPUs for its data workers).
        speed: ``t / t_i``, training throughput relative to the ideal (1.0: ideal queue).
        gain_per_cpu: ``dt / dc`` of the last data-worker step, in speed per CPU.
        cpus: ``c``, CPUs its data workers hold.
        remaining: ``n / t_i``, remaining steps in seconds at the ideal rate.
        dw_size: CPUs of one data worker (job-level tuning).
        order: submission order (ties).
    """

    job_id: str
    gpus: int
    machines: tuple[str, ...]
    speed: float
    gain_per_cpu: float
    cpus: float
    remaining: float
    dw_size: int
    order: float = 0.0


@dataclass(frozen=True)
class MachineCpus:
    """Free CPUs of a machine and what loads its network."""

    name: str
    free_cpus: int
    distributed_jobs: int = 0
    remote_data_workers: int = 0


@dataclass(frozen=True)
class DataWorkerGrant:
    job_id: str
    machine: str
    cpus: int
    local: bool


def metric(policy: str, job: DataJob, dc: float, dt: float) -> float:
    """The 3.4.2 scaling metric of giving ``dc`` CPUs (gaining ``dt``) to ``job``; smaller wins.

    * ``maxtp`` (Throughput): ``dt / dc * g``, returned negated so that smaller wins.
    * ``srtf`` (Remaining time): ``n * (c + dc) / (t + dt)``: remaining time x resources.
    * ``fair`` (Fairness): ``(t + dt) / t_i``: normalised performance after the step.

    Raises:
        ConfigError: an unknown policy.
    """
    if policy == "maxtp":
        return -(dt / dc) * job.gpus
    if policy == "srtf":
        return job.remaining * (job.cpus + dc) / max(job.speed + dt, 1e-12)
    if policy == "fair":
        return job.speed + dt
    raise ConfigError(f"unknown data-worker policy {policy!r}; known: {', '.join(POLICIES)}")


class DataWorkerAllocator:
    """Cluster-level data-worker allocation: ``allocate(jobs, machines) -> grants``.

    A ``ClusterAllocator`` (``tidal.brain.api``) of ``DataJob``, ``MachineCpus`` and
    ``DataWorkerGrant``: one grant per data worker, in the order they were given.
    """

    name: str

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"unknown data-worker policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy = policy
        self.name = f"goldminer-{policy}"

    @staticmethod
    def place(job: DataJob, free: dict[str, int], machines: dict[str, MachineCpus],
              remote_added: dict[str, int]) -> tuple[str, bool] | None:
        """Where the next data worker of ``job`` goes: a local machine with the most free CPUs,
        else the remote one with the fewest distributed jobs + remote data workers (then most free)."""
        local = [m for m in job.machines if free.get(m, 0) > 0]
        if local:
            return max(local, key=lambda m: (free[m], m)), True
        remote = [m for m, n in free.items() if n > 0]
        if not remote:
            return None
        best = min(remote, key=lambda m: (machines[m].distributed_jobs
                                          + machines[m].remote_data_workers + remote_added[m],
                                          -free[m], m))
        return best, False

    def allocate(self, jobs: Sequence[DataJob], machines: Sequence[MachineCpus]) -> list[DataWorkerGrant]:
        """Grant data workers one at a time to the best job until CPUs or hungry jobs run out."""
        by_name = {m.name: m for m in machines}
        free = {m.name: m.free_cpus for m in machines}
        remote_added = dict.fromkeys(free, 0)
        state = {j.job_id: j for j in jobs}
        grants: list[DataWorkerGrant] = []
        while True:
            best: tuple[float, float, str, str, int, bool, float] | None = None
            for j in state.values():
                if j.speed >= 1 - 1e-9 or j.gain_per_cpu <= 0:
                    continue
                where = self.place(j, free, by_name, remote_added)
                if where is None:
                    break
                machine, local = where
                need = math.ceil((1 - j.speed) / j.gain_per_cpu - 1e-9)
                dc = max(1, min(j.dw_size, free[machine], need))
                dt = min(1 - j.speed, dc * j.gain_per_cpu)
                key = (metric(self.policy, j, dc, dt), j.order, j.job_id, machine, dc, local, dt)
                if best is None or key[:3] < best[:3]:
                    best = key
            if best is None:
                return grants
            _, _, jid, machine, dc, local, dt = best
            free[machine] -= dc
            if not local:
                remote_added[machine] += 1
            j = state[jid]
            state[jid] = DataJob(j.job_id, j.gpus, j.machines, j.speed + dt, j.gain_per_cpu,
                                 j.cpus + dc, j.remaining, j.dw_size, j.order)
            grants.append(DataWorkerGrant(jid, machine, dc, local))


# ---------------------------------------------------------------------------- job level, live
@dataclass
class _Measure:
    """One configuration's throughput: committed samples over ``span`` s after ``warmup`` s."""

    since: float  # when the configuration was in place
    start: tuple[float, int] | None = None  # (time, committed samples) once warmed up
    waits: list[float] = field(default_factory=list)

    def sample(self, now: float, committed: int, warmup: float, span: float, wait: float) -> float | None:
        """Samples/s once measured (None until then); ``wait``: the trainers' wait share now."""
        if self.start is None and now - self.since >= warmup:
            self.start = (now, committed)
        if self.start is None:
            return None
        self.waits.append(wait)
        if now - self.start[0] < span:
            return None
        return (committed - self.start[1]) / (now - self.start[0])


class DataWorkerTuner:
    """GoldMiner 3.4.1 run live: how many data workers a job gets, decided from what it measures.

    tidal's data workers are single-CPU processes, so 3.4.1's "data worker size" (grow the CPUs
    of the data worker from 1 while the speedup stays linear) becomes the number of them; the
    termination rules are the paper's:

    1. *Baseline.* With ``--data-workers 0:MAX`` the job first runs without data workers (the
       trainers build their batches) and measures its throughput B (3.4.1 (i)).
    2. *Grow.* Then one data worker, then one more each time the last count is measured, until
       (a) the queue is ideal: the trainers wait for batches less than ``ideal_wait`` of their
       time, or (b) the last data worker added less than ``linear_tol`` x the first one's gain
       (sublinear: ``data_worker_size``), which keeps the count before it, or (c) MAX.
    3. *Fall back* to 0 when the best count does not reach ``tolerance`` x B
       (``use_data_workers``); otherwise settle on the best count measured.
    4. *Trainer CPUs* (3.4.1 (iii); only where ``obs.data.trainer_threads`` > 0). With the queue
       ideal, fewer CPUs (torch threads) for the trainers, one at a time, down to the fewest that
       keep the settled throughput within ``cpu_tolerance`` (``trainer_cpus``); with the queue
       not ideal and the trainers using over 90% of their CPUs (they fetch and feed, not the data
       workers, limit), one CPU more, kept only if it gains ``cpu_gain``. The plan's
       ``worker_cpu`` carries it.

    A count is measured once every data worker of it serves (``obs.data.count == target``): after
    ``warmup_s``, the committed samples over the next ``measure_s`` seconds (``obs.
    committed_samples``: what the job really trained, data waits included). Times come
    from ``obs.now_s``: the tuner reads no clock. ``plan`` returns the target and why; the
    master applies it and journals the decision (``tidal status`` shows it).
    """

    name = "goldminer-job"

    def __init__(self, *, warmup_s: float = 3.0, measure_s: float = 6.0, ideal_wait: float = 0.05,
                 linear_tol: float = 0.5, tolerance: float = 0.95, cpu_tolerance: float = 0.02,
                 cpu_gain: float = 0.05) -> None:
        self.warmup_s = warmup_s
        self.measure_s = measure_s
        self.ideal_wait = ideal_wait
        self.linear_tol = linear_tol
        self.tolerance = tolerance
        self.cpu_tolerance = cpu_tolerance
        self.cpu_gain = cpu_gain
        self.measured: dict[int, float] = {}  # count -> mean samples/s
        self.settled: int | None = None
        self.reason = ""
        self._current: tuple[int, _Measure] | None = None
        self._waits: dict[int, float] = {}
        # step 4: the trainers' threads measured (threads -> samples/s), the direction, the result
        self.threads_measured: dict[int, float] = {}
        self.threads_settled: int | None = None
        self._threads_target: int | None = None
        self._threads_dir = 0
        self._threads_base = 0
        self._threads_current: tuple[int, _Measure] | None = None

    @property
    def done(self) -> bool:
        """Nothing more to try: the count and (where tunable) the trainers' CPUs are settled."""
        return self.settled is not None and (self.threads_settled is not None or self._threads_dir == 2)

    def plan(self, obs: JobObservation) -> ResourcePlan:
        data = obs.data
        if data is None:
            return ResourcePlan(workers=obs.target_workers, reason="no data workers in this job")
        target = self._decide(obs.now_s, obs.committed_samples, data)
        threads = None
        if self.settled is not None and data.trainer_threads > 0:
            threads = self._decide_threads(obs.now_s, obs.committed_samples, data)
        elif self.settled is not None:
            self._threads_dir = 2  # not tunable
        return ResourcePlan(workers=obs.target_workers, data_workers=target, worker_cpu=threads, reason=self.reason)

    def _decide_threads(self, now: float, committed: int, data: DataWorkerObservation) -> int:
        """Step 4: the trainers' threads (``trainer_cpus`` going down; one step up when CPU-bound)."""
        current = data.trainer_threads
        if self.threads_settled is not None:
            return self.threads_settled
        if data.count != data.target:  # the count is still moving: no throughput of the threads yet
            self._threads_current = None
            return self._threads_target or current
        if self._threads_target is None:  # the settled count's own measurement is the start
            self._threads_target = self._threads_base = current
            self.threads_measured[current] = self.measured.get(self.settled or 0, 0.0)
            ideal = self._waits.get(self.settled or 0, 1.0) <= self.ideal_wait
            if ideal and current > 1:
                self._threads_dir = -1
            elif not ideal and data.trainer_cpu >= 0.9 * current and current < data.trainer_threads_max:
                self._threads_dir = 1
            else:
                self.threads_settled = current
                return current
            self._threads_target = current + self._threads_dir
            self.reason = f"trying {self._threads_target} CPUs per trainer (from {current})"
            return self._threads_target
        wanted = self._threads_target
        if current != wanted:
            self._threads_current = None
            return wanted
        if self._threads_current is None or self._threads_current[0] != wanted:
            self._threads_current = (wanted, _Measure(now))
        measured = self._threads_current[1].sample(now, committed, self.warmup_s, self.measure_s, data.wait_share)
        if measured is None:
            self.reason = f"measuring {wanted} CPUs per trainer"
            return wanted
        tput = self.threads_measured[wanted] = measured
        before = self.threads_measured[wanted - self._threads_dir]
        if self._threads_dir < 0:  # trainer_cpus: against the throughput the search started from
            keep = tput >= (1 - self.cpu_tolerance) * self.threads_measured[self._threads_base]
            if keep and wanted > 1:
                self._threads_target = wanted - 1
                self.reason = f"{wanted} CPUs per trainer keep {tput:,.0f} samples/s; trying {wanted - 1}"
                return wanted - 1
            choice = wanted if keep else wanted + 1
        else:
            choice = wanted if tput >= (1 + self.cpu_gain) * before else wanted - 1
        self.threads_settled = self._threads_target = choice
        self.reason = (f"{wanted} CPUs per trainer: {tput:,.0f} samples/s against {before:,.0f} with "
                       f"{wanted - self._threads_dir}; settled on {choice} CPUs per trainer")
        return choice

    def _decide(self, now: float, committed: int, data: DataWorkerObservation) -> int:
        if self.settled is not None:
            return self.settled
        count = data.target
        if data.count != data.target:
            self._current = None  # still starting (or stopping) some: not this count's throughput yet
            self.reason = f"waiting for {data.target} data workers to serve ({data.count} do)"
            return data.target
        if self._current is None or self._current[0] != count:
            self._current = (count, _Measure(now))
        m = self._current[1]
        tput = m.sample(now, committed, self.warmup_s, self.measure_s, data.wait_share)
        if tput is None:
            self.reason = f"measuring {count} data workers"
            return count
        self.measured[count] = tput
        self._waits[count] = sum(m.waits) / len(m.waits)
        return self._next(count, data)

    def _next(self, count: int, data: DataWorkerObservation) -> int:
        tput = self.measured[count]
        if count == 0 and data.high > 0:
            self.reason = f"baseline without data workers: {tput:,.0f} samples/s; trying 1"
            return 1
        first = min(self.measured)
        gain_first = self.measured.get(first + 1, tput) - self.measured[first] if first + 1 <= count else 0.0
        ideal = self._waits.get(count, 1.0) <= self.ideal_wait
        previous = self.measured.get(count - 1)
        sublinear = previous is not None and count - 1 > first and tput - previous < self.linear_tol * gain_first
        if first == 0 and count == 1 and gain_first <= 0:
            return self._settle(count, f"1 data worker gave {tput:,.0f} samples/s against {self.measured[0]:,.0f} "
                                       "without")
        if ideal:
            return self._settle(count, f"the queue is ideal at {count} data workers (trainers wait "
                                       f"{self._waits.get(count, 0.0):.0%} of their time)")
        if sublinear:
            return self._settle(count - 1, f"data worker {count} added {tput - (previous or 0):,.0f} samples/s, "
                                           f"under {self.linear_tol:g}x the first one's {gain_first:,.0f}")
        if count >= data.high:
            return self._settle(count, f"MAX {data.high} data workers reached")
        self.reason = f"{count} data workers: {tput:,.0f} samples/s, trainers waiting {self._waits.get(count, 0):.0%}; " \
                      f"trying {count + 1}"
        return count + 1

    def _settle(self, count: int, why: str) -> int:
        baseline = self.measured.get(0)
        tput = self.measured[count]
        if baseline is not None and not use_data_workers(baseline, tput, self.tolerance):
            self.settled = 0
            self.reason = (f"{why}; falling back to no data workers: {tput:,.0f} samples/s with {count} is under "
                           f"{self.tolerance:g}x the baseline {baseline:,.0f}")
            return 0
        self.settled = count
        self.reason = f"{why}; settled on {count} data workers ({tput:,.0f} samples/s" + \
            (f", baseline {baseline:,.0f})" if baseline is not None else ")")
        return count
