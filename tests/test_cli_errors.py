"""The real ``tidal`` command on bad input: a one-line error naming the problem, a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.speed_free

TIDAL = str(Path(sys.executable).with_name("tidal"))


class Run:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    @property
    def err_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.strip()]


@pytest.fixture
def tidal(tmp_path: Path) -> Iterator:
    """Runs ``tidal ARGS`` in tmp_path with a timeout; kills the whole session at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def run(*args: str, timeout: float = 20, cwd: Path | None = None) -> Run:
        proc = subprocess.Popen(
            [TIDAL, *args], cwd=cwd or tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "TIDAL_HOME": str(tmp_path / "home"), "COLUMNS": "200", "NO_COLOR": "1"},
        )
        procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"tidal {' '.join(args)} did not finish in {timeout} s\n{out}\n{err}")
        return Run(proc.returncode, out, err)

    yield run
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return path


def assert_one_line_error(r: Run, *needles: str) -> str:
    assert r.code == 2, (r.code, r.out, r.err)
    assert len(r.err_lines) == 1, r.err
    line = r.err_lines[0]
    assert line.startswith("tidal: error: "), line
    assert "Traceback" not in r.err
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def test_run_help(tidal) -> None:
    r = tidal("run", "--help")
    assert r.code == 0, r.err
    assert "MIN:MAX" in r.out and "--workers" in r.out and "--ledger" in r.out


