"""The docs point at tests that exist: every ``file.py::test_name`` in docs/*.md and the README
names a test function in that file, so a renamed or deleted test cannot leave a claim
pointing at nothing (issue 17: what the docs claim, a test proves)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# `tests/integration/test_x.py::test_y`, `test_x.py::test_y`, and `::test_z` after one of them.
REFERENCE = re.compile(r"`(?:(?P<file>[\w/]*test_\w+\.py))?::(?P<test>test_\w+)`")


def _test_file(name: str) -> Path:
    if "/" in name:
        return REPO / name
    found = sorted((REPO / "tests").rglob(name))
    assert len(found) == 1, f"{name}: {len(found)} files of that name under tests/"
    return found[0]


def _references() -> list[tuple[str, str, str]]:
    refs = []
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            current = None
            for match in REFERENCE.finditer(line):
                current = match["file"] or current
                assert current, f"{doc.name}: `::{match['test']}` with no file before it on its line"
                refs.append((doc.name, current, match["test"]))
    return refs


def test_the_docs_name_tests() -> None:
    assert len(_references()) >= 30  # the claims table of docs/OPERATIONS.md, at least


@pytest.mark.parametrize(("doc", "file", "test"), _references())
def test_each_named_test_exists(doc: str, file: str, test: str) -> None:
    source = _test_file(file).read_text()
    assert re.search(rf"^def {test}\(", source, re.M), f"{doc} names {file}::{test}, which does not exist"
