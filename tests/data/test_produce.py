"""``tidal produce`` (tidal.data.produce): arrivals follow the trace compressed in time, the split
over partitions follows the skew exactly, and the records are the example's samples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.jobtools import ROOT, TIDAL
from tests.redis_server import free_port, redis_server
from tidal.api import ConfigError
from tidal.data.api import FIRST
from tidal.data.produce import arrival_rates, partition_shares, produce
from tidal.data.streams import open_source

sys.path.insert(0, str(ROOT))
from examples.ctr.data import ClickDataset
from examples.ctr.stream import ClickRecords


def test_shares_follow_the_skew() -> None:
    assert np.allclose(partition_shares(4, 0.0), 0.25)
    hot = partition_shares(4, 2.0)
    assert abs(hot.sum() - 1) < 1e-12 and 0.69 < hot[0] < 0.71 and list(hot) == sorted(hot, reverse=True)
    for bad in ((0, 1.0), (2, -1.0), (2, float("nan"))):
        with pytest.raises(ConfigError):
            partition_shares(*bad)


def test_rates_are_compressed_by_the_speedup_and_scaled_to_the_peak() -> None:
    counts = np.array([60.0, 120.0, 0.0])  # per minute
    assert list(arrival_rates(counts, 60.0, 60.0, None)) == [60.0, 120.0, 0.0]  # a minute lasts a second
    assert list(arrival_rates(counts, 60.0, 1.0, 50.0)) == [25.0, 50.0, 0.0]
    with pytest.raises(ConfigError):
        arrival_rates(counts, 60.0, 0.0, None)
    with pytest.raises(ConfigError):
        arrival_rates(np.zeros(3), 60.0, 1.0, 10.0)


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_arrivals_follow_the_trace_and_the_split_is_exact(tmp_path: Path) -> None:
    source = open_source(f"file://{tmp_path}/clicks")
    records = ClickRecords()
    t = FakeTime()
    seen: list[tuple[float, int, list[int]]] = []
    original_append = source.append

    def append(partition: int, batch: list[dict[str, bytes]]) -> list[str]:
        seen.append((t.now, partition, [records.index_of(r) for r in batch]))
        return original_append(partition, batch)

    source.append = append  # type: ignore[method-assign]
    rates = np.array([10.0, 30.0, 0.0, 20.0])  # records per second, intervals of 1 s
    shares = partition_shares(3, 1.0)
    done = produce(source, rates, 1.0, shares, records.encode, clock=t.clock, sleep=t.sleep, tick_s=0.05)
    assert done.records == 60 and done.next_index == 60
    due = np.concatenate([[0.0], np.cumsum(rates)])
    written = 0
    for now, _, indices in seen:  # never ahead of the trace
        written += len(indices)
        k = min(int(now), 3)
        assert written <= due[k] + rates[k] * (now - k) + 1e-9
    assert t.now == pytest.approx(4.0, abs=0.1)  # the trace lasts 4 s
    for p in range(3):  # the split follows the shares to within one record
        assert abs(done.per_partition[p] - 60 * shares[p]) < 1
        got = source.read(p, FIRST, 1000)
        assert len(got) == done.per_partition[p] and got[0].id == done.first_ids[p] and got[-1].id == done.last_ids[p]
    indices = sorted(records.index_of(r.fields) for p in range(3) for r in source.read(p, FIRST, 1000))
    assert indices == list(range(60))  # every sample once over the partitions
    source.close()


def test_the_limit_stops_the_producer(tmp_path: Path) -> None:
    source = open_source(f"file://{tmp_path}/clicks")
    t = FakeTime()
    done = produce(source, np.array([1000.0] * 10), 1.0, partition_shares(2, 0.0), ClickRecords().encode,
                   limit=123, first_index=7, clock=t.clock, sleep=t.sleep)
    assert done.records == 123 and done.next_index == 130 and done.per_partition == [62, 61]
    source.close()


def test_tidal_produce_writes_the_examples_samples(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("period,count\n" + "".join(f"{m},{c}\n" for m, c in enumerate([30, 90, 60])))
    url = f"file://{tmp_path}/clicks"
    out = subprocess.run([TIDAL, "produce", "--stream", url, "--partitions", "2", "--trace", str(trace),
                          "--speedup", "120", "--skew", "1", "--seed", "3"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wrote 180 records" in out.stdout and "partition 0: 120 records" in out.stdout, out.stdout
    assert "3 intervals of 60 s at speedup 120 (1.5 s)" in out.stderr
    source = open_source(url)
    records = [r for p in (0, 1) for r in source.read(p, FIRST, 1000)]
    source.close()
    clicks = ClickRecords(seed=3)
    order = np.argsort([clicks.index_of(r.fields) for r in records])
    batch, bad = clicks.decode([records[i].fields for i in order])
    expected = ClickDataset(180, seed=3).get_range(0, 180)
    assert not bad and all(torch.equal(batch[k], expected[k]) for k in expected)


@pytest.mark.parametrize("args, message", [
    (["--partitions", "0"], "--partitions must be 1 to 1024"),
    (["--partitions", "2", "--limit", "0"], "--limit must be at least 1"),
    (["--partitions", "2", "--stream", "redis:///x"], "bad stream URL"),
    (["--partitions", "2", "--speedup", "-1"], "speedup must be a positive number"),
])
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("period,count\n0,5\n1,5\n")
    argv = [TIDAL, "produce", "--trace", str(trace)]
    if "--stream" not in args:
        argv += ["--stream", f"file://{tmp_path}/s"]
    out = subprocess.run(argv + args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_tidal_produce_into_a_real_redis(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("period,count\n0,100\n1,300\n")
    with redis_server(tmp_path) as server:
        url = server.url("clicks")
        out = subprocess.run([TIDAL, "produce", "--stream", url, "--partitions", "4", "--trace", str(trace),
                              "--speedup", "120", "--skew", "2", "-q"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        source = open_source(url)
        try:
            counts = [len(source.read(p, FIRST, 1000)) for p in source.partitions()]
        finally:
            source.close()
    assert sum(counts) == 400 and counts[0] == round(400 * partition_shares(4, 2.0)[0])
    assert f"partition 0: {counts[0]} records" in out.stdout


def test_an_unreachable_redis_is_one_line_naming_the_url(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("period,count\n0,5\n1,5\n")
    url = f"redis://127.0.0.1:{free_port()}/clicks"
    out = subprocess.run([TIDAL, "produce", "--stream", url, "--partitions", "1", "--trace", str(trace)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and url in out.stderr and "cannot reach redis" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
