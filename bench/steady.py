"""Steady-state training throughput: tidal vs torchrun + DDP, 2 workers (issue 2, part 3).

    .venv/bin/python bench/steady.py [--samples 2000000] [--repeats 2] [--json]

Both runs train the CTR example (DLRM on ClickDataset, batch 512 per worker, Adam, gloo, one
intra-op thread per worker, ``OMP_NUM_THREADS=1``) with 2 worker processes on this machine:

* tidal: ``tidal run --workers 2:2 bench/common.py`` (examples/ctr/train.py's own ``main`` with
  a step stamp; the master runs as a third process, as it does in production);
* torchrun: one agent, ``--nproc-per-node 2``, c10d rendezvous on 127.0.0.1,
  ``bench/ddp_ctr.py`` (DistributedSampler over batch index ranges, DDP; no checkpoints).

Samples/s = samples of every step stamped in the steady window / window length
(bench/common.py ``steady_rate``). The window starts ``--warmup`` seconds after the first step
of the run (start-up, first rendezvous, first state sync are excluded) and ends 0.5 s before the
last step (the tail where a worker may run out of data early). Runs alternate tidal/torchrun;
the median over repeats is reported, with the 1-minute load average before each run, and the
median of the ratios of the back-to-back pairs (the steadier figure when the machine is shared:
a pair sees about the same background load).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average, median, one_epoch_args, runs, steady_ddp, steady_tidal, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2_000_000, help="samples of the one epoch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds after the first step left out")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--keep", type=Path, default=None, help="keep logs and stamps here")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tidal-steady-")) if args.keep is None else args.keep
    tidal_rates: list[float] = []
    peer_rates: list[float] = []
    load: list[float] = []
    try:
        for i in range(args.repeats):
            load.append(load_average())
            tidal_rates.append(steady_tidal(base / f"tidal-{i}", 2, one_epoch_args(args.samples), args.warmup))
            load.append(load_average())
            peer_rates.append(steady_ddp(base / f"torchrun-{i}", 2, one_epoch_args(args.samples), args.warmup))
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    t, r = median(tidal_rates), median(peer_rates)
    paired = [a / b for a, b in zip(tidal_rates, peer_rates, strict=True)]
    result = {"samples_per_s": {"tidal": t, "torchrun": r, "ratio": t / r, "paired_ratio": median(paired)},
              "runs": {"tidal": tidal_rates, "torchrun": peer_rates}, "load_average": load}
    if args.json:
        print(json.dumps(result))
        return
    print(table([
        ["2 workers, batch 512/worker", "tidal", "torchrun+DDP", "ratio", "target"],
        ["samples/s (median)", f"{t:,.0f}", f"{r:,.0f}", f"{t / r:.2f}x", ">= 0.95x"],
        ["runs", runs(tidal_rates, "{:,.0f}"), runs(peer_rates, "{:,.0f}"), runs(paired, "{:.2f}x"), ""],
        ["median of the run pairs' ratios", "", "", f"{median(paired):.2f}x", ">= 0.95x"],
    ]))
    print(f"load average (1 min) before each run (tidal, torchrun, ...): {runs(load, '{:.2f}')}")


if __name__ == "__main__":
    main()
