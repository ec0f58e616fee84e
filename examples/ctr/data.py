"""Synthetic click-through data with a known generating model.

Every sample is a pure function of ``(seed, global_index)``: a counter-based hash
(splitmix64, vectorised in numpy ``uint64``) turns the index into its random draws,
so the dataset is random-access, needs O(1) memory in its size, and gives the same
bytes for a sample whichever range or index array it was requested in.

The known model (why a learned model's AUC has a ceiling):

* ``dense``: ``num_dense`` independent standard normals (Box-Muller on the hash).
* raw categories: field ``f`` draws ``r_f`` in ``[0, cardinality)`` from a truncated
  power law with density ~ ``x^-ZIPF_EXPONENT`` (Zipf-like: a few head categories,
  a long tail), by inverse CDF on a hashed uniform.
* ``sparse``: the model only sees ``bucket_f(r_f)``, a seeded hash of ``r_f`` into
  ``hash_size`` buckets (rare categories collide, as with the hashing trick).
* ``logit = MEAN_LOGIT + w_dense . dense + sum_f w_sparse[f, r_f] + w_pair(r_0, r_1)``:
  ``w_dense`` is a seeded random direction of norm ``DENSE_WEIGHT_NORM``; ``w_sparse``
  holds seeded normals per ``(field, raw category)``, standardised per field to mean 0
  and std ``SPARSE_STD`` under the category distribution; ``w_pair`` is a seeded normal
  with std ``PAIR_STD`` per raw pair of fields 0 and 1 (one interaction term).
* ``label ~ Bernoulli(sigmoid(logit))``, drawn from its own hash stream.

So about 25% of samples are clicks and even the true probability only reaches an AUC
of about 0.8 (:meth:`ClickDataset.oracle_auc`); a model that sees hashed buckets
instead of raw categories, and learns from finitely many samples, does somewhat worse.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ClickDataset", "roc_auc"]

ZIPF_EXPONENT = 1.3
DENSE_WEIGHT_NORM = 1.0
SPARSE_STD = 0.4
PAIR_STD = 0.4
MEAN_LOGIT = -1.5

_CHUNK = 8192  # samples per generation block: keeps the uint64 temporaries in cache
_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31, _S32 = (np.uint64(k) for k in (11, 27, 30, 31, 32))
_LO32 = np.uint64(0xFFFFFFFF)
_INV53 = 1.0 / (1 << 53)
_INV32 = 1.0 / (1 << 32)
_TWO_PI_F32 = np.float32(2.0 * np.pi)

# Hash stream ids; each names one splitmix64 stream keyed by the seed.
_S_LABEL = 0
_S_PAIR_W = 1
_S_DENSE_W = 2
_S_SPARSE_W = 3
_S_BUCKET = 4
_S_SPARSE = 1_000  # + k: raw categories of fields 2k and 2k + 1
_S_DENSE = 2_000  # + k: dense features 2k and 2k + 1


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, in place on a ``uint64`` array (which it returns)."""
    tmp = np.empty_like(z)
    np.right_shift(z, _S30, out=tmp)
    z ^= tmp
    z *= _M1
    np.right_shift(z, _S27, out=tmp)
    z ^= tmp
    z *= _M2
    np.right_shift(z, _S31, out=tmp)
    z ^= tmp
    return z


def _stream_keys(seed: int, streams: list[int]) -> np.ndarray:
    """One well-mixed 64-bit key per stream id for this seed."""
    base = int(_mix(np.array([seed & _MASK64], dtype=np.uint64))[0])
    z = np.array([(base + (s + 1) * 0xD1B54A32D192ED03) & _MASK64 for s in streams], dtype=np.uint64)
    return _mix(z)


