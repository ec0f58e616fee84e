"""How the cluster scenarios' results depend on the offered load (issue 4's misses).

The 500-job windows of the Philly trace ask a 64-GPU cluster for 5-15x its capacity, while
the papers ran trace samples their clusters could serve (GoldMiner section 5.6: the
hardware-ratio baseline has near-zero queuing). This runs every policy of the easyscale and
goldminer scenarios on the same windows, at Philly's own arrival times and with the arrivals
stretched to a set of offered loads (``tidal.sim.cluster.api.at_load``), and prints each
policy's average JCT gain over the scenario's baseline and its average queuing.

    .venv/bin/python bench/cluster_load.py [--scenarios easyscale,goldminer] [--loads trace,2,1,0.5,0.25]
                                           [--seeds 0,1,2] [--jobs 500] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tidal.sim.cluster import scenario

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / ".." / "shared" / "traces" / "philly-jobs.csv"
BASELINE = {"easyscale": "yarn-cs", "goldminer": "no-dw-tuned"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="easyscale,goldminer")
    ap.add_argument("--loads", default="trace,2,1,0.5,0.25", help="'trace' keeps Philly's arrival times")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    loads = [None if x == "trace" else float(x) for x in args.loads.split(",")]
    rows = []
    for name in args.scenarios.split(","):
        module = scenario(name)
        base = BASELINE[name]
        print(f"\n{name}: {args.jobs} jobs; gain = avg JCT of {base} / avg JCT of the policy; queue in hours")
        print(f"{'seed':>4} {'load':>6} " + " ".join(f"{p:>22}" for p in module.POLICIES) + f" {'time':>6}")
        for seed in map(int, args.seeds.split(",")):
            for load in loads:
                t0 = time.monotonic()
                res = module.run(args.trace, args.jobs, seed, list(module.POLICIES), load).policies
                ref = res[base].avg_jct_s
                cells = [f"{ref / m.avg_jct_s:6.2f}x q {m.avg_queue_s / 3600:8.2f}h" for m in res.values()]
                label = "trace" if load is None else f"{load:g}"
                print(f"{seed:>4} {label:>6} " + " ".join(f"{c:>22}" for c in cells)
                      + f" {time.monotonic() - t0:5.1f}s", flush=True)
                rows.append({"scenario": name, "seed": seed, "load": load,
                             "policies": {p: m.to_json() for p, m in res.items()}})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
