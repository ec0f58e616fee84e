"""Registry of per-job planners by name (``planners.get("max")``)."""

from __future__ import annotations

from collections.abc import Callable

from tidal.api import ConfigError, JobSnapshot, ResourcePlan
from tidal.brain.api import Planner


class MaxWorkersPlanner:
    """As many workers as the job's MAX allows: the default until a throughput model is fitted."""

    name = "max"

    def plan(self, snapshot: JobSnapshot) -> ResourcePlan:
        return ResourcePlan(workers=snapshot.max_workers, reason="max workers allowed")


def _builtin() -> dict[str, Callable[[], Planner]]:
    # Imported here so that importing the registry stays cheap (statsmodels, torch load lazily).
    from tidal.brain.baselines import AdequatePlanner, AutopilotPlanner, HPAPlanner, MaduPlanner
    from tidal.brain.kale import KalePlanner

    return {
        "max": MaxWorkersPlanner,
        "kale": KalePlanner,
        "hpa": HPAPlanner,
        "autopilot": AutopilotPlanner,
        "madu": MaduPlanner,
        "adequate": AdequatePlanner,
    }


_REGISTRY: dict[str, Callable[[], Planner]] = _builtin()


def register(name: str, factory: Callable[[], Planner]) -> None:
    _REGISTRY[name] = factory


def get(name: str) -> Planner:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ConfigError(f"unknown planner {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
