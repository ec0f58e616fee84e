"""tidal.brain.nsga2: NSGA-II on integer problems whose Pareto front is known by enumeration."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from tidal.brain.nsga2 import non_dominated_fronts, nsga2


def trade_off(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """min (a + b, (12 - a)^2 + 3 b) over integers a in [0, 12], b in [0, 9], with a + b <= 14: the
    front is b = 0, every a (13 points); b > 0 only costs."""
    a, b = x[:, 0].astype(float), x[:, 1].astype(float)
    return np.column_stack([a + b, (12 - a) ** 2 + 3 * b]), a + b - 14


def exact_front() -> set[tuple[int, int]]:
    points = np.array(list(itertools.product(range(13), range(10))))
    f, g = trade_off(points)
    ok = points[g <= 0]
    return {tuple(int(v) for v in ok[i]) for i in non_dominated_fronts(f[g <= 0])[0]}


def test_fronts_are_ordered_by_domination() -> None:
    f = np.array([[1.0, 5.0], [2.0, 2.0], [3.0, 3.0], [5.0, 1.0], [4.0, 4.0], [1.0, 5.0]])
    fronts = [sorted(int(i) for i in front) for front in non_dominated_fronts(f)]
    assert fronts == [[0, 1, 3, 5], [2], [4]]  # equal rows do not dominate each other


def test_finds_the_exact_front_of_a_small_problem() -> None:
    exact = exact_front()
    assert exact == {(a, 0) for a in range(13)}
    found = {tuple(int(v) for v in row) for row in nsga2(trade_off, np.zeros(2), np.array([12, 9]),
                                                         pop_size=16, generations=20, seed=3)}
    assert found <= exact  # every answer is Pareto-optimal and feasible
    assert len(found) >= 11, sorted(found)


def test_a_seed_gives_one_answer() -> None:
    def run(seed: int) -> list[list[int]]:
        return sorted(nsga2(trade_off, np.zeros(2), np.array([12, 9]), pop_size=8, generations=3,
                            seed=seed).tolist())

    assert run(5) == run(5)
    assert any(run(5) != run(s) for s in range(6, 12))  # the seed is used


def test_constraints_are_kept_and_nothing_feasible_is_empty() -> None:
    def never(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        f, _ = trade_off(x)
        return f, np.full(len(x), 1.0)

    assert nsga2(never, np.zeros(2), np.array([12, 9]), pop_size=8, generations=3).shape == (0, 2)
    rows = nsga2(trade_off, np.zeros(2), np.array([12, 9]), pop_size=8, generations=5)
    assert len(rows) and (rows.sum(axis=1) <= 14).all()


def test_a_space_smaller_than_the_population() -> None:
    rows = nsga2(trade_off, np.zeros(2), np.array([1, 1]), pop_size=32, generations=4)
    assert sorted(rows.tolist()) == [[0, 0], [1, 0]]


def hypervolume(f: np.ndarray, ref: tuple[float, float]) -> float:
    """Area dominated by the 2-objective points ``f`` (minimisation) up to ``ref``."""
    area, best = 0.0, ref[1]
    for x, y in f[np.lexsort((f[:, 1], f[:, 0]))].tolist():
        if x <= ref[0] and y < best:
            area += (ref[0] - x) * (best - y)
            best = y
    return area


def test_as_good_as_pymoos_nsga2_on_dlrover_rm_searches() -> None:
    """DLRover-RM's Eq. 9 searches (tidal.brain.dlrover_rm.nsga_candidates): on ten random
    throughput models and quotas, the fronts this NSGA-II finds cover as much of the exact front's
    hypervolume (every integer point enumerated) as pymoo's NSGA-II with the same settings."""
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.core.problem import Problem
    from pymoo.operators.crossover.sbx import SBX
    from pymoo.operators.mutation.pm import PM
    from pymoo.operators.repair.rounding import RoundingRepair
    from pymoo.operators.sampling.rnd import IntegerRandomSampling
    from pymoo.optimize import minimize

    from tidal.brain.dlrover import C_MAX
    from tidal.brain.dlrover_rm import PAPER_PARAMS, predict_many

    grid = np.array(list(itertools.product(range(1, 33), range(1, 9), range(1, C_MAX + 1), range(1, 9))))
    xu = np.array([32, 8, C_MAX, 8])

    class Eq9(Problem):  # type: ignore[misc]
        def __init__(self, problem: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> None:
            super().__init__(n_var=4, n_obj=2, n_ieq_constr=1, xl=np.ones(4), xu=xu, vtype=int)
            self.problem = problem

        def _evaluate(self, x: np.ndarray, out: dict[str, np.ndarray], *args: object, **kwargs: object) -> None:
            out["F"], g = self.problem(x.astype(int))
            out["G"] = g[:, None]

    rng = np.random.default_rng(0)
    ours, theirs = [], []
    for _ in range(10):
        params = {k: v * float(rng.uniform(0.2, 5.0)) for k, v in PAPER_PARAMS.items()}
        quota, mem_w, mem_p = int(rng.choice([16, 32, 64, 128])), float(rng.choice([4, 16])), float(rng.choice([8, 64]))

        def problem(x: np.ndarray, params: dict[str, float] = params, quota: int = quota, mem_w: float = mem_w,
                    mem_p: float = mem_p) -> tuple[np.ndarray, np.ndarray]:
            w, p, wc, pc = (x[:, i].astype(float) for i in range(4))
            cost = w * wc + p * pc + (w * mem_w + p * mem_p) * 0.25
            return np.column_stack([cost, -predict_many(params, w, p, wc, pc)]), w * wc + p * pc - quota

        f_all, g_all = problem(grid)
        exact = f_all[g_all <= 0]
        ref = (float(exact[:, 0].max()) * 1.01, 0.0)
        best = hypervolume(exact, ref)  # (the points a front dominates add no area)
        ours.append(hypervolume(problem(nsga2(problem, np.ones(4), xu, 32, 15, seed=0))[0], ref) / best)

        algorithm = NSGA2(pop_size=32, sampling=IntegerRandomSampling(), eliminate_duplicates=True,
                          crossover=SBX(prob=0.9, eta=3.0, vtype=float, repair=RoundingRepair()),
                          mutation=PM(prob=0.9, eta=3.0, vtype=float, repair=RoundingRepair()))
        res = minimize(Eq9(problem), algorithm, ("n_gen", 15), seed=0, verbose=False)
        theirs.append(hypervolume(np.atleast_2d(res.F), ref) / best)
    print(f"hypervolume / exact: ours {np.round(ours, 3)}, pymoo's {np.round(theirs, 3)}")
    assert min(ours) > 0.6 and np.mean(ours) >= np.mean(theirs) - 0.01, (ours, theirs)
