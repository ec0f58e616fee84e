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


class FrameError(PermanentError, ValueError):
    """A data-plane message (``tidal.api.frames``) that breaks the codec's rules: malformed or
    unknown header fields, a dtype outside the whitelist, a buffer whose length does not match
    its shape, a size over a limit. The same bytes will fail again, so it is permanent; it is a
    ``ValueError`` because it is bad input."""
