"""Logical workers (EasyScale ESTs, issue 5): what they cost against plain data parallelism.

    .venv/bin/python bench/est.py [--part overhead,ests,reduce] [--procs 2,4] [--ests 1,2,4,8]
                                  [--sizes-mb 1,10,100] [--reduce-procs 2,4] [--repeats 3] [--json]

Three measurements, each printed as a table with its peer side by side and the ratio:

1. **overhead** (target: >= 0.97x). N logical workers on N processes
   (``tidal run --logical-workers N --workers N:N bench/common.py``: examples/ctr/train.py's own
   ``main`` with a stamp per batch) against plain DDP under torchrun on N processes
   (bench/ddp_ctr.py, ``--nproc-per-node N``), the same DLRM, ClickDataset, batch 512 per worker,
   Adam, gloo, one intra-op thread. Samples/s over the steady window (bench/common.py
   ``steady_rate``: 3 s after the first step to 0.5 s before the last). tidal without logical
   workers (``--workers N:N``, one collective per step) is shown as a third column, to separate
   the cost of the logical-worker path from tidal's own. Runs alternate, median of
   ``--repeats``. With 4 processes the 2 cores are oversubscribed (4 busy processes plus the
   master), so N = 4 measures contention as much as the runtime: both sides share it alike.

2. **ests** (target: throughput >= 0.95x; memory growth about the stashed gradients). E
   logical workers in ONE process (``python bench/common.py --logical-workers E --batch-size B``,
   a local tidal job without a master: the E batches of a step run one after the other, as
   EasyScale's ESTs do) against one plain PyTorch process with the same global batch, no tidal
   (bench/ddp_ctr.py under plain ``python``: no process group, no DDP), in two forms:
   - **accumulated** (the target's peer): ``--accumulate E --batch-size B``, E micro-batches of
     B per optimizer step, each loss scaled by its share: the same arithmetic per sample as the
     ESTs (E forward/backward passes of B samples and one Adam step), the same activation
     memory, so the only differences are what tidal adds: the stash, the ordered sum, D1;
   - **one batch** (shown, no target): ``--batch-size E*B``, the E batches as one forward and
     backward. On this small model a larger batch is much more efficient per sample (E times
     fewer kernel launches and Python calls), and its activations are E times larger, so
     memory can come out lower for the ESTs. This is the cost of keeping N workers' semantics
     on fewer processes, not of tidal's machinery: a one-batch run computes a different sum.
   The same samples per run. Reported: samples/s (bench/common.py ``steady_rate``, warm-up 1 s)
   and the peak resident set while training (the largest of the RSS samples the worker takes
   every 16 stamps, bench/common.py ``StampWriter``; ``VmHWM``, the peak over the whole process
   life, is in the JSON: start-up and the example's final evaluation dominate it). The bound
   on the memory growth over the accumulated run is the gradient stash, one gradient per EST
   (E x 134,193 parameters x 4 bytes = E x 0.51 MiB, shown); in one process (it holds logical
   rank 0) the stash folds each EST's gradient into the first as it is made, so it keeps about
   two (the sum and the EST in flight). Fairness: the logical run also pays what D1 implies
   (``torch.use_deterministic_algorithms(True)``, per-EST reseeding of the generators, and
   the save/restore of persistent module buffers at every EST switch, which DLRM has none
   of): that is the feature's cost as shipped.

3. **reduce** (no target: the cost of D1's reduction). k processes (started with
   ``subprocess``, each forms its group with ``tidal.worker.comm.RoundComm.connect`` against a
   ``TCPStore`` this script serves on 127.0.0.1, so the group is exactly tidal's) time
   ``reduce_in_logical_order`` (one contribution per process, N = k: an all-to-all, the
   left-to-right sum of the owned slice, an all-gather) against ``reduce_by_allreduce`` (one
   gloo all-reduce) on fp32 gradients of 1, 10 and 100 MiB. Each repetition starts after a small
   all-reduce used as a barrier; median over ``--reduce-reps`` after 2 warm-up calls, as seen by
   rank 0. The two results are checked to agree (allclose); peak RSS per process is reported,
   and the whole run is timed (100 MiB x 4 processes on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    DDP_WORKER,
    PYTHON,
    ROOT,
    WORKER,
    bench_env,
    free_port,
    load_average,
    load_peak_rss,
    median,
    one_epoch_args,
    run_to_end,
    runs,
    steady_ddp,
    steady_rate,
    steady_tidal,
    table,
)

BATCH = 512
PARAMS = 134_193  # examples/ctr/model.py DLRM() with its defaults
PARAM_MIB = PARAMS * 4 / 2**20


# ---------------------------------------------------------------------------- 1. overhead
def overhead(base: Path, procs: list[int], samples: int, repeats: int) -> list[dict[str, Any]]:
    out = []
    for n in procs:
        rates: dict[str, list[float]] = {"logical": [], "ddp": [], "tidal": []}
        load: list[float] = []
        for i in range(repeats):
            work = base / f"overhead-{n}-{i}"
            load.append(load_average())
            rates["logical"].append(steady_tidal(work / "lw", n, one_epoch_args(samples),
                                                 run_opts=["--logical-workers", str(n)]))
            rates["ddp"].append(steady_ddp(work / "ddp", n, one_epoch_args(samples)))
            rates["tidal"].append(steady_tidal(work / "plain", n, one_epoch_args(samples)))
        med = {k: median(v) for k, v in rates.items()}
        out.append({"procs": n, "samples_per_s": med, "runs": rates, "load_average": load,
                    "ratio_logical_ddp": med["logical"] / med["ddp"], "ratio_tidal_ddp": med["tidal"] / med["ddp"],
                    "oversubscribed": n > (os.cpu_count() or 1)})
    return out


# ---------------------------------------------------------------------------- 2. ESTs per process
def ests(base: Path, counts: list[int], samples: int, repeats: int) -> list[dict[str, Any]]:
    """Part 2: E ESTs in one tidal process against two plain-PyTorch processes (no tidal)."""
    kinds = ("logical", "accumulate", "one_pass")
    out = []
    for e in counts:
        res: dict[str, dict[str, list[float]]] = {k: {"rate": [], "rss_mib": [], "hwm_mib": []} for k in kinds}
        load: list[float] = []
        commands = {
            "logical": [PYTHON, WORKER, *one_epoch_args(samples), "--logical-workers", str(e)],
            "accumulate": [PYTHON, DDP_WORKER, *one_epoch_args(samples), "--accumulate", str(e)],
            "one_pass": [PYTHON, DDP_WORKER, *one_epoch_args(samples, e * BATCH)],
        }
        for i in range(repeats):
            load.append(load_average())
            for kind in kinds:
                if kind == "one_pass" and e == 1:
                    continue  # the same command as "accumulate"
                work = base / f"ests-{e}-{i}-{kind}"
                run_to_end([*commands[kind], "--stamp-dir", str(work)], base / f"ests-{e}-{i}-{kind}.log",
                           bench_env(), timeout=400)
                res[kind]["rate"].append(steady_rate(work, 1.0)[0])
                ((rss, hwm),) = load_peak_rss(work).values()
                res[kind]["rss_mib"].append(rss / 1024)
                res[kind]["hwm_mib"].append(hwm / 1024)
        if e == 1:
            res["one_pass"] = res["accumulate"]
        med = {k: {m: median(v) for m, v in d.items()} for k, d in res.items()}
        out.append({"ests": e, "median": med, "runs": res, "load_average": load,
                    "ratio": med["logical"]["rate"] / med["accumulate"]["rate"],
                    "ratio_one_pass": med["logical"]["rate"] / med["one_pass"]["rate"],
                    "rss_growth_mib": med["logical"]["rss_mib"] - med["accumulate"]["rss_mib"],
                    "expected_stash_mib": e * PARAM_MIB})
    return out


# ---------------------------------------------------------------------------- 3. reduction
def reduce_worker(args: argparse.Namespace) -> None:
    """One of the k processes: form tidal's group, time both reductions, write JSON."""
    import torch

    from bench.common import peak_rss_kb
    from tidal.worker.comm import RoundComm

    torch.set_num_threads(1)
    comm = RoundComm.connect(host="127.0.0.1", port=args.port, prefix="est-bench/", rank=args.rank,
                             world_size=args.world, backend="gloo", device=torch.device("cpu"), timeout_s=300)
    barrier = torch.zeros(1)
    result: dict[str, Any] = {"rank": args.rank, "sizes": {}}
    for mb in args.sizes_mb:
        n = int(mb * 2**20) // 4
        gen = torch.Generator().manual_seed(1000 + args.rank)
        local = [[torch.randn(n, generator=gen)]]  # one logical worker per process, one flat parameter
        counts, row = [1] * args.world, [0] * 6
        # the mean over the k contributions: summed, then scaled once (both leave ``local`` as it is:
        # the logical order copies it into its send buffer, the all-reduce adds it unweighted)
        mean = 1.0 / args.world
        ref, t_logical = _timed(comm, barrier, args.reps,
                                partial(comm.reduce_in_logical_order, local, counts, mean, row))
        out, t_allreduce = _timed(comm, barrier, args.reps, partial(comm.reduce_by_allreduce, local, 1.0, row))
        agree = bool(torch.allclose(ref[0][0], out[0][0] * mean, rtol=1e-5, atol=1e-5))
        del ref, out
        times = {"logical": t_logical, "allreduce": t_allreduce}
        result["sizes"][str(mb)] = {"times": times, "agree": agree}
    result["peak_rss_mib"] = peak_rss_kb() / 1024
    comm.close()
    Path(args.out).write_text(json.dumps(result))


