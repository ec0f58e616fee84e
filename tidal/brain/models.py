"""Throughput models: resources -> samples/s, fitted by non-negative least squares.

Registry by name (``models.get("kale-sync")``). Every model here has the form

    throughput(c) = scale(c) / (x(c) . theta),      theta >= 0,

where ``x(c)`` is a vector of features of the configuration ``c`` (1, 1/w, w/p, ...) and
``x(c) . theta`` is the time of one step (or its inverse rate) as the paper writes it. The
papers fit ``theta`` by non-negative least squares on that linearised form, ``y = scale / thp
= x . theta``; so do we (``scipy.optimize.nnls``). DLRover-RM instead minimises the root mean
squared *logarithmic* error (RMSLE) under the same non-negativity bounds: we start from the
relative-error NNLS solution and refine with a bounded least-squares solve in log space.

Units: throughput in samples/s; ``batch_size`` in a ``ThroughputConfig`` is the global batch
M of one step (see ``tidal.brain.api.ThroughputConfig``).

Models:

* ``kale-sync``: Kale Eq. 6 (fixed worker/PS ratio, 4 coefficients) or Eq. 5 (7 coefficients)
  when the samples vary the worker/PS ratio.
* ``kale-async``: Kale Eq. 9 (fixed ratio) or Eq. 8.
* ``dlrover-rm``: DLRover-RM Eq. 1-6 with CPU cores per worker and per PS.
* ``optimus``: Optimus (Peng et al., EuroSys'18) Eq. 2, the synchronous PS step time.
* ``ernest``: Ernest (Venkataraman et al., NSDI'16) Eq. 1 applied to one step.
* ``data-parallel``: Optimus Eq. 2 for an all-reduce job with a fixed per-worker batch, the
  per-worker term starting at a knee (what the live master fits as a job explores counts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import least_squares, nnls

from tidal.api import ConfigError
from tidal.brain.api import (
    FitError,
    FitReport,
    NotFittedError,
    ThroughputConfig,
    ThroughputModel,
    ThroughputSample,
)

__all__ = [
    "DLRoverRMModel",
    "DataParallelModel",
    "ErnestModel",
    "KaleAsyncModel",
    "KaleSyncModel",
    "LinearisedModel",
    "OptimusModel",
    "evaluate",
    "fit_and_report",
    "get",
    "names",
    "register",
    "split",
]


class LinearisedModel:
    """Base of the models: ``thp = scale(c) / (features(c) . theta)`` with ``theta >= 0``.

    Subclasses define ``terms`` (coefficient names, in feature order), ``features`` and
    ``scale``; ``objective`` is ``"nnls"`` (least squares on the linearised form, Kale and
    Optimus and Ernest) or ``"rmsle"`` (DLRover-RM).
    """

    name = "linearised"
    required_columns: tuple[str, ...] = ()
    objective = "nnls"

    def __init__(self, params: dict[str, float] | Sequence[float] | None = None) -> None:
        self.params: dict[str, float] = {}
        if params is not None:
            self.set_params(params)

    # -- definition, per subclass -----------------------------------------------------------

    def terms(self) -> tuple[str, ...]:
        raise NotImplementedError

    def features(self, c: ThroughputConfig) -> np.ndarray:
        raise NotImplementedError

    def scale(self, c: ThroughputConfig) -> float:
        raise NotImplementedError

    def choose_form(self, samples: Sequence[ThroughputSample]) -> None:
        """Pick the equation variant that the samples can identify (default: only one)."""

    # -- common machinery ------------------------------------------------------------------

    def set_params(self, params: dict[str, float] | Sequence[float]) -> None:
        """Set coefficients by name or in order; a list's length may also pick the form."""
        if isinstance(params, dict):
            self._form_for(len(params))
            unknown = set(params) - set(self.terms())
            if unknown:
                raise ConfigError(
                    f"{self.name}: unknown parameter(s) {sorted(unknown)}; expected {list(self.terms())}"
                )
            values = [float(params.get(t, 0.0)) for t in self.terms()]
        else:
            self._form_for(len(params))
            if len(params) != len(self.terms()):
                raise ConfigError(f"{self.name}: expected {len(self.terms())} parameters, got {len(params)}")
            values = [float(v) for v in params]
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise ConfigError(f"{self.name}: parameters must be finite and non-negative")
        self.params = dict(zip(self.terms(), values, strict=True))

    def _form_for(self, n_params: int) -> None:
        """Models with two forms switch on the number of parameters given."""

    def theta(self) -> np.ndarray:
        if not self.params:
            raise NotFittedError(f"{self.name}: not fitted")
        return np.array([self.params[t] for t in self.terms()], dtype=float)

    def step_time(self, c: ThroughputConfig) -> float:
        """``features(c) . theta``: the linearised quantity (time per ``scale`` samples)."""
        return float(self.features(c) @ self.theta())

    def predict(self, config: ThroughputConfig) -> float:
        try:
            t = self.step_time(config)
        except ZeroDivisionError:
            raise ConfigError(f"{self.name}: the configuration has 0 where the model divides by it") from None
        if t <= 0:
            return 0.0
        return self.scale(config) / t

    def fit(self, samples: Sequence[ThroughputSample]) -> LinearisedModel:
        _check_samples(samples)
        self.choose_form(samples)
        n_terms = len(self.terms())
        if len(samples) < n_terms:
            raise FitError(f"{self.name}: {len(samples)} rows, need at least {n_terms} to fit {n_terms} coefficients")
        try:
            x = np.array([self.features(s.config) for s in samples], dtype=float)
        except ZeroDivisionError:
            raise FitError(f"{self.name}: a configuration has 0 where the model divides by it (ps, cpus)") from None
        y = np.array([self.scale(s.config) / s.throughput for s in samples], dtype=float)
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            raise FitError(f"{self.name}: non-finite features (zero workers or PS where the model divides by them?)")
        if self.objective == "rmsle":
            theta = _nnls_rmsle(x, y)
        else:
            theta, _ = nnls(x, y)
        self.params = dict(zip(self.terms(), (float(v) for v in theta), strict=True))
        return self


