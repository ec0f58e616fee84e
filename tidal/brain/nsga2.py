"""NSGA-II (Deb, Pratap, Agarwal, Meyarivan 2002) for small bounded integer problems.

DLRover-RM (section 4.3, Eq. 9) finds each job's Pareto set of configurations with NSGA-II. The
problems are tiny (4 integer variables, 2 objectives, 1 constraint, populations of a few dozen)
and solved hundreds of times per simulated cluster, so a general framework's bookkeeping per
generation costs more than the search. This is the algorithm with the usual operators, in numpy:

* start: ``pop_size`` distinct random integer vectors in ``[xl, xu]``;
* mating: binary tournaments (feasible before infeasible, then the lower violation; among
  feasible, the lower non-domination rank, then the larger crowding distance), simulated binary
  crossover (SBX, ``eta_c``, per pair with ``p_crossover``, per variable with 1/2), polynomial
  mutation (``eta_m``, per child with ``p_mutation``, per variable with ``1/n_var``), both in
  Deb's bounded forms, then rounding; children equal to a parent or to each other are dropped
  and mating repeats (up to ``MATING_ROUNDS`` times) until ``pop_size`` new ones are found;
* survival: parents and children together, sorted by constrained domination (every feasible
  vector before every infeasible one, infeasible ones by violation), non-dominated fronts,
  the last admitted front cut by crowding distance.

``nsga2`` returns the feasible non-dominated vectors of the last population. Everything is drawn
from one ``numpy.random.Generator`` seeded by ``seed``: equal inputs give equal answers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["non_dominated_fronts", "nsga2"]

#: ``evaluate(X) -> (F, G)``: objectives to minimise, shape (n, m); constraint values, shape (n,),
#: feasible where ``<= 0``
Evaluate = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
MATING_ROUNDS = 10


def non_dominated_fronts(f: np.ndarray) -> list[np.ndarray]:
    """Indices of ``f``'s rows by non-dominated front (minimisation), best front first."""
    n = len(f)
    if n == 0:
        return []
    le = np.all(f[:, None, :] <= f[None, :, :], axis=2)
    lt = np.any(f[:, None, :] < f[None, :, :], axis=2)
    dominates: np.ndarray = le & lt  # [i, j]: i dominates j
    dominated_by = dominates.sum(axis=0)
    fronts = []
    left = np.ones(n, dtype=bool)
    while left.any():
        front = np.flatnonzero(left & (dominated_by == 0))
        fronts.append(front)
        left[front] = False
        dominated_by = dominated_by - dominates[front].sum(axis=0)
    return fronts


def _crowding(f: np.ndarray) -> np.ndarray:
    """Crowding distance of each row of one front (infinite at each objective's extremes)."""
    n, m = f.shape
    if n <= 2:
        return np.full(n, np.inf)
    out = np.zeros(n)
    for k in range(m):
        order = np.argsort(f[:, k], kind="stable")
        span = f[order[-1], k] - f[order[0], k]
        out[order[0]] = out[order[-1]] = np.inf
        if span > 0:
            out[order[1:-1]] += (f[order[2:], k] - f[order[:-2], k]) / span
    return out


