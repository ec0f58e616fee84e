"""Training blocked per checkpoint: tidal's flash checkpoint beside torch.save, DCP async_save and memcpy.

    .venv/bin/python bench/checkpoint.py [--sizes 0.1,1,4] [--repeat 3] [--dir DIR] [--json]

For each size S (GB = 10^9 bytes) one state tree is built and saved by every method in turn:
``{"model": {...}, "optimizer": {"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups":
[...]}}``, float32, shaped like a GPT-2-style model with its Adam state (so the parameters are
about a third of the bytes): two large embedding-like matrices (token embedding, untied output
head), a position embedding, many mid-size layer matrices (qkv, attention projection, MLP in and
out), many small biases and norms, and one scalar ``step`` tensor per parameter. The width, the
depth and the vocabulary are chosen from S so that the total is within 2% of S (the header of
each size says the exact bytes and tensor count). The same tree, resident in memory, is given to
every method; every blocking time is ``time.perf_counter`` around the call, in this process:

- tidal: ``FlashCheckpoint(dir, name=..., slots=2).save(step, tree, contexts=[], meta={})``; the
  blocking time is the larger of the ``SaveResult.blocked_s`` it reports and the wall time
  measured around the call. After each save the bench waits for ``wait_persisted(step)`` (the
  persister process writing safetensors + JSON + manifest, hashed and fsynced) before the next
  measurement, so the disk writing never overlaps a measurement; that wait is reported as the
  background (persist) time. A save that creates a shared-memory slot (each of the 2 slots is
  created, its pages reserved and mapped, on its first use: the first two saves) is COLD: reported
  separately ("cold"), not in the median; the median is over ``--repeat`` warm saves after them.
- torch.save: ``torch.save(tree, path)`` to the same directory, then ``os.fsync`` of the file
  (durability parity with the persister and DCP's writer, which fsync); blocked = both, the
  fsync's share is reported too.
- DCP: ``torch.distributed.checkpoint.async_save(tree, checkpoint_id=dir, no_dist=True)`` in this
  single process with no process group (``no_dist=True`` is the API's documented single-process
  mode; the defaults otherwise: thread executor, ``DefaultStager`` staging synchronously into new
  CPU memory, ``FileSystemWriter`` which fsyncs). Blocked = until ``async_save`` returns (the
  staging copy plus planning); then the bench waits for its future (the write), reported as the
  background time.
- memcpy (the limit): a file in /dev/shm of the state's size, mmap'ed (MAP_SHARED) and touched
  once beforehand, with a ``torch.frombuffer`` view per tensor made beforehand; the time to
  ``copy_`` every tensor into its slice. No method copying the state into shared memory can
  block for less.

Every method is measured ``--repeat`` times (medians reported, every run listed under --json),
one method after the other (memcpy, tidal, torch.save, DCP; not interleaved: the 4 GB state with
2 flash slots, a DCP staging copy and the memcpy buffer at once would not fit in memory), with a
``gc.collect()`` before each measurement. torch.save and DCP first save a tiny state once, not
measured (one-time imports). Each checkpoint's files are deleted after its measurement; the
FlashCheckpoint is closed and its shared memory removed at the end of each size. A size whose
peak (the state and two flash slots, plus 1 GB) does not fit in the available memory or in
/dev/shm is skipped with a message. Everything created (the directory, shm files, the persister)
is removed at exit, also on Ctrl-C or SIGTERM.

Targets (issue): tidal's blocking time at most 0.1x torch.save's, at most 0.5x DCP async_save's,
at most 2x the memcpy limit, for every size: reported PASS/MISS, not asserted. Progress goes to
stderr; ``--json`` prints ``{"sizes": {"1GB": {"tidal_block_s", "torch_save_s",
"dcp_async_block_s", "memcpy_s", ...}, ...}}`` on stdout (keys named by the sizes as given).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import mmap
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import torch
import torch.distributed.checkpoint as dcp

from bench.common import MACHINE, ROOT, cleanup_on_sigterm, load_average, median, table
from tidal.worker.flash import FlashCheckpoint, remove_shm
from tidal.worker.state import split_tree

GB = 10**9
SHM = Path("/dev/shm")
SLOTS = 2
TARGETS = (("torch_save_s", "torch.save", 0.1), ("dcp_async_block_s", "DCP async_save", 0.5),
           ("memcpy_s", "memcpy", 2.0))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the state
def build_state(nbytes: int, seed: int = 0) -> dict[str, Any]:
    """A GPT-2-style model's state dict and its Adam state, float32, totalling ``nbytes`` (+-2%)."""
    params = nbytes / 4 / 3  # floats in the parameters: Adam keeps two more of each
    d = 128 * max(1, round(math.sqrt(params / 200) / 128))
    layers = max(1, round(0.7 * params / (12 * d * d)))
    ctx = 1024
    per_layer = 12 * d * d + 13 * d
    vocab = round((params - layers * per_layer - ctx * d - 2 * d) / (2 * d))
    if vocab < 16:
        raise ValueError(f"{nbytes / GB:g} GB is too small for this bench's model shape")
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (vocab, d)), ("pos_emb.weight", (ctx, d))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [(p + "ln1.weight", (d,)), (p + "ln1.bias", (d,)),
                   (p + "attn.qkv.weight", (3 * d, d)), (p + "attn.qkv.bias", (3 * d,)),
                   (p + "attn.proj.weight", (d, d)), (p + "attn.proj.bias", (d,)),
                   (p + "ln2.weight", (d,)), (p + "ln2.bias", (d,)),
                   (p + "mlp.fc.weight", (4 * d, d)), (p + "mlp.fc.bias", (4 * d,)),
                   (p + "mlp.proj.weight", (d, 4 * d)), (p + "mlp.proj.bias", (d,))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("lm_head.weight", (vocab, d))]
    gen = torch.Generator().manual_seed(seed)
    model = {name: torch.empty(shape).normal_(0.0, 0.02, generator=gen) for name, shape in shapes}
    state = {i: {"step": torch.tensor(1000.0),
                 "exp_avg": torch.empty(shape).normal_(0.0, 1e-3, generator=gen),
                 "exp_avg_sq": torch.empty(shape).uniform_(0.0, 1e-6, generator=gen)}
             for i, (_, shape) in enumerate(shapes)}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "params": list(range(len(shapes)))}]
    tree = {"model": model, "optimizer": {"state": state, "param_groups": groups}}
    total = sum(t.numel() * 4 for t in tensors_of(tree))
    if abs(total - nbytes) > 0.02 * nbytes:
        raise ValueError(f"state of {total} bytes is not within 2% of {nbytes}")
    return tree


