"""Resume when every process is gone (issue "Flash checkpoint, and resume"): real jobs, real
SIGKILLs. Every worker killed at once: the master relaunches them from the newest flash
checkpoint and rolls the data back to it. Master and workers killed: `tidal resume JOBDIR`
continues the job. With logical workers the resumed model is bitwise the uninterrupted one's; a
corrupt newest checkpoint is skipped for the one before; a changed model is a one-line error.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.jobtools import ROOT, TIDAL, Job, example_args
from tidal.master.journal import SqliteJournal
from tidal.worker.checkpoint import fingerprint, latest_checkpoint
from tidal.worker.flash import list_checkpoints

pytestmark = pytest.mark.speed_free

SCRIPT = ROOT / "tests" / "scripts" / "bn_dropout.py"


def rollbacks(job: Job) -> list[int]:
    return [json.loads(line)["rollback_to_step"] for line in job.ledger.read_text().splitlines()
            if "rollback_to_step" in line]


def remove_shm(job_id: str) -> None:
    for path in Path("/dev/shm").glob(f"tidal-{job_id}-*"):
        path.unlink(missing_ok=True)


def test_every_worker_killed_resumes_from_the_flash_checkpoint(tmp_path: Path) -> None:
    samples, epochs = 120_000, 1
    job = Job(tmp_path, "2:2", example_args(samples, epochs, 256, 0.01),
              run_args=["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10",
                        "--checkpoint-keep", "2"]).start()
    try:
        st = job.wait_status(lambda s: s["checkpoint_step"] >= 19 and s["finalized_step"] >= s["checkpoint_step"] + 3,
                             120, "a flash checkpoint and steps after it")
        before = {w["pid"] for w in st["workers"] if w["state"] == "active"}
        killed = job.kill_workers()
        assert before <= set(killed)
        st = job.wait_status(lambda s: any(e["kind"] == "restore" for e in s["events"]), 60, "the resume")
        restore = next(e for e in st["events"] if e["kind"] == "restore")["message"]
        assert "resuming from the checkpoint of step" in restore, restore
        assert job.wait(240) == 0, job.output()[-3000:]
    finally:
        job.kill_all()
    # one rollback; more if a restore round failed (a checkpoint torn by the kill, a new worker
    # lost), each to the same or an earlier checkpoint
    backs = rollbacks(job)
    back = backs[-1]
    assert backs == sorted(backs, reverse=True) and back >= 19 and (back + 1) % 10 == 0, (  # a checkpoint
        f"rollbacks {backs}\n{job.output()[-3000:]}")
    audit = job.audit(samples, epochs)
    assert audit.ok, audit.summary()  # every sample once in the model's lineage
    job_id = job.info()["job_id"]
    assert not list(Path("/dev/shm").glob(f"tidal-{job_id}-*")), "shared memory left behind"
    kept = [c.step for c in list_checkpoints(tmp_path / "ckpt")]
    assert 2 <= len(kept) <= 3, kept  # --checkpoint-keep 2, and the final checkpoint


@pytest.mark.parametrize("persist_delay_s", ["0", "0.1"], ids=["disk", "slow-disk"])
def test_keep_never_deletes_the_checkpoint_the_master_would_resume_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persist_delay_s: str) -> None:
    """A checkpoint every 2 steps at 50 steps/s, keep 1: the master learns of checkpoints after
    they are taken, so the one it would resume from is older than the newest (it was pruned, and
    the resume fell back to step -1, before the persister kept it). A disk slower than the
    checkpoints (each snapshot persisted 0.1 s late): the snapshot a worker reported is still
    pending when the next save comes (it was replaced, and every resume failed down to step -1)."""
    monkeypatch.setenv("TIDAL_PERSIST_DELAY_S", persist_delay_s)  # the workers' persisters inherit it
    samples, epochs = 120_000, 1
    job = Job(tmp_path, "2:2", example_args(samples, epochs, 256, 0.01),
              run_args=["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
                        "--checkpoint-keep", "1"]).start()
    try:
        job.wait_status(lambda s: s["checkpoint_step"] >= 29, 120, "flash checkpoints")
        job.kill_workers()
        assert job.wait(240) == 0, job.output()[-3000:]
    finally:
        job.kill_all()
    backs = rollbacks(job)
    assert len(backs) == 1 and backs[0] >= 1 and (backs[0] + 1) % 2 == 0, (
        f"rollbacks {backs}\n{job.output()[-3000:]}")  # a string: pytest prints it whole, a tuple cut short
    assert "could not be loaded" not in job.output()
    audit = job.audit(samples, epochs)
    assert audit.ok, audit.summary()


def _determinism_job(tmp: Path, name: str, every: str | None) -> Job:
    ckpt = tmp / f"{name}-ckpt"
    run = ["--logical-workers", "4", "--checkpoint-dir", str(ckpt)]
    if every:
        run += ["--checkpoint-every", every]
    return Job(tmp, "2:2", ["--checkpoint-dir", str(ckpt), "--step-sleep", "0.15"], run_args=run, script=SCRIPT,
               name=name)


def test_a_job_killed_entirely_resumes_to_the_same_model(tmp_path: Path) -> None:
    """Master, workers and persisters SIGKILLed: `tidal resume` loads the snapshot left in shared
    memory; with 4 logical workers the final model is bitwise the uninterrupted job's."""
    whole = _determinism_job(tmp_path, "whole", None).start()
    try:
        assert whole.wait(240) == 0, whole.output()[-3000:]
    finally:
        whole.kill_all()
    expected = fingerprint(latest_checkpoint(tmp_path / "whole-ckpt"))

    job = _determinism_job(tmp_path, "cut", "5").start()
    try:
        job.wait_status(lambda s: s["checkpoint_step"] >= 9 and s["finalized_step"] >= s["checkpoint_step"] + 2,
                        120, "a flash checkpoint and steps after it")
        job.kill_all()  # the master, every worker and every persister: nothing is left running
        assert not job.worker_processes()
        job.resume()
        assert job.wait(240) == 0, job.output()[-3000:]
    finally:
        job.kill_all()
    assert fingerprint(latest_checkpoint(tmp_path / "cut-ckpt")) == expected
    backs = rollbacks(job)
    assert backs == sorted(backs, reverse=True) and backs[-1] >= 9
    audit = job.audit(4096, 2)
    assert audit.ok, audit.summary()


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_one_before(tmp_path: Path) -> None:
    job = _determinism_job(tmp_path, "bad", "4").start()
    ckpt = tmp_path / "bad-ckpt"
    try:
        def two_on_disk(s: dict) -> bool:
            ok = [c.step for c in list_checkpoints(ckpt) if c.ok]
            return len(ok) >= 2 and s["finalized_step"] >= max(ok) + 2

        job.wait_status(two_on_disk, 120, "two checkpoints on disk")
        job.kill_all()
        remove_shm(job.info()["job_id"])  # the disk path
        on_disk = sorted((c.step for c in list_checkpoints(ckpt) if c.ok), reverse=True)
        newest = ckpt / f"step-{on_disk[0]:08d}" / "tensors.safetensors"
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
        listed = subprocess.run([TIDAL, "checkpoints", str(ckpt)], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 1 and "BAD" in listed.stdout.splitlines()[0], listed.stdout
        job.resume()
        assert job.wait(240) == 0, job.output()[-3000:]
    finally:
        job.kill_all()
    # each checkpoint that would not load cost a round (and a rollback line), newest first
    backs = rollbacks(job)
    assert backs[-1] == on_disk[1] and backs == sorted(backs, reverse=True), (backs, on_disk)
    journal = SqliteJournal(job.dir / "journal.sqlite", create=False)
    try:
        bad = [step for step, _ in journal.get_meta("state")["checkpoints"]["bad"]]
    finally:
        journal.close()
    assert on_disk[0] in bad
    audit = job.audit(4096, 2)
    assert audit.ok, audit.summary()


def test_a_resume_against_a_changed_model_is_a_one_line_error(tmp_path: Path) -> None:
    script = tmp_path / "model.py"
    script.write_text(SCRIPT.read_text())
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, "1:1", ["--checkpoint-dir", str(ckpt), "--step-sleep", "0.15"], script=script,
              run_args=["--logical-workers", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"])
    job.start()
    try:
        job.wait_status(lambda s: s["checkpoint_step"] >= 3 and s["finalized_step"] >= 5, 120, "a checkpoint")
        job.kill_all()
        script.write_text(SCRIPT.read_text().replace("Linear(8, 32), torch.nn.BatchNorm1d(32)",
                                                     "Linear(8, 48), torch.nn.BatchNorm1d(48)")
                          .replace("Linear(32, 1)", "Linear(48, 1)"))
        other = subprocess.run([TIDAL, "run", "--resume", str(job.dir), str(SCRIPT)], capture_output=True,
                               text=True, timeout=60)
        assert other.returncode == 2 and "--resume: job" in other.stderr and "not " in other.stderr, other.stderr
        job.resume()
        assert job.wait(120) == 1, job.output()[-3000:]
    finally:
        job.kill_all()
    line = next(x for x in job.output().splitlines() if "cannot resume from the checkpoint of step" in x)
    assert "size mismatch" in line and "48" in line, line


@pytest.mark.parametrize("state", ["succeeded"])
def test_resume_of_a_finished_job_says_there_is_nothing_to_resume(tmp_path: Path, state: str) -> None:
    job = Job(tmp_path, "1:1", example_args(2_000, 1, 256)).start()
    try:
        assert job.wait(120) == 0
    finally:
        job.kill_all()
    done = subprocess.run([TIDAL, "resume", str(job.dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"has already {state}" in done.stderr, done.stderr
    missing = subprocess.run([TIDAL, "resume", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stderr