def _rank(f: np.ndarray, cv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Survival order (best first), rank and crowding distance under constrained domination."""
    n = len(f)
    rank = np.zeros(n, dtype=int)
    crowd = np.zeros(n)
    feasible = np.flatnonzero(cv <= 0)
    order: list[int] = []
    fronts = non_dominated_fronts(f[feasible])
    for r, front in enumerate(fronts):
        idx = feasible[front]
        d = _crowding(f[idx])
        rank[idx], crowd[idx] = r, d
        order.extend(idx[np.argsort(-d, kind="stable")])
    infeasible = np.flatnonzero(cv > 0)
    infeasible = infeasible[np.argsort(cv[infeasible], kind="stable")]
    rank[infeasible] = len(fronts) + np.arange(len(infeasible))
    order.extend(infeasible)
    return np.array(order, dtype=int), rank, crowd


def _tournament(rng: np.random.Generator, n: int, count: int, rank: np.ndarray, crowd: np.ndarray) -> np.ndarray:
    a, b = rng.integers(0, n, count), rng.integers(0, n, count)
    tie = rng.random(count) < 0.5
    a_wins = (rank[a] < rank[b]) | ((rank[a] == rank[b]) & ((crowd[a] > crowd[b]) | ((crowd[a] == crowd[b]) & tie)))
    return np.where(a_wins, a, b)


def _sbx(rng: np.random.Generator, p1: np.ndarray, p2: np.ndarray, xl: np.ndarray, xu: np.ndarray, eta: float,
         prob: float) -> tuple[np.ndarray, np.ndarray]:
    c1, c2 = p1.copy(), p2.copy()
    pairs, n_var = p1.shape
    do = (rng.random((pairs, 1)) < prob) & (rng.random((pairs, n_var)) < 0.5) & (np.abs(p1 - p2) > 1e-14)
    y1, y2 = np.minimum(p1, p2), np.maximum(p1, p2)
    span = np.where(do, y2 - y1, 1.0)
    u = rng.random((pairs, n_var))

    def betaq(beta: np.ndarray) -> np.ndarray:
        alpha = 2.0 - np.power(beta, -(eta + 1.0))
        low = np.power(u * alpha, 1.0 / (eta + 1.0))
        high = np.power(1.0 / np.maximum(2.0 - u * alpha, 1e-14), 1.0 / (eta + 1.0))
        return np.where(u <= 1.0 / alpha, low, high)

    lo = 0.5 * (y1 + y2 - betaq(1.0 + 2.0 * (y1 - xl) / span) * span)
    hi = 0.5 * (y1 + y2 + betaq(1.0 + 2.0 * (xu - y2) / span) * span)
    lo, hi = np.clip(lo, xl, xu), np.clip(hi, xl, xu)
    swap = rng.random((pairs, n_var)) < 0.5
    c1 = np.where(do, np.where(swap, hi, lo), c1)
    c2 = np.where(do, np.where(swap, lo, hi), c2)
    return c1, c2


def _mutate(rng: np.random.Generator, x: np.ndarray, xl: np.ndarray, xu: np.ndarray, eta: float,
            prob: float) -> np.ndarray:
    n, n_var = x.shape
    do = (rng.random((n, 1)) < prob) & (rng.random((n, n_var)) < 1.0 / n_var)
    span = xu - xl
    d1, d2 = (x - xl) / span, (xu - x) / span
    u = rng.random((n, n_var))
    power = 1.0 / (eta + 1.0)
    down = np.power(2.0 * u + (1.0 - 2.0 * u) * np.power(1.0 - d1, eta + 1.0), power) - 1.0
    up = 1.0 - np.power(2.0 * (1.0 - u) + 2.0 * (u - 0.5) * np.power(1.0 - d2, eta + 1.0), power)
    return np.where(do, np.clip(x + np.where(u < 0.5, down, up) * span, xl, xu), x)


def _unique_new(children: np.ndarray, known: np.ndarray) -> np.ndarray:
    """``children`` without duplicates among themselves or of a row of ``known``."""
    _, first = np.unique(children, axis=0, return_index=True)
    children = children[np.sort(first)]
    if len(known) == 0 or len(children) == 0:
        return children
    seen = (children[:, None, :] == known[None, :, :]).all(axis=2).any(axis=1)
    return children[~seen]


def nsga2(evaluate: Evaluate, xl: np.ndarray, xu: np.ndarray, pop_size: int = 32, generations: int = 15,
          seed: int = 0, eta_c: float = 3.0, eta_m: float = 3.0, p_crossover: float = 0.9,
          p_mutation: float = 0.9, initial: np.ndarray | None = None) -> np.ndarray:
    """The feasible non-dominated integer vectors NSGA-II finds (rows; none: shape (0, n_var)).

    ``generations`` counts the first population as the first generation. A search space with
    fewer than ``pop_size`` points is searched with what it has. ``initial``: rows the first
    population starts with (within the bounds; at most ``pop_size``), the rest drawn at random.
    """
    xl, xu = np.asarray(xl, dtype=float), np.asarray(xu, dtype=float)
    n_var = len(xl)
    rng = np.random.default_rng(seed)
    x = np.empty((0, n_var))
    if initial is not None and len(initial):
        x = _unique_new(np.clip(np.round(np.asarray(initial, dtype=float).reshape(-1, n_var)), xl, xu), x)[:pop_size]
    for _ in range(10):  # distinct starting points
        more = rng.integers(xl.astype(int), xu.astype(int) + 1, size=(pop_size, n_var)).astype(float)
        x = np.concatenate([x, _unique_new(more, x)])[:pop_size]
        if len(x) == pop_size:
            break
    f, g = evaluate(x.astype(int))
    cv = np.maximum(np.asarray(g, dtype=float), 0.0)
    f = np.asarray(f, dtype=float)
    _, rank, crowd = _rank(f, cv)
    for _ in range(generations - 1):
        children = np.empty((0, n_var))
        for _ in range(MATING_ROUNDS):  # rounding makes duplicates: mate again for the missing ones
            pairs = (pop_size + 1) // 2
            mates = _tournament(rng, len(x), 2 * pairs, rank, crowd)
            c1, c2 = _sbx(rng, x[mates[:pairs]], x[mates[pairs:]], xl, xu, eta_c, p_crossover)
            more = np.round(_mutate(rng, np.concatenate([c1, c2]), xl, xu, eta_m, p_mutation))
            children = np.concatenate([children, _unique_new(more, np.concatenate([x, children]))])[:pop_size]
            if len(children) == pop_size:
                break
        if len(children) == 0:
            continue
        fc, gc = evaluate(children.astype(int))
        x = np.concatenate([x, children])
        f = np.concatenate([f, np.asarray(fc, dtype=float)])
        cv = np.concatenate([cv, np.maximum(np.asarray(gc, dtype=float), 0.0)])
        order, _, _ = _rank(f, cv)
        keep = order[:pop_size]
        x, f, cv = x[keep], f[keep], cv[keep]
        _, rank, crowd = _rank(f, cv)
    feasible = np.flatnonzero(cv <= 0)
    if len(feasible) == 0:
        return np.empty((0, n_var), dtype=int)
    best = feasible[non_dominated_fronts(f[feasible])[0]]
    return x[best].astype(int)
