"""``GET /dashboard``: the job's page, seen by a real browser over a real job.

One real ``tidal run`` of the example (workers 1:2, one to begin with; once the test hands the
target back to the planner, ``max`` scales it to two, so the page has a decision and a pause to
show; one data worker, so the page has its data-worker section) serves every test of the module. The
HTTP tests check how the page authenticates (the token as a query parameter once, then an
HttpOnly cookie that only GETs accept); the browser test opens the page in headless Chromium
(tests/chromium.py), waits for its charts and reads what it shows against ``/v1/status``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import chromium
from tests.jobtools import Job, example_args
from tidal.master.service import dashboard_cookie

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"

# What the page shows, read in one go (ids and data-* attributes of tidal/master/dashboard.html).
READ_PAGE = """(() => {
  const v = (id) => document.getElementById(id).dataset.value;
  return {
    updates: Number(document.body.dataset.updates),
    error: document.body.dataset.error || null,
    job_id: v("job-id"), state: v("job-state"), planner: v("planner"),
    workers: Number(v("workers-now")), target: Number(v("target-now")),
    committed: Number(v("committed-samples")),
    rows: [...document.querySelectorAll("#workers tr[data-worker-id]")].map((r) => Number(r.dataset.workerId)),
    split: document.querySelectorAll("#chart-split [data-split-worker-id]").length,
    series: [...document.querySelectorAll("svg polyline.series")].map((p) => p.dataset.series),
    decisions: document.querySelectorAll("#decisions tr[data-decision]").length,
    pauses: document.querySelectorAll("#pauses tr[data-pause]").length,
    lag_hidden: document.getElementById("lag-section").hidden && document.getElementById("lag-kv").hidden,
    data_hidden: document.getElementById("data-section").hidden,
    data_rows: [...document.querySelectorAll("#data-workers tr[data-data-worker-id]")].map((r) => Number(r.dataset.dataWorkerId)),
    data_queue: document.getElementById("data-queue").dataset.dequeue || null,
    address: location.href, cookie: document.cookie,
  };
})()"""


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """A real job that keeps training for minutes (it is killed after the module's tests)."""
    j = Job(tmp_path_factory.mktemp("dashboard"), "1:2", example_args(400_000, 1, 256, 0.05),
            run_args=["--initial", "1", "--planner", "max", "--planner-interval", "0.5", "--data-workers", "1"])
    try:
        yield j.start()
    finally:
        j.kill_all()


def url(job: Job, path: str) -> str:
    return job.info()["url"] + path


def active(status: dict[str, Any]) -> int:
    return sum(w["state"] == "active" for w in status["workers"])


# ------------------------------------------------------------------------------ authentication
def test_the_dashboard_needs_the_token(job: Job) -> None:
    token = job.info()["token"]
    for params, headers in [
        ({}, {}),
        ({"token": "wrong"}, {}),
        ({"token": token[:-1]}, {}),
        ({"token": token + "x"}, {}),
        ({"token": ""}, {}),
        ({}, {"Cookie": f"{dashboard_cookie(job.info()['job_id'])}=wrong"}),
        ({}, {"Cookie": f"tidal_token_other={token}"}),
    ]:
        r = httpx.get(url(job, "/dashboard"), params=params, headers=headers, timeout=10)
        assert r.status_code == 401, (params, headers, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
        assert "set-cookie" not in r.headers


def test_the_query_token_opens_the_page_and_sets_the_cookie(job: Job) -> None:
    info = job.info()
    token, name = info["token"], dashboard_cookie(info["job_id"])
    r = httpx.get(url(job, "/dashboard"), params={"token": token}, timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert r.headers["set-cookie"] == f"{name}={token}; HttpOnly; SameSite=Strict; Path=/"
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["cache-control"] == "no-store"
    # a static page: nothing of the job is written into it on the server
    assert token not in r.text and info["job_id"] not in r.text
    assert 'id="workers-now"' in r.text

    cookie = {"Cookie": f"{name}={token}"}
    page = httpx.get(url(job, "/dashboard"), headers=cookie, timeout=10)
    assert page.status_code == 200 and page.text == r.text
    assert "set-cookie" not in page.headers  # only a query-parameter hit sets it
    bearer = httpx.get(url(job, "/dashboard"), headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert bearer.status_code == 200 and "set-cookie" not in bearer.headers


def test_the_cookie_opens_gets_only(job: Job) -> None:
    info = job.info()
    cookie = {"Cookie": f"other=1; {dashboard_cookie(info['job_id'])}={info['token']}"}
    status = httpx.get(url(job, "/v1/status"), headers=cookie, timeout=10)
    assert status.status_code == 200 and status.json()["job_id"] == info["job_id"]
    scale = httpx.post(url(job, "/v1/scale"), headers=cookie, json={"workers": 1}, timeout=10)
    assert scale.status_code == 401
    # the query token is for the page only
    assert httpx.get(url(job, "/v1/status"), params={"token": info["token"]}, timeout=10).status_code == 401


# ------------------------------------------------------------------------------ the browser
@pytest.mark.skipif(not chromium.available(), reason="needs Debian's chromium on PATH (make setup installs it)")
def test_the_browser_draws_the_job(job: Job, tmp_path: Path) -> None:
    with chromium.Browser(timeout=20) as browser:
        # one worker trains; handed back to the planner (max), the job scales 1 -> 2: the page then
        # has a decision and a pause to show
        job.wait_step(1, 60)
        httpx.post(url(job, "/v1/scale"), json={"auto": True}, timeout=10,
                   headers={"Authorization": f"Bearer {job.info()['token']}"}).raise_for_status()
        job.wait_status(lambda s: active(s) == 2 and not s["reforming"] and s["finalized_step"] >= 2,
                        60, "two active workers")
        browser.navigate(url(job, f"/dashboard?token={job.info()['token']}"))
        browser.wait_until("document.querySelectorAll('svg polyline.series').length >= 3"
                           " && document.querySelectorAll('#chart-split [data-split-worker-id]').length > 0",
                           timeout=20)

        # what the page shows comes from a poll between two statuses of the test's own
        before = job.status()
        seen = browser.evaluate(READ_PAGE)["updates"]
        browser.wait_until(f"Number(document.body.dataset.updates) > {seen}", timeout=10)
        shown = browser.evaluate(READ_PAGE)
        after = job.status()

        assert shown["error"] is None, shown
        assert shown["job_id"] == before["job_id"]
        assert shown["state"] in {before["state"], after["state"]}
        assert shown["workers"] in {active(before), active(after)}, (shown, before["workers"], after["workers"])
        assert shown["target"] in {before["target_workers"], after["target_workers"]}
        assert shown["rows"] in ([w["worker_id"] for w in before["workers"]], [w["worker_id"] for w in after["workers"]])
        committed = [sum(s["samples_done"] for s in st["shards"]) for st in (before, after)]
        assert committed[0] <= shown["committed"] <= committed[1]
        assert shown["planner"] == "max"
        assert set(shown["series"]) == {"samples/s", "workers", "target"}
        assert shown["split"] >= 1
        assert shown["decisions"] >= 1  # the planner's 1 -> 2
        assert shown["pauses"] >= 1  # the round that took the second worker in
        assert shown["lag_hidden"]  # a dataset job has no stream lag (tests/test_stream_slo.py draws one)
        assert not shown["data_hidden"] and shown["data_queue"] is not None  # its data worker and queue
        serving = [[d["id"] for d in st["data_workers"] if d["state"] != "exited"] for st in (before, after)]
        assert shown["data_rows"] in serving and shown["data_rows"], (shown["data_rows"], serving)
        assert "token" not in shown["address"]  # the page took it out of the address bar
        assert shown["cookie"] == ""  # HttpOnly: the page's script cannot read the token
        assert browser.errors() == []  # no exception, no failed fetch, nothing the CSP blocked

        shot = browser.screenshot(tmp_path / "dashboard.png")
        data = shot.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000


def test_the_browser_is_gone_after_close() -> None:
    if not chromium.available():
        pytest.skip("needs Debian's chromium on PATH (make setup installs it)")
    browser = chromium.Browser()
    leftovers = lambda: set(Path(tempfile.gettempdir()).glob("org.chromium.*"))  # noqa: E731
    before = leftovers()
    with browser:
        assert browser.proc is not None
        pgid = browser.proc.pid
        profile = Path(browser._profile)
        started = time.monotonic()
        assert browser.evaluate("1 + 1") == 2
    assert browser.proc is None
    assert chromium._running_in_group(pgid) == []
    assert time.monotonic() - started < 10
    assert not profile.exists()
    assert leftovers() - before == set()  # nothing of the browser's left in the temporary directory
