"""``tidal run --checkpoint-every``: a real job takes flash checkpoints while it trains (rank 0
copies the state into shared memory, the persister writes it to --checkpoint-dir), the master
shows the newest, and nothing is left in /dev/shm when the job ends."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.jobtools import TIDAL, Job, example_args
from tidal.worker.checkpoint import load_meta
from tidal.worker.flash import list_checkpoints

pytestmark = pytest.mark.speed_free


def test_a_job_checkpoints_every_n_steps_in_the_background(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    samples, epochs = 60_000, 1
    job = Job(tmp_path, "2:2", example_args(samples, epochs, 256, 0.01),
              run_args=["--checkpoint-dir", str(ckpt), "--checkpoint-every", "20"]).start()
    try:
        st = job.wait_status(lambda s: s["checkpoint_step"] >= 39, 120, "a flash checkpoint of step 39")
        assert st["checkpoint_problem"] is None
        assert job.wait(180) == 0, job.output()[-2000:]
    finally:
        job.kill_all()
    assert job.audit(samples, epochs).ok
    found = list_checkpoints(ckpt)
    steps = sorted(c.step for c in found)
    assert all(c.ok for c in found), [c.problem for c in found if not c.ok]
    assert 19 in steps and 39 in steps  # every 20 applied steps (0-based), and the final one
    meta = load_meta(next(c.path for c in found if c.step == 39))
    assert meta["step"] == 39 and meta["world_size"] == 2
    job_id = job.info()["job_id"]
    assert not list(Path("/dev/shm").glob(f"tidal-{job_id}-*")), "shared memory left behind"


def test_a_bad_checkpoint_every_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    bad = subprocess.run([TIDAL, "run", "--checkpoint-dir", str(tmp_path / "c"), "--checkpoint-every", "5x",
                          str(script)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--checkpoint-every takes a number of steps" in bad.stderr
    alone = subprocess.run([TIDAL, "run", "--checkpoint-every", "5", str(script)], capture_output=True, text=True,
                           timeout=60)
    assert alone.returncode == 2 and "--checkpoint-every needs --checkpoint-dir" in alone.stderr


def test_checkpoint_keep_needs_checkpoint_every_and_a_count(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    ckpt = str(tmp_path / "c")
    alone = subprocess.run([TIDAL, "run", "--checkpoint-dir", ckpt, "--checkpoint-keep", "2", str(script)],
                           capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and "--checkpoint-keep needs --checkpoint-every" in alone.stderr
    zero = subprocess.run([TIDAL, "run", "--checkpoint-dir", ckpt, "--checkpoint-every", "5", "--checkpoint-keep",
                           "0", str(script)], capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2 and "--checkpoint-keep" in zero.stderr
