"""The shard order convention, shared by the master's shard manager and the local (no master) mode.

Shards are ``[k * shard_size, (k + 1) * shard_size)`` clipped to the dataset; with ``shuffle``
their order in an epoch is a permutation seeded by ``(seed, epoch)``. Batches are contiguous
ranges inside a shard, so the ledger can record them as ranges.
"""

from __future__ import annotations

import random


def shard_starts(size: int, shard_size: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Start indices of an epoch's shards in the order they are handed out."""
    starts = list(range(0, size, shard_size))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(starts)
    return starts
