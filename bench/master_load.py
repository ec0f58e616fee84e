"""Control-plane load: 2,000 simulated workers against one job master (issue 2, part 2).

    .venv/bin/python bench/master_load.py [--workers 2000] [--clients 2] [--duration 30] [--client raw|httpx] [--json]

The master runs in its own process, built the way tidal/master/server.py builds it (SQLite
journal in WAL mode, the planner loop (``--planner``, default dlrover-rm, asked every second with an
observation of all the workers), FastAPI app with the bearer-token guard, uvicorn on a
socket bound to 127.0.0.1, uvloop and the server's GC settings, ``master.tick()`` every 20 ms
on the same event loop), except that its
backend is a *null backend*: ``launch`` only records the worker ids the master assigns (no
process is started), so the master believes it launched ``--workers`` workers with ids
0..N-1. No TCPStore is created (the simulated workers never form a process group).

The simulated workers (``--clients`` processes, asyncio + one ``httpx.AsyncClient`` each, one
keep-alive connection per worker) then do what tidal.worker does, minus training:

1. ``POST /v1/workers/join``, then a heartbeat (``POST /v1/report``) once a second;
2. ``POST /v1/rendezvous`` until the first round of all N forms (long polls);
3. for ``--duration`` seconds: steps happen on a shared clock (``--step-hz`` steps/s, the same
   step numbers in every client process); once a second (phases spread evenly over the
   second) each worker "applies" the steps since its last report, one batch of its shard per
   step, leasing the next shard (``POST /v1/shards/lease``) at a random point of the current
   shard's second half (tidal.worker's loader prefetches leases that way), and sends
   ``POST /v1/report`` with ``applied_step``, the step records of its own batches (so the
   master finalizes steps, journals shard commits and writes the ledger as in a real job),
   ``samples_per_s`` and ``compute_s_per_sample`` (non-zero, as a real worker reports).

Reported: requests/s over the steady phase, p50/p99/max latency per request kind (measured in
the client: send to parsed answer, so the clients' own event-loop delay is included; reports
and leases of the steady window only, joins of the set-up phase), the
master-side service time of reports and leases (an ASGI wrapper around tidal's app: request
received to response sent, so it includes waiting for the master's event loop but not the
clients' delays), how late the master's event loop woke a 5 ms sleep (time it could serve
nobody), errors (non-2xx, timeouts, connection errors), the CPU each process used in the
window, and what the master saw (rounds, failures, slow ticks).

Fairness: the master and the client processes share the machine's 2 cores, so every latency
includes CPU contention with the load generator. The default load generator (``--client raw``,
the one whose numbers bench/RESULTS.md reports) is a minimal HTTP/1.1 keep-alive client on
asyncio streams (one write per request, about a tenth of httpx's CPU per request), so that the
master, not the load generator, is what saturates. ``--client httpx`` uses ``httpx.AsyncClient``
(what tidal.worker uses): on 2 shared cores its 2,000 clients need more CPU than is left, the
offered load is not reached and the latencies are mostly the load generator's own queueing.
The master's socket is tidal's own (``tidal.master.server.bind_socket``, TCP_NODELAY on).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PYTHON, ROOT, bench_env, load_average, stop, table

DATASET = 20_000_000
BATCH = 32
BATCHES_PER_SHARD = 50


# ---------------------------------------------------------------------------- the master process
def serve_master(work: Path, workers: int, planner: str) -> None:
    import uvicorn

    from tidal.backends import registry
    from tidal.brain import planners
    from tidal.master.api import JobSpec
    from tidal.master.job import JobMaster, new_token
    from tidal.master.journal import SqliteJournal
    from tidal.master.server import TICK_S, bind_socket, loop_factory, tune_gc
    from tidal.master.service import ChangeNotifier, create_app

    sock = bind_socket("127.0.0.1", 0)
    spec = JobSpec(job_id="load", argv=["/bin/false"], min_workers=workers, max_workers=workers,
                   token=new_token(), job_dir=str(work), port=sock.getsockname()[1], planner=planner)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    journal = SqliteJournal(work / "journal.sqlite")
    box: list[ChangeNotifier] = []
    # the simulated workers stand in for the processes: an in-memory backend starts nothing
    master = JobMaster(spec, journal, registry.get("fake"), planners.get(spec.planner), time.time, store_port=1,
                       on_change=lambda: box[0].notify() if box else None)
    master.start()
    stopping = asyncio.Event()

    async def main() -> None:
        tune_gc()
        lags: list[tuple[float, float]] = []

        async def lag_monitor() -> None:
            """How late the event loop wakes a 5 ms sleep: time the master could not serve."""
            while True:
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append((time.time(), time.perf_counter() - t0 - 0.005))

        monitor = asyncio.create_task(lag_monitor())
        box.append(ChangeNotifier())
        inner = create_app(master, spec.token, box[0])
        served: dict[str, list[tuple[float, float]]] = {}

        async def app(scope: dict, receive: Any, send: Any) -> None:
            """Service time per request, receive to last byte sent (the clients' delays excluded)."""
            t0, wall = time.perf_counter(), time.time()
            await inner(scope, receive, send)
            if scope.get("type") == "http":
                served.setdefault(scope["path"], []).append((wall, time.perf_counter() - t0))
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30, backlog=2048)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        tmp = work / "master.json.tmp"
        tmp.write_text(json.dumps({"url": f"http://127.0.0.1:{spec.port}", "token": spec.token, "pid": os.getpid()}))
        tmp.replace(work / "master.json")
        slow_ticks, worst = 0, 0.0
        while not stopping.is_set():
            t0 = time.perf_counter()
            master.tick()
            dt = time.perf_counter() - t0
            worst = max(worst, dt)
            slow_ticks += dt > 0.01
            await asyncio.sleep(TICK_S)
        window = json.loads((work / "window.json").read_text()) if (work / "window.json").is_file() else [0, 1e12]
        service = {}
        for path in ("/v1/report", "/v1/shards/lease"):
            v = [d for t, d in served.get(path, []) if window[0] <= t <= window[1]]
            service[path.rsplit("/", 1)[-1]] = {"n": len(v), "p50_ms": 1e3 * pct(v, 0.5), "p99_ms": 1e3 * pct(v, 0.99)}
        monitor.cancel()
        lag = [d for t, d in lags if window[0] <= t <= window[1]]
        (work / "master-stats.json").write_text(json.dumps({
            "slow_ticks_over_10ms": slow_ticks, "worst_tick_s": worst, "service_ms": service,
            "loop_lag_ms": {"p50": 1e3 * pct(lag, 0.5), "p99": 1e3 * pct(lag, 0.99), "max": 1e3 * max(lag, default=0.0)}}))
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 5)

    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as tidal's master
        runner.run(main())
    journal.close()


