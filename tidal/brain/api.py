"""Interfaces of the brain.

A planner is a pure function of a snapshot: the job master calls it with what it observed and
acts on the returned plan; the simulator calls the very same planner with simulated
observations. Planners never read a clock or do I/O.

Besides the ``Planner`` protocol this module holds the other brain interfaces and their data:

* ``ThroughputModel``: resource -> samples/s models fitted by non-negative least squares
  (implementations in ``tidal.brain.models``, registered by name);
* ``Forecaster``: traffic forecasting (``tidal.brain.forecast``);
* ``StreamSnapshot``: what an online-training planner sees (arrivals, lag, measured
  throughput), a ``JobSnapshot`` with the streaming observations added;
* the brain's errors: ``FitError`` (bad or too little data: permanent) and ``NotFittedError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from pydantic import Field

from tidal.api import ConfigError, JobSnapshot, ResourcePlan, TidalError

__all__ = [
    "FitError",
    "FitReport",
    "Forecaster",
    "NotFittedError",
    "Planner",
    "StreamSnapshot",
    "ThroughputConfig",
    "ThroughputModel",
    "ThroughputSample",
]


class Planner(Protocol):
    """Decides a job's resources from a snapshot of it."""

    name: str

    def plan(self, snapshot: JobSnapshot) -> ResourcePlan:
        """Return the desired resources. Must not block, do I/O or read a clock."""
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


# --------------------------------------------------------------------------------------------
# Online-training planners
# --------------------------------------------------------------------------------------------


class StreamSnapshot(JobSnapshot):
    """What an online-training planner sees at one decision point.

    The master (and the simulator) build one per decision interval. Observations are the ones
    *since the previous call*, so a planner keeps its own history (it is an object with state
    but no clock: time comes in ``now_s``). All rates are in samples/s.

    Attributes:
        now_s: seconds since the job started (the caller's clock, never read by the brain).
        interval_s: length of one arrivals interval.
        arrivals: samples that arrived in each interval since the previous call, oldest first.
        measured: ``(workers, samples/s)`` pairs measured since the previous call while
            training ran, as ``compute_s_per_sample`` gives them: the rate the workers reach
            when busy, not the (possibly lower) rate of arrivals.
        backlog: samples waiting in the stream, not yet trained on.
        lag_s: age of the oldest waiting sample (Kale section 2.2), 0 when none waits.
        utilization: share of the time the workers were busy over the last interval (0..1).
        scaling: True while a previous scaling action is still being carried out.
    """

    now_s: float = 0.0
    interval_s: float = Field(default=60.0, gt=0)
    arrivals: list[float] = Field(default_factory=list)
    measured: list[tuple[float, float]] = Field(default_factory=list)
    backlog: float = 0.0
    lag_s: float = 0.0
    utilization: float = 0.0
    scaling: bool = False
