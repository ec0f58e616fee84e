"""Click samples as stream records: what `tidal produce` writes and the example trains on.

A record is one sample of :class:`examples.ctr.data.ClickDataset` (so a stream is made of the same
data as the dataset runs, and a model trained on either can be compared): fields ``dense``
(float32 little-endian, ``num_dense`` values), ``sparse`` (int64 little-endian hashed bucket ids,
``num_sparse`` values), ``label`` (``b"0"`` or ``b"1"``) and ``index`` (the sample's global
index, ASCII; for audits). ``decode`` checks every field's size and value range before it builds
a tensor: a record that breaks them is malformed (returned apart, never trained).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from examples.ctr.data import ClickDataset

FIELDS = ("dense", "sparse", "label", "index")


class ClickRecords:
    """Encode samples of a dataset's shape; decode records of the same shape."""

    def __init__(self, seed: int = 0, num_dense: int = 4, num_sparse: int = 8, hash_size: int = 1000) -> None:
        self.seed, self.num_dense, self.num_sparse, self.hash_size = seed, num_dense, num_sparse, hash_size

    def dataset(self, size: int) -> ClickDataset:
        return ClickDataset(size, self.seed, num_dense=self.num_dense, num_sparse=self.num_sparse,
                            hash_size=self.hash_size)

    def encode(self, start: int, count: int) -> list[dict[str, bytes]]:
        """Samples ``[start, start + count)`` of the generator as records."""
        if count <= 0:
            return []
        data = self.dataset(start + count).get_range(start, start + count)
        dense = data["dense"].numpy().astype("<f4", copy=False)
        sparse = data["sparse"].numpy().astype("<i8", copy=False)
        labels = data["label"].numpy()
        return [{"dense": dense[i].tobytes(), "sparse": sparse[i].tobytes(),
                 "label": b"1" if labels[i] > 0.5 else b"0", "index": str(start + i).encode()}
                for i in range(count)]

    def decode(self, records: Sequence[dict[str, bytes]]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The batch of the well-formed records (``dense``, ``sparse``, ``label`` as in
        ``ClickDataset.get_range``) and the positions of the malformed ones."""
        dense_len, sparse_len = 4 * self.num_dense, 8 * self.num_sparse
        good: list[int] = []
        bad: list[int] = []
        for pos, fields in enumerate(records):
            d, s, y = fields.get("dense"), fields.get("sparse"), fields.get("label")
            ok = d is not None and s is not None and len(d) == dense_len and len(s) == sparse_len and y in (b"0", b"1")
            (good if ok else bad).append(pos)
        n = len(good)
        dense = np.frombuffer(b"".join(records[i]["dense"] for i in good), dtype="<f4").reshape(n, self.num_dense)
        sparse = np.frombuffer(b"".join(records[i]["sparse"] for i in good), dtype="<i8").reshape(n, self.num_sparse)
        label = np.array([records[i]["label"] == b"1" for i in good], dtype=np.float32)
        in_range = (sparse >= 0).all(axis=1) & (sparse < self.hash_size).all(axis=1) & np.isfinite(dense).all(axis=1)
        if not in_range.all():  # well-sized, but values the model must not index with
            bad = sorted(bad + [good[i] for i in np.flatnonzero(~in_range)])
            dense, sparse, label = dense[in_range], sparse[in_range], label[in_range]
        return ({"dense": torch.from_numpy(dense.copy()), "sparse": torch.from_numpy(sparse.copy()),
                 "label": torch.from_numpy(label)}, bad)