def _timed(comm: Any, barrier: Any, reps: int, fn: Callable[[], Any]) -> tuple[Any, list[float]]:
    """(last result, seconds of each of ``reps`` calls after 2 warm-up calls), a barrier before each."""
    times, out = [], None
    for rep in range(2 + reps):
        comm.group.allreduce([barrier]).wait()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        if rep >= 2:
            times.append(dt)
    return out, times


def reduce_bench(base: Path, procs: list[int], sizes_mb: list[float], reps: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out = []
    for k in procs:
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=300))
        load = load_average()
        t0 = time.time()
        files = [base / f"reduce-{k}-{r}.json" for r in range(k)]
        children = [subprocess.Popen([PYTHON, __file__, "--role", "reduce-worker", "--rank", str(r), "--world", str(k),
                                      "--port", str(port), "--reduce-reps", str(reps),
                                      "--sizes-mb", ",".join(str(s) for s in sizes_mb), "--out", str(files[r])],
                                     env=bench_env(), cwd=ROOT) for r in range(k)]
        try:
            for c in children:
                if c.wait(timeout=540) != 0:
                    raise RuntimeError(f"reduce worker exited with {c.returncode}")
        finally:
            for c in children:
                if c.poll() is None:
                    c.kill()
            del store
        wall = time.time() - t0
        res = [json.loads(f.read_text()) for f in files]
        rows = []
        for mb in sizes_mb:
            r0 = res[0]["sizes"][str(mb)]
            lo, ar = statistics.median(r0["times"]["logical"]), statistics.median(r0["times"]["allreduce"])
            rows.append({"mb": mb, "logical_ms": 1e3 * lo, "allreduce_ms": 1e3 * ar, "ratio": lo / ar,
                         "agree": all(r["sizes"][str(mb)]["agree"] for r in res),
                         "runs_logical_ms": [1e3 * t for t in r0["times"]["logical"]],
                         "runs_allreduce_ms": [1e3 * t for t in r0["times"]["allreduce"]]})
        out.append({"procs": k, "sizes": rows, "peak_rss_mib": [r["peak_rss_mib"] for r in res], "wall_s": wall,
                    "load_average": load})
    return out


