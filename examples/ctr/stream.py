"""Click samples as stream records: what `tidal produce` writes and the example trains on.

A record is one sample of :class:`examples.ctr.data.ClickDataset` (so a stream is made of the same
data as the dataset runs, and a model trained on either can be compared), packed in one field,
``click``, with a fixed little-endian layout (:meth:`ClickRecords.layout`)::

    version  uint8                  1 (a record of another layout is malformed, never misread)
    label    uint8                  0 or 1
    index    int64                  the sample's global index (for audits)
    dense    float32 x num_dense
    sparse   int64   x num_sparse   hashed bucket ids in [0, hash_size)

One field, not one per feature: a reader's cost is per field of every record (Redis' reply, the
client's parsing, a dict entry), and a batch of same-sized values decodes with one
``np.frombuffer`` over their concatenation. ``decode`` checks every record's size, then its
version, label and value ranges (vectorised) before it builds a tensor: a record that breaks
them is malformed (returned apart, never trained).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from examples.ctr.data import ClickDataset

FIELD = "click"
VERSION = 1


class ClickRecords:
    """Encode samples of a dataset's shape; decode records of the same shape."""

    def __init__(self, seed: int = 0, num_dense: int = 4, num_sparse: int = 8, hash_size: int = 1000) -> None:
        self.seed, self.num_dense, self.num_sparse, self.hash_size = seed, num_dense, num_sparse, hash_size
        self.layout = np.dtype([("version", "u1"), ("label", "u1"), ("index", "<i8"),
                                ("dense", "<f4", (num_dense,)), ("sparse", "<i8", (num_sparse,))])

    def dataset(self, size: int) -> ClickDataset:
        return ClickDataset(size, self.seed, num_dense=self.num_dense, num_sparse=self.num_sparse,
                            hash_size=self.hash_size)

    def encode(self, start: int, count: int) -> list[dict[str, bytes]]:
        """Samples ``[start, start + count)`` of the generator as records."""
        if count <= 0:
            return []
        data = self.dataset(start + count).get_range(start, start + count)
        packed = np.empty(count, dtype=self.layout)
        packed["version"] = VERSION
        packed["label"] = data["label"].numpy() > 0.5
        packed["index"] = np.arange(start, start + count)
        packed["dense"] = data["dense"].numpy()
        packed["sparse"] = data["sparse"].numpy()
        raw, size = packed.tobytes(), self.layout.itemsize
        return [{FIELD: raw[i:i + size]} for i in range(0, count * size, size)]

    def index_of(self, fields: dict[str, bytes]) -> int:
        """The sample's global index in a well-sized record.

        Raises:
            ValueError: the record has no ``click`` field of this layout's size.
        """
        value = fields.get(FIELD, b"")
        if len(value) != self.layout.itemsize:
            raise ValueError(f"not a click record of {self.layout.itemsize} bytes: {len(value)} bytes")
        return int(np.frombuffer(value, dtype=self.layout)["index"][0])

    def decode(self, records: Sequence[dict[str, bytes]]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The batch of the well-formed records (``dense``, ``sparse``, ``label`` as in
        ``ClickDataset.get_range``) and the positions of the malformed ones."""
        size = self.layout.itemsize
        values = [fields.get(FIELD, b"") for fields in records]
        bad: list[int] = []
        if set(map(len, values)) <= {size}:  # the common case: one length check for the batch
            good = list(range(len(values)))
        else:
            good = [pos for pos, value in enumerate(values) if len(value) == size]
            bad = [pos for pos, value in enumerate(values) if len(value) != size]
            values = [values[pos] for pos in good]
        packed = np.frombuffer(b"".join(values), dtype=self.layout)
        version, label = packed["version"], packed["label"]
        dense, sparse = packed["dense"].copy(), packed["sparse"].copy()  # contiguous: reductions are fast
        if len(packed) and not ((version == VERSION).all() and label.max() <= 1 and np.isfinite(dense).all()
                                and sparse.min() >= 0 and sparse.max() < self.hash_size):
            # well-sized, but values the model must not train on or index with: find the records
            ok = ((version == VERSION) & (label <= 1) & np.isfinite(dense).all(axis=1)
                  & (sparse >= 0).all(axis=1) & (sparse < self.hash_size).all(axis=1))
            bad = sorted(bad + [good[i] for i in np.flatnonzero(~ok)])
            dense, sparse, label = dense[ok], sparse[ok], label[ok]
        return ({"dense": torch.from_numpy(dense), "sparse": torch.from_numpy(sparse),
                 "label": torch.from_numpy(label.astype(np.float32))}, bad)
