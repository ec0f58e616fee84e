"""Backends by name: ``get("local")``, ``get("fake")``, and any a program adds with ``register``.

One idiom for every backend (STYLE.md 1 and 17): a factory per name, called with the options the
caller passes. The built-in factories import their module only when called, so importing
``tidal.backends`` costs nothing (psutil, or a cluster's client library, loads when a backend of
that kind is built) and changes nothing: the only state is this module's table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidal.backends.api import Backend, BackendError

BackendFactory = Callable[..., Backend]


def _local(**options: Any) -> Backend:
    from tidal.backends.local import LocalBackend

    return LocalBackend(**options)


def _fake(**options: Any) -> Backend:
    from tidal.backends.fake import FakeBackend

    return FakeBackend(**options)


def _ray(**options: Any) -> Backend:
    from tidal.backends.ray import RayBackend

    return RayBackend(**options)


# name -> (factory, what it is: one line for ``tidal run --help``)
_REGISTRY: dict[str, tuple[BackendFactory, str]] = {
    "local": (_local, "processes of this machine, started by the master"),
    "ray": (_ray, "Ray actors anywhere in a Ray cluster (pip install 'tidal[ray]'; --ray-address)"),
    "fake": (_fake, "in memory, starts no process (for tests: the job never trains)"),
}


def register(name: str, factory: BackendFactory, summary: str = "") -> None:
    """Make ``get(name, **options)`` return ``factory(**options)`` (a second call for one name
    replaces the first). ``summary``: what the backend is, in one line, for ``--help``."""
    _REGISTRY[name] = (factory, summary)


def get(name: str, **options: Any) -> Backend:
    """A new backend of kind ``name``.

    Raises:
        BackendError: ``name`` is not registered, or ``options`` are not ones it takes.
    """
    try:
        factory, _ = _REGISTRY[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(names())}") from None
    try:
        return factory(**options)
    except TypeError as exc:  # an option the factory does not take
        raise BackendError(f"backend {name!r}: {exc}") from None


def names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def summary(name: str) -> str:
    """What backend ``name`` is, in one line ("" if registered without one).

    Raises:
        BackendError: ``name`` is not registered.
    """
    try:
        return _REGISTRY[name][1]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(names())}") from None
