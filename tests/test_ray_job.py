"""Whole jobs on the ray backend: a real Ray cluster of a head and 3 machines on 127.0.0.1
(tests/ray_cluster.py), started once for the module; ``tidal run --backend ray`` against it.

Each machine is a real raylet with 1 CPU (room for one worker); the head has none, so every node
of a job runs on the 3 machines, placed by Ray. A machine is lost by killing its raylet (``Cluster.remove_node``): its
actors die, and their children with them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.jobtools import (
    EXAMPLE,
    ROOT,
    TIDAL,
    Job,
    example_args,
    fingerprint,
    plain_python_fingerprint,
    wait_for,
)
from tests.ray_cluster import RayCluster, ray_cluster
from tidal.master.audit import audit_ledger

pytestmark = pytest.mark.slow

ARGS = example_args(48_000, 2, 256, 0.15, "--logical-workers", "4")
UNPACED = example_args(48_000, 2, 256, 0.0, "--logical-workers", "4")  # the same model, no emulated device time


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with ray_cluster(head_cpus=0, nodes=[1, 1, 1]) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The example under plain python: what the job must produce, on any backend."""
    return plain_python_fingerprint(tmp_path_factory.mktemp("plain") / "ckpt", UNPACED)


def ray_job(tmp_path: Path, cluster: RayCluster, workers: str, script_args: list[str], *run_args: str,
            name: str = "job") -> Job:
    return Job(tmp_path, workers, script_args, name=name,
               run_args=["--backend", "ray", "--ray-address", cluster.address, *run_args])


def node_of(cluster: RayCluster, job: Job, index: int, role: str = "worker") -> str:
    """The Ray machine (node id) a node's actor runs on."""
    import ray

    from tidal.backends.ray import connect

    connect(cluster.address)
    actor = ray.get_actor(f"{role}-{index}", namespace=f"tidal-{job.info()['job_id']}")
    info: dict[str, Any] = ray.get(actor.describe.remote(), timeout=10)
    return str(info["ray_node"])


def test_exactly_once_and_the_same_model_through_sigkills_a_lost_machine_a_new_one_and_a_master_failover(
        tmp_path: Path, jobs: list[Job], cluster: RayCluster, reference: str) -> None:
    ckpt = tmp_path / "ckpt"
    job = ray_job(tmp_path, cluster, "2:3", ARGS, "--logical-workers", "4", "--checkpoint-dir", str(ckpt))
    jobs.append(job.start())
    st = job.wait_status(lambda s: s["finalized_step"] >= 3 and sum(w["state"] == "active" for w in s["workers"]) == 3,
                         120, "3 workers training")
    where = {w["worker_id"]: node_of(cluster, job, w["worker_id"]) for w in st["workers"] if w["state"] == "active"}
    assert len(set(where.values())) == 3  # one CPU per machine: one worker on each
    # (a) a random worker SIGKILLed: the master re-forms the survivors, Ray places a replacement
    # where the killed one freed its CPU
    rng = random.Random(7)
    victim = rng.choice([w for w in st["workers"] if w["state"] == "active"])
    os.kill(victim["pid"], signal.SIGKILL)
    st = job.wait_status(lambda s: s["finalized_step"] > st["finalized_step"] + 3 and not s["reforming"]
                         and sum(w["state"] == "active" for w in s["workers"]) == 3, 120, "3 workers after the kill")
    # (b) a whole machine lost: its worker goes with it; the job goes on with the other two, and
    # its replacement waits for room
    survivors = [w for w in st["workers"] if w["state"] == "active"]
    where = {w["worker_id"]: node_of(cluster, job, w["worker_id"]) for w in survivors}
    lost_worker = survivors[0]
    lost = where[lost_worker["worker_id"]]
    cluster.remove(cluster.node_of(lost))
    st = job.wait_status(lambda s: any(w["worker_id"] == lost_worker["worker_id"] and w["state"] == "failed"
                                       for w in s["workers"]), 60, "the lost machine's worker failed")
    st = job.wait_status(lambda s: s["finalized_step"] > st["finalized_step"] + 3 and not s["reforming"],
                         120, "training on the remaining machines")
    assert sum(w["state"] == "active" for w in st["workers"]) == 2
    # (c) a machine joins: Ray places the waiting replacement there (it then joins the job, if
    # the job has not ended meanwhile)
    st = job.wait_status(lambda s: max(w["worker_id"] for w in s["workers"]) > max(where), 60,
                         "the replacement launched")
    replacement = max(w["worker_id"] for w in st["workers"])  # launched at the loss, waiting for room
    assert replacement not in where and not next(w for w in st["workers"] if w["worker_id"] == replacement)["pid"]
    joined = cluster.add(1)
    job.wait_status(lambda s: any(w["worker_id"] == replacement and w["pid"] for w in s["workers"]), 120,
                    "the replacement placed and started")
    assert node_of(cluster, job, replacement) == joined.node_id
    kept = [w for w in survivors if where[w["worker_id"]] != lost]
    assert len(kept) == 2
    # (d) the master SIGKILLed and started again: it finds the actors by name and adopts them
    job.kill_master()
    st = job.resume_master_and_train(3)
    for w in kept:  # the workers on the machines that stayed were never restarted, through all of it
        assert any(s["worker_id"] == w["worker_id"] and s["pid"] == w["pid"] and s["state"] == "active"
                   for s in st["workers"]), (w, st["workers"])
    assert job.wait(300) == 0, job.output()[-3000:]
    # nothing of the job is left in the cluster (its actors are detached: they would hold CPUs),
    # not even a replacement still starting when the job ended
    import ray

    namespace = f"tidal-{job.info()['job_id']}"
    wait_for(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace],
             10, "the job's actors to be freed")
    result = job.audit(48_000, 2)
    assert result.ok, result.summary()
    assert fingerprint(ckpt) == reference
    # every actor's output reached the job directory
    logs = sorted(p.name for p in (job.dir / "logs").glob("worker-*.log"))
    # (a log exists from its node's start: a replacement started as the job ended may have printed nothing)
    assert len(logs) >= 5 and sum((job.dir / "logs" / n).stat().st_size > 0 for n in logs) >= 4, logs


