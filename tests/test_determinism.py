"""Logical workers (EasyScale D1): the same fingerprint whatever ran the job (issue: logical workers).

N = 4 logical workers, a fixed seed and the same number of steps; every run writes its final
checkpoint and ``tidal fingerprint`` must print the same digest for: plain ``python`` with no
master, 1 to 4 fixed processes, 4 -> 2 -> 3 by ``tidal scale``, two SIGKILLs at random moments,
and a different ``OMP_NUM_THREADS``. The plain all-reduce (``TIDAL_REDUCTION=allreduce``) must
give different digests, so this test can fail.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobtools import Job, fingerprint, plain_python_fingerprint

pytestmark = [pytest.mark.slow, pytest.mark.speed_free]

# 16,000 samples = 62.5 batches of 256: each epoch's last step has a half batch and an EST with
# none, so the unequal weighting (tidal.worker.logical.Weighting) is compared across k as well
ARGS = ["--samples", "16000", "--epochs", "2", "--batch-size", "256", "--log-every", "0", "--logical-workers", "4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The script under plain python: one process, four logical workers, no master."""
    return plain_python_fingerprint(tmp_path_factory.mktemp("plain") / "ckpt", ARGS)


def run_job(tmp_path: Path, jobs: list[Job], workers: str, extra: list[str] | None = None,
            run_args: list[str] | None = None, env: dict[str, str] | None = None) -> tuple[Job, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, workers, [*ARGS, *(extra or [])],
              run_args=["--logical-workers", "4", "--checkpoint-dir", str(ckpt), *(run_args or [])])
    if env:
        os.environ.update(env)
    try:
        job.start()
    finally:
        for key in env or {}:
            os.environ.pop(key, None)
    jobs.append(job)
    return job, ckpt


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_same_model_on_any_number_of_processes(tmp_path: Path, jobs: list[Job], reference: str, k: int) -> None:
    job, ckpt = run_job(tmp_path, jobs, f"{k}:{k}")
    assert job.wait(240) == 0, job.output()[-3000:]
    assert fingerprint(ckpt) == reference


def test_same_model_through_scale_in_and_out(tmp_path: Path, jobs: list[Job], reference: str) -> None:
    job, ckpt = run_job(tmp_path, jobs, "2:4", ["--step-sleep", "0.3"], ["--initial", "4"])
    job.wait_step(6, 120)
    job.scale(2)
    job.wait_status(lambda s: sum(w["state"] == "active" for w in s["workers"]) == 2 and not s["reforming"],
                    60, "2 workers")
    step = job.status()["finalized_step"]
    job.wait_step(step + 4, 60)
    job.scale(3)
    job.wait_status(lambda s: sum(w["state"] == "active" for w in s["workers"]) == 3 and not s["reforming"],
                    90, "3 workers")
    assert job.wait(240) == 0, job.output()[-3000:]
    rounds = re.findall(r"round (\d+): (\d+) workers", job.output())
    assert [n for _, n in rounds][-3:] == ["4", "2", "3"], rounds
    assert fingerprint(ckpt) == reference


def test_same_model_through_sigkills(tmp_path: Path, jobs: list[Job], reference: str) -> None:
    job, ckpt = run_job(tmp_path, jobs, "2:4", ["--step-sleep", "0.3"], ["--initial", "4"])
    rng = random.Random(7)
    job.wait_step(3, 120)
    for _ in range(2):
        time.sleep(rng.uniform(0.2, 1.5))
        st = job.wait_status(lambda s: s["state"] != "running" or (
            not s["reforming"] and sum(w["state"] == "active" for w in s["workers"]) >= 3), 90, "a formed round")
        if st["state"] != "running":
            break
        victim = rng.choice([w for w in st["workers"] if w["state"] == "active"])
        os.kill(victim["pid"], signal.SIGKILL)
    assert job.wait(240) == 0, job.output()[-3000:]
    assert job.output().count("failed: exited with code -9") >= 1, job.output()[-2000:]
    assert fingerprint(ckpt) == reference


def test_same_model_whatever_omp_num_threads(tmp_path: Path, jobs: list[Job], reference: str) -> None:
    job, ckpt = run_job(tmp_path, jobs, "2:2", env={"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})
    assert job.wait(240) == 0, job.output()[-3000:]
    assert fingerprint(ckpt) == reference


def test_plain_allreduce_is_not_reproducible(tmp_path: Path, jobs: list[Job], reference: str) -> None:
    digests = []
    for k in (2, 4):
        job, ckpt = run_job(tmp_path / f"k{k}", jobs, f"{k}:{k}", env={"TIDAL_REDUCTION": "allreduce"})
        assert job.wait(240) == 0, job.output()[-3000:]
        digests.append(fingerprint(ckpt))
    assert digests[0] != digests[1]
    assert reference not in digests


BN_SCRIPT = Path(__file__).resolve().parent / "scripts" / "bn_dropout.py"


def test_batchnorm_buffers_and_dropout_follow_the_logical_workers(tmp_path: Path, jobs: list[Job]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    plain = tmp_path / "plain"
    out = subprocess.run([sys.executable, str(BN_SCRIPT), "--checkpoint-dir", str(plain)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, "3:3", ["--checkpoint-dir", str(ckpt)], script=BN_SCRIPT,
              run_args=["--logical-workers", "4"]).start()
    jobs.append(job)
    assert job.wait(240) == 0, job.output()[-3000:]
    assert fingerprint(ckpt) == fingerprint(plain)
