"""Cluster-level simulators: many jobs, one cluster, one policy at a time (``tidal sim cluster``).

Each scenario module exposes ``POLICIES`` (names) and ``run(trace, jobs, seed, policies, load) ->
ScenarioResult``; ``SCENARIOS`` maps the CLI's scenario names to them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from tidal.api import ConfigError

SCENARIOS = {
    "easyscale": "tidal.sim.cluster.easyscale",
    "goldminer": "tidal.sim.cluster.goldminer",
    "dlrover-rm": "tidal.sim.cluster.dlrover_rm",
}


def scenario(name: str) -> ModuleType:
    try:
        return importlib.import_module(SCENARIOS[name])
    except KeyError:
        raise ConfigError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
