"""``tidal run --stream --lag-slo S --traffic-history CSV``: a real job on a real redis-server whose
kale planner is seeded with past traffic, and whose lag, held to a tiny SLO, is scored in
``tidal status``, on ``/metrics`` and drawn by the dashboard in real headless Chromium; and bad
input to the two options, a one-line error before anything starts."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from tests import chromium
from tests.jobtools import TIDAL, Job
from tests.redis_server import redis_server
from tests.test_stream_job import produce

# one worker, 128 records a step and a step every 0.1 s: 8000 records waiting take ~6 s to drain
ARGS = ["--batch-size", "128", "--step-sleep", "0.1", "--log-every", "0"]
HISTORY_ROWS = 3000  # minutes: above the 290 ten-minute bins kale fits its forecaster on

READ_LAG = """(() => {
  const v = (id) => document.getElementById(id).dataset.value;
  return {
    error: document.body.dataset.error || null,
    hidden: document.getElementById("lag-section").hidden,
    series: [...document.querySelectorAll("#chart-lag polyline.series")].map((p) => p.dataset.series),
    lag: Number(v("lag-now")), slo: Number(v("lag-slo")), violation: Number(v("slo-violation")),
    partitions: [...document.querySelectorAll("#partitions tr[data-partition]")].map((tr) => ({...tr.dataset})),
  };
})()"""


def history_csv(path: Path, rows: int = HISTORY_ROWS) -> Path:
    """Past traffic: a daily cycle, records per minute."""
    lines = ["minute,records"] + [f"{m},{600 + 400 * ((m // 60) % 24 >= 8)}" for m in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, (name, text)
    return float(found.group(1))


def test_kale_is_seeded_and_the_lag_is_scored_against_its_slo(tmp_path: Path) -> None:
    history = history_csv(tmp_path / "history.csv")
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 2, [4000, 4000])  # waiting before the job starts: the lag passes 0.5 s at once
        job = Job(tmp_path, "1:1", ARGS, run_args=[
            "--planner", "kale", "--planner-interval", "0.5", "--stream", url, "--lag-slo", "0.5",
            "--traffic-history", str(history), "--traffic-column", "records"]).start()
        try:
            st = job.wait_status(lambda s: s["stream_lag"] is not None and s["stream_lag"]["violation_ratio"] > 0
                                 and s["finalized_step"] >= 3, 120, "the lag scored over the SLO")
            assert st["planner"]["name"] == "kale" and st["planner"]["history_bins"] == HISTORY_ROWS
            assert st["planner"]["history_interval_s"] == 60.0
            assert st["stream_lag"]["slo_s"] == 0.5 and st["stream_lag"]["observed_s"] > 0
            env = {**os.environ, "TIDAL_HOME": str(job.dir.parent / ".tidal"), "COLUMNS": "200"}
            text = subprocess.run([TIDAL, "status", "--job-dir", str(job.dir)], capture_output=True, text=True,
                                  timeout=60, env=env).stdout
            assert f"seeded with {HISTORY_ROWS} bins of 60 s traffic history" in text, text
            assert "stream partitions: 0: committed" in text and "vs SLO 0.5 s (trace time)" in text, text
            assert re.search(r"SLO violated \d+\.\d% of", text), text

            info = job.info()
            auth = {"Authorization": f"Bearer {info['token']}"}
            metrics = httpx.get(info["url"] + "/metrics", timeout=5, headers=auth).text
            assert metric(metrics, "tidal_stream_lag_slo_seconds") == 0.5
            assert 0 < metric(metrics, "tidal_stream_slo_violation_ratio") <= 1
            assert metric(metrics, "tidal_stream_accumulated_lag_minutes_total") > 0
            assert metric(metrics, "tidal_stream_lag_seconds") >= 0
            assert 'tidal_stream_lag_records{partition="1"}' in metrics
            assert metric(metrics, 'tidal_stream_partition_lag_seconds{partition="1"}') >= 0
            assert re.search(r"1: committed \S+, worker 0, lag \d+ records / \d+\.\d s", text), text

            if chromium.available():  # the dashboard draws the lag against the SLO line
                with chromium.Browser(timeout=20) as browser:
                    browser.navigate(f"{info['url']}/dashboard?token={info['token']}")
                    browser.wait_until("document.querySelectorAll('#chart-lag polyline.series').length === 2",
                                       timeout=20)
                    shown = browser.evaluate(READ_LAG)
                    assert shown["error"] is None and not shown["hidden"], shown
                    assert set(shown["series"]) == {"lag", "SLO"} and shown["slo"] == 0.5, shown
                    assert 0 < shown["violation"] <= 1 and shown["lag"] >= 0, shown
                    assert [p["partition"] for p in shown["partitions"]] == ["0", "1"], shown
                    assert all(float(p["lagS"]) >= 0 and int(p["lag"]) >= 0 for p in shown["partitions"]), shown
                    assert browser.errors() == []
        finally:
            job.kill_all()
        assert "planner kale failed" not in job.output(), job.output()[-3000:]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TIDAL, "run", "--job-dir", str(cwd / "job"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "TIDAL_HOME": str(cwd / "home")})


@pytest.mark.parametrize(
    ("csv", "options", "needle"),
    [
        (None, ["--traffic-history", "missing.csv"], "--traffic-history missing.csv: no such file"),
        ("", [], "needs a header and at least two rows"),
        ("minute,records\n0,5\n1,6\n", ["--traffic-column", "hits"], "no column 'hits'"),
        ("minute,records\n0,5\n1,-6\n2,7\n", [], "line 3: negative count -6"),
        ("minute,records\n0,5\n1,6\n", ["--planner", "hpa"], "planner hpa keeps no arrival history"),
        ("minute,records\n0,5\n1,6\n", ["--lag-slo", "0"], "--lag-slo"),
        (None, ["--load-headroom", "0"], "--load-headroom must be between 0.5 and 10"),
        (None, ["--lag-price", "-1"], "--lag-price must be between 0 and"),
        (None, ["--planner", "hpa", "--lag-price", "5"], "--load-headroom and --lag-price are kale's; planner hpa"),
    ],
)
def test_bad_traffic_history_or_slo_is_one_line(tmp_path: Path, csv: str | None, options: list[str],
                                                needle: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    given = [] if csv is None else ["--traffic-history", "history.csv"]
    if csv is not None:
        (tmp_path / "history.csv").write_text(csv)
    # an unreachable stream: the options are refused before tidal would find out
    out = run("--stream", "redis://127.0.0.1:1/x", *given, *options, str(script), cwd=tmp_path)
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("tidal: error: "), out.stderr
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "job").exists()  # nothing was started


def test_the_stream_options_need_a_stream(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    history_csv(tmp_path / "h.csv", 3)
    for options in (["--lag-slo", "60"], ["--traffic-history", "h.csv"]):
        out = run(*options, str(script), cwd=tmp_path)
        assert out.returncode == 2 and out.stderr.strip() == (
            "tidal: error: --lag-slo, --traffic-history and --traffic-column need --stream"), out.stderr
    out = run("--lag-price", "5", str(script), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip() == (
        "tidal: error: --load-headroom and --lag-price need --stream"), out.stderr
