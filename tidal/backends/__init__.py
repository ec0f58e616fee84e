"""Where a job's nodes run. ``backends.get("local")`` is the embedded default (DESIGN.md 3).

The interface is in ``tidal.backends.api``; the implementations (``local``, ``ray``, ``fake``) are
built by name through ``tidal.backends.registry``, which imports each only when it is asked for.
"""

from __future__ import annotations

from tidal.backends.api import (
    ROLES,
    Backend,
    BackendError,
    BackendState,
    NodeError,
    NodeExit,
    NodeHandle,
    NodeSpec,
    Resources,
    Role,
    node_id,
    parse_node_id,
)
from tidal.backends.registry import get, names, register, summary

__all__ = [
    "ROLES",
    "Backend",
    "BackendError",
    "BackendState",
    "NodeError",
    "NodeExit",
    "NodeHandle",
    "NodeSpec",
    "Resources",
    "Role",
    "get",
    "names",
    "node_id",
    "parse_node_id",
    "register",
    "summary",
]
