"""Backends by name (tidal.backends.registry)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal import backends
from tidal.backends.api import BackendError
from tidal.backends.fake import FakeBackend
from tidal.backends.local import LocalBackend


def test_builtins() -> None:
    assert backends.names() == ["fake", "local", "ray"]
    local = backends.get("local", poll_interval_s=0.5)
    try:
        assert isinstance(local, LocalBackend) and local.name == "local"
    finally:
        local.close()
    assert isinstance(backends.get("fake"), FakeBackend)
    assert all(backends.summary(name) for name in backends.names())


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(BackendError, match=r"unknown backend 'kubernetes'; known: fake, local, ray"):
        backends.get("kubernetes")
    with pytest.raises(BackendError, match="unknown backend"):
        backends.summary("kubernetes")


def test_ray_without_a_cluster_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match=r"cannot reach the Ray cluster at 127\.0\.0\.1:9"):
        backends.get("ray", address="127.0.0.1:9")
    with pytest.raises(BackendError, match="placement must be one of spread, pack"):
        backends.get("ray", address="127.0.0.1:9", placement="anywhere")


def test_an_option_the_backend_does_not_take() -> None:
    with pytest.raises(BackendError, match="local"):
        backends.get("local", nodes=3)
    with pytest.raises(BackendError, match="poll_interval_s"):
        backends.get("local", poll_interval_s=-1)


def test_register(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends.registry, "_REGISTRY", dict(backends.registry._REGISTRY))
    made: list[dict[str, object]] = []

    def factory(**options: object) -> FakeBackend:
        made.append(options)
        return FakeBackend()

    backends.register("mine", factory, "a test's own")
    assert isinstance(backends.get("mine", size=2), FakeBackend) and made == [{"size": 2}]
    assert "mine" in backends.names() and backends.summary("mine") == "a test's own"


def test_importing_the_package_loads_no_backend() -> None:
    code = ("import sys, tidal.backends; "
            "print(sorted(m for m in sys.modules if m in ('psutil', 'tidal.backends.local', 'tidal.backends.fake')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