# ---------------------------------------------------------------------------- the client processes
class Stats:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.steady_from = 0.0
        self.steady_to = 0.0
        self.steady_requests = 0
        self.reform_seen = 0

    def add(self, kind: str, t0: float, t1: float) -> None:
        steady = self.steady_from <= t0 and t1 <= self.steady_to
        self.steady_requests += steady
        if steady or kind == "join":  # joins all happen in the set-up phase
            self.lat.setdefault(kind, []).append(t1 - t0)

    def error(self, kind: str, what: str) -> None:
        key = f"{kind}: {what}"
        self.errors[key] = self.errors.get(key, 0) + 1


class HttpxClient:
    """One simulated worker's HTTP client: ``httpx.AsyncClient`` (what tidal.worker uses, async)."""

    def __init__(self, url: str, token: str) -> None:
        import httpx

        self._c = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                    limits=httpx.Limits(max_connections=2, max_keepalive_connections=2), timeout=30)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        resp = await self._c.post(path, json=body)
        return resp.status_code, resp.json()

    async def close(self) -> None:
        await self._c.aclose()


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams (``--client raw``): about a tenth of
    httpx's CPU per request, so that on 2 shared cores the master, not the load generator, is measured."""

    def __init__(self, url: str, token: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self._addr = (host, int(port))
        self._auth = f"Authorization: Bearer {token}\r\n".encode()
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        conn = self._idle.pop() if self._idle else await asyncio.open_connection(*self._addr)
        reader, writer = conn
        payload = json.dumps(body).encode()
        writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: master\r\n" + self._auth
                     + b"Content-Type: application/json\r\nContent-Length: " + str(len(payload)).encode()
                     + b"\r\n\r\n" + payload)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        data = json.loads(await reader.readexactly(length)) if length else None
        self._idle.append(conn)
        return status, data

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()