# ---------------------------------------------------------------------------- report
def report(result: dict[str, Any]) -> None:
    if "overhead" in result:
        rows = [["processes", "tidal LW samples/s", "torchrun+DDP samples/s", "ratio", "target",
                 "tidal plain samples/s", "plain/DDP", "runs LW | DDP | plain", "load"]]
        for r in result["overhead"]:
            m, fmt = r["samples_per_s"], "{:,.0f}"
            rows.append([f"{r['procs']}{' (oversubscribed)' if r['oversubscribed'] else ''}", fmt.format(m["logical"]),
                         fmt.format(m["ddp"]), f"{r['ratio_logical_ddp']:.2f}x", ">= 0.97x", fmt.format(m["tidal"]),
                         f"{r['ratio_tidal_ddp']:.2f}x",
                         f"{runs(r['runs']['logical'], fmt)} | {runs(r['runs']['ddp'], fmt)} | "
                         f"{runs(r['runs']['tidal'], fmt)}", runs(r["load_average"], "{:.2f}")])
        print("1. N logical workers on N processes vs DDP on N processes (batch 512 per worker)")
        print(table(rows) + "\n")
    if "ests" in result:
        rows = [["ESTs E", "LW samples/s", "plain, E x 512 accumulated", "ratio", "target",
                 "plain, one batch of E x 512", "ratio", "LW RSS MiB", "accumulated RSS MiB", "growth MiB",
                 "stash E x params MiB", "runs LW | accumulated | one batch", "load"]]
        for r in result["ests"]:
            m, fmt = r["median"], "{:,.0f}"
            rows.append([str(r["ests"]), fmt.format(m["logical"]["rate"]), fmt.format(m["accumulate"]["rate"]),
                         f"{r['ratio']:.2f}x", ">= 0.95x", fmt.format(m["one_pass"]["rate"]),
                         f"{r['ratio_one_pass']:.2f}x", f"{m['logical']['rss_mib']:.1f}",
                         f"{m['accumulate']['rss_mib']:.1f}", f"{r['rss_growth_mib']:+.1f}",
                         f"{r['expected_stash_mib']:.2f}",
                         " | ".join(runs(r["runs"][k]["rate"], fmt) for k in ("logical", "accumulate", "one_pass")),
                         runs(r["load_average"], "{:.2f}")])
        print("2. E logical workers in one process vs one plain PyTorch process with the same global batch "
              "(RSS: peak while training)")
        print(table(rows) + "\n")
    if "reduce" in result:
        rows = [["processes", "gradient MiB", "logical order ms", "gloo all-reduce ms", "ratio", "results agree",
                 "peak RSS MiB / process", "wall s", "load"]]
        for r in result["reduce"]:
            for s in r["sizes"]:
                rows.append([str(r["procs"]), f"{s['mb']:g}", f"{s['logical_ms']:.1f}", f"{s['allreduce_ms']:.1f}",
                             f"{s['ratio']:.2f}x", str(s["agree"]), runs(r["peak_rss_mib"], "{:.0f}"),
                             f"{r['wall_s']:.0f}", f"{r['load_average']:.2f}"])
        print("3. reduce_in_logical_order vs reduce_by_allreduce (one contribution per process; median, rank 0)")
        print(table(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="overhead,ests,reduce", help="comma-separated: overhead, ests, reduce")
    p.add_argument("--procs", default="2", help="process counts of part 1 (e.g. 2,4)")
    p.add_argument("--samples", type=int, default=2_000_000, help="samples of part 1's one epoch")
    p.add_argument("--ests", default="1,2,4,8", help="logical workers per process of part 2")
    p.add_argument("--est-samples", type=int, default=1_000_000, help="samples of part 2's one epoch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes-mb", default="1,10,100")
    p.add_argument("--reduce-procs", default="2,4")
    p.add_argument("--reduce-reps", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", type=Path, default=None, help="keep logs and stamps here")
    p.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes_mb = [float(x) for x in args.sizes_mb.split(",")]
    args.reps = args.reduce_reps
    if args.role == "reduce-worker":
        reduce_worker(args)
        return
    parts = set(args.part.split(","))
    base = Path(tempfile.mkdtemp(prefix="tidal-est-")) if args.keep is None else args.keep
    base.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    try:
        if "overhead" in parts:
            result["overhead"] = overhead(base, [int(x) for x in args.procs.split(",")], args.samples, args.repeats)
        if "ests" in parts:
            result["ests"] = ests(base, [int(x) for x in args.ests.split(",")], args.est_samples, args.repeats)
        if "reduce" in parts:
            result["reduce"] = reduce_bench(base, [int(x) for x in args.reduce_procs.split(",")], args.sizes_mb,
                                            args.reduce_reps)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)


if __name__ == "__main__":
    main()
