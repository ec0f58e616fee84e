"""Stream sources: one contract suite, run against every implementation.

``TestStreamSourceContract`` holds the behaviour every ``StreamSource`` must have; its ``source``
fixture opens a fresh stream of each kind by URL: Redis Streams on a real ``redis-server``
(tests/redis_server.py, one per module, a new stream name per test) and a recorded stream in
files. Redis-only properties (an unreachable server, a restart mid-job) and file-only ones (a
partial last line, a clock stepping back, a corrupt file) follow, then the URL and id helpers.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisServer, free_port, redis_server
from tidal.api import ConfigError
from tidal.data.api import FIRST, StreamRecord, StreamSource, StreamUnavailableError, format_id, parse_id
from tidal.data.streams import StreamURL, open_source, parse_stream_url
from tidal.data.streams.file import FileStreamSource
from tidal.data.streams.redis import RedisStreamSource


def rec(i: int) -> dict[str, bytes]:
    return {"i": str(i).encode()}


def numbers(records: list[StreamRecord]) -> list[int]:
    return [int(r.fields["i"]) for r in records]


def ids_of(records: list[StreamRecord]) -> list[str]:
    return [r.id for r in records]


def two_apart(source: StreamSource) -> tuple[list[str], str]:
    """Two records in different milliseconds, and an id strictly between them."""
    ids = source.append(0, [rec(0)])
    time.sleep(0.003)
    ids += source.append(0, [rec(1)])
    later = parse_id(ids[1])[0]
    assert later > parse_id(ids[0])[0]
    return ids, format_id(later - 1, 2**40)


def fresh_name() -> str:
    return f"s{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as s:
        yield s


class TestStreamSourceContract:
    """Behaviour every StreamSource must have, whatever stores the stream."""

    @pytest.fixture(params=["redis", "file"])
    def source(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StreamSource]:
        if request.param == "redis":
            url = request.getfixturevalue("server").url(fresh_name())
        else:
            url = f"file://{tmp_path}/{fresh_name()}"
        s = open_source(url)
        yield s
        s.close()

    @pytest.fixture
    def other(self, source: StreamSource) -> Iterator[StreamSource]:
        """A second source on the same URL (another reader or producer)."""
        s = open_source(source.url)
        yield s
        s.close()

    # ------------------------------------------------------------------ empty
    def test_a_new_stream_is_empty(self, source: StreamSource) -> None:
        assert source.partitions() == []
        assert source.read(0, FIRST, 10) == []
        assert source.range(0, FIRST, "99999999999999-0") == []
        assert source.last_id(0) == FIRST
        assert source.lag(0, FIRST) == 0
        assert source.trim(0, "99999999999999-0") == 0
        assert source.partitions() == []

    # ------------------------------------------------------------------ append and read
    def test_append_then_read_in_order(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(5)])
        assert len(ids) == 5
        assert [parse_id(i) for i in ids] == sorted({parse_id(i) for i in ids})  # strictly increasing
        got = source.read(0, FIRST, 100)
        assert ids_of(got) == ids and numbers(got) == [0, 1, 2, 3, 4]
        assert all(r.partition == 0 for r in got)
        more = source.append(0, [rec(5)])
        assert parse_id(more[0]) > parse_id(ids[-1])

    def test_ids_increase_within_one_millisecond(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(2000)])
        pairs = [parse_id(i) for i in ids]
        assert all(a < b for a, b in itertools.pairwise(pairs))
        assert any(a[0] == b[0] for a, b in itertools.pairwise(pairs))  # the sequence counts up

    def test_read_after_an_id_is_exclusive(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(5)])
        assert ids_of(source.read(0, ids[1], 100)) == ids[2:]
        assert source.read(0, ids[-1], 100) == []

    def test_read_after_an_id_that_is_not_in_the_stream(self, source: StreamSource) -> None:
        ids, between = two_apart(source)
        assert ids_of(source.read(0, between, 10)) == ids[1:]

    def test_count_limits_a_read(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(5)])
        assert ids_of(source.read(0, FIRST, 2)) == ids[:2]
        assert ids_of(source.read(0, ids[1], 2)) == ids[2:4]
        assert source.read(0, FIRST, 0) == []

    def test_partitions_are_independent(self, source: StreamSource) -> None:
        a = source.append(0, [rec(0), rec(1)])
        b = source.append(1, [rec(10)])
        assert ids_of(source.read(0, FIRST, 10)) == a
        assert numbers(source.read(1, FIRST, 10)) == [10] and ids_of(source.read(1, FIRST, 10)) == b
        assert [r.partition for r in source.read(1, FIRST, 10)] == [1]

    # ------------------------------------------------------------------ blocking reads
    def test_a_blocked_read_returns_when_a_record_arrives(self, source: StreamSource, other: StreamSource) -> None:
        (first,) = source.append(0, [rec(0)])
        for partition, after in ((0, first), (3, FIRST)):  # a partition with records, and one without yet
            timer = threading.Timer(0.1, other.append, (partition, [rec(1)]))
            t0 = time.monotonic()
            timer.start()
            try:
                got = source.read(partition, after, 10, block_s=10.0)
            finally:
                timer.join()
            took = time.monotonic() - t0
            assert numbers(got) == [1]
            assert 0.05 <= took < 3.0, took

    def test_a_blocked_read_gives_nothing_after_its_timeout(self, source: StreamSource) -> None:
        (first,) = source.append(0, [rec(0)])
        t0 = time.monotonic()
        assert source.read(0, first, 10, block_s=0.2) == []
        assert 0.2 <= time.monotonic() - t0 < 2.0

    def test_a_blocked_read_returns_at_once_when_records_are_there(self, source: StreamSource) -> None:
        source.append(0, [rec(0)])
        t0 = time.monotonic()
        assert numbers(source.read(0, FIRST, 10, block_s=10.0)) == [0]
        assert time.monotonic() - t0 < 1.0

    # ------------------------------------------------------------------ range, last_id, lag
    def test_range_is_inclusive_at_both_ends(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(5)])
        assert ids_of(source.range(0, ids[1], ids[3])) == ids[1:4]
        assert ids_of(source.range(0, ids[2], ids[2])) == [ids[2]]
        assert ids_of(source.range(0, FIRST, ids[0])) == [ids[0]]
        assert ids_of(source.range(0, FIRST, "99999999999999-0")) == ids
        assert source.range(0, ids[3], ids[1]) == []

    def test_range_over_many_records(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(2500)])
        assert numbers(source.range(0, ids[10], ids[2400])) == list(range(10, 2401))

    def test_last_id_and_lag(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(5)])
        assert source.last_id(0) == ids[-1]
        assert source.lag(0, FIRST) == 5
        assert source.lag(0, ids[1]) == 3
        assert source.lag(0, ids[-1]) == 0
        assert source.lag(0, "99999999999999-0") == 0
        assert source.lag(1, FIRST) == 0

    def test_lag_of_a_long_backlog(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(2500)])
        for at, want in ((FIRST, 2500), (ids[0], 2499), (ids[999], 1500), (ids[1000], 1499), (ids[1499], 1000),
                         (ids[2000], 499), (ids[2498], 1), (ids[2499], 0)):
            assert source.lag(0, at) == want, at

    # ------------------------------------------------------------------ partitions
    def test_partitions_appear_with_their_first_record(self, source: StreamSource) -> None:
        assert source.partitions() == []
        source.append(2, [rec(0)])
        assert source.partitions() == [2]
        source.append(0, [rec(1)])
        assert source.partitions() == [0, 2]
        source.append(11, [rec(2)])  # a new partition while the stream is in use; ordered as numbers
        assert source.partitions() == [0, 2, 11]

    # ------------------------------------------------------------------ trim
    def test_trim_deletes_up_to_and_including_the_id(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(5)])
        assert source.trim(0, ids[1]) == 2
        assert ids_of(source.read(0, FIRST, 100)) == ids[2:]
        assert source.lag(0, FIRST) == 3
        assert source.trim(0, ids[1]) == 0
        assert source.trim(0, FIRST) == 0
        assert ids_of(source.range(0, FIRST, ids[-1])) == ids[2:]

    def test_appended_counts_every_record_ever_appended_trimmed_ones_too(self, source: StreamSource) -> None:
        assert source.appended(0) == 0
        ids = source.append(0, [rec(i) for i in range(5)])
        assert source.appended(0) == 5
        source.trim(0, ids[2])
        source.trim(0, ids[3])
        source.append(0, [rec(9)])
        assert source.appended(0) == 6 and source.lag(0, FIRST) == 2
        again = open_source(source.url)  # another reader sees the same count (the file keeps it in its marker)
        try:
            assert again.appended(0) == 6
        finally:
            again.close()

    def test_trim_to_an_id_between_records(self, source: StreamSource) -> None:
        ids, between = two_apart(source)
        assert source.lag(0, between) == 1
        assert source.trim(0, between) == 1
        assert ids_of(source.read(0, FIRST, 10)) == ids[1:]

    def test_trimming_everything_keeps_ids_increasing(self, source: StreamSource) -> None:
        ids = source.append(0, [rec(i) for i in range(3)])
        assert source.trim(0, ids[-1]) == 3
        assert source.read(0, FIRST, 10) == []
        assert source.last_id(0) == FIRST and source.lag(0, FIRST) == 0
        assert source.partitions() == [0]  # an emptied partition still exists
        (new,) = source.append(0, [rec(3)])
        assert parse_id(new) > parse_id(ids[-1])
        assert numbers(source.read(0, ids[-1], 10)) == [3]

    # ------------------------------------------------------------------ fields
    def test_fields_round_trip_as_bytes(self, source: StreamSource) -> None:
        fields = {
            "empty": b"",
            "all_bytes": bytes(range(256)),
            "not_utf8": b"\xff\xfe\x00\xc3",
            "ünïcode name": "ünïcode".encode(),
            "big": os.urandom(200_000),
            "newline": b"a\nb\r\n",
        }
        (record_id,) = source.append(0, [fields])
        (got,) = source.read(0, FIRST, 10)
        assert got.id == record_id and got.fields == fields
        assert all(type(v) is bytes for v in got.fields.values())
        assert source.range(0, record_id, record_id)[0].fields == fields

    def test_a_record_needs_a_field(self, source: StreamSource) -> None:
        with pytest.raises(ConfigError):
            source.append(0, [rec(0), {}])
        assert source.read(0, FIRST, 10) == []
        assert source.append(0, []) == []

    def test_bad_ids_and_partitions_are_refused(self, source: StreamSource) -> None:
        for bad in ("", "5", "a-1", "1-b", "-1-0", "1-0 "):
            with pytest.raises(ConfigError):
                source.read(0, bad, 10)
            with pytest.raises(ConfigError):
                source.lag(0, bad)
        with pytest.raises(ConfigError):
            source.read(-1, FIRST, 10)

    # ------------------------------------------------------------------ sharing
    def test_two_sources_on_one_url_see_the_same_stream(self, source: StreamSource, other: StreamSource) -> None:
        a = source.append(0, [rec(0), rec(1)])
        assert ids_of(other.read(0, FIRST, 10)) == a
        b = other.append(0, [rec(2)])
        assert parse_id(b[0]) > parse_id(a[-1])
        assert numbers(source.read(0, FIRST, 10)) == [0, 1, 2]
        other.append(4, [rec(3)])
        assert source.partitions() == other.partitions() == [0, 4]
        assert other.trim(0, a[0]) == 1
        assert ids_of(source.read(0, FIRST, 10)) == [a[1], b[0]]
        assert source.last_id(0) == other.last_id(0) == b[0]


# ---------------------------------------------------------------------- redis only
def test_an_unreachable_redis_is_a_config_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/events"
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        open_source(url)
    message = str(err.value)
    assert url in message and "cannot reach redis" in message and "\n" not in message
    assert time.monotonic() - t0 < 5.0


def test_redis_down_past_the_retries_is_unavailable(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        source = RedisStreamSource(server.url("events"), retry_s=0.3)
        try:
            source.append(0, [rec(0)])
            server.stop()
            t0 = time.monotonic()
            with pytest.raises(StreamUnavailableError) as err:
                source.read(0, FIRST, 10)
            assert 0.3 <= time.monotonic() - t0 < 3.0
            assert server.url("events") in str(err.value)
            server.start()  # no persistence: the stream is gone, but the source works again
            assert source.read(0, FIRST, 10) == []
        finally:
            source.close()


def test_redis_restarting_mid_job_loses_nothing(tmp_path: Path) -> None:
    """A producer and a reader run on while the server restarts (persistent, same port and data)."""
    total = 600
    with redis_server(tmp_path, persistent=True) as server:
        url = server.url("events")
        producer, reader = RedisStreamSource(url, retry_s=20), RedisStreamSource(url, retry_s=20)
        appended: list[str] = []
        got: list[StreamRecord] = []
        failures: list[BaseException] = []

        def read_all() -> None:
            try:
                after = FIRST
                while len(got) < total:
                    batch = reader.read(0, after, 7, block_s=0.05)
                    if batch:
                        got.extend(batch)
                        after = batch[-1].id
            except BaseException as exc:
                failures.append(exc)

        thread = threading.Thread(target=read_all, daemon=True)
        restart = threading.Thread(target=server.restart, kwargs={"down_s": 0.3}, daemon=True)
        thread.start()
        try:
            for start in range(0, total, 20):
                appended.extend(producer.append(0, [rec(i) for i in range(start, start + 20)]))
                if start == total // 2:
                    restart.start()  # the producer keeps appending while the server is down
                    time.sleep(0.05)
            restart.join(timeout=30)
            thread.join(timeout=30)
            assert not thread.is_alive() and not failures, failures
            assert numbers(got) == list(range(total))
            assert ids_of(got) == appended
            assert reader.lag(0, FIRST) == total
        finally:
            producer.close()
            reader.close()


# ---------------------------------------------------------------------- file only
def test_a_partial_last_line_is_ignored_until_complete(tmp_path: Path) -> None:
    source = FileStreamSource(f"file://{tmp_path}/rec")
    ids = source.append(0, [rec(0), rec(1)])
    ms, seq = parse_id(ids[-1])
    line = json.dumps({"id": format_id(ms, seq + 1), "fields": {"i": base64.b64encode(b"2").decode()}}) + "\n"
    path = tmp_path / "rec.0.jsonl"
    with open(path, "ab") as f:
        f.write(line[:15].encode())
    assert ids_of(source.read(0, FIRST, 10)) == ids
    assert source.lag(0, FIRST) == 2 and source.last_id(0) == ids[-1]
    with open(path, "ab") as f:
        f.write(line[15:].encode())
    assert numbers(source.read(0, ids[-1], 10)) == [2]
    source.close()


def test_a_dead_writers_partial_line_is_cut_before_the_next_append(tmp_path: Path) -> None:
    source = FileStreamSource(f"file://{tmp_path}/rec")
    source.append(0, [rec(0)])
    with open(tmp_path / "rec.0.jsonl", "ab") as f:
        f.write(b'{"id": "9999999999999-0", "fie')
    source.append(0, [rec(1)])
    assert numbers(FileStreamSource(f"file://{tmp_path}/rec").read(0, FIRST, 10)) == [0, 1]
    source.close()


def test_file_ids_survive_a_clock_stepping_back(tmp_path: Path) -> None:
    now = [1000.0]
    source = FileStreamSource(f"file://{tmp_path}/rec", clock=lambda: now[0])
    assert source.append(0, [rec(0), rec(1)]) == ["1000000-0", "1000000-1"]
    now[0] = 999.0
    assert source.append(0, [rec(2)]) == ["1000000-2"]
    now[0] = 1000.0015
    assert source.append(0, [rec(3)]) == ["1000001-0"]
    source.close()


def test_a_corrupt_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "rec.0.jsonl"
    path.write_text('{"id": "5-0", "fields": {}}\nnot json\n')
    with pytest.raises(ConfigError, match=r"rec\.0\.jsonl"):
        FileStreamSource(f"file://{tmp_path}/rec").read(0, FIRST, 10)
    path.write_text('{"id": "5-0", "fields": {}}\n{"id": "4-0", "fields": {}}\n')
    with pytest.raises(ConfigError, match="not above"):
        FileStreamSource(f"file://{tmp_path}/rec").read(0, FIRST, 10)


def test_a_file_reader_in_another_source_follows_trims_and_appends(tmp_path: Path) -> None:
    writer, reader = FileStreamSource(f"file://{tmp_path}/rec"), FileStreamSource(f"file://{tmp_path}/rec")
    ids = writer.append(0, [rec(i) for i in range(4)])
    assert reader.lag(0, FIRST) == 4
    for round_ in range(3):  # each trim replaces the file; the reader must notice every time
        writer.trim(0, ids[0])
        ids = ids[1:] + writer.append(0, [rec(10 + round_)])
        assert ids_of(reader.read(0, FIRST, 100)) == ids
    writer.close()
    reader.close()


# ---------------------------------------------------------------------- URLs and ids
def test_parse_stream_url() -> None:
    assert parse_stream_url("redis://127.0.0.1:7000/clicks") == StreamURL("redis", "clicks", "127.0.0.1", 7000)
    assert parse_stream_url("redis://cache.local/a.b_c-1").port == 6379
    assert parse_stream_url("file:///var/streams/clicks") == StreamURL("file", "clicks", directory="/var/streams")


@pytest.mark.parametrize("url", [
    "clicks", "http://127.0.0.1/clicks", "redis:///clicks", "redis://127.0.0.1:7000/", "redis://127.0.0.1:7000",
    "redis://127.0.0.1:7000/a/b", "redis://127.0.0.1:7000/a*", "redis://127.0.0.1:99999/a", "redis://127.0.0.1:0/a",
    "redis://127.0.0.1:port/a", "redis://user:pw@127.0.0.1:7000/a", "redis://127.0.0.1:7000/a?x=1",
    "redis://127.0.0.1:7000/" + "a" * 101, "file://relative/dir/clicks", "file:///clicks", "file:///dir/",
    "file:///dir/..", "file:///dir/a b", "redis://127.0.0.1:7000/a\nb",
])
def test_a_bad_url_is_a_config_error_naming_it(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        open_source(url)
    assert repr(url) in str(err.value) and "\n" not in str(err.value)


def test_ids_order_as_integer_pairs() -> None:
    assert parse_id("10-0") > parse_id("9-5")
    assert parse_id("9-10") > parse_id("9-9")
    assert parse_id(FIRST) < parse_id("0-1")
    assert format_id(*parse_id("1732268400123-7")) == "1732268400123-7"