@pytest.mark.parametrize(
    ("workers", "needles"),
    [
        ("3:2", ("MIN (3)", "MAX (2)")),
        ("0:2", ("MIN", "at least 1")),
        ("abc", ("--workers", "MIN:MAX", "'abc'")),
    ],
)
def test_bad_workers(tidal, script: Path, tmp_path: Path, workers: str, needles: tuple[str, ...]) -> None:
    r = tidal("run", "--workers", workers, "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, *needles)
    assert not (tmp_path / "job").exists()  # nothing was started


def test_missing_script(tidal, tmp_path: Path) -> None:
    r = tidal("run", "--job-dir", str(tmp_path / "job"), "no_such_train.py")
    assert_one_line_error(r, "no_such_train.py", "not found")


def test_initial_outside_min_max(tidal, script: Path, tmp_path: Path) -> None:
    r = tidal("run", "--workers", "1:2", "--initial", "3", "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, "--initial 3", "1:2")


def test_port_in_use(tidal, script: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = tidal("run", "--port", str(port), "--job-dir", str(tmp_path / "job"), str(script))
    line = assert_one_line_error(r, f"127.0.0.1:{port}")
    assert re.search(r"in use", line, re.I), line
    assert not (tmp_path / "job" / "job.json").exists()


def test_ledger_in_a_missing_directory(tidal, script: Path, tmp_path: Path) -> None:
    ledger = tmp_path / "no" / "such" / "ledger.jsonl"
    r = tidal("run", "--ledger", str(ledger), "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, "ledger", str(ledger))


def test_ledger_under_a_file(tidal, script: Path, tmp_path: Path) -> None:
    ledger = script / "ledger.jsonl"  # the parent is a regular file
    r = tidal("run", "--ledger", str(ledger), "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, "ledger", str(ledger))


def test_ledger_in_a_read_only_location(tidal, script: Path, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root writes through permission bits; sysfs refuses to create files even for root
        ledger = Path("/sys/tidal-test-ledger.jsonl")
        try:
            open(ledger, "a").close()
        except OSError:
            pass
        else:
            ledger.unlink()
            pytest.skip("no read-only location available to root here")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        ledger = ro / "ledger.jsonl"
    r = tidal("run", "--ledger", str(ledger), "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, "ledger", str(ledger))


def test_ledger_that_is_a_directory(tidal, script: Path, tmp_path: Path) -> None:
    r = tidal("run", "--ledger", str(tmp_path), "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, "ledger", str(tmp_path))


@pytest.mark.parametrize(
    ("source", "last_line"),
    [
        ('raise SystemExit("boom: bad config")\n', "boom: bad config"),
        ("import sys\nprint('starting')\n1 / 0\n", "ZeroDivisionError: division by zero"),
    ],
)
def test_script_that_crashes_on_start_fails_the_job(tidal, tmp_path: Path, source: str, last_line: str) -> None:
    crash = tmp_path / "crash.py"
    crash.write_text(source)
    job_dir = tmp_path / "job"
    r = tidal("run", "--job-dir", str(job_dir), "-q", str(crash), timeout=40)
    assert r.code == 1, (r.code, r.out, r.err)
    launched = re.findall(r"launched worker (\d+)", r.out)
    assert 1 <= len(launched) <= 3, r.out  # crash_loop_limit: no endless relaunching
    assert len(re.findall(r"worker \d+ failed: exited with code 1", r.out)) == len(launched)
    assert "Traceback" not in r.err
    summary = [ln for ln in r.err_lines if "failed" in ln]
    assert summary, r.err
    assert "crashed" in summary[-1] and last_line in summary[-1], summary
    assert len(list((job_dir / "logs").glob("worker-*.log"))) == len(launched)


def test_status_of_a_missing_job_dir(tidal) -> None:
    r = tidal("status", "--job-dir", "/nonexistent/tidal-job")
    assert_one_line_error(r, "/nonexistent/tidal-job/job.json")


def test_status_without_any_job(tidal) -> None:
    r = tidal("status")
    assert_one_line_error(r, "no job found")


def test_scale_of_a_job_whose_master_is_gone(tidal, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nobody listens there
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    info = {"job_id": "dead", "url": f"http://127.0.0.1:{port}", "token": "t", "journal": "j", "master_pid": 1}
    (job_dir / "job.json").write_text(json.dumps(info))
    r = tidal("scale", "2", "--job-dir", str(job_dir))
    assert_one_line_error(r, "dead", "not answering")


@pytest.mark.parametrize("args", [(), ("2", "--auto"), ("2", "--ps", "2"), ("--auto", "--ps", "1"),
                                  ("--ps", "1", "--data-workers", "2"), ("2", "--data-workers", "0")])
def test_scale_needs_a_number_or_auto_or_servers_but_only_one(tidal, args: tuple[str, ...]) -> None:
    assert_one_line_error(tidal("scale", *args), "either a number of workers, --auto, --ps N or --data-workers N")


@pytest.mark.parametrize(
    ("option", "value", "needles"),
    [
        # the master used to build tables for 10^8 workers (2.7 GB, deaf to Ctrl-C)
        ("--workers", "1:100000000", ("--workers MAX", "1024", "100000000", "must be between")),
        ("--port", "-1", ("--port", "65535", "-1", "must be between")),
        ("--port", "70000", ("--port", "65535", "70000", "must be between")),
        ("--port", "abc", ("--port", "integer")),
        ("--heartbeat-timeout", "0", ("--heartbeat-timeout", "3600", "must be between")),
        ("--heartbeat-timeout", "nan", ("--heartbeat-timeout", "nan", "must be between")),
        ("--heartbeat-timeout", "inf", ("--heartbeat-timeout", "inf", "must be between")),
        ("--heartbeat-timeout", "-1", ("--heartbeat-timeout", "-1", "must be between")),
        ("--heartbeat-timeout", "soon", ("--heartbeat-timeout", "number")),
        ("--collective-timeout", "0", ("--collective-timeout", "must be between")),
        ("--collective-timeout", "nan", ("--collective-timeout", "nan", "must be between")),
        ("--collective-timeout", "inf", ("--collective-timeout", "inf", "must be between")),
        ("--round-timeout", "0", ("--round-timeout", "must be between")),
        ("--round-timeout", "nan", ("--round-timeout", "nan", "must be between")),
        ("--round-timeout", "inf", ("--round-timeout", "inf", "must be between")),
        ("--progress-timeout", "0", ("--progress-timeout", "must be between")),
        ("--progress-timeout", "nan", ("--progress-timeout", "nan", "must be between")),
        ("--progress-timeout", "inf", ("--progress-timeout", "inf", "must be between")),
        ("--max-restarts", "-1", ("--max-restarts", "-1", "must be between")),
        ("--max-restarts", "1000000000", ("--max-restarts", "1000000000", "must be between")),
        ("--logical-workers", "100000000", ("--logical-workers", "1024", "must be between")),
        ("--planner-interval", "0", ("--planner-interval", "3600", "must be between")),
        ("--planner-interval", "nan", ("--planner-interval", "nan", "must be between")),
        ("--planner", "nope", ("--planner", "unknown planner 'nope'", "max")),
        ("--ps", "100", ("--ps MAX", "64", "100", "must be between")),
        ("--ps", "-1", ("--ps MIN must be at least 1", "-1")),
        ("--ps", "0", ("--ps MIN must be at least 1", "0")),
        ("--ps", "3:2", ("--ps MIN (3) is greater than MAX (2)",)),
        ("--ps", "1:x", ("--ps must be MIN:MAX or N", "1:x")),
    ],
)
def test_bad_numeric_option(tidal, script: Path, tmp_path: Path, option: str, value: str,
                            needles: tuple[str, ...]) -> None:
    """One line naming the option and its bounds, exit 2; nothing started (``nan`` used to be accepted)."""
    r = tidal("run", f"{option}={value}", "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, *needles)
    assert not (tmp_path / "job").exists()  # refused before anything was started


def read_only_dir(tmp_path: Path) -> Path:
    """An existing directory this user cannot create files in."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        return ro
    ro = Path("/sys")  # root writes through permission bits; sysfs refuses new files even to root
    try:
        open(ro / "tidal-test-probe", "w").close()
    except OSError:
        return ro
    (ro / "tidal-test-probe").unlink()
    pytest.skip("no read-only location available to root here")


@pytest.mark.parametrize("where", ["under-a-file", "a-file", "in-a-read-only-dir", "a-read-only-dir"])
def test_unwritable_job_dir(tidal, script: Path, tmp_path: Path, where: str) -> None:
    job_dir = {
        "under-a-file": lambda: script / "job",
        "a-file": lambda: script,
        "in-a-read-only-dir": lambda: read_only_dir(tmp_path) / "job",
        "a-read-only-dir": lambda: read_only_dir(tmp_path),
    }[where]()
    r = tidal("run", "--job-dir", str(job_dir), str(script))
    assert_one_line_error(r, "--job-dir", str(job_dir))
    assert not (tmp_path / "home" / "current").exists()  # no job was announced


WAIT_THEN_TRAIN = """\
import sys
import time
from pathlib import Path

import torch

import tidal.worker

deadline = time.monotonic() + 60
while not Path(sys.argv[1]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)  # the test looks at the job's files while the master runs


class Ones:
    def __len__(self):
        return 64

    def get_range(self, start, end):
        return torch.ones(end - start, 2)


job = tidal.worker.init()
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
job.state(model, optimizer)
for x in job.loader(Ones(), batch_size=32, epochs=1):
    optimizer.zero_grad()
    model(x).sum().backward()
    job.step()
job.close()
"""


def test_job_files_are_readable_by_the_user_only(tmp_path: Path) -> None:
    """The journal holds the job spec and so the bearer token: 0600, -wal and -shm too, in a 0700 dir."""
    train, go, job_dir = tmp_path / "train.py", tmp_path / "go", tmp_path / "job"
    train.write_text(WAIT_THEN_TRAIN)
    journal = job_dir / "journal.sqlite"
    sidecars = [journal.with_name("journal.sqlite-wal"), journal.with_name("journal.sqlite-shm")]
    proc = subprocess.Popen(
        [TIDAL, "run", "-q", "--job-dir", str(job_dir), str(train), str(go)], cwd=tmp_path, umask=0o022,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "TIDAL_HOME": str(tmp_path / "home")},
    )
    try:
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in [journal, *sidecars]) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        running = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [journal, *sidecars]}
        go.touch()
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, (out, err)
    assert running == {"journal.sqlite": 0o600, "journal.sqlite-wal": 0o600, "journal.sqlite-shm": 0o600}
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    for path in [journal, job_dir / "job.json", *sidecars]:
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


@pytest.mark.parametrize(("value", "names"), [("nccl", "GPU per worker"), ("mpi", "gloo or nccl")])
def test_comm_backend_is_checked_against_the_gpus(tidal, script: Path, tmp_path: Path, value: str,
                                                  names: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever this machine has
    r = tidal("run", "--workers", "1:2", "--comm-backend", value, "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, names)


def test_backend_help_lists_each_backend(tidal) -> None:
    r = tidal("run", "--help")
    assert r.code == 0, r.err
    text = " ".join(r.out.split())
    assert "--backend" in r.out and "local (processes of this machine" in text and "fake (in memory" in text


def test_unknown_backend(tidal, script: Path, tmp_path: Path) -> None:
    r = tidal("run", "--backend", "ray9", "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, "unknown --backend 'ray9'", "known: fake, local")
    assert not (tmp_path / "job").exists()  # refused before anything was made


def test_resume_of_a_journal_naming_an_unknown_backend(tidal, tmp_path: Path) -> None:
    from tidal.master.api import JobSpec
    from tidal.master.journal import SqliteJournal

    spec = JobSpec(job_id="j", argv=["python", "x.py"], min_workers=1, max_workers=1, token="t",
                   job_dir=str(tmp_path / "job"), backend="gone-since")
    journal = SqliteJournal(tmp_path / "journal.sqlite")
    journal.put_meta("spec", spec.to_json())
    journal.close()
    r = tidal("master", "--resume", str(tmp_path / "journal.sqlite"))
    assert_one_line_error(r, "backend 'gone-since', unknown here", "known: fake, local")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--data-workers", "x"], ("--data-workers must be MIN:MAX or N", "x")),
        (["--data-workers", "-1"], ("--data-workers MIN must be at least 0", "-1")),
        (["--data-workers", "3:1"], ("--data-workers MIN (3) is greater than MAX (1)",)),
        (["--data-workers", "1000"], ("--data-workers MAX", "256", "must be between")),
        (["--data-workers", "1", "--data-prefetch", "-2"], ("--data-prefetch", "must be between")),
        (["--data-prefetch", "4"], ("--data-prefetch needs --data-workers",)),
        (["--data-workers", "1", "--stream", "redis://127.0.0.1:1/s"], ("--data-workers", "--stream")),
    ],
)
def test_bad_data_worker_options(tidal, script: Path, tmp_path: Path, args: list[str],
                                 needles: tuple[str, ...]) -> None:
    """Data workers: a bad count or prefetch, prefetch without them, with a stream: one line, exit 2,
    nothing started."""
    r = tidal("run", *args, "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, *needles)
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--ps", "4", "--ps-shards", "2"], ("--ps-shards", "2", "must be between")),
        (["--ps", "1:8", "--ps-shards", "4"], ("--ps-shards", "4", "must be between 8")),
        (["--ps", "1", "--ps-memory", "lots"], ("--ps-memory takes a size such as 512M or 4G", "lots")),
        (["--ps", "1", "--ps-memory", "10"], ("--ps-memory must be between 64K and 1024T", "10")),
        (["--ps-memory", "1G"], ("--ps-memory needs --ps",)),
        (["--ps", "0"], ("--ps",)),
    ],
)
def test_bad_parameter_server_options(tidal, script: Path, tmp_path: Path, args: list[str],
                                      needles: tuple[str, ...]) -> None:
    """Parameter servers: fewer virtual shards than servers, a bad memory size, no server at all:
    one line, exit 2, nothing started."""
    r = tidal("run", *args, "--job-dir", str(tmp_path / "job"), str(script))
    assert_one_line_error(r, *needles)
    assert not (tmp_path / "job").exists()