def test_servers_and_data_workers_are_actors_too_packed_or_spread(tmp_path: Path, jobs: list[Job],
                                                                  cluster: RayCluster) -> None:
    # --placement pack: a worker and its parameter server (1 CPU each) on one machine, the
    # biggest (a 2-CPU machine joins for them); a data worker job beside it, spread
    big = cluster.add(2)
    try:
        ps = ray_job(tmp_path, cluster, "1:1", ["--ps", *example_args(4000, 1, 128, 0.6)],
                     "--ps", "1", "--placement", "pack", name="ps")
        jobs.append(ps.start())
        ps.wait_step(2, 120)
        assert node_of(cluster, ps, 0) == node_of(cluster, ps, 0, "ps") == big.node_id
        # 0.6 s a step: the job must outlive its data workers' start on a loaded machine (without
        # it, training was over in 3 s, before the second data worker served)
        data = ray_job(tmp_path, cluster, "1:1", [*example_args(4000, 1, 128, 0.6), "--raw-features"],
                       "--data-workers", "2", name="data")
        jobs.append(data.start())
        st = data.wait_status(lambda s: sum(d["state"] == "running" for d in s["data_workers"]) == 2, 120,
                              "2 data workers")
        machines = {node_of(cluster, data, d["id"], "data") for d in st["data_workers"]}
        assert len(machines) == 2 and big.node_id not in machines  # spread, on the machines with room
        assert ps.wait(240) == 0, ps.output()[-3000:]
        assert data.wait(240) == 0, data.output()[-3000:]
        assert ps.audit(4000, 1).ok and data.audit(4000, 1).ok
        # every actor's output goes to the job directory (a server reporting to its master prints nothing)
        assert (ps.dir / "logs" / "ps-0.log").is_file() and (data.dir / "logs" / "data-0.log").stat().st_size > 0
    finally:
        cluster.remove(big)


