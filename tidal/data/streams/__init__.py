"""Stream sources by URL (DESIGN.md 3): ``open_source(url)`` picks the implementation by scheme.

``redis://HOST[:PORT]/NAME``
    Redis Streams (``tidal.data.streams.redis``): partition ``p`` is the stream key ``NAME:p``.
    The port defaults to Redis' 6379.
``file:///ABS/DIR/NAME``
    A recorded stream (``tidal.data.streams.file``): partition ``p`` is the file
    ``DIR/NAME.p.jsonl``, one record a line.

NAME is 1-100 characters of ``[A-Za-z0-9_.-]``, so it is safe both in a Redis key pattern and
in a file name. A URL that does not fit raises ``ConfigError`` naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from tidal.api import ConfigError
from tidal.data.api import StreamSource

__all__ = ["StreamURL", "open_source", "parse_stream_url"]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_REDIS_PORT = 6379


@dataclass(frozen=True)
class StreamURL:
    """A parsed stream URL: ``host`` and ``port`` for redis, ``directory`` for file."""

    scheme: str  # "redis" or "file"
    name: str
    host: str | None = None
    port: int | None = None
    directory: str | None = None


def parse_stream_url(url: str) -> StreamURL:
    """Split a stream URL into its parts.

    Raises:
        ConfigError: not a ``redis://HOST[:PORT]/NAME`` or ``file:///ABS/DIR/NAME`` URL.
    """

    def bad(why: str) -> ConfigError:
        return ConfigError(f"bad stream URL {url!r}: {why}")

    if any(c.isspace() for c in url):
        raise bad("it contains white space")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise bad(str(exc)) from exc
    if parts.query or parts.fragment:
        raise bad("a stream URL takes no query or fragment")
    if parts.scheme == "redis":
        if parts.username is not None or parts.password is not None:
            raise bad("credentials in the URL are not supported")
        if not parts.hostname:
            raise bad("the redis host is missing (redis://HOST:PORT/NAME)")
        name = parts.path[1:]
        if not parts.path.startswith("/") or not _NAME.fullmatch(name):
            raise bad("the stream name must be /NAME, NAME of 1-100 characters [A-Za-z0-9_.-]")
        if port == 0:
            raise bad("port 0 is not a server's port")
        return StreamURL("redis", name, host=parts.hostname, port=_REDIS_PORT if port is None else port)
    if parts.scheme == "file":
        if parts.netloc:
            raise bad("a file URL names an absolute path: file:///ABS/DIR/NAME")
        directory, _, name = parts.path.rpartition("/")
        if not directory.startswith("/") or not _NAME.fullmatch(name) or name in (".", ".."):
            raise bad("the path must be /ABS/DIR/NAME, NAME of 1-100 characters [A-Za-z0-9_.-]")
        return StreamURL("file", name, directory=directory)
    raise bad(f"unknown scheme {parts.scheme!r} (redis:// or file://)")


def open_source(url: str, *, retry_s: float = 30.0) -> StreamSource:
    """The source for ``url``. ``retry_s`` bounds how long a Redis source retries a call.

    Raises:
        ConfigError: a bad URL, or a Redis server that does not answer.
    """
    where = parse_stream_url(url)
    # imported here: the implementations import this module, and a file user needs no redis-py
    if where.scheme == "redis":
        from tidal.data.streams.redis import RedisStreamSource

        return RedisStreamSource(url, retry_s=retry_s)
    from tidal.data.streams.file import FileStreamSource

    return FileStreamSource(url)
