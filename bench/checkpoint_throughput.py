"""Training throughput while flash checkpoints persist (issue "Flash checkpoint, and resume").

    .venv/bin/python bench/checkpoint_throughput.py [--every 10s] [--workers 2] [--samples N] [--rounds 2] [--json]

The example (examples/ctr/train.py, ``--model-size large``: tens of MB of parameters and Adam
state) trained by ``tidal run --workers W:W`` to the end of one epoch, alternately without
checkpoints and with ``--checkpoint-dir DIR --checkpoint-every EVERY`` (rank 0 copies the state
into shared memory at a step boundary; the persister process hashes and writes it to DIR,
fsync, rename, while training goes on), ``--rounds`` times each (A B A B ...: a slow phase of
the machine hits both). Throughput is the steady samples/s from per-step stamps
(bench/common.py ``steady_rate``: 3 s after the first step to 0.5 s before the last), the
median over rounds; the ratio with/without is the figure (target: at least 0.95x). The
checkpoints written in each run are counted (the run must actually have persisted some).

No accelerator time is emulated: both sides run the real CPU model on the same 2 cores, so the
persister's work (hashing and writing ~50 MB every EVERY) competes with training for CPU,
the pessimistic case.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average, median, one_epoch_args, steady_tidal, table
from tidal.worker.flash import list_checkpoints


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", default="10s", help="--checkpoint-every of the runs with checkpoints")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--samples", type=int, default=200_000, help="samples of the one epoch (about 80 s a run here)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="runs of each kind, alternated")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    train = [*one_epoch_args(args.samples, args.batch_size), "--model-size", "large"]
    base = Path(tempfile.mkdtemp(prefix="ckpt-thp-"))
    rates: dict[str, list[float]] = {"none": [], "flash": []}
    persisted: list[int] = []
    try:
        for i in range(args.rounds):
            for kind in ("none", "flash"):
                work = base / f"{kind}-{i}"
                opts = ["--planner", "fixed", "--history", "none"]
                if kind == "flash":
                    opts += ["--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", args.every]
                load = load_average()
                rate = steady_tidal(work, args.workers, train, run_opts=opts)
                rates[kind].append(rate)
                count = len(list_checkpoints(work / "ckpt")) if kind == "flash" else 0
                if kind == "flash":
                    persisted.append(count)
                print(f"{kind} {i}: {rate:,.0f} samples/s" + (f", {count} checkpoints persisted" if kind == "flash"
                                                              else "") + f" (load {load:.2f})",
                      file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    none, flash = median(rates["none"]), median(rates["flash"])
    result = {"every": args.every, "workers": args.workers, "samples_per_s_none": none,
              "samples_per_s_flash": flash, "ratio": flash / none, "runs": rates, "checkpoints_persisted": persisted}
    if args.json:
        print(json.dumps(result))
        return 0
    print(table([["run", "samples/s (median)", "runs"],
                 ["no checkpoints", f"{none:,.0f}", ", ".join(f"{r:,.0f}" for r in rates["none"])],
                 [f"flash every {args.every}", f"{flash:,.0f}", ", ".join(f"{r:,.0f}" for r in rates["flash"])]]))
    verdict = "PASS" if flash / none >= 0.95 else "MISS"
    print(f"ratio {flash / none:.3f}x (target >= 0.95x: {verdict}); checkpoints persisted per run: {persisted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
