"""``tidal sim online|cluster|job``: policies on a traffic trace, on a cluster trace, on one job."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import typer

from tidal.api import ConfigError
from tidal.cli import app, fail
from tidal.cli.job import (
    LAG_PRICE_HELP,
    LOAD_HEADROOM_HELP,
    PLANNED_LAG_HELP,
    PROGRAM_HOURS_HELP,
    PROGRAM_LAG_PRICE_HELP,
    PROGRAM_LAG_RATIO_HELP,
    check_kale_knobs,
    check_program_knobs,
)

sim_app = typer.Typer(help="Evaluate scaling policies in simulation on real traces.", no_args_is_help=True)
app.add_typer(sim_app, name="sim")


def read_csv(path: Path) -> list[list[str]]:
    """A trace's rows (``tidal.sim.online.load_trace`` reads them); a one-line error if unreadable."""
    try:
        with open(path, newline="") as f:
            return list(csv.reader(f))
    except OSError as exc:
        raise fail(f"cannot read {path}: {exc.strerror or exc}") from None


@sim_app.command("online")
def online(
    trace: Path = typer.Option(..., "--trace", help="CSV: time (timestamps or minutes) then counts per interval"),
    column: str | None = typer.Option(None, "--column", help="the count column (default: the second)"),
    peak_workers: int = typer.Option(28, "--peak-workers", help="workers the peak traffic needs"),
    days: float = typer.Option(7.0, "--days", help="simulate the last D days; everything before is history"),
    skip_days: float = typer.Option(
        0.0, "--skip-days",
        help="leave out the last S days of the trace entirely (simulate the D days before them): "
        "tune on an earlier window than the one scored",
    ),
    migration: str = typer.Option("restart", "--migration", help="restart | seamless"),
    job: str = typer.Option(
        "a10-sync-long", "--job",
        help="the job's true throughput model: a10-sync-long (Kale Table 1 A10 sync, per-worker overhead "
             "lowered so it scales to ~40 workers, nearly linear) | t4-sync (Table 1 T4 sync, unchanged; "
             "faster than linear)"),
    seed: int = typer.Option(0, "--seed"),
    partitions: int | None = typer.Option(
        None, "--partitions",
        help="the stream's partitions, assigned to the workers round-robin, each worker training only its own "
             "(default: one pool any worker takes from; with P partitions a count that does not divide P leaves "
             "some workers behind)"),
    global_shuffle: str | None = typer.Option(
        None, "--global-shuffle", metavar="LOWER:UPPER",
        help="with --partitions: the job runs with Kale's global shuffling (tidal run --global-shuffle): the "
             "workers train as one pool, but one whose partitions bring more than it trains keeps UPPER samples "
             "queued, and a sample waits behind them"),
    load_headroom: float = typer.Option(1.0, "--load-headroom", metavar="H", help=LOAD_HEADROOM_HELP),
    lag_price: float = typer.Option(0.0, "--lag-price", metavar="WORKERS", help=LAG_PRICE_HELP),
    planned_lag: float | None = typer.Option(None, "--planned-lag", metavar="SECONDS", help=PLANNED_LAG_HELP),
    time_share: bool = typer.Option(
        True, "--time-share/--no-time-share",
        help="where a move is cheap (seamless: 3 minutes) and whole workers round the traffic up by a tenth or "
             "more, kale time-shares them through what waits (one fewer while every sample can still be trained "
             "within 15 minutes, then as many as the traffic needs): fewer worker-hours for a mean lag of a few "
             "minutes; --no-time-share sizes every count from the forecast, for less lag"),
    program_hours: float | None = typer.Option(
        None, "--program-hours", metavar="HOURS",
        help=PROGRAM_HOURS_HELP + "; a week of minutes takes 1-3 min a policy instead of seconds"),
    program_lag_price: float | None = typer.Option(
        None, "--program-lag-price", metavar="WORKER_MIN", help=PROGRAM_LAG_PRICE_HELP),
    program_lag_ratio: float | None = typer.Option(
        None, "--program-lag-ratio", metavar="RATIO", help=PROGRAM_LAG_RATIO_HELP),
    policies: str = typer.Option("kale,hpa,autopilot,madu,adequate", "--policies"),
    bound_violations: float = typer.Option(
        0.0, "--bound-violations",
        help="the lower bound allows this share of the minutes over the SLO (e.g. 0.03; slower: a "
             "week takes about 40 s instead of 11 s)"),
    paid_bound: bool = typer.Option(
        False, "--paid-bound",
        help="also print the lower bound that pays every scaling action as --migration does (whole workers, "
             "a perfect forecast; the same --bound-violations): what no count schedule goes under once moves "
             "cost what they cost (about 15 s for a week, a few minutes with --bound-violations)"),
    json_out: Path | None = typer.Option(None, "--json", help="write the metrics as JSON here"),
    plot: Path | None = typer.Option(None, "--plot", help="write a PNG: traffic, workers, lag"),
) -> None:
    """Simulate online training under each policy and print Kale's metrics (section 4.1)."""
    from tidal.sim import online as sim
    from tidal.sim.paid_bound import paid_moves_worker_hours

    if migration not in sim.MIGRATIONS:
        raise fail(f"--migration must be restart or seamless, got {migration!r}")
    if job not in sim.JOBS:
        raise fail(f"--job must be one of {', '.join(sim.JOBS)}, got {job!r}")
    if peak_workers < 2:
        raise fail("--peak-workers must be at least 2")
    if days <= 0:
        raise fail("--days must be positive")
    if skip_days < 0:
        raise fail("--skip-days must not be negative")
    if partitions is not None and partitions < 1:
        raise fail("--partitions must be at least 1")
    upper = None
    if global_shuffle is not None:
        from tidal.cli.job import shuffle_thresholds

        if partitions is None:
            raise fail("--global-shuffle needs --partitions")
        upper = float(shuffle_thresholds(global_shuffle)[1])
    if not 0 <= bound_violations < 1:
        raise fail("--bound-violations must be in [0, 1)")
    check_kale_knobs(load_headroom, lag_price, "kale", planned_lag)
    check_program_knobs(program_hours, program_lag_price, program_lag_ratio, "kale")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise fail("--policies is empty")
    rows = read_csv(trace)
    try:
        counts, interval = sim.load_trace(rows, column)
        cfg = sim.SimConfig(peak_workers=peak_workers, migration=migration, seed=seed, interval_s=interval,
                            true_model=sim.JOBS[job](), partitions=partitions,
                            shuffle_upper=upper, load_headroom=load_headroom, lag_price=lag_price,
                            planned_lag_s=sim.SimConfig.planned_lag_s if planned_lag is None else planned_lag,
                            time_share=time_share,
                            program_horizon_s=None if program_hours is None else program_hours * 3600.0,
                            program_lag_price=sim.SimConfig.program_lag_price if program_lag_price is None
                            else program_lag_price, program_lag_ratio=program_lag_ratio)
        skip = round(skip_days * 86400 / interval)
        if skip >= len(counts) - 1:
            raise ConfigError(f"--skip-days {skip_days:g} leaves nothing of the trace")
        counts = counts[: len(counts) - skip]
        n = min(len(counts), max(1, round(days * 86400 / interval)))
        window, history = counts[-n:], counts[:-n]
        scaled = sim.scale_to_peak(window, cfg)
        factor = float(scaled.max() / window.max())
        results = sim.simulate(scaled, names, cfg, history=history * factor)
        oracle = sim.oracle_worker_hours(scaled, cfg, violations=bound_violations)
        paid = paid_moves_worker_hours(scaled, cfg, violations=bound_violations) if paid_bound else None
    except ConfigError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"{len(window)} intervals of {interval:g} s, peak {scaled.max() / interval:.0f} samples/s "
               f"= {peak_workers} workers, migration {migration}")
    typer.echo(f"{'policy':10s} {'SLO viol.':>9s} {'acc. lag min':>12s} {'downtime min':>12s} {'worker-h':>9s} {'actions':>7s}")
    for name, r in results.items():
        typer.echo(f"{name:10s} {r.slo_violation_rate:9.2%} {r.accumulated_lag_min:12.0f} {r.downtime_min:12.0f} "
                   f"{r.worker_hours:9.1f} {r.scaling_actions:7d}")
    adequate = peak_workers * len(window) * interval / 3600.0
    kept = "keeps the SLO" if bound_violations == 0 else f"passes the SLO in at most {bound_violations:.1%} of the time"
    if math.isfinite(oracle):
        typer.echo(f"lower bound for any policy that {kept} (perfect forecast, free rescaling every interval): "
                   f"{oracle:.1f} worker-h = {oracle / adequate:.2f}x the peak count's")
    else:
        typer.echo(f"no policy {kept}: even {peak_workers} workers cannot keep up")
    had_s = len(history) * interval
    late: dict[float, list[str]] = {}
    for name in results:
        wait = sim.forecast_wait_s(name, cfg, had_s)
        if wait > 0:
            late.setdefault(wait, []).append(name)
    meanwhile = {"kale": "kale scales out by its threshold fallback alone and in to what the last 3 hours' "
                         "busiest 20 minutes need",
                 "madu": "madu keeps its count"}
    for wait, who in late.items():
        what = "; ".join(meanwhile.get(name, f"{name} has no forecast") for name in who)
        typer.echo(f"note: the window has {had_s / 3600:.1f} h of arrivals before it and {' and '.join(who)} "
                   f"{'needs' if len(who) == 1 else 'need'} {(had_s + wait) / 3600:.1f} h to fit a forecast: for the "
                   f"window's first {wait / 3600:.1f} h {what} (a smaller --days leaves more history)")
    if paid is not None and math.isfinite(paid):
        typer.echo(f"lower bound paying every {migration} action (perfect forecast, whole workers): {paid:.1f} "
                   f"worker-h = {paid / oracle:.2f}x the bound above")
    finite = lambda v: v if v is not None and math.isfinite(v) else None  # noqa: E731
    if json_out is not None:
        json_out.write_text(json.dumps({"policies": {k: r.metrics() for k, r in results.items()},
                                        "job": job, "oracle_worker_hours": finite(oracle),
                                        "paid_bound_worker_hours": finite(paid),
                                        "oracle_violations": bound_violations}, indent=2))
    if plot is not None:
        _plot(plot, scaled / interval, interval, results)