def tensors_of(tree: Any) -> list[torch.Tensor]:
    return list(split_tree(tree, copy=False)[1].values())


def describe(tree: dict[str, Any]) -> str:
    ts = tensors_of(tree)
    sizes = sorted(t.numel() * 4 for t in ts)
    big = sum(1 for s in sizes if s >= 64 << 20)
    mid = sum(1 for s in sizes if 1 << 20 <= s < 64 << 20)
    small = len(sizes) - big - mid
    model = sum(t.numel() * 4 for t in tensors_of(tree["model"]))
    return (f"{sum(sizes):,} bytes float32 in {len(ts)} tensors ({big} of >= 64 MiB, {mid} of 1-64 MiB, "
            f"{small} smaller; largest {sizes[-1] / 2**20:.0f} MiB); parameters {model / sum(sizes):.1%} of the bytes")


# ----------------------------------------------------------------------------- the methods
class Cleanup:
    """Undo actions, run newest first (at the end of a size, and at exit whatever happens)."""

    def __init__(self) -> None:
        self._actions: list[tuple[str, Callable[[], None]]] = []

    def push(self, what: str, action: Callable[[], None]) -> None:
        self._actions.append((what, action))

    def run(self) -> None:
        while self._actions:
            what, action = self._actions.pop()
            try:
                action()
            except Exception as exc:  # a cleanup step failing must not stop the others
                log(f"  cleanup of {what} failed: {exc}")


