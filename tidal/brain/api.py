"""Interfaces of the brain.

A planner decides one job's resources from a ``JobObservation`` (``tidal.api``): the job master
builds the observation from what it measured and acts on the returned ``ResourcePlan``; the
simulators build it from their models and call the very same planner. A planner is an object
with state (its samples, its stage) but never reads a clock or does I/O.

A ``ClusterAllocator`` shares a cluster among jobs (YARN's capacity scheduler, EasyScale's
inter-job scheduler, GoldMiner's data-worker allocator, DLRover-RM's weighted greedy): given
the jobs' demands and the machines, it returns grants. What a demand, a machine and a grant
hold depends on the resource the policy shares (GPU gangs, data-worker CPUs, PS pods), so the
protocol is generic in those three types; every allocator is called the same way.

Besides these two protocols this module holds the other brain interfaces and their data:

* ``ThroughputModel``: resource -> samples/s models fitted by non-negative least squares
  (implementations in ``tidal.brain.models``, registered by name);
* ``Forecaster``: traffic forecasting (``tidal.brain.forecast``);
* the brain's errors: ``FitError`` (bad or too little data: permanent) and ``NotFittedError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from tidal.api import ConfigError, JobObservation, ResourcePlan, TidalError

__all__ = [
    "ClusterAllocator",
    "FitError",
    "FitReport",
    "Forecaster",
    "NotFittedError",
    "Planner",
    "ThroughputConfig",
    "ThroughputModel",
    "ThroughputSample",
]


class Planner(Protocol):
    """Decides one job's resources from what was observed of it."""

    name: str

    def plan(self, obs: JobObservation) -> ResourcePlan:
        """Return the desired resources, with a reason. Must not block, do I/O or read a clock.

        Called once per decision interval; it may keep state between calls (samples, stage).
        """
        ...


JobT = TypeVar("JobT", contravariant=True)
MachineT = TypeVar("MachineT", contravariant=True)
GrantT = TypeVar("GrantT")


class ClusterAllocator(Protocol[JobT, MachineT, GrantT]):
    """Shares a cluster among jobs: one call per scheduling round."""

    name: str

    def allocate(self, jobs: Sequence[JobT], machines: Sequence[MachineT]) -> list[GrantT]:
        """Grants for the jobs that get resources this round, in the order they were chosen.

        Pure: the same jobs and machines give the same grants; a job without a grant waits.
        """
        ...


class FitError(ConfigError):
    """The data cannot be fitted: a column the model needs is missing, too few rows, non-finite values."""


class NotFittedError(TidalError):
    """``predict`` was called on a model (or forecaster) that has neither been fitted nor given parameters."""


# --------------------------------------------------------------------------------------------
# Throughput models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputConfig:
    """One resource configuration of a job.

    Attributes:
        workers: number of training workers ``w`` (GPUs in Kale, worker pods in DLRover-RM).
        ps: number of parameter servers ``p``; 0 for all-reduce jobs (models that need ``p``
            then treat the worker/PS ratio as fixed, Kale Eq. 6/9).
        worker_cpu: CPU cores per worker (DLRover-RM's lambda_w).
        ps_cpu: CPU cores per parameter server (DLRover-RM's lambda_p).
        batch_size: the *global* batch size M of one synchronous step (samples over all
            workers, Kale's M); models that need the per-worker batch use ``m = M / w``.
            ``None`` when unknown: the models then absorb M into their coefficients.
    """

    workers: float
    ps: float = 0.0
    worker_cpu: float = 1.0
    ps_cpu: float = 1.0
    batch_size: float | None = None


@dataclass(frozen=True)
class ThroughputSample:
    """A measured throughput (samples/s) at one configuration."""

    config: ThroughputConfig
    throughput: float


@dataclass(frozen=True)
class FitReport:
    """Errors of a fitted model, measured on points it was *not* fitted on where there are any.

    ``mape`` is in percent, ``rmse`` in samples/s, ``rmsle`` the root mean squared log error.
    ``n_test == 0`` means the errors are in-sample (the report says so in ``held_out``).
    """

    model: str
    params: dict[str, float]
    mape: float
    rmse: float
    rmsle: float
    n_train: int
    n_test: int
    held_out: bool


class ThroughputModel(Protocol):
    """Resource -> throughput model (samples/s), linear in its coefficients after a transform.

    Implementations document each coefficient against its paper's equation.
    """

    name: str
    #: CSV columns the model needs beyond ``workers`` and ``throughput``.
    required_columns: tuple[str, ...]
    #: the fitted (or given) coefficients, by name; empty before ``fit``.
    params: dict[str, float]

    def fit(self, samples: Sequence[ThroughputSample]) -> ThroughputModel:
        """Fit the coefficients (non-negative) and return ``self``.

        Raises:
            FitError: fewer samples than coefficients, or non-finite / non-positive values.
        """
        ...

    def predict(self, config: ThroughputConfig) -> float:
        """Predicted throughput in samples/s (``inf`` never; 0 where the model says so).

        Raises:
            NotFittedError: neither fitted nor given parameters.
        """
        ...


# --------------------------------------------------------------------------------------------
# Forecasting
# --------------------------------------------------------------------------------------------


class Forecaster(Protocol):
    """A traffic forecaster over a regularly sampled series (one value per interval).

    ``fit`` learns from a history; ``update`` appends newly observed values *without* a full
    refit (cheap: the live master and the simulator call it every interval); ``predict``
    forecasts the next ``horizon`` values after the last value seen.
    """

    name: str

    def fit(self, series: Sequence[float] | np.ndarray) -> None:
        """Learn from ``series``. Raises FitError when it is too short for the model."""
        ...

    def update(self, values: Sequence[float] | np.ndarray) -> None:
        """Append observations after the fitted ones; the model's parameters stay fixed."""
        ...

    def predict(self, horizon: int) -> np.ndarray:
        """Forecast the next ``horizon`` values (non-negative). Raises NotFittedError."""
        ...
