"""Fixtures shared by the master's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_control_plane import Master, start_master, stop_master


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    """A real ``tidal run`` master (workers 1:2) on 127.0.0.1, one per test module."""
    m = start_master(tmp_path_factory.mktemp("master"), "1:2")
    yield m
    stop_master(m)
