# Quick start: `make demo` and `make test`. Both create .venv on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
PYTHON ?= python3

.PHONY: setup system-packages demo test lint unit bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first: the pinned version is the machine's local CPU wheel; a bare `torch`
	# pulled in by another package would download gigabytes of CUDA libraries.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,all]'
	touch $(STAMP)

setup: $(STAMP) system-packages

# Debian's headless browser for tests/master/test_dashboard.py and Redis for the stream-source
# tests (tests/redis_server.py starts its own servers); both skipped without them. As root, with
# one `apt-get update` for whichever is missing (each binary is named as its package).
SYSTEM_PACKAGES := chromium redis-server
system-packages:
	@missing=""; for p in $(SYSTEM_PACKAGES); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	[ -z "$$missing" ] || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null)

demo: setup
	$(VENV)/bin/tidal demo

lint: setup
	$(VENV)/bin/ruff check tidal tests bench examples
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# Component tests (each starts at most a few processes of its own) and the job tests marked
# speed_free (whole jobs whose every assertion holds at any speed: a fingerprint, a ledger, a
# status; no pause or rate is measured, every wait is long, a kill falls mid-run because each step
# sleeps) run two at a time, a file per xdist worker; the other job tests (tests/test_*.py, marked
# serial by tests/conftest.py) one at a time, so that no measured pause or rate shares the 2 cores.
# The Ray job tests stay serial: a replacement placed on a machine that joins must start before the
# job ends.
unit: setup
	$(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not serial" tests
	$(VENV)/bin/pytest -q -m serial tests

test: lint unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