def test_a_request_no_machine_can_hold_fails_the_job_naming_the_resource(
        tmp_path: Path, jobs: list[Job], cluster: RayCluster) -> None:
    job = ray_job(tmp_path, cluster, "1:1", example_args(2000, 1), "--gpus-per-worker", "1")
    jobs.append(job.start())
    assert job.wait(120) == 1
    out = job.output()
    assert "no Ray node has the GPUs asked for (1 CPU, 1 GPU)" in out and "127.0.0.1 (1 CPU, 0 GPU" in out, out[-2000:]


def test_bad_ray_setups_are_one_line_errors(tmp_path: Path, cluster: RayCluster) -> None:
    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([TIDAL, "run", "--job-dir", str(tmp_path / "j"), *args, sys.executable], text=True,
                              capture_output=True, timeout=60, env={**os.environ, **(env or {})})

    unreachable = run("--backend", "ray", "--ray-address", "127.0.0.1:9")
    assert unreachable.returncode == 2 and "cannot reach the Ray cluster at 127.0.0.1:9" in unreachable.stderr
    assert len(unreachable.stderr.strip().splitlines()) == 1, unreachable.stderr
    no_cluster = run("--backend", "ray", env={"RAY_ADDRESS": "", "TMPDIR": str(tmp_path)})
    assert no_cluster.returncode == 2 and "no Ray cluster found" in no_cluster.stderr, no_cluster.stderr
    # Ray missing: a package named ray that cannot be imported shadows the real one
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no ray here')\n")
    missing = run("--backend", "ray", "--ray-address", cluster.address, env={"PYTHONPATH": str(fake.parent)})
    assert missing.returncode == 2 and "pip install 'tidal[ray]'" in missing.stderr, missing.stderr
    wrong = run("--placement", "pack")
    assert wrong.returncode == 2 and "need --backend ray" in wrong.stderr


def test_a_cluster_that_disappears_stops_the_job_resumable(tmp_path: Path, jobs: list[Job]) -> None:
    with ray_cluster(head_cpus=0, nodes=[2]) as doomed:
        job = Job(tmp_path, "1:1", example_args(200_000, 1, 256, 0.05),
                  run_args=["--backend", "ray", "--ray-address", doomed.address])
        jobs.append(job.start())
        job.wait_step(3, 120)
        address = doomed.address
    # the whole cluster is gone (its GCS, raylets, actors and their children)
    assert job.wait(120) == 2
    out = job.output()
    assert f"the Ray cluster at {address} is gone" in out and "tidal master --resume" in out, out[-2000:]
    journal = sqlite3.connect(job.dir / "journal.sqlite")
    (state,) = journal.execute("select value from meta where key = 'state'").fetchone()
    assert json.loads(state).get("job_state", "running") == "running", state  # neither failed nor succeeded


def journal_state(path: Path) -> str:
    """The master's state row of a journal, "" while there is none yet."""
    try:
        row = sqlite3.connect(path).execute("select value from meta where key = 'state'").fetchone()
    except sqlite3.Error:  # not created yet, or being created
        return ""
    return str(row[0]) if row else ""


def test_a_detached_master_outlives_its_command_and_runs_the_job_to_the_end(tmp_path: Path, cluster: RayCluster) -> None:
    job_dir, ledger = tmp_path / "job", tmp_path / "job.ledger"
    started = subprocess.run(
        [TIDAL, "run", "--backend", "ray", "--ray-address", cluster.address, "--detach", "--planner", "max",
         "--workers", "2:2", "--job-dir", str(job_dir), "--ledger", str(ledger), "-q",
         str(EXAMPLE), *example_args(8_000, 1, 256, 0.02)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "TIDAL_HOME": str(tmp_path / ".tidal")})
    assert started.returncode == 0 and "the master runs detached" in started.stderr, started.stderr
    import ray

    try:
        # the command has returned; the master, a Ray actor's child, trains the job to its end
        wait_for(lambda: '"succeeded"' in journal_state(job_dir / "journal.sqlite"), 120, "the detached job to succeed")
        wait_for(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True)
                              if a["namespace"] == "tidal-masters"], 30, "the master's actor to end with it")
    finally:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == "tidal-masters":
                ray.kill(ray.get_actor(a["name"], namespace="tidal-masters"))
    assert audit_ledger(ledger.read_text().splitlines(), 8_000, 1).ok
    assert "job" in (job_dir / "master.log").read_text()
