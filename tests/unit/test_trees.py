"""Walks and removals of trees a tenant shapes never recurse, never follow a link, hold a
bounded number of descriptors and survive the tree changing under them (issue 25, DESIGN §10).

Python 3.11's ``os.walk`` and every ``shutil.rmtree`` recurse once per level: a task dir of
1,500 nested directories (6 MB, well under any quota) raised ``RecursionError`` in the
sandbox's watchdog, in ``reset`` and in the next start, and the worker crash-looped.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from executor import fileio
from executor.errors import BadArtifact
from executor.fileio import TREE_MAX_DEPTH, TreeTooDeep, empty_dir, remove_tree, walk_tree
from executor.sandbox import _result as result
from executor.session import _model as modelfile

PATH_MAX = os.pathconf("/", "PC_PATH_MAX")


@pytest.fixture(autouse=True)
def _removed_after(tmp_path: Path) -> Iterator[None]:
    # pytest removes old temp dirs with shutil.rmtree, which these trees would break.
    yield
    remove_tree(str(tmp_path), ignore_errors=True, keep_root=True)


def nest(root: Path, depth: int, name: str = "d", *, every: int = 0) -> None:
    """``depth`` directories below ``root``, made relative to a descriptor (no path is spelled,
    so the depth is not bounded by PATH_MAX); a 100-byte file every ``every`` levels."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
            if every and level % every == 0:
                file = os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
                os.write(file, b"x" * 100)
                os.close(file)
    finally:
        os.close(fd)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_under(root: Path) -> int:
    """This process's descriptors open on ``root`` or below it: what a walk holds, whatever
    other threads of the test process (an earlier test's servers) open and close meanwhile."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between the listing and the look
            continue
        held += target == str(root) or target.startswith(f"{root}/")
    return held


@contextmanager
def fd_limit(soft: int) -> Iterator[None]:
    """A soft RLIMIT_NOFILE of ``soft`` descriptors: a walk holding one per level runs out."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def test_the_quota_walk_of_a_deep_tree_fails_closed(tmp_path: Path) -> None:
    # The attack of issue 25: 1,500 levels of "d/" (3,000 characters, within PATH_MAX).
    nest(tmp_path / "task", 1500)
    assert result.tree_size(str(tmp_path / "task")) == result.OVER_QUOTA
    nest(tmp_path / "shallow", TREE_MAX_DEPTH - 1, every=10)
    assert 0 < result.tree_size(str(tmp_path / "shallow")) < 1 << 20


def test_a_walk_refuses_depth_instead_of_holding_a_descriptor_per_level(tmp_path: Path) -> None:
    root = tmp_path / "t"
    nest(root, 300)
    with pytest.raises(TreeTooDeep) as raised:
        for _ in walk_tree(str(root)):
            assert fds_under(root) <= TREE_MAX_DEPTH + 1
    assert raised.value.errno == errno.ELOOP
    assert fds_under(root) == 0  # every descriptor closed on the way out
    seen = sum(1 for _ in walk_tree(str(root), max_depth=10_000))
    assert seen == 300 and fds_under(root) == 0


def test_removal_of_a_tree_deeper_than_path_max_holds_few_descriptors(tmp_path: Path) -> None:
    nest(tmp_path / "t", 5000, every=100)  # "d/" 5,000 times: a path beyond PATH_MAX
    assert 5000 * len("d/") > PATH_MAX
    before = open_fds()
    with fd_limit(before + 2 * fileio.REMOVE_OPEN_LEVELS + 16):  # shutil.rmtree needs 5,000+
        freed = remove_tree(str(tmp_path / "t"))
    assert freed == 50 * 100
    assert not (tmp_path / "t").exists() and fds_under(tmp_path / "t") == 0


def test_reset_empties_a_deep_work_dir(tmp_path: Path) -> None:
    # Executor.reset's wipe: once a RecursionError that left the whole tree behind.
    work = tmp_path / "work"
    nest(work / "sandbox" / "task", 1500, every=500)
    (work / "model.safetensors").write_bytes(b"m" * 1000)
    assert empty_dir(str(work)) == 1000 + 3 * 100
    assert work.is_dir() and list(work.iterdir()) == []


