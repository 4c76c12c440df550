"""The suite's own rules, as pytest hooks (``tests/conftest.py`` imports them).

- **Skips in CI.** With ``CI=true`` a test may skip only for a reason on :data:`ALLOWED_SKIPS`
  (a fact of the machine that no install can change: no CUDA device, a cgroup version the
  kernel does not mount, another CPU architecture). Any other skip — a server that did not
  start, a tool that is missing — is turned into a failure: a CI machine without RabbitMQ
  must not go green without the RabbitMQ guarantee. Every skip, allowed or not, is listed
  at the end of the run under the rule that allowed it.
- **Module order.** ``tests/module_seconds.json`` holds each module's measured time (all
  phases, one run of ``make durations``); modules run longest first, so that pytest-xdist's
  ``--dist loadfile --no-loadscope-reorder`` hands the long ones out first and the short ones
  fill the gaps at the end (longest-processing-time-first scheduling). A module the file does
  not know is taken as short. Within a module the order is the file's.
- **Measured times.** ``--module-seconds=PATH`` writes each module's total of this run to
  ``PATH`` (the controller's view, so it works under xdist): ``make durations`` refreshes the
  committed file with it.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

IN_CI = os.environ.get("CI") == "true"
MODULE_SECONDS = Path(__file__).resolve().parents[1] / "module_seconds.json"

# (pattern of the skip reason, why CI may skip for it). Only facts of the machine belong here.
ALLOWED_SKIPS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), why)
    for pattern, why in (
        (r"^no CUDA device", "no NVIDIA GPU: scripts/gpu_check.sh runs these on one"),
        (r"^exercises the no-CUDA path", "a GPU machine: these check the CPU-only placement"),
        (
            r"no confinement 'cgroup[12]' for the sandbox here|no writable cgroup2 hierarchy",
            "the kernel mounts the other cgroup version: the hosts of each version run these",
        ),
        (r"^no syscall numbers for |^int 0x80 is x86's", "another CPU architecture"),
        (r"^this host has no global IPv4 address", "no global address to refuse on this host"),
    )
)

_skips: list[tuple[str, str, str | None]] = []  # (nodeid, reason, allowing rule or None)
_seconds: dict[str, float] = defaultdict(float)


def allowed(reason: str) -> str | None:
    """The rule of :data:`ALLOWED_SKIPS` that allows a skip for ``reason``, or None."""
    for pattern, why in ALLOWED_SKIPS:
        if pattern.search(reason):
            return why
    return None


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _enforce(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under CI, a skip for a reason off the list becomes a failure of that test."""
    if not (IN_CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _reason(report)
    if allowed(reason) is None:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped in CI for a reason that is not on the list of allowed skips "
            f"(tests/support/suite.py, ALLOWED_SKIPS): {reason}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    _enforce(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _enforce(outcome.get_result())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--module-seconds",
        metavar="PATH",
        help="write each test module's total time of this run (all phases) to PATH as JSON",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        weights: dict[str, float] = json.loads(MODULE_SECONDS.read_text())
    except (OSError, ValueError):
        return
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::", 1)[0], len(first_seen))

    def key(item: pytest.Item) -> tuple[float, int]:
        module = item.nodeid.split("::", 1)[0]
        return (-weights.get(module, 0.0), first_seen[module])

    items.sort(key=key)  # stable: a module's own order is kept


def _note_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        _skips.append((report.nodeid, reason, allowed(reason)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # On the controller under xdist, every worker's reports arrive here.
    _seconds[report.nodeid.split("::", 1)[0]] += report.duration
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _skips:
        terminalreporter.section("skips, by the rule that allows them in CI")
        by_rule: dict[str, list[str]] = defaultdict(list)
        for nodeid, reason, rule in _skips:
            by_rule[rule or f"NOT ALLOWED IN CI: {reason}"].append(nodeid)
        for rule, nodeids in sorted(by_rule.items()):
            terminalreporter.write_line(f"{len(nodeids):4d}  {rule}")
    path = config.getoption("--module-seconds")
    if path and _seconds and not hasattr(config, "workerinput"):
        ranked = dict(sorted(((m, round(s, 1)) for m, s in _seconds.items()), key=lambda kv: -kv[1]))
        Path(path).write_text(json.dumps(ranked, indent=1) + "\n")
