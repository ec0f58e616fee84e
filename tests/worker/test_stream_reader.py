"""The stream loader's read-ahead (tidal.worker.stream_reader): a forked reader process gives the
same batches as a thread, falls back to a thread when a batch cannot cross the pipe, and ends
with its worker, also when the worker is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.api.streams import pack_id
from tidal.data.streams.file import FileStreamSource
from tidal.worker.stream_reader import PartitionReader, ReadAhead, Taken

ROOT = Path(__file__).resolve().parents[2]


def decode(fields: list[dict[str, bytes]]) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Records whose ``n`` is a multiple of 7 are malformed."""
    bad = [i for i, f in enumerate(fields) if int(f["n"]) % 7 == 0]
    good = [int(f["n"]) for i, f in enumerate(fields) if i not in bad]
    return {"n": torch.tensor(good, dtype=torch.int64), "x": torch.tensor(good, dtype=torch.float32)[:, None] / 2}, bad


def not_tensors(fields: list[dict[str, bytes]]) -> tuple[list[int], list[int]]:
    return [int(f["n"]) for f in fields], []


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture
def source(tmp_path: Path) -> FileStreamSource:
    src = FileStreamSource(f"file://{tmp_path}/clicks")
    for p in range(2):
        src.append(p, [{"n": str(100 * p + i).encode()} for i in range(23 + 10 * p)])
    return src


def read_all(source: FileStreamSource, decode_fn: Any, use_process: bool,
             skips: dict[int, list[list[int]]] | None = None) -> tuple[list[Taken], bool]:
    """Every batch of both partitions through ``ReadAhead``, as the loader takes them."""
    reader = PartitionReader(source, batch_size=5)
    reader.order, reader.skips = [0, 1], skips or {}
    ahead = ReadAhead(reader, decode_fn, use_process=use_process)
    positions, turn, out, used_process = {0: 0, 1: 0}, 0, [], False  # 0: "0-0", before every record
    try:
        while True:
            ahead.start(positions, turn)
            used_process = used_process or ahead.in_process
            got = ahead.take()
            if got is None:  # the read ahead gave up: the loader reads in its own thread
                picked, turn = reader.next_records(positions, turn)
                got = (None if picked is None else Taken.decoded(picked, decode_fn)), turn
            taken, turn = got
            if taken is None:
                return out, used_process
            out.append(taken)
            for partition, _, _, last, _ in taken.spans:
                positions[partition] = last
    finally:
        ahead.close()


def as_plain(taken: list[Taken]) -> list[tuple[Any, ...]]:
    def batch(b: Any) -> Any:
        return {k: v.tolist() for k, v in b.items()} if isinstance(b, dict) else b

    return [(t.spans, batch(t.batch), t.bad_ids) for t in taken]


def test_the_reader_process_gives_the_batches_a_thread_gives(source: FileStreamSource) -> None:
    ids = [pack_id(r.id) for r in source.read(0, "0-0", 100)]
    skips = {0: [[ids[6], ids[9]]]}  # records 7-9 of partition 0 were committed ahead
    by_thread, _ = read_all(source, decode, use_process=False, skips=skips)
    by_process, used_process = read_all(source, decode, use_process=True, skips=skips)
    assert used_process
    assert as_plain(by_process) == as_plain(by_thread)
    # in turn (round-robin); partition 0 has 2 records before the range committed ahead, and the
    # step takes the rest of its batch from partition 1; every step but the last is a full batch
    assert [[s[0] for s in t.spans] for t in by_thread[:4]] == [[0], [1], [0, 1], [0]]
    assert [t.count for t in by_thread[:-1]] == [5] * (len(by_thread) - 1)
    read = [n for n in list(range(23)) + list(range(100, 133)) if n not in (7, 8, 9)]
    assert sorted(n for t in by_thread for n in t.batch["n"].tolist()) == [n for n in read if n % 7]
    assert sum(len(t.bad_ids) for t in by_thread) == sum(1 for n in read if n % 7 == 0)


def test_records_committed_ahead_do_not_wait(source: FileStreamSource) -> None:
    """What a worker reports waiting in its partition leaves out the ranges committed ahead of its
    position: a partition whose last records a receiver of forwarded records trained is drained
    at the range's start (counted waiting, a job with --stop-when-drained never stopped)."""
    ids = [pack_id(r.id) for r in source.read(0, "0-0", 100)]  # 23 records
    reader = PartitionReader(source, batch_size=5)
    reader.order, reader.skips = [0], {0: [[ids[6], ids[9]], [ids[15], ids[22]]]}  # 7-9 and 16-22 committed
    assert reader.uncommitted(0, ids[4]) == 8  # 5, 6, 10 .. 15
    assert reader.uncommitted(0, ids[9]) == 6
    assert reader.uncommitted(0, ids[15]) == 0
    assert reader.read_partition(0, ids[15], limit=1) == (ids[22], [])
    after, head = reader.read_partition(0, ids[6], limit=1)  # the oldest waiting: past the range
    assert (after, [r.fields["n"] for r in head]) == (ids[9], [b"10"])
    assert PartitionReader(source, batch_size=5).uncommitted(1, 0) == 33  # nothing committed ahead


def test_batches_that_are_not_tensors_are_read_ahead_by_a_thread(source: FileStreamSource,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    by_process, _ = read_all(source, not_tensors, use_process=True)
    by_thread, _ = read_all(source, not_tensors, use_process=False)
    assert as_plain(by_process) == as_plain(by_thread)
    assert "cannot leave the reader process" in caplog.text


def test_the_reader_process_ends_when_its_worker_is_killed(tmp_path: Path, source: FileStreamSource) -> None:
    script = tmp_path / "worker.py"
    script.write_text(f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from tidal.data.streams.file import FileStreamSource
from tidal.worker.stream_reader import PartitionReader, ReadAhead
from tests.worker.test_stream_reader import decode
reader = PartitionReader(FileStreamSource({source.url!r}), batch_size=5)
reader.order = [0]
ahead = ReadAhead(reader, decode, use_process=True)
ahead.start({{0: 0}}, 0)
assert ahead.take() is not None and ahead.in_process
print(ahead._process.pid, flush=True)
time.sleep(60)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        reader_pid = int(proc.stdout.readline())
        assert alive(reader_pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 5
        while alive(reader_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(reader_pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        proc.wait(10)


def test_closing_ends_the_reader_process(source: FileStreamSource) -> None:
    reader = PartitionReader(source, batch_size=5)
    reader.order = [0]
    ahead = ReadAhead(reader, decode, use_process=True)
    ahead.start({0: 0}, 0)
    assert ahead.take() is not None and ahead.in_process
    pid = ahead._process.pid  # type: ignore[union-attr]
    ahead.close()
    assert not alive(pid)


def test_a_worker_too_big_to_fork_reads_ahead_in_a_thread(source: FileStreamSource, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from tidal.worker import stream_reader

    assert stream_reader.fits_a_copy() == ""  # this test process is small
    monkeypatch.setattr(stream_reader, "fits_a_copy", lambda: "the worker holds 90 GiB")
    by_thread, used_process = read_all(source, decode, use_process=True)
    assert not used_process and len(by_thread) > 2
    assert "reader process not started (the worker holds 90 GiB)" in caplog.text
