"""tidal's exception hierarchy.

``RetryableError`` means the same call may succeed later (master restarting, round changing);
``PermanentError`` means it will not (bad input, missing file). CLI commands turn a
``ConfigError`` into a one-line message and exit code 2.
"""

from __future__ import annotations


class TidalError(Exception):
    """Base class of every error tidal raises on purpose."""


class RetryableError(TidalError):
    """A transient condition: retry with backoff."""


class PermanentError(TidalError):
    """Retrying will not help."""


class ConfigError(PermanentError):
    """Bad user input: a flag, a path, a port. The message names the problem in one line."""


class StaleRoundError(RetryableError):
    """The request named a membership round that is no longer current: rendezvous again."""
