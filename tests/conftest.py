"""Puts the repository root on sys.path so tests can import ``examples``; the ``jobs`` fixture."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture
def jobs() -> Iterator[list]:
    """``tidal run`` jobs (tests.jobtools.Job) a test started: every process of them is killed after it."""
    started: list = []
    yield started
    for job in started:
        job.kill_all()