def bench_memcpy(tree: dict[str, Any], label: str, repeat: int, cleanup: Cleanup) -> list[float]:
    tensors = tensors_of(tree)
    total = sum(t.numel() * 4 for t in tensors)
    path = SHM / f"tidal-bench-memcpy-{os.getpid()}-{label}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    cleanup.push(str(path), lambda: path.unlink(missing_ok=True))
    cleanup.push(f"fd of {path}", lambda: os.close(fd))
    os.posix_fallocate(fd, 0, total)
    buf = mmap.mmap(fd, total, flags=mmap.MAP_SHARED)
    views: list[torch.Tensor] = []

    def unmap() -> None:
        views.clear()
        gc.collect()
        with contextlib.suppress(BufferError):  # a view still alive (a traceback): freed with it
            buf.close()

    cleanup.push(f"mapping of {path}", unmap)
    torch.frombuffer(buf, dtype=torch.uint8).fill_(0)  # touch every page once
    at = 0
    for t in tensors:
        views.append(torch.frombuffer(buf, dtype=torch.float32, count=t.numel(), offset=at).view(t.shape))
        at += t.numel() * 4
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(views, tensors, strict=True):
                dst.copy_(src)
        times.append(time.perf_counter() - t0)
        log(f"  memcpy: {times[-1]:.3f} s")
    assert torch.equal(views[0], tensors[0]) and torch.equal(views[-1], tensors[-1])
    return times


def bench_tidal(tree: dict[str, Any], label: str, directory: Path, repeat: int, cleanup: Cleanup
                ) -> dict[str, list[float]]:
    name = f"bench-{os.getpid()}-{label}"
    fc = FlashCheckpoint(directory, name=name, slots=SLOTS)

    def close() -> None:
        fc.close(timeout=120)
        proc = fc._proc  # the persister (ours): never left behind, even when close timed out
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        remove_shm(name, SHM)

    cleanup.push(f"flash checkpoint {name}", close)
    out: dict[str, list[float]] = {"cold": [], "cold_persist": [], "warm": [], "persist": [], "reported": []}
    step = 0
    while len(out["warm"]) < repeat:
        if step >= SLOTS + repeat + 2:
            raise RuntimeError("flash saves keep creating slots")
        slots_before = len(list(SHM.glob(f"tidal-{name}-*")))
        gc.collect()
        t0 = time.perf_counter()
        res = fc.save(step, tree, contexts=[], meta={})
        wall = time.perf_counter() - t0
        if res.where != "shm":
            raise RuntimeError(f"flash save went to {res.where!r}, not shared memory: {res.note}")
        t1 = time.perf_counter()
        path = fc.wait_persisted(step, timeout=900)
        persist = time.perf_counter() - t1
        shutil.rmtree(path)
        cold = len(list(SHM.glob(f"tidal-{name}-*"))) > slots_before
        blocked = max(wall, res.blocked_s)
        out["cold" if cold else "warm"].append(blocked)
        out["cold_persist" if cold else "persist"].append(persist)
        if not cold:
            out["reported"].append(res.blocked_s)
        log(f"  tidal step {step}{' (cold: creates a slot)' if cold else ''}: blocked {blocked:.3f} s "
            f"(reported {res.blocked_s:.3f}, wall {wall:.3f}), persisted after {persist:.2f} s")
        step += 1
    return out


def bench_torch_save(tree: dict[str, Any], directory: Path, repeat: int) -> tuple[list[float], list[float]]:
    path = directory / "torch_save.pt"
    warm = directory / "warmup.pt"
    torch.save({"x": torch.zeros(4)}, warm)  # one-time costs (imports), not measured
    warm.unlink()
    times, syncs = [], []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        torch.save(tree, path)
        t1 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t2 = time.perf_counter()
        path.unlink()
        times.append(t2 - t0)
        syncs.append(t2 - t1)
        log(f"  torch.save: {t2 - t0:.3f} s (fsync {t2 - t1:.3f})")
    return times, syncs