async def call(http: Any, stats: Stats, kind: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    import httpx

    t0 = time.time()
    try:
        status, data = await http.post(path, body)
    except (httpx.HTTPError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
        stats.error(kind, type(exc).__name__)
        return None
    t1 = time.time()
    if status >= 400:
        stats.error(kind, f"{status} {str(data.get('detail') if isinstance(data, dict) else data)[:80]}")
        return None
    if kind != "rendezvous":  # a long poll's latency is the wait for the round, not service time
        stats.add(kind, t0, t1)
    return data


async def sim_worker(wid: int, http: Any, stats: Stats, args: argparse.Namespace) -> None:
    if await call(http, stats, "join", "/v1/workers/join", {"worker_id": wid, "pid": 100000 + wid}) is None:
        return
    phase = (wid % 1000) / 1000.0  # heartbeats and reports spread evenly over each second

    async def heartbeat() -> None:  # tidal.worker's reporter thread runs from init() on
        while True:
            await asyncio.sleep(1.0 - (time.time() - phase) % 1.0)
            await call(http, stats, "report", "/v1/report", {"worker_id": wid, "round": -1, "applied_step": -1})

    beating = asyncio.create_task(heartbeat())
    try:
        while True:
            a = await call(http, stats, "rendezvous", "/v1/rendezvous",
                           {"worker_id": wid, "after_round": -1, "applied_step": -1, "records": []})
            if a is None or time.time() > args.t_end:
                return
            if a["status"] == "ready":
                rnd = a["round"]
                break
    finally:
        beating.cancel()
    period = 1.0 / args.step_hz
    applied = int((time.time() - args.t0) / period)  # steps before joining the load: nobody's records
    epoch, shard, pos = 0, None, 0
    prefetched: dict[str, Any] | None = None
    prefetch_at = 1
    incarnation: str | None = None
    now = time.time()
    next_report = now - (now % 1.0) + phase + 1.0
    while True:
        await asyncio.sleep(max(0.0, next_report - time.time()))
        now = time.time()
        if now > args.t_end:
            return
        next_report += 1.0
        records = []
        upto = int((now - args.t0) / period)
        for step in range(applied + 1, upto + 1):
            if shard is None or pos >= shard["end"]:
                if prefetched is not None:
                    lease, prefetched = prefetched, None
                else:
                    lease = await call(http, stats, "lease", "/v1/shards/lease", lease_body(wid, rnd, epoch))
                if lease is None:
                    return
                if lease["status"] != "ok":
                    epoch += 1
                    shard = None
                    continue
                shard = lease["shard"]
                pos = shard["start"]
                prefetch_at = random.randint(1, max(1, BATCHES_PER_SHARD // 2))
            end = min(pos + BATCH, shard["end"])
            records.append({"step": step, "worker": wid, "epoch": epoch, "start": pos, "end": end})
            pos = end
        # as tidal.worker's loader does: lease the next shard in the background at a random
        # point of the current one's second half, not when it runs out
        if shard is not None and prefetched is None and -(-(shard["end"] - pos) // BATCH) <= prefetch_at:
            prefetched = await call(http, stats, "lease", "/v1/shards/lease", lease_body(wid, rnd, epoch))
        applied = upto
        body = {"worker_id": wid, "round": rnd, "applied_step": applied, "records": records,
                "compute_s_per_sample": 1e-5 * (1 + 0.1 * random.random()), "samples_per_s": BATCH * args.step_hz}
        if incarnation is not None:
            body["incarnation"] = incarnation  # the master's id, echoed back as tidal.worker does
        rep = await call(http, stats, "report", "/v1/report", body)
        if rep is None:
            return
        incarnation = rep.get("incarnation", incarnation)
        if rep["reform"]:
            stats.reform_seen += 1


def lease_body(wid: int, rnd: int, epoch: int) -> dict[str, Any]:
    return {"worker_id": wid, "round": rnd, "epoch": epoch, "dataset_size": DATASET, "batch_size": BATCH,
            "batches_per_shard": BATCHES_PER_SHARD, "shuffle": True, "seed": 0}


async def run_clients(args: argparse.Namespace) -> dict[str, Any]:

    info = json.loads(Path(args.master_json).read_text())
    ids = range(args.first, args.first + args.count)
    stats = Stats()
    stats.steady_from, stats.steady_to = args.t_steady, args.t_end
    # one client per simulated worker, as every tidal worker has its own (a shared httpx pool
    # scans all its connections per request: the load generator would be the bottleneck)
    kind = RawClient if args.client == "raw" else HttpxClient
    clients = [kind(info["url"], info["token"]) for _ in ids]
    try:
        await asyncio.gather(*(sim_worker(w, c, stats, args) for w, c in zip(ids, clients, strict=True)))
    finally:
        for c in clients:
            await c.close()
    return {"lat": stats.lat, "errors": stats.errors, "steady_requests": stats.steady_requests,
            "reform_seen": stats.reform_seen}


def client_main(args: argparse.Namespace) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()  # the load generator as cheap as it gets (the master keeps asyncio's loop)
    out = asyncio.run(run_clients(args))
    Path(args.out).write_text(json.dumps(out))


# ---------------------------------------------------------------------------- the bench
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2000)
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of steady load (measured)")
    p.add_argument("--setup", type=float, default=30.0, help="seconds allowed for join + first rendezvous")
    p.add_argument("--step-hz", type=float, default=5.0, help="simulated optimizer steps per second")
    p.add_argument("--json", action="store_true")
    p.add_argument("--planner", default="dlrover-rm",
                   help="the master's planner: its loop (an observation of every worker, the model refit) runs "
                        "every second as in a live job; MIN = MAX = --workers, so the target cannot move")
    p.add_argument("--client", choices=["raw", "httpx"], default="raw",
                   help="the simulated workers' HTTP client: raw HTTP/1.1 on asyncio streams (default, cheap) or httpx")
    p.add_argument("--keep", type=Path, default=None)
    p.add_argument("--role", choices=["bench", "master", "clients"], default="bench", help=argparse.SUPPRESS)
    p.add_argument("--dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--master-json", default="", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--t-steady", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--t-end", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "master":
        serve_master(Path(args.dir), args.workers, args.planner)
        return
    if args.role == "clients":
        client_main(args)
        return

    work = args.keep or Path(tempfile.mkdtemp(prefix="tidal-load-"))
    work.mkdir(parents=True, exist_ok=True)
    env = bench_env()
    load = load_average()
    me = str(ROOT / "bench" / "master_load.py")
    master = subprocess.Popen([PYTHON, me, "--role", "master", "--dir", str(work), "--workers", str(args.workers),
                               "--planner", args.planner],
                              env=env, cwd=ROOT, start_new_session=True,
                              stdout=open(work / "master.log", "wb"), stderr=subprocess.STDOUT)
    clients: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.time() + 30
        while not (work / "master.json").is_file():
            if time.time() > deadline or master.poll() is not None:
                raise RuntimeError(f"the master did not start (see {work / 'master.log'})")
            time.sleep(0.1)
        # give the master's first ticks time to "launch" the N workers
        import httpx

        info = json.loads((work / "master.json").read_text())
        hdr = {"Authorization": f"Bearer {info['token']}"}
        while len(httpx.get(info["url"] + "/v1/status", headers=hdr, timeout=30).json()["workers"]) < args.workers:
            time.sleep(0.2)
        t0 = time.time()
        t_steady = t0 + args.setup + 5.0  # 5 s of load before the measured window
        t_end = t_steady + args.duration
        (work / "window.json").write_text(json.dumps([t_steady, t_end]))
        per = (args.workers + args.clients - 1) // args.clients
        for i in range(args.clients):
            first, count = i * per, min(per, args.workers - i * per)
            clients.append(subprocess.Popen(
                [PYTHON, me, "--role", "clients", "--master-json", str(work / "master.json"), "--first", str(first),
                 "--count", str(count), "--t0", str(t0), "--t-steady", str(t_steady), "--t-end", str(t_end),
                 "--step-hz", str(args.step_hz), "--out", str(work / f"clients-{i}.json"),
                 "--client", args.client],
                env=env, cwd=ROOT, stdout=open(work / f"clients-{i}.log", "wb"),
                stderr=subprocess.STDOUT))
        procs = {"master": psutil.Process(master.pid), **{f"clients-{i}": psutil.Process(c.pid)
                                                          for i, c in enumerate(clients)}}
        time.sleep(max(0.0, t_steady - time.time()))
        cpu0 = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
        time.sleep(max(0.0, t_end - time.time()))
        cpu = {k: round(100 * (sum(p.cpu_times()[:2]) - cpu0[k]) / args.duration) for k, p in procs.items()}
        for c in clients:
            c.wait(timeout=args.setup + args.duration + 120)
        status = httpx.get(info["url"] + "/v1/status", headers=hdr, timeout=30).json()
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        stop(master, signal.SIGTERM)
    results = [json.loads((work / f"clients-{i}.json").read_text()) for i in range(args.clients)]
    lat: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["lat"].items():
            lat.setdefault(k, []).extend(v)
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    steady = sum(r["steady_requests"] for r in results)
    kinds = ["report", "lease", "join"]
    failures = [e["message"] for e in status["events"] if e["kind"] == "failure"]
    mstats = json.loads((work / "master-stats.json").read_text()) if (work / "master-stats.json").is_file() else {}
    summary = {
        "workers": args.workers, "client": args.client, "load_average_before": load, "duration_s": args.duration, "requests_per_s": steady / args.duration,
        "latency_ms": {k: {"n": len(lat.get(k, [])), "p50": 1e3 * pct(lat.get(k, []), 0.5),
                           "p99": 1e3 * pct(lat.get(k, []), 0.99), "max": 1e3 * max(lat.get(k, [0.0]))}
                       for k in kinds},
        "cpu_percent": cpu, "errors": errors, "error_count": sum(errors.values()), "failure_events": failures[:5],
        "master": {"round": status["round"], "finalized_step": status["finalized_step"], "state": status["state"],
                   "failures": len(failures), "reform_notices_seen": sum(r["reform_seen"] for r in results),
                   **mstats},
    }
    if args.json:
        print(json.dumps(summary))
        return
    rows = [["request", "count", "p50 ms", "p99 ms", "max ms", "target"]]
    for k in kinds:
        s = summary["latency_ms"][k]
        rows.append([k, str(s["n"]), f"{s['p50']:.1f}", f"{s['p99']:.1f}", f"{s['max']:.1f}",
                     "p99 < 100 ms" if k == "report" else ""])
    print(f"{args.workers} simulated workers, {args.clients} client processes ({args.client} HTTP), "
          f"{args.duration:.0f} s steady load; master and clients share {os.cpu_count()} cores; "
          f"load average before: {load:.2f}")
    print(table(rows))
    for k, v in mstats.get("service_ms", {}).items():
        print(f"master-side service time of {k} (receive to response sent, in the master): "
              f"p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f} ms (n {v['n']})")
    if "loop_lag_ms" in mstats:
        lag = mstats["loop_lag_ms"]
        print(f"master event-loop lag (a 5 ms sleep woken late by): p50 {lag['p50']:.1f} ms, "
              f"p99 {lag['p99']:.1f} ms, max {lag['max']:.1f} ms")
    print(f"requests/s (steady window, all kinds): {summary['requests_per_s']:.0f}; "
          f"CPU % of one core in the window: {cpu}")
    shown = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5])
    print(f"errors: {summary['error_count']} (target 0){'; most frequent: ' + str(shown) if errors else ''}")
    if failures:
        print(f"master failure events (first 5 of {len(failures)}): {failures[:5]}")
    print(f"master: round {status['round']}, finalized step {status['finalized_step']}, {len(failures)} worker "
          f"failures, {mstats.get('slow_ticks_over_10ms')} ticks over 10 ms (worst {mstats.get('worst_tick_s', 0):.3f} s)")


if __name__ == "__main__":
    main()
