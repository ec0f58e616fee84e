"""Puts the repository root on sys.path so tests can import ``examples``; the ``jobs`` fixture; the
``serial`` mark on the job tests that must not share the 2 cores."""

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


_JOB_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``serial`` every test in tests/test_*.py (whole jobs with timeouts and SIGKILLs) that is
    not marked ``speed_free``: one whose pause, rate or planner decision is measured, or whose kill
    must land in a window, would fail or flake beside another test on 2 cores. ``make unit`` runs
    the rest two at a time and these alone (``-m serial``)."""
    for item in items:
        if item.path.parent == _JOB_TESTS and item.get_closest_marker("speed_free") is None:
            item.add_marker(pytest.mark.serial)
