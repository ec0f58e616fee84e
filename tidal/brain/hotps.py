"""Hot parameter servers (DLRover section 4.2, the adjust stage, and 5.4).

A server much busier than its peers slows every step: a sync step waits for the slowest pull.
DLRover finds such a server from the CPU its pods use and replaces it with one of

    s = min(s_hot / s_total * s_hat * N_w, C_max)                     (DLRover 4.2, "Hot PS")

cores (``s_hot``: the hot server's CPU, ``s_total``: every server's, ``s_hat``: every server's
CPU per worker, ``N_w``: workers): ``tidal.brain.dlrover.hot_ps_cores``, which the cluster
simulator's DLRover policy uses. Where a server cannot be given more CPU (a process of the local
backend has no quota to raise), the other remedy is the one tidal's virtual shards allow: move
the hot server's hottest shards to cooler servers. ``plan_hot_shards``
does that from what the servers report: the share of each second spent serving (``busy``) and
the rows pulled per virtual shard. A server's time per row is its busy time over its rows, so
moving shard ``v`` from ``a`` to ``b`` is predicted to take ``hits_v * cost_a`` off ``a`` and
add ``hits_v * cost_b`` to ``b``; shards move, hottest first, while that lowers the busiest
server's predicted load.

Rows hash to virtual shards (``tidal.ps.api.virtual_shard``), so skewed ids (80% of lookups on
1% of ids) spread over every shard and make no hot server by themselves; what does is a slower or
shared machine, or a map left uneven. Pure: the master feeds it reports and executes the map.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HotShardPlan", "plan_hot_shards"]

HOT_FACTOR = 1.5  # a server is hot when busier than this times its peers' median
MIN_BUSY = 0.2  # ... and busy at least this share of the time (an idle job has no hot spot)
MIN_GAIN = 0.1  # the move must lower the busiest server's predicted load by this share


@dataclass(frozen=True)
class HotShardPlan:
    """Outcome of ``plan_hot_shards``.

    Attributes:
        hot: the hot server.
        new_map: the shard map with the moved shards (virtual shard -> server).
        moved: the virtual shards moved, in the order chosen.
        busy_before: the hot server's busy share.
        busy_after: the busiest server's predicted busy share after the move.
        peers_median: the other servers' median busy share.
    """

    hot: int
    new_map: list[int]
    moved: list[int]
    busy_before: float
    busy_after: float
    peers_median: float

    def describe(self) -> str:
        return (f"hot parameter server {self.hot} (busy {self.busy_before:.2f}, peers' median "
                f"{self.peers_median:.2f}): moving virtual shards {self.moved} away, busiest predicted "
                f"{self.busy_after:.2f}")


def plan_hot_shards(busy: Mapping[int, float], hits: Mapping[int, Sequence[float]], shard_map: Sequence[int],
                    *, factor: float = HOT_FACTOR, min_busy: float = MIN_BUSY,
                    min_gain: float = MIN_GAIN) -> HotShardPlan | None:
    """The shards to move off a hot server, or None when no server is hot or no move helps.

    Args:
        busy: each server of the map's share of time spent serving (0..1) over a window.
        hits: each server's rows pulled per virtual shard over the same window (a rate: any
            unit, the same for every server); a server's own shards are the ones that count.
        shard_map: virtual shard -> server.
    """
    servers = sorted(set(shard_map))
    if len(servers) < 2 or any(s not in busy or s not in hits for s in servers):
        return None
    hot = max(servers, key=lambda s: (busy[s], -s))
    peers = statistics.median(busy[s] for s in servers if s != hot)
    if busy[hot] < min_busy or busy[hot] < factor * peers:
        return None
    load = {s: float(busy[s]) for s in servers}
    rate = {v: float(hits[i][v]) if v < len(hits[i]) else 0.0 for v, i in enumerate(shard_map)}
    held = {s: sum(rate[v] for v, i in enumerate(shard_map) if i == s) for s in servers}
    # seconds of busy share per row: a server that served nothing is costed like its peers
    known = [load[s] / held[s] for s in servers if held[s] > 0]
    if not known:
        return None
    cost = {s: load[s] / held[s] if held[s] > 0 else statistics.median(known) for s in servers}
    new_map = list(shard_map)
    moved: list[int] = []
    candidates = sorted((v for v, i in enumerate(shard_map) if i == hot and rate[v] > 0), key=lambda v: -rate[v])
    for v in candidates:
        if sum(1 for i in new_map if i == hot) <= 1:
            break  # a server keeps a shard: emptying it is a scale-in, not a balance
        dst = min((s for s in servers if s != hot), key=lambda s: (load[s] + rate[v] * cost[s], s))
        after_hot, after_dst = load[hot] - rate[v] * cost[hot], load[dst] + rate[v] * cost[dst]
        if max(after_hot, after_dst) >= max(load[hot], load[dst]):
            continue  # this shard is too hot to move anywhere useful; a cooler one may fit
        load[hot], load[dst] = after_hot, after_dst
        new_map[v] = dst
        moved.append(v)
        if load[hot] <= max(load[s] for s in servers if s != hot):
            break
    busiest = max(load.values())
    if not moved or busiest > busy[hot] * (1 - min_gain):
        return None
    return HotShardPlan(hot, new_map, moved, float(busy[hot]), busiest, float(peers))
