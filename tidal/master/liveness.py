"""Which workers are dead, hung or slow: pure decisions over the worker records and the time.

* Heartbeats: a registered worker silent for ``heartbeat_timeout_s``, or a launched one that did
  not join within ``start_timeout_s``, has failed (its process is killed: it may still run).
* Progress (DESIGN.md 4, "No false success"; a hung main thread still heartbeats): a re-form
  that has not closed ``round_timeout_s`` after it began fails the members that never reached
  the rendezvous; a member that applies no step for ``progress_timeout_s`` while its peers do is
  replaced. Both are judged against the worker's own pace (``WorkerRecord.allowance``).
* Stragglers (DLRover-RM section 5.1): a worker slower per sample than its peers' median by
  ``factor`` for ``window_s`` gets shards and batches scaled to its speed, until it catches up.

Each function returns actions (``tidal.master.actions``); ``JobMaster`` applies them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

from tidal.api import WorkerState
from tidal.master.actions import FailWorker, SetStraggler, SlowSince
from tidal.master.membership import WorkerRecord
from tidal.master.rounds import RoundState

W = WorkerState
CAUGHT_UP = 1.2  # a straggler is one again below this ratio to its peers


def check_heartbeats(workers: Iterable[WorkerRecord], now: float, *, heartbeat_timeout_s: float,
                     start_timeout_s: float) -> list[FailWorker]:
    out = []
    for rec in workers:
        if (rec.state in (W.JOINED, W.WAITING, W.ACTIVE) and not rec.finished
                and now - rec.last_seen > heartbeat_timeout_s):
            out.append(FailWorker(rec.worker_id, f"missed heartbeats for {now - rec.last_seen:.1f}s",
                                  kill=f"hb-{rec.worker_id}"))
        # from the start of its process: a backend that places nodes (ray) may hold one for a while
        # before it has room (its --wait-for-resources decides how long), and it has no pid then
        elif rec.state is W.LAUNCHING and rec.pid and now - max(rec.launched_at, rec.create_time or 0.0) > start_timeout_s:
            out.append(FailWorker(rec.worker_id, f"did not join within {start_timeout_s:.0f}s",
                                  kill=f"start-{rec.worker_id}"))
    return out


def check_progress(rs: RoundState, workers: Mapping[int, WorkerRecord], now: float, *, round_timeout_s: float,
                   progress_timeout_s: float) -> list[FailWorker]:
    if rs.round < 0:
        return []
    if rs.reforming:
        waited = now - rs.reform_started
        return [FailWorker(m, f"did not reach the rendezvous {waited:.0f}s after the re-form began "
                              f"({rs.reform_cause})", kill=f"late-{m}-{rs.round}")
                for m in rs.members if workers[m].alive and m not in rs.waiting
                and waited > workers[m].allowance(round_timeout_s)]
    active = [workers[m] for m in rs.members if workers[m].state is W.ACTIVE]
    if len(active) < 2:
        return []
    ahead = max(r.applied_step for r in active)
    out = []
    for rec in active:
        stuck_for = now - rec.progressed_at
        if rec.applied_step < ahead and stuck_for > rec.allowance(progress_timeout_s):
            out.append(FailWorker(rec.worker_id, f"applied no step for {stuck_for:.0f}s while its peers reached "
                                                 f"step {ahead}", kill=f"stuck-{rec.worker_id}-{rs.round}"))
    return out


def detect_stragglers(active: list[WorkerRecord], now: float, *, factor: float,
                      window_s: float) -> list[SetStraggler | SlowSince]:
    """DLRover-RM 5.1: only a lasting slowness counts (one noisy report on a shared core is no
    straggler)."""
    if len(active) < 2:
        return []
    speeds = [r.compute_s_per_sample for r in active if r.compute_s_per_sample > 0]
    if len(speeds) < 2:
        return []
    # the peers' median; with three or more workers the median of all is close enough and keeps
    # this O(n log n) for thousands of workers
    median = statistics.median(speeds)
    out: list[SetStraggler | SlowSince] = []
    for rec in active:
        if rec.compute_s_per_sample <= 0:
            continue
        if len(speeds) > 2:
            peer = median
        else:
            peer = next(r.compute_s_per_sample for r in active if r is not rec and r.compute_s_per_sample > 0)
        ratio = rec.compute_s_per_sample / peer
        since = rec.slow_since
        if ratio <= factor:
            since = None
        elif since is None:
            since = now
        if since != rec.slow_since:
            out.append(SlowSince(rec.worker_id, since))
        slow = since is not None and now - since >= window_s
        if not rec.straggler and slow:
            size_factor = max(0.25, min(1.0, 1.0 / ratio))
            out.append(SetStraggler(rec.worker_id, True, size_factor,
                                    f"worker {rec.worker_id} is a straggler ({ratio:.1f}x slower per sample than "
                                    f"its peers); shards and batches scaled to {size_factor:.2f}"))
        elif rec.straggler and ratio < CAUGHT_UP:
            out.append(SetStraggler(rec.worker_id, False, 1.0, f"worker {rec.worker_id} caught up"))
    return out
