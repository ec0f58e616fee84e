"""The data-plane codec (tidal.api.frames) beside torch.save/torch.load, on one process.

    .venv/bin/python bench/frames.py [--mib 64] [--tensors 16] [--repeats 9] [--threads N]

A state of ``--mib`` MiB of float32 in ``--tensors`` equal tensors (a dict, as a state_dict) is
sent through memory, encode then decode, four ways:

- frames: ``encode`` -> frames -> ``decode``: what a ZeroMQ peer does (``send_multipart`` /
  ``recv_multipart`` with ``copy=False`` hand over the same buffers; the socket is not timed);
- joined: ``encode_joined`` -> (header, one buffer) -> ``decode_joined``: the form
  ``RoundComm.broadcast_state`` sends (one more copy, into the flat buffer);
- pack_state: ``tidal.worker.state.pack_state`` / ``unpack_state`` of ``{"model": state}``:
  the joined form plus the tree skeleton, exactly what the state broadcast runs;
- peer: ``torch.save`` into a ``BytesIO`` and ``torch.load(..., weights_only=True)`` from it.

Each is run ``--repeats`` times after one warm-up, the four ways taking turns; the table gives
the medians (ms), the throughput (MB/s = 10^6 bytes of tensor data per second, encode + decode
median), the speed-up over the peer (its median / this one's), and the best run of each with
its speed-up (less sensitive to a neighbour on the shared cores, which moves the medians a lot:
most of the time goes to first-touch page faults and memory bandwidth). Every decoded state is checked bitwise against the
source once. torch copies with its intra-op threads (``--threads``, default torch's own).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import MACHINE, load_average, median, table
from tidal.api import frames
from tidal.worker.state import pack_state, unpack_state


def codec_frames(state: dict[str, torch.Tensor]) -> tuple[Callable[[], Any], Callable[[Any], dict[str, torch.Tensor]]]:
    return (lambda: frames.encode(state)), (lambda sent: frames.decode(sent).tensors)


def codec_joined(state: dict[str, torch.Tensor]) -> tuple[Callable[[], Any], Callable[[Any], dict[str, torch.Tensor]]]:
    return (lambda: frames.encode_joined(state)), (lambda sent: frames.decode_joined(*sent).tensors)


def state_pack(state: dict[str, torch.Tensor]) -> tuple[Callable[[], Any], Callable[[Any], dict[str, torch.Tensor]]]:
    return (lambda: pack_state({"model": state})), (lambda sent: unpack_state(*sent)["model"])


def torch_save(state: dict[str, torch.Tensor]) -> tuple[Callable[[], Any], Callable[[Any], dict[str, torch.Tensor]]]:
    def save() -> io.BytesIO:
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf

    def load(buf: io.BytesIO) -> dict[str, torch.Tensor]:
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    return save, load


def measure(state: dict[str, torch.Tensor], ways: list[tuple[str, Any]], repeats: int
            ) -> dict[str, tuple[list[float], list[float]]]:
    """Encode and decode seconds of every way, interleaved (one round of all ways per repeat, so
    that a neighbour's load on the shared cores falls on all of them alike). Each way's first
    decoded state is checked bitwise."""
    made = {name: make(state) for name, make in ways}
    for encode, decode in made.values():
        back = decode(encode())  # warm-up, and the check
        assert list(back) == list(state) and all(torch.equal(back[k], v) for k, v in state.items())
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in made}
    for _ in range(repeats):
        for name, (encode, decode) in made.items():
            t0 = time.perf_counter()
            sent = encode()
            t1 = time.perf_counter()
            decode(sent)
            t2 = time.perf_counter()
            times[name][0].append(t1 - t0)
            times[name][1].append(t2 - t1)
            del sent
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    numel = (args.mib << 20) // 4 // args.tensors
    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(args.tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    ways = [("frames (encode/decode)", codec_frames), ("joined (broadcast form)", codec_joined),
            ("pack_state/unpack_state", state_pack), ("peer: torch.save/torch.load", torch_save)]
    times = measure(state, ways, args.repeats)
    totals = {name: [e + d for e, d in zip(enc, dec, strict=True)] for name, (enc, dec) in times.items()}
    peer, peer_best = median(totals[ways[-1][0]]), min(totals[ways[-1][0]])

    rows = [["way", "encode ms", "decode ms", "total ms", "MB/s", "vs torch.save", "best ms", "best vs torch.save"]]
    for name, (enc, dec) in times.items():
        total, best = median(totals[name]), min(totals[name])
        rows.append([name, f"{median(enc) * 1e3:.1f}", f"{median(dec) * 1e3:.1f}", f"{total * 1e3:.1f}",
                     f"{nbytes / total / 1e6:.0f}", f"{peer / total:.2f}x", f"{best * 1e3:.1f}",
                     f"{peer_best / best:.2f}x"])
    print(f"{args.mib} MiB float32 in {args.tensors} tensors, median of {args.repeats}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} intra-op threads; {MACHINE}; "
          f"load {load_average():.2f}")
    print(table(rows))


if __name__ == "__main__":
    main()
