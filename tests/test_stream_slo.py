"""``tidal run --stream --lag-slo S --traffic-history CSV``: a real job on a real redis-server whose
kale planner is seeded with past traffic, and whose lag, held to a tiny SLO, is scored in
``tidal status``, on ``/metrics`` and drawn by the dashboard in real headless Chromium; and bad
input to the two options, a one-line error before anything starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
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
        (None, ["--planned-lag", "0"], "--planned-lag must be between"),
        (None, ["--planner", "hpa", "--planned-lag", "90"], "--planned-lag is kale's; planner hpa has none"),
        (None, ["--program-hours", "0"], "--program-hours must be in (0, 24], got 0"),
        (None, ["--program-lag-ratio", "0.3"], "--program-lag-ratio needs --program-hours"),
        (None, ["--program-hours", "3", "--program-lag-price", "-1"], "--program-lag-price needs --program-hours and"),
        (None, ["--planner", "hpa", "--program-hours", "3"], "--program-hours is kale's; planner hpa has none"),
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
    out = run("--program-hours", "3", str(script), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip() == "tidal: error: --program-hours needs --stream", out.stderr
    for options in (["--lag-price", "5"], ["--planned-lag", "90"]):
        out = run(*options, str(script), cwd=tmp_path)
        assert out.returncode == 2 and out.stderr.strip() == (
            "tidal: error: --load-headroom, --lag-price and --planned-lag need --stream"), out.stderr


def test_the_arrival_rate_a_stream_job_sees_is_the_producers(tmp_path: Path) -> None:
    """``tidal produce`` writes 20 records per trace second (1,200 a minute) into 2 partitions at
    --speedup 12: 240 records/s of wall time. The job replays at --time-scale 12, so its status and
    /metrics show the trace's rate, counted from what was appended to the partitions (the rate a
    stream planner is handed: ``tidal.master.planning.ArrivalMeter``)."""
    trace = tmp_path / "trace.csv"
    trace.write_text("minute,records\n" + "".join(f"{m},1200\n" for m in range(30)))
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 2, [1, 1])  # the partitions exist when the workers first look
        job = Job(tmp_path, "1:1", ARGS, run_args=["--stream", url, "--time-scale", "12"]).start()
        producer = None
        try:
            job.wait_status(lambda s: s["finalized_step"] >= 0, 120, "the first step")
            producer = subprocess.Popen([TIDAL, "produce", "--stream", url, "--partitions", "2", "--trace", str(trace),
                                         "--speedup", "12", "--first-index", "2", "-q"], start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            job.wait_status(lambda s: ((s["stream_lag"] or {}).get("arrivals_per_s") or 0.0) > 10.0, 60,
                            "records arriving")  # the producer started (it imports numpy and the example)
            time.sleep(1.0)  # the count from before it started is out of the window
            rates = []
            for _ in range(6):  # a reading a second for six seconds
                rates.append(job.status()["stream_lag"]["arrivals_per_s"])
                time.sleep(1.0)
            assert producer.poll() is None, "the producer ended before the readings"
            assert abs(float(np.median(rates)) - 20.0) <= 3.0, rates
            info = job.info()
            metrics = httpx.get(info["url"] + "/metrics", timeout=5,
                                headers={"Authorization": f"Bearer {info['token']}"}).text
            assert abs(metric(metrics, "tidal_stream_arrivals_per_second") - 20.0) <= 4.0
            if chromium.available():  # and the dashboard shows it
                with chromium.Browser(timeout=20) as browser:
                    browser.navigate(f"{info['url']}/dashboard?token={info['token']}")
                    browser.wait_until("document.getElementById('arrivals-now').dataset.value > 0", timeout=20)
                    shown = browser.evaluate("Number(document.getElementById('arrivals-now').dataset.value)")
                    assert abs(shown - 20.0) <= 4.0, shown
                    assert browser.errors() == []
        finally:
            if producer is not None:
                os.killpg(producer.pid, signal.SIGKILL)
                producer.wait()
            job.kill_all()