def bench_dcp(tree: dict[str, Any], directory: Path, repeat: int, cleanup: Cleanup
              ) -> tuple[list[float], list[float]]:
    pending: list[Future[Any]] = []

    def finish() -> None:  # a write still running (Ctrl-C) must end before its directory goes
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.result(timeout=600)

    cleanup.push("DCP writes", finish)

    def save(state: dict[str, Any], path: Path) -> Future[Any]:
        fut = dcp.async_save(state, checkpoint_id=str(path), no_dist=True)
        if not isinstance(fut, Future):
            raise TypeError(f"async_save returned a {type(fut).__name__}, not a Future")
        pending.append(fut)
        return fut

    save({"x": torch.zeros(4)}, directory / "dcp-warmup").result()  # one-time costs, not measured
    shutil.rmtree(directory / "dcp-warmup")
    times, background = [], []
    for i in range(repeat):
        path = directory / f"dcp-{i}"
        gc.collect()
        t0 = time.perf_counter()
        fut = save(tree, path)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        pending.clear()
        del fut
        shutil.rmtree(path)
        times.append(t1 - t0)
        background.append(t2 - t1)
        log(f"  DCP async_save: blocked {t1 - t0:.3f} s, written after {t2 - t1:.2f} s")
    return times, background


# ----------------------------------------------------------------------------- one size
def fits(nbytes: int) -> str | None:
    """Why a state of ``nbytes`` would not fit (None when it does)."""
    need = (1 + SLOTS) * nbytes + GB  # the peak: the state and the two flash slots, plus a margin
    avail = psutil.virtual_memory().available
    if need > avail:
        return f"needs about {need / GB:.1f} GB of memory at its peak, {avail / GB:.1f} GB available"
    shm_free = shutil.disk_usage(SHM).free
    if SLOTS * nbytes * 1.01 > shm_free:
        return f"needs {SLOTS * nbytes * 1.01 / GB:.1f} GB in {SHM}, {shm_free / GB:.1f} GB free"
    return None


def run_size(label: str, nbytes: int, repeat: int, directory: Path) -> dict[str, Any]:
    why = fits(nbytes)
    if why is not None:
        log(f"{label}: SKIPPED: {why}")
        return {"skipped": why, "tidal_block_s": None, "torch_save_s": None, "dcp_async_block_s": None,
                "memcpy_s": None}
    t0 = time.perf_counter()
    tree = build_state(nbytes)
    total = sum(t.numel() * 4 for t in tensors_of(tree))
    count = len(tensors_of(tree))
    info = describe(tree)
    log(f"{label}: {info} (built in {time.perf_counter() - t0:.1f} s)")
    cleanup = Cleanup()
    try:
        log(f"{label}: memcpy into preallocated shared memory")
        mem = bench_memcpy(tree, label, repeat, cleanup)
        cleanup.run()
        gc.collect()
        log(f"{label}: tidal FlashCheckpoint.save")
        flash = bench_tidal(tree, label, directory / f"tidal-{label}", repeat, cleanup)
        cleanup.run()
        gc.collect()
        log(f"{label}: torch.save + fsync")
        tsave, tsync = bench_torch_save(tree, directory, repeat)
        gc.collect()
        log(f"{label}: DCP async_save")
        dblock, dback = bench_dcp(tree, directory, repeat, cleanup)
    finally:
        cleanup.run()
        del tree
        gc.collect()
    res: dict[str, Any] = {
        "bytes": total, "tensors": count, "load": round(load_average(), 2),
        "tidal_block_s": median(flash["warm"]), "torch_save_s": median(tsave),
        "dcp_async_block_s": median(dblock), "memcpy_s": median(mem),
        "tidal_persist_s": median(flash["persist"]), "tidal_block_runs": flash["warm"],
        "tidal_reported_blocked_runs": flash["reported"], "tidal_cold_s": flash["cold"],
        "tidal_cold_persist_s": flash["cold_persist"], "tidal_persist_runs": flash["persist"],
        "torch_save_runs": tsave, "torch_save_fsync_s": median(tsync), "torch_save_fsync_runs": tsync,
        "dcp_async_block_runs": dblock, "dcp_background_s": median(dback), "dcp_background_runs": dback,
        "memcpy_runs": mem,
    }
    res["targets"] = {f"tidal/{peer}": {"ratio": res["tidal_block_s"] / res[key], "at_most": limit,
                                        "met": res["tidal_block_s"] <= limit * res[key]}
                      for key, peer, limit in TARGETS}
    return res


