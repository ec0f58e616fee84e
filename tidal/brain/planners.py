"""Registry of per-job planners by name: what ``tidal run --planner NAME`` and the simulators build.

``get(name, context)`` returns a fresh ``tidal.brain.api.Planner``. The context carries what a
planner may need beyond its observations, read once when the job starts: the job's signature
and the history of finished jobs (the warm start), the cores its workers may use.

Names and what they size:

* ``max``: MAX workers, whatever is measured.
* ``fixed``, ``es``, ``optimus``, ``dlrover``, ``dlrover-rm``: a data-parallel job's workers
  (``tidal.brain.dataparallel``). The parameter-server forms of the last four
  (``tidal.brain.es``, ``optimus_alloc``, ``dlrover``, ``dlrover_rm``) size workers, servers
  and cores together; ``tidal sim cluster`` builds them with a job's CPU quota.
* ``kale``, ``hpa``, ``autopilot``, ``madu``, ``adequate``: an online-training job's workers
  from its stream (``tidal.brain.kale``, ``tidal.brain.baselines``).

``DEFAULT`` is ``dlrover-rm``: it measures the job at the counts it tries, refits the throughput
model as it goes, starts from similar finished jobs when the history has some, and settles on
the fewest workers within 10% of the best throughput (see ``tidal.brain.dataparallel``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tidal.api import ConfigError, JobObservation, ResourcePlan
from tidal.brain.api import Planner
from tidal.brain.history import Feature, HistoryStore

__all__ = ["DEFAULT", "MaxWorkersPlanner", "PlannerContext", "get", "names", "register"]

DEFAULT = "dlrover-rm"


@dataclass(frozen=True)
class PlannerContext:
    """What a planner is built with (all optional: a planner that needs none ignores it).

    Attributes:
        job_id: the job.
        features: its signature, compared with finished jobs' for the warm start.
        history: finished jobs (``tidal.brain.history``); None: no warm start.
        cpus: cores the job's workers may use (0: not known).
        lag_slo_s: an online-training job's lag SLO in trace time (Kale's 20 minutes); kale
            plans for a quarter of it, falls back to reacting at three quarters, and where an
            action ends within a planner interval trains every sample within three quarters.
        action_lead_s, action_pause_s: what a scaling action is expected to cost, on the
            planner's clock (trace time): the time until the new count trains, and the pause
            of training within it; priors a planner may refine on the job's own actions
            (kale does). None: the planner's own default (kale's: a 10-minute restart).
        load_headroom, lag_price: kale's knobs for a lag far below the SLO (``KalePlanner``'s
            ``headroom`` and ``lag_price``; 1 and 0: off, the paper's Eq. 10).
        planned_lag_s: the lag kale acts before (trace time; None: a quarter of ``lag_slo_s``).
        program_horizon_s, program_lag_price, program_lag_ratio: kale planning over that long
            (trace time) with each lag-minute priced (``KalePlanner``'s; None: off, Eq. 10; the
            price None: kale's own; the ratio None: the price fixed).
    """

    job_id: str = ""
    features: Mapping[str, Feature] = field(default_factory=dict)
    history: HistoryStore | None = None
    cpus: float = 0.0
    lag_slo_s: float = 1200.0
    action_lead_s: float | None = None
    action_pause_s: float | None = None
    load_headroom: float = 1.0
    lag_price: float = 0.0
    planned_lag_s: float | None = None
    program_horizon_s: float | None = None
    program_lag_price: float | None = None
    program_lag_ratio: float | None = None


class MaxWorkersPlanner:
    """As many workers as the job's MAX allows."""

    name = "max"

    def plan(self, obs: JobObservation) -> ResourcePlan:
        return ResourcePlan(workers=obs.max_workers, reason="max workers allowed")


def _builtin() -> dict[str, Callable[[PlannerContext], Planner]]:
    # Imported here so that importing the registry stays cheap (statsmodels, scipy load lazily).
    from tidal.brain.baselines import AdequatePlanner, AutopilotPlanner, HPAPlanner, MaduPlanner
    from tidal.brain.dataparallel import (
        DLRoverRMWorkers,
        DLRoverWorkers,
        ESWorkers,
        FixedWorkers,
        OptimusWorkers,
    )
    from tidal.brain.kale import PROGRAM_LAG_PRICE, KalePlanner, ThresholdFallback

    return {
        "max": lambda _: MaxWorkersPlanner(),
        "fixed": lambda _: FixedWorkers(),
        "es": lambda _: ESWorkers(),
        "optimus": lambda _: OptimusWorkers(),
        "dlrover": lambda ctx: DLRoverWorkers(cpus=ctx.cpus),
        "dlrover-rm": lambda ctx: DLRoverRMWorkers(features=ctx.features, history=ctx.history),
        # at the default SLO (20 min) these are KalePlanner's own defaults: 5, 15, 5 and 15 minutes
        "kale": lambda ctx: KalePlanner(planned_lag_s=ctx.lag_slo_s / 4 if ctx.planned_lag_s is None
                                        else ctx.planned_lag_s,
                                        fallback=ThresholdFallback(lag_bound_s=ctx.lag_slo_s * 3 / 4,
                                                                   utilization_lag_s=ctx.lag_slo_s / 4),
                                        lead_s=ctx.action_lead_s, pause_s=ctx.action_pause_s,
                                        headroom=ctx.load_headroom, lag_price=ctx.lag_price,
                                        deadline_s=ctx.lag_slo_s * 3 / 4, program_horizon_s=ctx.program_horizon_s,
                                        program_lag_price=PROGRAM_LAG_PRICE if ctx.program_lag_price is None
                                        else ctx.program_lag_price, program_lag_ratio=ctx.program_lag_ratio),
        "hpa": lambda _: HPAPlanner(),
        "autopilot": lambda _: AutopilotPlanner(),
        "madu": lambda _: MaduPlanner(),
        "adequate": lambda _: AdequatePlanner(),
    }


_REGISTRY: dict[str, Callable[[PlannerContext], Planner]] | None = None


def _registry() -> dict[str, Callable[[PlannerContext], Planner]]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _builtin()
    return _REGISTRY


def register(name: str, factory: Callable[[PlannerContext], Planner]) -> None:
    _registry()[name] = factory


def names() -> list[str]:
    return sorted(_registry())


def get(name: str, context: PlannerContext | None = None) -> Planner:
    """A fresh planner. Raises ConfigError (one line, the known names) for an unknown name."""
    try:
        factory = _registry()[name]
    except KeyError:
        raise ConfigError(f"unknown planner {name!r}; known: {', '.join(names())}") from None
    return factory(context or PlannerContext())
