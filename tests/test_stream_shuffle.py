"""Global shuffling (Kale 3.5, ``tidal run --stream --global-shuffle LOWER:UPPER``): real jobs on a
real redis-server. A worker whose partition carries most of the records forwards its overflow to
the others over ZeroMQ; every record is still trained exactly once (the ledger against the
stream, `tidal audit --stream`), through SIGKILLs of workers holding forwarded records and of
the master."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.jobtools import TIDAL, Job, wait_for
from tests.redis_server import redis_server
from tests.test_stream_job import audit, produce

pytestmark = pytest.mark.speed_free

# every step waits 20 ms of emulated device time: the worker with the big partition cannot keep
# up alone, the others idle without shuffling
ARGS = ["--batch-size", "64", "--step-sleep", "0.02", "--log-every", "0"]


def shuffled_job(tmp_path: Path, url: str, workers: str = "3:3") -> Job:
    return Job(tmp_path, workers, ARGS, run_args=["--stream", url, "--stop-when-drained", "3",
                                                  "--global-shuffle", "128:512"]).start()


def audited(job: Job, url: str, records: int) -> None:
    """`tidal audit --stream`: every record once; partition 0 all ``records`` of it."""
    done = audit(job, url)
    assert done.returncode == 0 and done.stdout.startswith("PASSED"), done.stdout + done.stderr
    assert f"partition 0: {records} records" in done.stdout, done.stdout


def test_overflow_is_forwarded_and_every_record_is_trained_once_through_a_scale_in(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 3, [12000, 500, 500])
        job = shuffled_job(tmp_path, url, "2:3")
        try:
            job.wait_step(10, 120)
            job.scale(2)  # a scaled-in worker closes its shuffle unit and exits 0; the others re-form
            assert job.wait(300) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        out = job.output()
        left = [ln.split("worker ")[1].split()[0] for ln in out.splitlines() if "leaves (scale-in)" in ln]
        assert left and f"worker {left[0]} exited (code 0)" in out, out[-3000:]
        audited(job, url, 12000)
        lines = [ln for ln in job.ledger.read_text().splitlines() if '"partition": 0' in ln]
        trainers = {int(ln.split('"worker": ')[1].split(",")[0]) for ln in lines}
        assert len(trainers) >= 2, f"partition 0 was trained by {trainers} only: nothing was forwarded"


def test_sigkills_of_workers_and_the_master_lose_and_repeat_nothing(tmp_path: Path) -> None:
    rng = random.Random(11)
    with redis_server(tmp_path / "redis") as server:
        url = server.url("clicks")
        produce(url, 3, [36000, 1000, 1000])
        job = shuffled_job(tmp_path, url)
        try:
            job.wait_step(10, 120)
            wait_for(lambda: sum(w["stream_forwarded_out"] for w in job.status()["workers"]) > 0, 60,
                     "records forwarded", job)
            # what a planner prices the queues' wait with (kale --lag-price): each worker's step batch
            # and upper threshold, as its reports say
            wait_for(lambda: {(w["stream_batch"], w["stream_queue_upper"]) for w in job.wait_active()} == {(64, 512)},
                     30, "each worker's step batch and queue threshold reported", job)
            # each worker's part of the lag: partition 0's backlog is old
            wait_for(lambda: max(w["stream_lag_s"] for w in job.wait_active()) > 0, 30,
                     "the oldest record a worker holds reported", job)
            shown = subprocess.run([TIDAL, "status", "--job-dir", str(job.dir)], capture_output=True, text=True,
                                   timeout=60, env={**os.environ, "COLUMNS": "300"})
            assert re.search(r"global shuffling \(queued / forwarded out / in, records; the oldest record each holds\): "
                             r"worker 0: \d+ / \d+ / \d+, \d+\.\d s", shown.stdout), shown.stdout
            metrics = httpx.get(job.info()["url"] + "/metrics", timeout=5,
                                headers={"Authorization": f"Bearer {job.info()['token']}"}).text
            assert 'tidal_stream_forwarded_records_total{direction="out",worker="0"}' in metrics, metrics
            assert "tidal_stream_queued_records{" in metrics
            for _ in range(2):
                victim = rng.choice(job.wait_active())
                os.kill(victim["pid"], signal.SIGKILL)
                job.wait_step(job.status()["finalized_step"] + 5, 120)
            # and the master: the positions and the ranges committed beyond them come back from its journal
            job.kill_master()
            job.resume_master_and_train()
            assert job.wait(300) == 0, job.output()[-3000:]
        finally:
            job.kill_all()
        audited(job, url, 36000)


@pytest.mark.parametrize("value", ["5:2", "abc", "0:0", "128:512x"])
def test_bad_thresholds_are_one_line(tmp_path: Path, value: str) -> None:
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    out = subprocess.run([TIDAL, "run", "--stream", f"file://{tmp_path}/s", "--global-shuffle", value,
                          "--job-dir", str(tmp_path / "job"), str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--global-shuffle takes LOWER:UPPER" in out.stderr
    assert len(out.stderr.splitlines()) == 1