def test_links_are_removed_and_measured_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"p" * 50_000)
    tree = tmp_path / "tree"
    nest(tree, 3)
    (tree / "to-dir").symlink_to(outside)
    (tree / "d" / "to-file").symlink_to(outside / "precious")
    names = {entry.name for _fd, entry in walk_tree(str(tree))}
    assert names == {"d", "to-dir", "to-file"}  # nothing of what the links point at
    assert result.tree_size(str(tree)) < 50_000
    assert remove_tree(str(tmp_path / "link")) == 0  # nothing there
    (tmp_path / "link").symlink_to(outside)
    remove_tree(str(tmp_path / "link"))  # the link goes, not what it points at
    assert not (tmp_path / "link").is_symlink()
    remove_tree(str(tree))
    assert not tree.exists() and (outside / "precious").read_bytes() == b"p" * 50_000


def test_entries_that_vanish_or_change_during_a_walk_are_skipped(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for name in ("a", "b", "c"):
        nest(tree / name, 3, every=1)
    outside = tmp_path / "outside"
    nest(outside, 2, every=1)
    seen = []
    for _fd, entry in walk_tree(str(tree)):
        seen.append(entry.name)
        if len(seen) == 1:  # the first subdirectory is being listed: change its siblings
            for name in {"a", "b", "c"} - {entry.name}:
                remove_tree(str(tree / name))
                if not (tmp_path / "swapped").exists():
                    (tree / name).symlink_to(outside)  # a directory swapped for a link
                    (tmp_path / "swapped").touch()
    assert "f" in seen and seen.count("d") <= 3  # one subtree (maybe only its top) and no more


CHURN = """
import os, sys
tree, n = sys.argv[1], 0
while True:  # the tenant, in a process of its own, running on while the worker measures
    here, there = f"{tree}/x{n % 50}", f"{tree}/x{(n + 25) % 50}"
    try:
        os.mkdir(here)
        open(f"{here}/f", "wb").write(b"y" * 10)
        os.mkdir(f"{here}/g") if n % 3 else os.symlink("/etc", f"{here}/g")  # a dir, or a link
        os.unlink(f"{there}/f")
        os.unlink(f"{there}/g") if os.path.islink(f"{there}/g") else os.rmdir(f"{there}/g")
        os.rmdir(there)
    except OSError:
        pass
    n += 1
"""


def test_a_tree_changing_under_walks_and_removal_never_loops_or_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fileio, "REMOVE_MAX_RELISTS", 200)  # a writer that never stops: refused soon
    tree = tmp_path / "tree"
    tree.mkdir()
    tenant = subprocess.Popen([sys.executable, "-c", CHURN, str(tree)])
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert result.tree_size(str(tree)) < 1 << 20
        try:
            remove_tree(str(tree))  # racing the writer: done, or refused without looping forever
        except OSError as exc:
            assert exc.errno == errno.ENOTEMPTY, exc
    finally:
        tenant.kill()
        tenant.wait()
    remove_tree(str(tree))
    assert not tree.exists()


def test_a_removal_that_never_catches_up_gives_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = tmp_path / "tree"
    nest(tree, 2)
    real = fileio._unlink_files

    def refilling(fd: int, subdirs: list[str]) -> int:  # a writer always one directory ahead
        freed = real(fd, subdirs)
        with open(os.open("new", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "wb") as file:
            file.write(b"z")
        return freed

    monkeypatch.setattr(fileio, "_unlink_files", refilling)
    monkeypatch.setattr(fileio, "REMOVE_MAX_RELISTS", 50)
    with pytest.raises(OSError) as raised:
        remove_tree(str(tree))
    assert raised.value.errno == errno.ENOTEMPTY
    assert remove_tree(str(tree), ignore_errors=True) >= 0  # quietly, as rmtree(ignore_errors)


def test_a_bundle_tree_is_made_readable_without_recursion(tmp_path: Path) -> None:
    # A bundle's dirs are what its archive names: 1,500 levels fit in a zip member's name.
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"m")
    outside = tmp_path / "outside"
    outside.write_bytes(b"o")
    outside.chmod(0o600)
    bundle = tmp_path / "bundle"
    nest(bundle, 3, every=1)
    (bundle / "d" / "f").chmod(0o600)
    (bundle / "d" / "link").symlink_to(outside)
    modelfile._readable(str(model), str(bundle))
    assert (bundle / "d" / "f").stat().st_mode & 0o777 == 0o644
    assert (bundle / "d" / "d").stat().st_mode & 0o777 == 0o755
    assert outside.stat().st_mode & 0o777 == 0o600  # the link's target is left alone
    nest(tmp_path / "deep", 1500)
    with pytest.raises(BadArtifact, match="deeper than"):
        modelfile._readable(str(model), str(tmp_path / "deep"))
