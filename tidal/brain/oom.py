"""OOM prediction for parameter servers (DLRover-RM section 5.3).

Embedding memory is ``M_emb = T D phi_cats`` (bytes per value T, dimension D, categories
phi_cats), and new categories arrive in proportion to the samples consumed: ``Delta phi_cats ~
Psi_thp Delta t``. So a PS's memory is linear in the job's consumed samples (here: steps done):

    mem(steps) = m0 + g * steps,

``m0`` the dense parameters and the embeddings at the start, ``g`` bytes per step. We fit
``m0, g`` by least squares on the (steps, memory) samples the master reports, predict the
memory at ``total_steps`` (the job's end) and, when that exceeds what the PS has (less a
headroom), plan more memory *before* the OOM happens: the predicted end-of-job need times
``1 + margin``. Pure: the caller keeps the samples' source.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["OOMForecast", "ServerMemoryPlan", "fit_memory_growth", "predict_oom", "servers_for_memory"]


@dataclass(frozen=True)
class OOMForecast:
    """Outcome of ``predict_oom``.

    Attributes:
        will_oom: the predicted memory at the job's end exceeds ``capacity * headroom``.
        predicted_gb: predicted memory of the PS at ``total_steps``.
        oom_at_step: the step at which the PS reaches its capacity (inf when never).
        recommended_gb: memory to give the PS (``predicted_gb * (1 + margin)``; the current
            capacity when no OOM is predicted).
    """

    will_oom: bool
    predicted_gb: float
    oom_at_step: float
    recommended_gb: float


def fit_memory_growth(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(m0, g)`` of ``mem = m0 + g * steps`` with ``g >= 0``.

    One sample gives ``g = 0``; raises ValueError with none.
    """
    if not samples:
        raise ValueError("no memory samples")
    x = np.array([s for s, _ in samples], dtype=float)
    y = np.array([m for _, m in samples], dtype=float)
    if len(samples) == 1 or float(np.ptp(x)) == 0.0:
        return float(y.mean()), 0.0
    g, m0 = np.polyfit(x, y, 1)
    if g < 0:
        return float(y.mean()), 0.0
    return float(m0), float(g)


def predict_oom(samples: Sequence[tuple[float, float]], total_steps: float, capacity_gb: float,
                headroom: float = 0.95, margin: float = 0.2) -> OOMForecast:
    """Will a PS with ``capacity_gb`` run out before ``total_steps``?

    Args:
        samples: ``(steps done, memory used in GB)`` of the PS (the largest one), oldest first.
        total_steps: steps of the whole job.
        capacity_gb: memory the PS has now.
        headroom: fraction of the capacity that may be used safely.
        margin: extra memory planned above the predicted end-of-job need.
    """
    m0, g = fit_memory_growth(samples)
    predicted = m0 + g * total_steps
    oom_at = (capacity_gb - m0) / g if g > 0 else float("inf")
    will = predicted > capacity_gb * headroom
    recommended = predicted * (1.0 + margin) if will else capacity_gb
    return OOMForecast(will, predicted, oom_at, recommended)


@dataclass(frozen=True)
class ServerMemoryPlan:
    """Outcome of ``servers_for_memory``.

    Attributes:
        servers: the parameter servers the job should have (never fewer than now).
        forecast: the prediction for the servers it has now.
        enough: ``servers`` hold the predicted need (False: even ``max_servers`` do not).
    """

    servers: int
    forecast: OOMForecast
    enough: bool


def servers_for_memory(samples: Sequence[tuple[float, float]], total: float, per_server: float, servers: int,
                       max_servers: int, headroom: float = 0.95, margin: float = 0.2) -> ServerMemoryPlan:
    """DLRover-RM 5.3 for sharded tables: how many servers of ``per_server`` memory keep the job
    from running out before it consumes ``total``.

    ``samples`` are ``(progress, memory held by all the servers)``, in any units (samples
    consumed, bytes), oldest first. Rows hash evenly over the servers (virtual shards), so the
    job's capacity is ``servers * per_server``; when ``predict_oom`` says that runs out, the
    plan is the servers that hold the predicted need times ``1 + margin`` within ``headroom``
    (Sec. 5.3: plan the memory before the OOM happens), at most ``max_servers``.
    """
    forecast = predict_oom(samples, total, per_server * servers, headroom, margin)
    if not forecast.will_oom:
        return ServerMemoryPlan(servers, forecast, True)
    need = math.ceil(forecast.recommended_gb / (per_server * headroom))
    return ServerMemoryPlan(min(max(need, servers), max_servers), forecast, need <= max_servers)
