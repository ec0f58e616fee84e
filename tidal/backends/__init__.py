"""Where worker processes run. ``backends.get("local")`` is the embedded default."""

from __future__ import annotations

from tidal.api import ConfigError
from tidal.backends.api import Backend, BackendEvent, LaunchError, WorkerSpec

__all__ = ["Backend", "BackendEvent", "LaunchError", "WorkerSpec", "get"]


def get(name: str, **options: object) -> Backend:
    if name == "local":
        from tidal.backends.local import LocalBackend

        return LocalBackend(**options)  # type: ignore[arg-type]
    raise ConfigError(f"unknown backend {name!r}; known: local")
