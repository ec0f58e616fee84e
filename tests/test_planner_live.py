"""A planner deciding a real job: ``tidal run --planner dlrover-rm`` with emulated device time
(the example sleeps as if a GPU ran each step, so more workers do train faster on 2 cores).

The first job starts cold (one worker), measures it, explores, and is recorded in the history
when it succeeds; the second, with the same signature, starts where the first ended (the warm
start of DLRover-RM Algorithm 1). The workers report their CPU and memory, the master shows
the planner's decisions in its status and its timeline."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import httpx

from tests.jobtools import TIDAL, Job, example_args

EMULATED = ["--device-ms-per-step", "4", "--device-us-per-sample", "40"]


def timeline(job: Job) -> dict:
    info = job.info()
    resp = httpx.get(info["url"] + "/v1/timeline", headers={"Authorization": f"Bearer {info['token']}"}, timeout=5)
    resp.raise_for_status()
    return resp.json()


def test_dlrover_rm_explores_cold_records_history_and_starts_warm(tmp_path: Path) -> None:
    history = tmp_path / "history.sqlite"
    run_args = ["--planner", "dlrover-rm", "--history", str(history), "--planner-interval", "0.5"]
    args = [*example_args(260_000, 1, 512), *EMULATED]
    cold = Job(tmp_path, "1:3", args, run_args=run_args, name="cold").start()
    try:
        st = cold.wait_status(lambda s: (s.get("planner") or {}).get("decisions", 0) >= 2, 90,
                              "the planner's second decision")
        planner = st["planner"]
        assert planner["name"] == "dlrover-rm" and not planner["overridden_by_user"]
        assert planner["last"]["from_workers"] == 1 and planner["last"]["to_workers"] > 1
        assert "explor" in planner["last"]["reason"] or "samples/s" in planner["last"]["reason"]
        assert planner["last"]["inputs"]["throughput"], "it decided from a measured point"
        shown = subprocess.run([TIDAL, "status", "--job-dir", str(cold.dir)], capture_output=True, text=True,
                               timeout=30, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
        assert shown.returncode == 0 and "planner dlrover-rm, " in shown.stdout and "last: at " in shown.stdout
        seen = timeline(cold)
        assert seen["planner"] == "dlrover-rm" and len(seen["decisions"]) >= 2 and seen["points"]
        assert any(w["cpu_percent"] > 0 and w["rss_bytes"] > 10 << 20 for w in seen["workers"])
        assert cold.wait(180) == 0, cold.output()[-2000:]
    finally:
        cold.kill_all()
    out = cold.output()
    assert "planner dlrover-rm: 3 -> 1 workers (cold start: one worker)" in out
    rows = sqlite3.connect(history).execute("SELECT config, params FROM jobs").fetchall()
    assert len(rows) == 1 and '"knee"' in rows[0][1]

    warm = Job(tmp_path, "1:3", args, run_args=run_args, name="warm").start()
    try:
        assert warm.wait(180) == 0, warm.output()[-2000:]
    finally:
        warm.kill_all()
    first = next(line for line in warm.output().splitlines() if "planner dlrover-rm:" in line)
    assert "warm start (Algorithm 1) from" in first and "-> 1 workers" not in first
