"""``tidal produce``: write synthetic click samples into a stream at a traffic trace's rate."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from tidal.cli import app, fail


def _click_records(seed: int) -> Any:
    """The example's generator (examples/ctr/stream.py), from the checkout tidal runs from."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "examples" / "ctr" / "stream.py").is_file():
        raise fail(f"the click-sample generator examples/ctr/stream.py is not beside this tidal ({root})")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from examples.ctr.stream import ClickRecords

    return ClickRecords(seed)


@app.command()
def produce(
    stream: str = typer.Option(..., "--stream", metavar="URL",
                               help="redis://127.0.0.1:PORT/NAME (partition p is the key NAME:p) or file:///DIR/NAME."),
    partitions: int = typer.Option(..., "--partitions", help="How many partitions to write (1 to 1024)."),
    trace: Path = typer.Option(..., "--trace", help="CSV: time (timestamps or minutes) then arrivals per interval."),
    column: str | None = typer.Option(None, "--column", help="The count column (default: the second)."),
    speedup: float = typer.Option(60.0, "--speedup", help="Compress time: an interval of I s lasts I/X s."),
    peak: float | None = typer.Option(None, "--peak", metavar="RATE",
                                      help="Scale the counts so that the busiest interval arrives at RATE records/s."),
    skew: float = typer.Option(0.0, "--skew", help="Partition p gets the share (p+1)^-S (0: even; 2: 70% on the "
                                                    "first of 4)."),
    limit: int | None = typer.Option(None, "--limit", help="Stop after N records."),
    first_index: int = typer.Option(0, "--first-index", help="The generator's index of the first record written."),
    seed: int = typer.Option(0, "--seed", help="The generator's seed (the example's --seed)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the summary at the end."),
) -> None:
    """Write synthetic click samples (examples/ctr's generator) into STREAM at TRACE's rate.

    Arrivals follow the trace interval by interval, compressed in time by --speedup, spread evenly
    within an interval; records never leave the stream on tidal's account (`tidal run
    --trim-after-commit` is the one way it deletes any). Prints progress every 2 s and, at the
    end, what it wrote per partition (count, first and last id).
    """
    from tidal.cli.sim import read_csv
    from tidal.data.produce import arrival_rates, partition_shares
    from tidal.data.produce import produce as run_producer
    from tidal.data.streams import open_source
    from tidal.sim.online import load_trace

    if not 1 <= partitions <= 1024:
        raise fail(f"--partitions must be 1 to 1024, got {partitions}")
    if limit is not None and limit < 1:
        raise fail(f"--limit must be at least 1, got {limit}")
    if first_index < 0:
        raise fail("--first-index must not be negative")
    counts, interval = load_trace(read_csv(trace), column)
    rates = arrival_rates(counts, interval, speedup, peak)
    shares = partition_shares(partitions, skew)
    records = _click_records(seed)
    source = open_source(stream)
    real_interval = interval / speedup
    total = int(rates.sum() * real_interval)
    if limit is not None:
        total = min(total, limit)
    typer.echo(f"tidal produce: {trace.name}: {len(counts)} intervals of {interval:g} s at speedup {speedup:g} "
               f"({len(counts) * real_interval:.1f} s), peak {rates.max():.1f} records/s; {total} records into "
               f"{stream} over {partitions} partitions (shares {', '.join(f'{s:.2f}' for s in shares)})", err=True)

    def progress(done: Any, t: float) -> None:
        if not quiet:
            typer.echo(f"  {t:7.1f} s  {done.records} records ({done.records / max(t, 1e-9):.1f}/s)", err=True)

    try:
        done = run_producer(source, rates, real_interval, shares, records.encode, limit=limit,
                            first_index=first_index, progress=progress)
    except KeyboardInterrupt:
        typer.echo("tidal produce: interrupted", err=True)
        raise typer.Exit(130) from None
    finally:
        source.close()
    typer.echo(f"wrote {done.records} records in {done.seconds:.1f} s ({done.records / max(done.seconds, 1e-9):.1f}/s), "
               f"indices {first_index}..{done.next_index - 1}")
    for p in range(partitions):
        typer.echo(f"  partition {p}: {done.per_partition[p]} records, ids {done.first_ids[p]} .. {done.last_ids[p]}")