def _plot(path: Path, rate: object, interval: float, results: dict) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rate_arr = np.asarray(rate)
    hours = np.arange(len(rate_arr)) * interval / 3600.0
    fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    axes[0].plot(hours, rate_arr, lw=0.6, color="black")
    axes[0].set_ylabel("traffic (samples/s)")
    for name, r in results.items():
        axes[1].step(hours, r.workers, where="post", lw=0.9, label=name)
        axes[2].plot(hours, r.lag_s / 60.0, lw=0.8, label=name)
    axes[1].set_ylabel("workers")
    axes[1].legend(loc="upper right", ncol=len(results), fontsize=8)
    axes[2].axhline(20, color="red", ls="--", lw=0.8, label="SLO 20 min")
    axes[2].set_ylabel("lag (min)")
    axes[2].set_yscale("symlog", linthresh=1)
    axes[2].set_xlabel("hours")
    axes[2].legend(loc="upper right", ncol=len(results) + 1, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@sim_app.command("cluster")
def cluster(
    scenario: str = typer.Option(..., "--scenario", help="dlrover-rm | easyscale | goldminer"),
    trace: Path = typer.Option(Path("../shared/traces/philly-jobs.csv"), "--trace",
                               help="Philly jobs CSV (timestamp,duration,num_gpus,...)"),
    jobs: int = typer.Option(500, "--jobs", help="jobs in the sampled window of the trace"),
    seed: int = typer.Option(0, "--seed"),
    policies: str | None = typer.Option(None, "--policies", help="comma-separated (default: all of the scenario)"),
    load: float | None = typer.Option(
        None, "--load",
        help="offered load, a fraction of the cluster's capacity. easyscale/goldminer: the window's arrivals "
             "are stretched so its jobs' GPU-time (as run on Philly) is LOAD x the GPUs over the arrival span "
             "(default: Philly's own times, 5-15x a 64-GPU cluster); dlrover-rm: the cluster is sized so the "
             "requested cores are LOAD of it (default 0.8)"),
    json_out: Path | None = typer.Option(None, "--json", help="write the metrics as JSON here"),
    plot: Path | None = typer.Option(None, "--plot", help="write a PNG: utilization over time, JCT distribution"),
    jobs_out: Path | None = typer.Option(
        None, "--jobs-out",
        help="write one JSON line per job and policy (dlrover-rm): queue time, JCT, cores allocated and "
             "used, configurations, every scaling decision"),
) -> None:
    """Simulate a cluster of jobs from the Philly trace under each policy of a scenario."""
    import time

    from tidal.sim.cluster import scenario as load_scenario

    module = load_scenario(scenario)
    names = [p.strip() for p in policies.split(",") if p.strip()] if policies else list(module.POLICIES)
    unknown = [n for n in names if n not in module.POLICIES]
    if unknown or not names:
        raise fail(f"unknown policies {unknown} for {scenario}; known: {', '.join(module.POLICIES)}")
    if jobs < 1:
        raise fail("--jobs must be at least 1")
    if not trace.is_file():
        raise fail(f"trace {trace} not found")
    started = time.monotonic()
    result = module.run(trace, jobs, seed, names, load)
    elapsed = time.monotonic() - started
    header = f"{'policy':18} {'avg JCT s':>11} {'median JCT s':>13} {'makespan s':>11} {'avg queue s':>12} " \
             f"{'GPU util':>9} {'CPU util':>9} {'completed':>10} {'actions':>8}"
    at = "" if load is None else f", load {load:g}"
    typer.echo(f"scenario {scenario}: {jobs} jobs, seed {seed}{at}, simulated in {elapsed:.1f}s")
    typer.echo(header)
    for name, m in result.policies.items():
        typer.echo(f"{name:18} {m.avg_jct_s:11.0f} {m.median_jct_s:13.0f} {m.makespan_s:11.0f} {m.avg_queue_s:12.0f} "
                   f"{m.gpu_util:9.2f} {m.cpu_util:9.2f} {m.completion_rate:10.3f} {m.scaling_actions:8d}")
    for note in result.notes:  # a module docstring: its first line (the rest: python -m pydoc MODULE)
        typer.echo(f"note: {note.strip().splitlines()[0]}")
    if json_out:
        json_out.write_text(json.dumps({"scenario": scenario, "jobs": jobs, "seed": seed, "load": load,
                                        "policies": {k: v.to_json() for k, v in result.policies.items()}}, indent=2))
    if jobs_out:
        with open(jobs_out, "w") as f:
            for name, m in result.policies.items():
                for row in m.jobs:
                    f.write(json.dumps({"policy": name, **row}) + "\n")
        if not any(m.jobs for m in result.policies.values()):
            typer.echo(f"note: the {scenario} scenario records no per-job lines; {jobs_out} is empty")
    if plot:
        _plot_cluster(result, plot)


def _plot_cluster(result: object, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = result.policies  # type: ignore[attr-defined]
    fig, (ax_util, ax_jct) = plt.subplots(2, 1, figsize=(11, 8))
    for name, m in policies.items():
        if m.timeline:
            t = [p[0] / 3600 for p in m.timeline]
            gpu = [p[1] for p in m.timeline]
            cpu = [p[2] for p in m.timeline]
            if any(gpu):
                ax_util.plot(t, gpu, label=f"{name} GPU", lw=1)
            if any(cpu):
                ax_util.plot(t, cpu, label=f"{name} CPU", lw=1, ls="--")
    ax_util.set_xlabel("hours")
    ax_util.set_ylabel("utilization")
    ax_util.set_ylim(0, 1.05)
    ax_util.legend(fontsize=7, ncol=3)
    data = [[j / 3600 for j in m.jcts] or [0.0] for m in policies.values()]
    ax_jct.boxplot(data, showfliers=False)
    ax_jct.set_xticks(range(1, len(policies) + 1), list(policies), rotation=20)
    ax_jct.set_ylabel("JCT (hours)")
    ax_jct.set_title("job completion time per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@sim_app.command("job")
def job(
    params: str = typer.Option(
        ..., "--params",
        help="the job's data-parallel throughput model, theta0=S,theta1=S,knee=N (what `tidal status` shows "
             "a live run fitted): seconds per step alone, seconds each worker beyond the knee adds"),
    samples: int = typer.Option(..., "--samples", help="samples the job trains (all epochs)"),
    batch_size: int = typer.Option(512, "--batch-size", help="samples per worker per step"),
    workers: str = typer.Option("1:6", "--workers", help="MIN:MAX"),
    planner: str = typer.Option("dlrover-rm", "--planner", help="a planner of tidal.brain.planners"),
    interval: float = typer.Option(1.0, "--planner-interval", help="seconds between decisions"),
    start_s: float = typer.Option(4.0, "--start-s", help="seconds from asking for a worker to its first step"),
    pause_s: float = typer.Option(0.1, "--pause-s", help="seconds training stands still at each re-form"),
    tail_s: float = typer.Option(2.0, "--tail-s", help="seconds after the last step (evaluation, exit)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Replay one data-parallel job under a live planner, its throughput from a fitted model."""
    from tidal.brain import planners
    from tidal.cli.job import parse_workers
    from tidal.sim.job import simulate_job

    try:
        model = {k.strip(): float(v) for k, v in (p.split("=", 1) for p in params.split(",") if p.strip())}
    except ValueError:
        raise fail(f"--params must be name=number pairs, got {params!r}") from None
    if set(model) != {"theta0", "theta1", "knee"} or any(v < 0 or not math.isfinite(v) for v in model.values()):
        raise fail("--params needs theta0, theta1 and knee, each a finite number >= 0")
    if model["theta0"] <= 0:
        raise fail("--params theta0 (seconds per step alone) must be positive")
    if samples <= 0 or batch_size <= 0:
        raise fail("--samples and --batch-size must be positive")
    low, high = parse_workers(workers)
    try:
        result = simulate_job(planners.get(planner), model, samples=samples, batch_size=batch_size,
                              min_workers=low, max_workers=high, interval_s=interval, start_s=start_s,
                              pause_s=pause_s, tail_s=tail_s)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps({"planner": planner, "job_s": round(result.job_s, 2), "worker_s": round(result.worker_s, 2),
                               "settled_workers": result.settled_workers, "settle_s": result.settle_s,
                               "decisions": result.decisions}))
        return
    for at, old, new, reason in result.decisions:
        typer.echo(f"{at:7.1f}s  {old} -> {new} workers  ({reason})")
    typer.echo(f"planner {planner}: job {result.job_s:.1f} s, {result.worker_s:.1f} worker-s, "
               f"settled at {result.settled_workers} workers after {result.settle_s:.1f} s")