def _hash(keys: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``[len(keys), len(idx)]`` hashes: output number ``idx + 1`` of each key's splitmix64 stream."""
    z = np.empty((keys.size, idx.size), dtype=np.uint64)
    np.add(keys[:, None], (idx.astype(np.uint64) + np.uint64(1)) * _GAMMA, out=z)
    return _mix(z)


def _normal_pairs(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two independent float32 standard normals per hash (Box-Muller on its 32-bit halves)."""
    u1 = ((h >> _S32).astype(np.float64) + 0.5) * _INV32
    u2 = ((h & _LO32).astype(np.float64) + 0.5) * _INV32
    r = np.sqrt(np.float32(-2.0) * np.log(u1.astype(np.float32)))
    t = _TWO_PI_F32 * u2.astype(np.float32)
    return r * np.cos(t), r * np.sin(t)


def _normals(key: np.ndarray, n: int) -> np.ndarray:
    """``n`` float64 standard normals from one stream (used for the model's weights)."""
    z0, z1 = _normal_pairs(_hash(key, np.arange((n + 1) // 2))[0])
    return np.stack([z0, z1], axis=1).reshape(-1)[:n].astype(np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve via the rank-sum statistic; tied scores share their average rank."""
    y = np.asarray(labels).reshape(-1) > 0.5
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels {y.shape} and scores {s.shape} differ in shape")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("roc_auc needs both positive and negative labels")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # Tie groups [starts[k], ends[k]) in sorted order; each gets the mean of its 1-based ranks.
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return (float(ranks[y].sum()) - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


class ClickDataset:
    """Synthetic CTR dataset: sample ``i`` is a pure function of ``(seed, offset + i)``.

    See the module docstring for the known logistic model. ``offset`` shifts the global
    indices, so ``ClickDataset(n_eval, seed, offset=n_train)`` is a held-out set from the
    same generating model, disjoint from ``ClickDataset(n_train, seed)``.
    """

    def __init__(
        self,
        size: int,
        seed: int = 0,
        num_dense: int = 4,
        num_sparse: int = 8,
        cardinality: int = 10_000,
        hash_size: int = 1000,
        offset: int = 0,
    ) -> None:
        if size < 0 or offset < 0:
            raise ValueError("size and offset must be non-negative")
        if num_dense < 0 or num_sparse < 0 or cardinality < 1 or hash_size < 1:
            raise ValueError("num_dense/num_sparse must be >= 0, cardinality/hash_size >= 1")
        self.size = int(size)
        self.seed = int(seed)
        self.num_dense = int(num_dense)
        self.num_sparse = int(num_sparse)
        self.cardinality = int(cardinality)
        self.hash_size = int(hash_size)
        self.offset = int(offset)

        # Per-sample hash rows: [sparse pairs | dense pairs | label].
        self._n_sparse_h = (self.num_sparse + 1) // 2
        self._n_dense_h = (self.num_dense + 1) // 2
        self._keys = _stream_keys(
            self.seed,
            [_S_SPARSE + k for k in range(self._n_sparse_h)]
            + [_S_DENSE + k for k in range(self._n_dense_h)]
            + [_S_LABEL],
        )
        self._pair_w_key = _stream_keys(self.seed, [_S_PAIR_W])

        # The known model: tables of size O(num_sparse * cardinality), independent of `size`.
        c = self.cardinality
        self._zipf_a = 1.0 - ZIPF_EXPONENT
        self._zipf_span = (c + 1.0) ** self._zipf_a - 1.0
        edges = (np.arange(1, c + 2, dtype=np.float64) ** self._zipf_a - 1.0) / self._zipf_span
        self.category_prob: np.ndarray = np.diff(edges)  # P(raw category = r), same for every field

        w = _normals(_stream_keys(self.seed, [_S_DENSE_W]), self.num_dense)
        norm = float(np.linalg.norm(w))
        self.dense_weight: np.ndarray = w * (DENSE_WEIGHT_NORM / norm) if norm > 0 else w

        w = _normals(_stream_keys(self.seed, [_S_SPARSE_W]), self.num_sparse * c).reshape(self.num_sparse, c)
        mean = w @ self.category_prob
        std = np.sqrt(((w - mean[:, None]) ** 2) @ self.category_prob)
        self.sparse_weight: np.ndarray = SPARSE_STD * (w - mean[:, None]) / np.maximum(std, 1e-12)[:, None]

        raw = np.arange(self.num_sparse * c, dtype=np.int64)
        bucket = _hash(_stream_keys(self.seed, [_S_BUCKET]), raw)[0] % np.uint64(self.hash_size)
        self.bucket_of: np.ndarray = bucket.astype(np.int64).reshape(self.num_sparse, c)
        self.bias = MEAN_LOGIT

    def __len__(self) -> int:
        return self.size

    # -- generation -----------------------------------------------------------------------
    def _generate(self, gidx: np.ndarray, batch: bool, raw_out: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Samples (if ``batch``) and true probabilities for global indices, block by block;
        ``raw_out``: the raw categories instead of their buckets (``category``, not ``sparse``)."""
        n, nf, nd = gidx.size, self.num_sparse, self.num_dense
        c = self.cardinality
        prob = np.empty(n, dtype=np.float64)
        out: dict[str, np.ndarray] = {}
        if batch:
            out = {
                "dense": np.empty((n, nd), dtype=np.float32),
                "category" if raw_out else "sparse": np.empty((n, nf), dtype=np.int64),
                "label": np.empty(n, dtype=np.float32),
            }
        field_base = (np.arange(nf, dtype=np.int64) * c)[:, None]
        flat_w = self.sparse_weight.reshape(-1)
        flat_b = self.bucket_of.reshape(-1)
        for s in range(0, n, _CHUNK):
            g = gidx[s : s + _CHUNK]
            m = g.size
            h = _hash(self._keys, g)
            hs, hd, hl = h[: self._n_sparse_h], h[self._n_sparse_h : -1], h[-1]

            # Raw categories [nf, m]: inverse CDF of the truncated power law on [1, c + 1).
            u = np.empty((2 * self._n_sparse_h, m), dtype=np.float64)
            u[0::2] = (hs >> _S32).astype(np.float64)
            u[1::2] = (hs & _LO32).astype(np.float64)
            u = u[:nf]
            u += 0.5
            u *= _INV32 * self._zipf_span
            u += 1.0
            raw = np.power(u, 1.0 / self._zipf_a).astype(np.int64)
            raw -= 1
            np.minimum(raw, c - 1, out=raw)
            flat = raw + field_base

            z = np.empty((2 * self._n_dense_h, m), dtype=np.float32)
            z[0::2], z[1::2] = _normal_pairs(hd)
            dense = z[:nd]

            # Fixed-order elementwise sums (no BLAS), so results never depend on the block layout.
            logit = np.full(m, self.bias, dtype=np.float64)
            for j in range(nd):
                logit += self.dense_weight[j] * dense[j].astype(np.float64)
            w = flat_w[flat]
            for f in range(nf):
                logit += w[f]
            if nf >= 2 and PAIR_STD > 0:
                pair = raw[0] * c + raw[1]
                logit += PAIR_STD * _normal_pairs(_hash(self._pair_w_key, pair)[0])[0].astype(np.float64)
            p = _sigmoid(logit)
            prob[s : s + m] = p
            if batch:
                out["dense"][s : s + m] = dense.T
                if raw_out:
                    out["category"][s : s + m] = raw.T
                else:
                    out["sparse"][s : s + m] = flat_b[flat].T
                out["label"][s : s + m] = ((hl >> _S11).astype(np.float64) * _INV53) < p
        return out, prob

    def _global_range(self, start: int, end: int) -> np.ndarray:
        if not 0 <= start <= end <= self.size:
            raise IndexError(f"range [{start}, {end}) outside dataset of size {self.size}")
        return np.arange(self.offset + start, self.offset + end, dtype=np.int64)

    def _global_indices(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.size):
            raise IndexError(f"indices outside dataset of size {self.size}")
        return idx + self.offset

    @staticmethod
    def _to_torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in arrays.items()}

    def get_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Samples ``[start, end)``: ``dense`` float32 ``[n, num_dense]``, ``sparse`` int64
        ``[n, num_sparse]`` (hashed bucket ids in ``[0, hash_size)``), ``label`` float32 ``[n]``."""
        return self._to_torch(self._generate(self._global_range(start, end), batch=True)[0])

    def get_raw_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Samples ``[start, end)`` before feature engineering (``examples.ctr.features``):
        ``dense`` float32 as in :meth:`get_range`, ``category`` int64 ``[n, num_sparse]`` raw
        categories in ``[0, cardinality)``, ``label``."""
        return self._to_torch(self._generate(self._global_range(start, end), batch=True, raw_out=True)[0])

    def get_indices(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """Like :meth:`get_range` for an arbitrary 1-d array of indices into this dataset."""
        return self._to_torch(self._generate(self._global_indices(indices), batch=True)[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """One sample: ``dense`` ``[num_dense]``, ``sparse`` ``[num_sparse]``, 0-d ``label``."""
        i = int(i)
        if i < 0:
            i += self.size
        return {k: v[0] for k, v in self.get_indices(np.array([i])).items()}

    # -- the known model ------------------------------------------------------------------
    def true_probability(self, start: int, end: int) -> np.ndarray:
        """The generating model's click probability (float64 ``[n]``) for samples ``[start, end)``."""
        return self._generate(self._global_range(start, end), batch=False)[1]

    def oracle_auc(self, start: int = 0, end: int | None = None) -> float:
        """AUC of the true probabilities against the sampled labels over ``[start, end)``
        (default: the whole dataset): the ceiling for any model of this data."""
        out, prob = self._generate(self._global_range(start, self.size if end is None else end), batch=True)
        return roc_auc(out["label"], prob)
