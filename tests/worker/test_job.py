"""The job, its loader and its step runner together, in one process (no master, or a fake one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from tidal.worker.api import UsageError, WorkerGoneError
from tidal.worker.job import Job


class Ranges:
    """A dataset whose batch is the index range it was built from."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.x = torch.arange(size, dtype=torch.float32)[:, None]

    def __len__(self) -> int:
        return self.size

    def get_range(self, start: int, end: int) -> tuple[int, int, torch.Tensor]:
        return start, end, self.x[start:end]


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(job: Job, size: int, batch_size: int, epochs: int) -> list[tuple[int, int]]:
    model, optimizer = model_and_optimizer()
    job.state(model, optimizer)
    seen = []
    for start, end, x in job.loader(Ranges(size), batch_size=batch_size, epochs=epochs, batches_per_shard=2):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        assert job.step() is True
        seen.append((start, end))
    return seen


def test_a_local_job_trains_every_sample_once_per_epoch() -> None:
    job = Job(None, 0, "local")
    seen = train(job, 10, 4, 2)
    per_epoch = sorted(seen[:3]), sorted(seen[3:])
    assert per_epoch == ([(0, 4), (4, 8), (8, 10)], [(0, 4), (4, 8), (8, 10)])
    assert job.applied_step == 5
    assert (job.steps.state.epoch, job.steps.state.epoch_step) == (2, 0)


def test_a_local_job_with_logical_workers_follows_their_schedule() -> None:
    job = Job(None, 0, "local", logical=4)
    seen = train(job, 20, 2, 1)
    assert sorted(seen) == [(s, s + 2) for s in range(0, 20, 2)]  # 10 batches, each once
    assert job.applied_step == 2  # 3 steps of 4 logical workers (the last has 2 batches)
    assert [c["next_step"] for c in job.est_contexts()] == [3] * 4


def test_the_loop_is_told_when_it_skips_job_step() -> None:
    job = Job(None, 0, "local")
    model, optimizer = model_and_optimizer()
    job.state(model, optimizer)
    batches = iter(job.loader(Ranges(8), batch_size=2))
    next(batches)
    with pytest.raises(UsageError, match="once for every batch"):
        next(batches)


def test_the_loader_needs_the_state_first() -> None:
    job = Job(None, 0, "local")
    with pytest.raises(UsageError, match=r"job\.state"):
        next(iter(job.loader(Ranges(8), batch_size=2)))


class GoneMaster:
    """A master that has declared this worker failed: every request is answered 410."""

    url = "http://127.0.0.1:1"
    token = "t"

    def __init__(self) -> None:
        self.paths: list[str] = []

    def post(self, path: str, body: BaseModel, response: type[BaseModel], patience_s: float | None = None) -> Any:
        self.paths.append(path)
        raise WorkerGoneError(f"worker {body.worker_id} was declared failed; it must exit")  # type: ignore[attr-defined]

    def post_raw(self, path: str, body: BaseModel, patience_s: float | None = None) -> Any:
        return self.post(path, body, BaseModel, patience_s)


def test_a_worker_the_master_declared_failed_stops_training_with_an_error(tmp_path: Path) -> None:
    master = GoneMaster()
    job = Job(master, 4, "job")  # type: ignore[arg-type]
    job.checkpoint_dir = str(tmp_path)
    model, optimizer = model_and_optimizer()
    state = job.state(model, optimizer)
    state.applied_step = 3
    with pytest.raises(WorkerGoneError, match="worker 4 must stop training: worker 4 was declared failed"):
        job.finish()
    assert master.paths == ["/v1/report"]  # the last records, then no finish
    assert list(tmp_path.iterdir()) == []  # and no checkpoint of a state that is no longer the job's
    with pytest.raises(WorkerGoneError):  # the loop cannot go on either
        job.ensure_round()
    assert master.paths == ["/v1/report"]


def test_a_reform_asked_for_is_taken_after_the_next_step_once() -> None:
    """``ask_reform`` rides in the step header: the step runs, the round is left after it, and the
    ask ends with that round (a local run re-enters without a master, so it must not stay set)."""
    job = Job(None, 0, "local")
    model, optimizer = model_and_optimizer()
    job.state(model, optimizer)
    job.ensure_round()
    generation = job.generation
    job.ask_reform("a partition came")
    assert job.reform_notice
    job.steps.begin(0, 0, 1)
    model(torch.ones(1, 1)).sum().backward()
    assert job.step() is True
    assert not job.reform_notice
    job.ensure_round()
    assert job.generation == generation + 1
    job.steps.begin(0, 1, 2)
    model(torch.ones(1, 1)).sum().backward()
    assert job.step() is True
    job.ensure_round()
    assert job.generation == generation + 1  # the next step did not re-form again
