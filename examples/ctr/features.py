"""Raw click features and the CPU work that turns them into the model's input.

``RawClicks`` serves the samples of a :class:`examples.ctr.data.ClickDataset` as a production
log would hold them: numeric features as raw counts (``exp`` of the standard normals) and
categorical features as raw values, not yet hashed. ``FeatureTransform`` is the pre-processing
every recommendation pipeline runs before its embedding lookups, and it is real CPU work:

* string hashing: each categorical value becomes the string ``"<field>=<value>"``, hashed
  (CRC-32) into ``hash_size`` buckets, one Python string per value;
* crosses: ``crosses`` pairs (then triples) of fields, each the string
  ``"<f>x<g>=<value_f>|<value_g>"`` hashed the same way, into one multi-hot ``crosses`` input
  that the model sums in one embedding bag (the known model has a pairwise term);
* bucketizing: each numeric feature is log-transformed and cut into ``buckets`` quantile-like
  buckets (one more categorical field each), and kept as ``log(count)`` for the dense tower.

It has no parameter and no state, so it runs in the trainer or in any data worker
(``job.loader(RawClicks(data), ..., preprocess=FeatureTransform(...))``) with the same result.
"""

from __future__ import annotations

import itertools
import zlib

import torch
from torch import nn

from examples.ctr.data import ClickDataset

__all__ = ["FeatureTransform", "RawClicks"]


class RawClicks:
    """The raw samples of ``data``: ``counts`` float32 ``[n, num_dense]`` (positive),
    ``category`` int64 ``[n, num_sparse]``, ``label`` float32 ``[n]``."""

    def __init__(self, data: ClickDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def get_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        raw = self.data.get_raw_range(start, end)
        return {"counts": torch.exp(raw["dense"]), "category": raw["category"], "label": raw["label"]}


class FeatureTransform(nn.Module):
    """Raw samples -> ``dense`` float32 ``[n, num_dense]``, ``sparse`` int64 ``[n, fields]``
    (hashed categories, then crosses, then numeric buckets), ``label``. No parameters."""

    def __init__(self, num_sparse: int = 8, num_dense: int = 4, hash_size: int = 1000, crosses: int = 16,
                 buckets: int = 16) -> None:
        super().__init__()
        pairs = [*itertools.combinations(range(num_sparse), 2), *itertools.combinations(range(num_sparse), 3)]
        if not 0 <= crosses <= len(pairs):
            raise ValueError(f"crosses must be in [0, {len(pairs)}] for {num_sparse} fields, got {crosses}")
        self.num_sparse, self.num_dense, self.hash_size = num_sparse, num_dense, hash_size
        self.pairs = pairs[:crosses]
        self.buckets = buckets
        # edges of the log-count buckets (standard normal quantiles); a plain attribute, not a buffer
        self.edges = torch.distributions.Normal(0.0, 1.0).icdf(torch.linspace(0, 1, buckets + 1)[1:-1])

    @property
    def fields(self) -> int:
        """Categorical fields of ``sparse``: the raw fields, then the numeric buckets."""
        return self.num_sparse + self.num_dense

    def _hash(self, strings: list[str]) -> list[int]:
        size = self.hash_size
        return [zlib.crc32(s.encode()) % size for s in strings]

    def forward(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        category = raw["category"].tolist()
        n = len(category)
        columns = [self._hash([f"{f}={row[f]}" for row in category]) for f in range(self.num_sparse)]
        crossed = [self._hash(["x".join(map(str, fs)) + "=" + "|".join(str(row[f]) for f in fs) for row in category])
                   for fs in self.pairs]
        dense = torch.log(raw["counts"])
        sparse = torch.tensor(columns, dtype=torch.int64).T.reshape(n, -1)
        buckets = torch.bucketize(dense, self.edges) + torch.arange(self.num_dense) * self.buckets
        sparse = torch.cat([sparse, buckets % self.hash_size], dim=1)
        crosses = torch.tensor(crossed, dtype=torch.int64).T if crossed else torch.zeros((n, 0), dtype=torch.int64)
        return {"dense": dense, "sparse": sparse, "crosses": crosses, "label": raw["label"]}


class RawClickModel(nn.Module):
    """The whole model from raw samples: ``FeatureTransform``, then the DLRM. With
    ``job.loader(..., preprocess="auto")`` tidal cuts its forward where the transform ends
    (tidal.data.partition): the transform holds no parameter, so it and the column slicing after
    it run in the data workers."""

    def __init__(self, transform: FeatureTransform, dlrm: nn.Module) -> None:
        super().__init__()
        self.transform = transform
        self.dlrm = dlrm

    def forward(self, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        f = self.transform(raw)
        return self.dlrm(f["dense"], f["sparse"], f["crosses"])  # type: ignore[no-any-return]