def _check_samples(samples: Sequence[ThroughputSample]) -> None:
    if not samples:
        raise FitError("no samples to fit")
    for s in samples:
        if not (math.isfinite(s.throughput) and s.throughput > 0):
            raise FitError(f"throughput must be a positive number, got {s.throughput}")
        if not (math.isfinite(s.config.workers) and s.config.workers > 0):
            raise FitError(f"workers must be a positive number, got {s.config.workers}")


def _nnls_rmsle(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative theta minimising RMSLE between ``x . theta`` and ``y`` (DLRover-RM 4.3).

    ``log(pred) - log(obs) = log(y) - log(x . theta)`` because ``pred = scale / (x . theta)`` and
    ``obs = scale / y``; so the RMSLE of the throughput equals the RMSLE of the step time.
    Start: NNLS on the relative error (rows divided by y: the first-order expansion of the log
    error), then a bounded trust-region solve of the log residuals.
    """
    theta0, _ = nnls(x / y[:, None], np.ones_like(y))
    scale = np.maximum(np.abs(theta0), 1e-12)

    def residuals(u: np.ndarray) -> np.ndarray:
        pred = x @ (u * scale)
        return np.log(np.maximum(pred, 1e-300)) - np.log(y)

    if float(np.min(x @ theta0)) <= 0:
        return theta0
    res = least_squares(residuals, np.ones_like(theta0), bounds=(0.0, np.inf), method="trf")
    theta = res.x * scale
    # keep the start if the refinement did not help (flat directions, degenerate columns)
    if float(np.sum(residuals(res.x) ** 2)) > float(np.sum(residuals(np.ones_like(theta0)) ** 2)):
        return theta0
    return np.asarray(theta)


def _global_batch(c: ThroughputConfig) -> float:
    """Kale's and Optimus' M; 1 when unknown (M is then absorbed into the coefficients)."""
    return float(c.batch_size) if c.batch_size is not None else 1.0


def _varies_ratio(samples: Sequence[ThroughputSample]) -> bool:
    ratios = {round(s.config.workers / s.config.ps, 9) for s in samples if s.config.ps > 0}
    return all(s.config.ps > 0 for s in samples) and len(ratios) > 1


class KaleSyncModel(LinearisedModel):
    """Kale's synchronous PS model (Kale section 3.3.3, Eq. 5 and Eq. 6).

    Eq. 4 writes one step as ``M/w T_fwd + T_bwd + (2 (M/w) S + D) / (min(B0/w, B0/p) p)
    + (M/w) S T_upd / p + lambda p + lambda' w`` and the throughput as M over it. Collecting
    like terms and linearising the min gives Eq. 5, ``f = M (theta0 + theta1/w + theta2/p +
    theta3 w/p + theta4/(w p) + theta5 p + theta6 w)^-1``:

    * theta0: the backward pass ``T_bwd`` (independent of the batch) and constant overheads;
    * theta1 / w: the forward pass on the per-worker batch ``(M/w) T_fwd``;
    * theta2 / p: dense parameters pushed and pulled, ``D / (B0)`` spread over p servers;
    * theta3 w/p: transfers when the PS side is the bottleneck (``B = B0/w``, Eq. 3);
    * theta4 / (w p): sparse parameters ``(M/w) S`` sent over p servers and their update
      ``(M/w) S T_upd / p``;
    * theta5 p, theta6 w: control overheads ``lambda p + lambda' w``.

    At a fixed ratio ``p = w / r`` the terms fold into Eq. 6, ``f = M (theta0 + theta1/w +
    theta2/w^2 + theta3 w)^-1`` (theta2/w^2 from theta4/(w p); theta3 w from theta5 p and
    theta6 w and the constant ratio terms into theta0). Eq. 6 is used unless the samples vary
    the worker/PS ratio. Throughput is ``M / step`` with M the global batch
    (``batch_size``); when unknown, M = 1 and the fitted thetas carry 1/M.
    """

    name = "kale-sync"

    _EQ6 = ("theta0", "theta1", "theta2", "theta3")
    _EQ5 = ("theta0", "theta1", "theta2", "theta3", "theta4", "theta5", "theta6")

    def __init__(self, params: dict[str, float] | Sequence[float] | None = None, form: str = "eq6") -> None:
        self.form = form
        super().__init__(params)

    def _form_for(self, n_params: int) -> None:
        self.form = "eq5" if n_params == len(self._EQ5) else "eq6"

    def choose_form(self, samples: Sequence[ThroughputSample]) -> None:
        self.form = "eq5" if _varies_ratio(samples) else "eq6"

    def terms(self) -> tuple[str, ...]:
        return self._EQ5 if self.form == "eq5" else self._EQ6

    def features(self, c: ThroughputConfig) -> np.ndarray:
        w = float(c.workers)
        if self.form == "eq5":
            p = float(c.ps)
            return np.array([1.0, 1 / w, 1 / p, w / p, 1 / (w * p), p, w])
        return np.array([1.0, 1 / w, 1 / w**2, w])

    def scale(self, c: ThroughputConfig) -> float:
        return _global_batch(c)


class KaleAsyncModel(LinearisedModel):
    """Kale's asynchronous PS model (Kale section 3.3.3, Eq. 8 and Eq. 9).

    Each worker steps on its own mini-batch at bandwidth ``B0/p`` (Eq. 7); the job's rate is w
    times one worker's: Eq. 8, ``f = w (theta0 + theta1/p + theta2 p + theta3 w)^-1``:

    * theta0: forward + backward + the transfer ``(2S + D)/B0`` of one worker's step;
    * theta1 / p: the sparse update ``S T_upd / p`` shared by p servers;
    * theta2 p, theta3 w: control overheads ``lambda p + lambda' w``.

    At a fixed ratio ``p = w / r`` this is Eq. 9, ``f = w (theta0 + theta1/w + theta2 w)^-1``.
    The per-worker mini-batch is constant in Kale's setting and absorbed into the thetas (as
    Table 1's async coefficients show: they give samples/s directly); ``batch_size`` is unused.
    """

    name = "kale-async"

    _EQ9 = ("theta0", "theta1", "theta2")
    _EQ8 = ("theta0", "theta1", "theta2", "theta3")

    def __init__(self, params: dict[str, float] | Sequence[float] | None = None, form: str = "eq9") -> None:
        self.form = form
        super().__init__(params)

    def _form_for(self, n_params: int) -> None:
        self.form = "eq8" if n_params == len(self._EQ8) else "eq9"

    def choose_form(self, samples: Sequence[ThroughputSample]) -> None:
        self.form = "eq8" if _varies_ratio(samples) else "eq9"

    def terms(self) -> tuple[str, ...]:
        return self._EQ8 if self.form == "eq8" else self._EQ9

    def features(self, c: ThroughputConfig) -> np.ndarray:
        w = float(c.workers)
        if self.form == "eq8":
            p = float(c.ps)
            return np.array([1.0, 1 / p, p, w])
        return np.array([1.0, 1 / w, w])

    def scale(self, c: ThroughputConfig) -> float:
        return float(c.workers)


class DLRoverRMModel(LinearisedModel):
    """DLRover-RM's resource-performance model (DLRover-RM section 4.1, Eq. 1-6).

    Eq. 1: ``thp = w m / (T_comp + T_comm)`` with m the per-worker batch (``M / w`` here), and

    * Eq. 2, ``T_grad = alpha_grad m / lambda_w + beta_grad``: gradient work grows with the
      batch and shrinks with the worker's CPU cores ``lambda_w`` (``worker_cpu``);
    * Eq. 3, ``T_upd = alpha_upd w / (p lambda_p) + beta_upd``: w gradient copies applied by p
      servers of ``lambda_p`` cores (``ps_cpu``);
    * Eq. 4, ``T_sync = alpha_sync (M_model / p) / (B / w) + beta_sync``: parameters pulled and
      pushed over a bandwidth shared by w workers; model size and bandwidth are constant for a
      job, so the feature is ``w / p``;
    * Eq. 5, ``T_emb = alpha_emb m D / p + beta_emb``: embedding lookups of m samples of
      dimension D spread over p servers; D is constant, so the feature is ``m / p``;
    * Eq. 6: throughput is a function of these alphas and betas; the betas add up to one
      constant ``beta`` (they are not separately identifiable from throughput alone).

    Fitted under non-negativity minimising RMSLE, as DLRover-RM does. Needs ``ps``,
    ``worker_cpu``, ``ps_cpu`` and ``batch_size``.
    """

    name = "dlrover-rm"
    required_columns = ("ps", "worker_cpu", "ps_cpu", "batch_size")
    objective = "rmsle"

    def terms(self) -> tuple[str, ...]:
        return ("alpha_grad", "alpha_upd", "alpha_sync", "alpha_emb", "beta")

    def features(self, c: ThroughputConfig) -> np.ndarray:
        w, p = float(c.workers), float(c.ps)
        m = _global_batch(c) / w
        return np.array([m / c.worker_cpu, w / (p * c.ps_cpu), w / p, m / p, 1.0])

    def scale(self, c: ThroughputConfig) -> float:
        return _global_batch(c)  # w * m


class OptimusModel(LinearisedModel):
    """Optimus' synchronous PS model (Peng et al., EuroSys'18, section 3.2, Eq. 2).

    One step takes ``theta0 M/w + theta1 + theta2 w/p + theta3 w + theta4 p`` seconds:

    * theta0 M/w: forward and backward on the per-worker batch;
    * theta1: constant per-step cost (gradient update on the PS, assumed uniform);
    * theta2 w/p: push and pull through a PS serving w workers, parameters spread evenly on p;
    * theta3 w, theta4 p: communication overheads growing with the number of workers and PSs.

    Throughput is ``M / step``. Without a ``ps`` column (all-reduce jobs, or a fixed ratio)
    the w/p term is constant and folds into theta1, and theta4 p into theta3 w.
    """

    name = "optimus"

    def __init__(self, params: dict[str, float] | Sequence[float] | None = None, with_ps: bool = False) -> None:
        self.with_ps = with_ps
        super().__init__(params)

    def _form_for(self, n_params: int) -> None:
        self.with_ps = n_params == 5

    def choose_form(self, samples: Sequence[ThroughputSample]) -> None:
        self.with_ps = _varies_ratio(samples)

    def terms(self) -> tuple[str, ...]:
        if self.with_ps:
            return ("theta0", "theta1", "theta2", "theta3", "theta4")
        return ("theta0", "theta1", "theta3")

    def features(self, c: ThroughputConfig) -> np.ndarray:
        w, m_global = float(c.workers), _global_batch(c)
        if self.with_ps:
            p = float(c.ps)
            return np.array([m_global / w, 1.0, w / p, w, p])
        return np.array([m_global / w, 1.0, w])

    def scale(self, c: ThroughputConfig) -> float:
        return _global_batch(c)


class ErnestModel(LinearisedModel):
    """Ernest's model (Venkataraman et al., NSDI'16, section 3.2, Eq. 1), applied to one step.

    ``time = theta0 + theta1 (scale / machines) + theta2 log(machines) + theta3 machines``:

    * theta0: fixed serial cost;
    * theta1 M/w: parallel computation on the input (here: the global batch M) split over w;
    * theta2 log(w): tree-shaped aggregation (all-reduce / broadcast depth);
    * theta3 w: all-to-one communication growing linearly with the machines.

    Throughput is ``M / time``.
    """

    name = "ernest"

    def terms(self) -> tuple[str, ...]:
        return ("theta0", "theta1", "theta2", "theta3")

    def features(self, c: ThroughputConfig) -> np.ndarray:
        w = float(c.workers)
        return np.array([1.0, _global_batch(c) / w, math.log(w), w])

    def scale(self, c: ThroughputConfig) -> float:
        return _global_batch(c)


class DataParallelModel(LinearisedModel):
    """Step time of a data-parallel (all-reduce) job with a fixed per-worker batch ``b``.

    Optimus Eq. 2 without parameter servers, ``theta0 M/w + theta1 + theta3 w``, has with
    ``M = w b`` a constant first term; what grows with the workers (``theta3 w``: the
    collectives, and the workers sharing the machine's cores or links) only starts where they
    saturate it. So the step takes

        step(w) = theta0 + theta1 max(0, w - knee)

    seconds: ``theta0`` the step of a worker alone, ``theta1`` what each worker beyond the
    ``knee`` adds. Throughput is ``w b / step(w)``: linear up to the knee, then flat or falling.
    ``theta0, theta1`` are fitted by NNLS (as every model here) for each candidate knee (0: no
    knee, and every whole count up to the largest measured), keeping the knee with the least
    squared error and, among knees the data cannot tell apart, the middle one (refitted). ``knee`` is a parameter beside the thetas.
    """

    name = "data-parallel"

    def terms(self) -> tuple[str, ...]:
        return ("theta0", "theta1", "knee")

    def features(self, c: ThroughputConfig) -> np.ndarray:
        knee = self.params.get("knee", 0.0)
        return np.array([1.0, max(0.0, float(c.workers) - knee), 0.0])

    def scale(self, c: ThroughputConfig) -> float:
        return float(c.workers) * _per_worker_batch(c)

    def fit(self, samples: Sequence[ThroughputSample]) -> DataParallelModel:
        _check_samples(samples)
        counts = sorted({float(s.config.workers) for s in samples})
        if len(samples) < 2:
            raise FitError(f"{self.name}: {len(samples)} rows, need at least 2")
        y = np.array([self.scale(s.config) / s.throughput for s in samples], dtype=float)
        w = np.array([float(s.config.workers) for s in samples])
        fits = []
        for knee in [0.0, *np.arange(1.0, counts[-1] + 1.0)]:
            x = np.column_stack([np.ones_like(w), np.maximum(0.0, w - knee)])
            theta, _ = nnls(x, y)
            fits.append((float(np.sum((x @ theta - y) ** 2)), knee, float(theta[0]), float(theta[1])))
        least = min(f[0] for f in fits)
        # knees the data cannot tell apart (e.g. none measured between the last count that
        # scaled and the first that did not): the middle one, refitted
        tied = [f[1] for f in fits if f[0] <= least + 1e-12 * max(1.0, float(np.sum(y ** 2)))]
        knee = float(np.median(tied))
        x = np.column_stack([np.ones_like(w), np.maximum(0.0, w - knee)])
        theta, _ = nnls(x, y)
        self.params = {"theta0": float(theta[0]), "theta1": float(theta[1]), "knee": knee}
        return self


def _per_worker_batch(c: ThroughputConfig) -> float:
    return 1.0 if c.batch_size is None else float(c.batch_size) / float(c.workers)


# --------------------------------------------------------------------------------------------
# registry, splitting and error reports
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[[], LinearisedModel]] = {
    "kale-sync": KaleSyncModel,
    "kale-async": KaleAsyncModel,
    "dlrover-rm": DLRoverRMModel,
    "optimus": OptimusModel,
    "ernest": ErnestModel,
    "data-parallel": DataParallelModel,
}


def register(name: str, factory: Callable[[], LinearisedModel]) -> None:
    _REGISTRY[name] = factory


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> LinearisedModel:
    """A fresh, unfitted model by name. Raises ConfigError for an unknown name."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ConfigError(f"unknown throughput model {name!r}; known: {', '.join(names())}") from None


def split(
    samples: Sequence[ThroughputSample], test_fraction: float, seed: int
) -> tuple[list[ThroughputSample], list[ThroughputSample]]:
    """Random train/test split; ``round(n * test_fraction)`` rows held out (at least 1 if > 0)."""
    if not 0.0 <= test_fraction < 1.0:
        raise ConfigError(f"test fraction must be in [0, 1), got {test_fraction}")
    n = len(samples)
    n_test = round(n * test_fraction)
    if test_fraction > 0 and n_test == 0 and n > 1:
        n_test = 1
    order = np.random.default_rng(seed).permutation(n)
    test_idx = set(int(i) for i in order[:n_test])
    train = [s for i, s in enumerate(samples) if i not in test_idx]
    test = [s for i, s in enumerate(samples) if i in test_idx]
    return train, test


def evaluate(model: ThroughputModel, samples: Sequence[ThroughputSample]) -> tuple[float, float, float]:
    """``(mape %, rmse samples/s, rmsle)`` of the model's predictions on ``samples``."""
    if not samples:
        return float("nan"), float("nan"), float("nan")
    obs = np.array([s.throughput for s in samples], dtype=float)
    pred = np.array([model.predict(s.config) for s in samples], dtype=float)
    mape = float(np.mean(np.abs(pred - obs) / obs) * 100.0)
    rmse = float(np.sqrt(np.mean((pred - obs) ** 2)))
    rmsle = float(np.sqrt(np.mean((np.log1p(np.maximum(pred, 0)) - np.log1p(obs)) ** 2)))
    return mape, rmse, rmsle


def fit_and_report(
    name: str, samples: Sequence[ThroughputSample], test_fraction: float = 0.25, seed: int = 0
) -> tuple[LinearisedModel, FitReport]:
    """Fit ``name`` on a random ``1 - test_fraction`` of the samples, report errors on the rest.

    With ``test_fraction == 0`` the errors are in-sample and ``held_out`` is False.

    Raises:
        FitError: too few training rows for the model's coefficients, or bad values.
    """
    train, test = split(samples, test_fraction, seed)
    model = get(name)
    model.fit(train)
    held_out = len(test) > 0
    mape, rmse, rmsle = evaluate(model, test if held_out else train)
    report = FitReport(
        model=name,
        params=dict(model.params),
        mape=mape,
        rmse=rmse,
        rmsle=rmsle,
        n_train=len(train),
        n_test=len(test),
        held_out=held_out,
    )
    return model, report




def samples_from_rows(rows: Sequence[dict[str, str]], model: LinearisedModel) -> list[ThroughputSample]:
    """Build samples from CSV rows (column name -> text), checking what the model needs.

    ``workers`` and ``throughput`` are always required; ``ps``, ``worker_cpu``, ``ps_cpu`` and
    ``batch_size`` are read when present and required when the model lists them.

    Raises:
        FitError: a missing column, a non-numeric or non-finite value (naming line and column).
    """
    needed = ("workers", "throughput", *model.required_columns)
    columns = set(rows[0]) if rows else set()
    missing = [c for c in needed if c not in columns]
    if missing:
        have = ", ".join(sorted(columns)) or "none"
        raise FitError(f"{model.name} needs column(s) {', '.join(missing)}; the CSV has {have}")
    optional = ("ps", "worker_cpu", "ps_cpu", "batch_size")
    out = []
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        values: dict[str, float] = {}
        for col in ("workers", "throughput", *(c for c in optional if c in columns)):
            text = (row.get(col) or "").strip()
            try:
                v = float(text)
            except ValueError:
                raise FitError(f"line {i}: column {col!r} is not a number: {text!r}") from None
            if not math.isfinite(v):
                raise FitError(f"line {i}: column {col!r} is not finite: {text!r}")
            values[col] = v
        config = ThroughputConfig(
            workers=values["workers"],
            ps=values.get("ps", 0.0),
            worker_cpu=values.get("worker_cpu", 1.0),
            ps_cpu=values.get("ps_cpu", 1.0),
            batch_size=values.get("batch_size"),
        )
        out.append(ThroughputSample(config, values["throughput"]))
    return out
