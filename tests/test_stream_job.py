"""``tidal run --stream``: real jobs reading a real redis-server, exactly once through SIGKILLs of
workers and of the master (issue 18). The ledger names record ids; `tidal audit --stream` reads
the stream back (XRANGE) and checks every record up to the committed position once."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.jobtools import ROOT, TIDAL, Job, wait_for
from tests.redis_server import redis_server
from tidal.api.streams import parse_id
from tidal.data.streams import open_source
from tidal.master.audit import audit_stream

sys.path.insert(0, str(ROOT))
from examples.ctr.stream import ClickRecords

ARGS = ["--batch-size", "128", "--step-sleep", "0.02", "--log-every", "0"]


def produce(url: str, partitions: int, per_partition: list[int], first_index: int = 0) -> int:
    source = open_source(url)
    records = ClickRecords()
    at = first_index
    try:
        for p in range(partitions):
            for start in range(0, per_partition[p], 1000):
                n = min(1000, per_partition[p] - start)
                source.append(p, records.encode(at, n))
                at += n
    finally:
        source.close()
    return at


def audit(job: Job, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TIDAL, "audit", str(job.ledger), "--stream", url], capture_output=True, text=True,
                          timeout=120)


def assert_every_worker_kept(job: Job) -> None:
    """No worker was declared failed: a re-form for a partition that came or went is taken by every
    member at the same step (a worker that left alone once held its peer in the step's collective
    for the 60-s collective timeout, and the master replaced that healthy worker)."""
    failed = [line for line in job.output().splitlines() if re.search(r"worker \d+ failed", line)]
    assert not failed, "\n".join(failed)


@pytest.mark.speed_free
def test_a_stream_job_trains_every_record_once_through_sigkills(tmp_path: Path) -> None:
    rng = random.Random(7)
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produced = produce(url, 3, [6000, 3000, 2000])
        job = Job(tmp_path, "2:2", ARGS, run_args=["--stream", url, "--stop-when-drained", "3"]).start()
        try:
            job.wait_step(5, 120)
            for kill in range(3):
                victim = rng.choice(job.wait_active())
                os.kill(victim["pid"], signal.SIGKILL)
                step = job.status()["finalized_step"]
                job.wait_step(step + 5, 120)
                if kill == 1:  # and the master, while more records arrive
                    job.kill_master()
                    produced = produce(url, 3, [1500, 0, 500], first_index=produced)
                    job.resume_master_and_train()
            assert job.wait(300) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        done = audit(job, url)
        assert done.returncode == 0 and done.stdout.startswith("PASSED"), done.stdout + done.stderr
        source = open_source(url)
        try:
            total = sum(len(source.read(p, "0-0", 100_000)) for p in source.partitions())
        finally:
            source.close()
        assert total == produced == 13_000
        assert "partition 0: 7500 records" in done.stdout and "partition 2: 2500 records" in done.stdout, done.stdout


def test_a_partition_that_appears_while_the_job_runs_is_trained(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 1, [3000])
        job = Job(tmp_path, "2:2", ARGS, run_args=["--stream", url, "--stop-when-drained", "8"]).start()
        try:
            job.wait_step(3, 120)
            produce(url, 3, [0, 0, 2000], first_index=3000)  # partition 2 appears
            wait_for(lambda: any("partitions [0, 2]" in e["message"] for e in job.events()), 60,
                     "the new partition", job)
            assert job.wait(300) == 0, job.output()[-3000:]
            assert_every_worker_kept(job)
        finally:
            job.kill_all()
        done = audit(job, url)
        assert done.returncode == 0 and "partition 2: 2000 records" in done.stdout, done.stdout + done.stderr


@pytest.mark.speed_free
def test_a_partition_that_disappears_while_the_job_runs_is_dropped_at_the_next_round(tmp_path: Path) -> None:
    """A partition's stream key deleted while it still holds records: the workers see it gone, the
    job re-forms without it (status no longer lists it) and ends once the others are drained;
    what it trained of the partition before is in the ledger exactly once."""
    import redis

    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        # partition 2 far longer than the others: the job must still be training it when its key goes,
        # however late a loaded machine lets the test see step 3 (at 60,000 the job once drained it first)
        produce(url, 3, [2000, 2000, 240_000])
        source = open_source(url)
        try:
            kept = {p: [r.id for r in source.read(p, "0-0", 300_000)] for p in range(3)}
        finally:
            source.close()
        job = Job(tmp_path, "2:2", ARGS, run_args=["--stream", url, "--stop-when-drained", "3"]).start()
        try:
            job.wait_step(3, 120)
            client = redis.Redis(host="127.0.0.1", port=server.port)
            try:
                assert client.delete("clicks:2") == 1
            finally:
                client.close()
            wait_for(lambda: any("gone: [2]" in e["message"] for e in job.events()), 60, "partition 2 gone", job)
            wait_for(lambda: [s["partition"] for s in job.status()["stream"]] == [0, 1], 60,
                     "status without partition 2", job)
            assert job.wait(300) == 0, job.output()[-3000:]
            assert_every_worker_kept(job)
        finally:
            job.kill_all()
        result = audit_stream(job.ledger.read_text().splitlines(), kept)
        assert result.ok, result.summary()
        by = {p.partition: p for p in result.partitions}
        assert by[0].records == by[1].records == 2000 and by[0].later == by[1].later == 0
        assert 0 < by[2].records < 240_000 and by[2].later > 0  # trained in part, the rest deleted untrained


@pytest.mark.speed_free
def test_an_unreachable_stream_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    out = subprocess.run([TIDAL, "run", "--stream", "redis://127.0.0.1:1/x", str(script)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "redis://127.0.0.1:1/x" in out.stderr and len(out.stderr.splitlines()) == 1
    alone = subprocess.run([TIDAL, "run", "--stop-when-drained", "2", str(script)], capture_output=True, text=True,
                           timeout=60)
    assert alone.returncode == 2 and "--stop-when-drained, --trim-after-commit and --global-shuffle need --stream" in alone.stderr


@pytest.mark.speed_free
def test_tidal_stop_ends_a_stream_job_and_status_shows_the_partitions(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 2, [4000, 4000])
        job = Job(tmp_path, "2:2", ARGS, run_args=["--stream", url]).start()  # no --stop-when-drained
        try:
            st = job.wait_status(lambda s: s["finalized_step"] >= 5 and all(p["lag"] >= 0 for p in s["stream"])
                                 and len(s["stream"]) == 2, 120, "two partitions with their lag")
            assert {p["worker"] for p in st["stream"]} == {w["worker_id"] for w in job.active()}
            env = {**os.environ, "TIDAL_HOME": str(job.dir.parent / ".tidal")}
            text = subprocess.run([TIDAL, "status", "--job-dir", str(job.dir)], capture_output=True, text=True,
                                  timeout=60, env=env).stdout
            assert "stream partitions: 0: committed" in text, text
            metrics = httpx.get(job.info()["url"] + "/metrics", timeout=5,
                                headers={"Authorization": f"Bearer {job.info()['token']}"}).text
            assert 'tidal_stream_lag_records{partition="0"}' in metrics
            stopped = subprocess.run([TIDAL, "stop", "--job-dir", str(job.dir)], capture_output=True, text=True,
                                     timeout=60, env=env)
            assert stopped.returncode == 0 and "tidal stop" in stopped.stdout, stopped.stderr
            assert job.wait(120) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        done = audit(job, url)
        assert done.returncode == 0 and done.stdout.startswith("PASSED"), done.stdout + done.stderr


@pytest.mark.speed_free
def test_tidal_stop_of_a_dataset_job_is_refused(tmp_path: Path) -> None:
    job = Job(tmp_path, "1:1", ["--samples", "200000", "--step-sleep", "0.01", "--log-every", "0"]).start()
    try:
        job.wait_step(2, 120)
        env = {**os.environ, "TIDAL_HOME": str(job.dir.parent / ".tidal")}
        out = subprocess.run([TIDAL, "stop", "--job-dir", str(job.dir)], capture_output=True, text=True, timeout=60,
                             env=env)
        assert out.returncode != 0 and "only a stream job stops" in out.stderr, out.stderr
    finally:
        job.kill_all()


@pytest.mark.speed_free
def test_redis_restarting_while_the_job_runs_loses_and_repeats_nothing(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis", persistent=True) as server:
        url = server.url("clicks")
        produce(url, 2, [4000, 2000])
        job = Job(tmp_path, "2:2", ARGS, run_args=["--stream", url, "--stop-when-drained", "3"]).start()
        try:
            job.wait_step(5, 120)
            server.restart(down_s=2.0)  # the workers' reads retry with backoff meanwhile
            step = job.status()["finalized_step"]
            job.wait_step(step + 5, 120)
            assert job.wait(300) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        done = audit(job, url)
        assert done.returncode == 0 and "partition 0: 4000 records" in done.stdout, done.stdout + done.stderr


@pytest.mark.speed_free
def test_trim_after_commit_deletes_only_committed_records(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 2, [3000, 3000])
        job = Job(tmp_path, "2:2", ARGS,
                  run_args=["--stream", url, "--stop-when-drained", "3", "--trim-after-commit"]).start()
        try:
            assert job.wait(300) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        committed: dict[int, str] = {}
        for line in job.ledger.read_text().splitlines():
            row = json.loads(line)
            committed[row["partition"]] = row["ids"][-1][1]
        source = open_source(url)
        try:
            left = {p: source.read(p, "0-0", 10_000) for p in (0, 1)}
        finally:
            source.close()
    for p in (0, 1):  # records were deleted as they were committed; what is left was committed too (drained)
        assert len(left[p]) < 3000
        assert all(parse_id(r.id) <= parse_id(committed[p]) for r in left[p])
    assert sum(len(v) for v in left.values()) < 6000


def test_a_stream_planner_scales_a_live_job_from_its_backlog_and_busy_share(tmp_path: Path) -> None:
    """HPA on the workers' busy share (Kale's baseline): handed the job at 1 worker with a backlog,
    it scales out; once the stream is drained and the workers idle, it scales in (its windows in
    trace time: --time-scale 60 makes the 5-minute scale-down window 5 real seconds). The workers
    report the rate they train at while busy, which a 0.1-second step bounds."""
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 2, [10_000, 10_000])
        args = ["--batch-size", "128", "--step-sleep", "0.1", "--log-every", "0"]
        job = Job(tmp_path, "1:3", args, run_args=[
            "--planner", "hpa", "--time-scale", "60", "--planner-interval", "0.5", "--stream", url,
            "--stop-when-drained", "12"]).start()
        try:
            job.wait_step(3, 120)
            # each worker's rate while busy: a step sleeps 0.1 s, so no more than 1,280 records/s
            st = job.wait_status(lambda s: any(w["stream_capacity"] > 0 for w in s["workers"]), 60, "a capacity")
            capacities = [w["stream_capacity"] for w in st["workers"] if w["stream_capacity"] > 0]
            assert all(c <= 128 / 0.1 * 1.01 for c in capacities), capacities
            job.scale(1)  # the user holds it at 1 ...
            job.wait_status(lambda s: len([w for w in s["workers"] if w["state"] == "active"]) == 1, 60, "1 worker")
            info = job.info()
            httpx.post(info["url"] + "/v1/scale", json={"auto": True}, timeout=5,
                       headers={"Authorization": f"Bearer {info['token']}"}).raise_for_status()  # ... then hands back
            job.wait_status(lambda s: s["target_workers"] >= 2, 60, "hpa scaling out under the backlog")
            job.wait_status(lambda s: any(e["kind"] == "scale" and "-> 1 workers" in e["message"]
                                          for e in s["events"]), 180, "hpa scaling in once drained")
            assert job.wait(300) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        done = audit(job, url)
        assert done.returncode == 0 and done.stdout.startswith("PASSED"), done.stdout + done.stderr


def test_kale_runs_live_on_a_stream_job(tmp_path: Path) -> None:
    """Kale is the default planner of a stream job: it plans from the live observation (arrivals,
    backlog, lag, busy share) without failing; with no traffic history its forecaster is not fitted
    yet, so its threshold fallback (section 3.4.3) is what scales out, and the plan only scales in."""
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 2, [3000, 3000])
        job = Job(tmp_path, "1:2", ARGS, run_args=["--planner", "kale", "--time-scale", "600", "--planner-interval",
                                                    "0.5", "--stream", url, "--stop-when-drained", "3"]).start()
        try:
            st = job.wait_status(lambda s: s["planner"] is not None and s["finalized_step"] >= 3, 120, "kale")
            assert st["planner"]["name"] == "kale"
            assert job.wait(300) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        assert "planner kale failed" not in job.output(), job.output()[-3000:]
        assert audit(job, url).returncode == 0


@pytest.mark.speed_free  # one decision, the first plan after the hand-over: no rate or pause measured
def test_kale_plans_over_an_hour_live_in_minute_steps(tmp_path: Path) -> None:
    """``--program-hours``: kale's lag-priced program runs in a live job whose arrivals are counted
    every 5 trace seconds (``--planner-interval 0.5`` at ``--time-scale 10``), summed into minute
    steps; handed a job of one worker with 24,000 records waiting (appended before it started: no
    arrival it saw, so aged from the stream's lag) it buys the lag down with a second, the decision
    is the program's, and every record is trained once."""
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 2, [12000, 12000])
        job = Job(tmp_path, "1:2", ["--batch-size", "128", "--step-sleep", "0.1", "--log-every", "0"], run_args=[
            "--planner", "kale", "--initial", "1", "--time-scale", "10", "--planner-interval", "0.5", "--stream", url,
            "--program-hours", "1", "--stop-when-drained", "3"]).start()
        try:
            job.wait_status(lambda s: any(w["stream_capacity"] > 0 for w in s["workers"]), 60, "a capacity")
            info = job.info()  # --initial 1 held the count; the planner is handed it with a backlog
            httpx.post(info["url"] + "/v1/scale", json={"auto": True}, timeout=5,
                       headers={"Authorization": f"Bearer {info['token']}"}).raise_for_status()
            st = job.wait_status(lambda s: s["planner"] is not None and s["planner"]["last"] is not None, 60,
                                 "the program's first decision")
            last = st["planner"]["last"]
            assert last["reason"].startswith("program: 2 workers at "), last
            assert (last["from_workers"], last["to_workers"]) == (1, 2), last
            assert job.wait(300) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        assert "planner kale failed" not in job.output(), job.output()[-3000:]
        assert audit(job, url).returncode == 0