# ----------------------------------------------------------------------------- report
def report(label: str, res: dict[str, Any], repeat: int) -> str:
    if "skipped" in res:
        return f"{label}: skipped: {res['skipped']}\n"
    nbytes = res["bytes"]

    def row(method: str, key: str, runs_key: str, background: str, note: str) -> list[str]:
        s = res[key]
        ratios = [f"{s / res[k]:.3f}x" for k in ("torch_save_s", "dcp_async_block_s", "memcpy_s")]
        return [method, f"{s:.3f}", " ".join(f"{v:.3f}" for v in res[runs_key]), f"{nbytes / GB / s:.2f}", *ratios,
                background, note]

    cold = ", ".join(f"{v:.3f}" for v in res["tidal_cold_s"])
    rows = [["method", "blocked s", "runs", "GB/s", "vs torch.save", "vs DCP", "vs memcpy", "background s", "note"],
            row("tidal FlashCheckpoint.save", "tidal_block_s", "tidal_block_runs",
                f"{res['tidal_persist_s']:.2f} (persist)", f"warm; cold (slot creation): {cold} s"),
            row("torch.save + fsync", "torch_save_s", "torch_save_runs", "-",
                f"of which fsync {res['torch_save_fsync_s']:.3f} s"),
            row("DCP async_save (no_dist)", "dcp_async_block_s", "dcp_async_block_runs",
                f"{res['dcp_background_s']:.2f} (write)", "staging copy + plan"),
            row("memcpy into shm (limit)", "memcpy_s", "memcpy_runs", "-", "")]
    out = [f"{label}: {nbytes:,} bytes in {res['tensors']} tensors; median of {repeat}; load {res['load']:.2f}",
           table(rows)]
    checks = []
    for _, peer, limit in TARGETS:
        t = res["targets"][f"tidal/{peer}"]
        checks.append(f"<= {limit:g}x {peer}: {t['ratio']:.3f}x {'PASS' if t['met'] else 'MISS'}")
    out.append("targets: tidal " + "; ".join(checks))
    return "\n".join(out) + "\n"


def default_parent() -> Path:
    """A temporary directory's parent on the repository's disk (never /dev/shm)."""
    dev = os.stat(ROOT).st_dev
    for cand in (Path(tempfile.gettempdir()), ROOT.parent):
        with contextlib.suppress(OSError):
            if os.stat(cand).st_dev == dev and os.access(cand, os.W_OK):
                return cand
    return ROOT


def fs_type(path: Path) -> str:
    best = ("", "?")
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (str(path) == mp or str(path).startswith(mp.rstrip("/") + "/")) and len(mp) > len(best[0]):
            best = (mp, f"{part.fstype} on {part.device}")
    return best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sizes", default="0.1,1,4", help="state sizes in GB (10^9 bytes), comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per method (median reported)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (a temporary directory "
                        "is made in it); default: the temporary directory, on the repository's disk")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout instead of the tables")
    args = parser.parse_args()
    labels = [s.strip() for s in args.sizes.split(",") if s.strip()]
    sizes = [(f"{s}GB", round(float(s) * GB)) for s in labels]
    if args.repeat < 1 or any(n <= 0 for _, n in sizes):
        parser.error("--repeat and every size must be positive")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    cleanup_on_sigterm()

    made_parent = None
    if args.dir is not None:
        parent = Path(args.dir).resolve()
        if not parent.exists():
            parent.mkdir(parents=True)
            made_parent = parent
    else:
        parent = default_parent()
    work = Path(tempfile.mkdtemp(prefix="tidal-bench-ckpt-", dir=parent))
    results: dict[str, Any] = {}
    try:
        where = fs_type(work)
        log(f"checkpoints in {work} ({where}); torch {torch.__version__}, {torch.get_num_threads()} intra-op "
            f"threads; {MACHINE}; load {load_average():.2f}")
        if where.startswith("tmpfs"):
            log("  warning: that directory is in memory (tmpfs), not on a disk")
        for label, nbytes in sizes:
            results[label] = run_size(label, nbytes, args.repeat, work)
            if not args.json:
                print(report(label, results[label], args.repeat), flush=True)
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        raise SystemExit(130) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made_parent is not None:
            with contextlib.suppress(OSError):
                made_parent.rmdir()
        for leftover in SHM.glob(f"tidal-bench-*{os.getpid()}-*"):
            leftover.unlink(missing_ok=True)
    if args.json:
        print(json.dumps({"sizes": results}, indent=1))


if __name__ == "__main__":
    main()
