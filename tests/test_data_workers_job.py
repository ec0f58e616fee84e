"""Data workers in real jobs (issue: data workers): exactly once through SIGKILLs and scaling,
the same model with 0, 1 or 3 of them, and a failing ``preprocess`` named, never skipped.

The example runs with ``--raw-features`` (examples/ctr/features.py): its batches need string
hashing, crosses and bucketizing before the model, done by the data workers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.jobtools import ROOT, TIDAL, Job, fingerprint, plain_python_fingerprint, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.speed_free]

RAW = ["--raw-features", "--crosses", "8"]


def running(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in st["data_workers"] if d["state"] == "running"]


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10,
             f"data worker pid {pid} to die")


def test_exactly_once_through_data_worker_sigkills_scaling_and_a_master_failover(tmp_path: Path, jobs: list[Job]) -> None:
    samples, epochs = 100_000, 2
    job = Job(tmp_path, "2:2", ["--samples", str(samples), "--epochs", str(epochs), "--batch-size", "256",
                                "--step-sleep", "0.12", "--log-every", "0", *RAW],
              run_args=["--data-workers", "1:3"]).start()
    jobs.append(job)
    st = job.wait_status(lambda s: len(running(s)) == 1 and s["finalized_step"] >= 3, 90, "1 data worker, training")
    assert st["data_range"] == [1, 3] and st["data_target"] == 1
    assert all(d["id"] >= 0 and d["pid"] > 0 for d in st["data_workers"])
    job.scale_data(3)
    st = job.wait_status(lambda s: len(running(s)) == 3, 60, "3 data workers")
    victim = running(st)[0]
    kill(victim["pid"])
    st = job.wait_status(lambda s: len(running(s)) == 3 and victim["id"] not in [d["id"] for d in running(s)],
                         60, "a replacement data worker")
    kill(running(st)[-1]["pid"])
    st = job.wait_status(lambda s: s["data_queue"] and s["data_queue"]["enqueue_per_s"] > 0, 30, "batches arriving")
    info = job.info()
    metrics = httpx.get(info["url"] + "/metrics", headers={"Authorization": f"Bearer {info['token']}"}, timeout=5).text
    for name in ("tidal_data_workers ", "tidal_data_queue_batches ", "tidal_data_enqueue_per_second ",
                 "tidal_data_dequeue_per_second ", "tidal_data_trainer_wait_ratio ", "tidal_data_redispatched_total "):
        assert name in metrics, name
    shown = subprocess.run([TIDAL, "status", "--job-dir", str(job.dir)], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "TIDAL_HOME": str(job.dir.parent / ".tidal")})
    assert shown.returncode == 0, shown.stderr
    assert "data workers: " in shown.stdout and "enqueue" in shown.stdout and "data worker " in shown.stdout, shown.stdout
    # the master fails over: the new one adopts the data workers, which keep serving the trainers
    job.kill_master()
    job.resume_master_and_train(5)
    job.wait_status(lambda s: len(running(s)) == 3 and s["state"] == "running", 60, "3 data workers after the failover")
    job.scale_data(1)
    assert job.wait(240) == 0, job.output()[-3000:]
    audit = job.audit(samples, epochs)
    assert audit.ok, audit.summary()
    out = job.output()
    assert out.count("the trainers re-dispatch its batches") == 2, out[-3000:]
    assert "retired data workers" in out
    assert not job._processes(lambda env, cmd: env.get("TIDAL_ROLE") == "data")  # the job stopped them


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Plain python, no data workers: the trainer pre-processes its own batches."""
    return plain_python_fingerprint(tmp_path_factory.mktemp("plain") / "ckpt", LOGICAL)


LOGICAL = ["--samples", "12000", "--epochs", "2", "--batch-size", "128", "--log-every", "0",
           "--logical-workers", "4", *RAW]


@pytest.mark.parametrize("data_workers", [0, 1, 3])
def test_same_model_with_any_number_of_data_workers(tmp_path: Path, jobs: list[Job], reference: str,
                                                    data_workers: int) -> None:
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, "2:2", [*LOGICAL, "--step-sleep", "0.3" if data_workers == 3 else "0.02"],
              run_args=["--logical-workers", "4", "--checkpoint-dir", str(ckpt),
                        "--data-workers", str(data_workers)]).start()
    jobs.append(job)
    if data_workers == 3:  # and through SIGKILLs of two of them
        killed: list[int] = []
        for _ in range(2):
            st = job.wait_status(lambda s: len(running(s)) == 3 and s["finalized_step"] >= 2
                                 and not {d["id"] for d in running(s)} & set(killed), 90, "3 data workers")
            killed.append(running(st)[0]["id"])
            kill(running(st)[0]["pid"])
        assert job.status()["state"] == "running"  # the kills were mid-run
    assert job.wait(240) == 0, job.output()[-3000:]
    assert fingerprint(ckpt) == reference
    built = sum(int(n) for n in re.findall(r"stopped \(built (\d+) batches\)", job.output()))
    assert (built > 0) == (data_workers > 0)  # the data workers did build batches of the job


@pytest.fixture(scope="module")
def auto_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return plain_python_fingerprint(tmp_path_factory.mktemp("plain-auto") / "ckpt", [*LOGICAL, "--auto-partition"])


@pytest.mark.parametrize("data_workers", [0, 2])
def test_auto_partition_gives_the_same_model_with_and_without_data_workers(
        tmp_path: Path, jobs: list[Job], auto_reference: str, data_workers: int) -> None:
    """preprocess="auto": torch.fx cuts the transform off the model; the data workers run it."""
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, "2:2", [*LOGICAL, "--auto-partition", "--step-sleep", "0.05"],
              run_args=["--logical-workers", "4", "--checkpoint-dir", str(ckpt),
                        "--data-workers", str(data_workers)]).start()
    jobs.append(job)
    assert job.wait(240) == 0, job.output()[-3000:]
    assert fingerprint(ckpt) == auto_reference
    logs = "".join(p.read_text() for p in (job.dir / "logs").glob("*.log"))
    assert "preprocess='auto': RawClickModel.forward cut after" in logs
    built = sum(int(n) for n in re.findall(r"stopped \(built (\d+) batches\)", job.output()))
    assert (built > 0) == (data_workers > 0)


@pytest.mark.parametrize(("mode", "data_workers"), [("raises", 1), ("dtype", 0)])
def test_a_bad_preprocess_fails_the_job_by_name(tmp_path: Path, jobs: list[Job], mode: str, data_workers: int) -> None:
    job = Job(tmp_path, "1:1", ["--mode", mode, "--at", "2000"], script=ROOT / "tests" / "scripts" / "bad_preprocess.py",
              run_args=["--data-workers", str(data_workers)]).start()
    jobs.append(job)
    assert job.wait(120) != 0
    out = job.output()
    what = "ValueError: record 2000 has no label" if mode == "raises" else "float32[1] then float64[1]"
    assert "job failed" in out and "samples [1984, 2048)" in out and what in out, out[-3000:]
    assert "at training step 31" in out
    assert out.count("launched worker") == 1  # failed at once: no restart can build that batch
