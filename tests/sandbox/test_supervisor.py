"""The worker's checks on what the runner hands back, and how the sandbox is chosen."""

from __future__ import annotations

import errno
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor.errors import SandboxProtocolError
from executor.sandbox import (
    AARCH64,
    MAX_FRAME_BYTES,
    X86_64,
    ResultState,
    build_filter,
    checked_error,
    read_frame,
    read_result,
)
from executor.tensorfile import write_state
from tests.support.bpf import ALLOW, ERRNO, run_filter

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def task(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    return tmp_path


def good(task: Path, name: str = "result-1.safetensors") -> Path:
    path = task / "out" / name
    with open(path, "wb") as file:
        write_state(file, {"w": torch.ones(3)})
    return path


def test_a_regular_result_is_read_and_removed(task: Path) -> None:
    path = good(task)
    state = read_result(str(task), path.name, 1 << 20)
    assert torch.equal(state["w"], torch.ones(3)) and not path.exists()


def test_the_state_is_read_key_by_key_through_its_descriptor_until_closed(task: Path) -> None:
    path = task / "out" / "result-1.safetensors"
    with open(path, "wb") as file:
        write_state(file, {"a": torch.ones(3), "b": torch.zeros(2)})
    before = len(os.listdir("/proc/self/fd"))
    state = read_result(str(task), path.name, 1 << 20)
    assert isinstance(state, ResultState) and not path.exists()  # unlinked at once: held by its fd
    assert sorted(state) == ["a", "b"] and len(state) == 2
    assert torch.equal(state["b"], torch.zeros(2)) and torch.equal(state["a"], torch.ones(3))
    assert len(os.listdir("/proc/self/fd")) == before + 1
    state.close()
    assert len(os.listdir("/proc/self/fd")) == before
    with pytest.raises(SandboxProtocolError):
        state["a"]


def test_a_result_shorter_than_its_header_says_is_refused_unread(task: Path) -> None:
    path = good(task)
    os.truncate(path, path.stat().st_size - 4)
    with pytest.raises(SandboxProtocolError, match="truncated"):
        read_result(str(task), path.name, 1 << 20)
    assert not path.exists()


@pytest.mark.parametrize(
    "make",
    [
        lambda t, p: os.symlink("/etc/passwd", p),
        lambda t, p: os.symlink("../../etc/passwd", p),
        lambda t, p: os.link(good(t, "result-x.safetensors"), p),
        lambda t, p: os.mkfifo(p),
        lambda t, p: os.mkdir(p),
        lambda t, p: os.truncate(os.open(p, os.O_CREAT | os.O_WRONLY), 10 << 20),  # sparse, too large
        lambda t, p: Path(p).write_bytes(b"\0" * 64),  # not a state
    ],
    ids=["symlink", "relative-symlink", "hardlink", "fifo", "directory", "too-large", "garbage"],
)
def test_tricks_are_refused(task: Path, make) -> None:  # type: ignore[no-untyped-def]
    path = task / "out" / "result-1.safetensors"
    make(task, path)
    with pytest.raises(SandboxProtocolError):
        read_result(str(task), path.name, 1 << 20)


def test_a_symlinked_out_dir_and_bad_names_are_refused(
    task: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "out").mkdir()
    good(elsewhere)
    (task / "out").rmdir()
    os.symlink(elsewhere / "out", task / "out")
    with pytest.raises(SandboxProtocolError):
        read_result(str(task), "result-1.safetensors", 1 << 20)
    for name in ("../out/result-1.safetensors", "/etc/passwd", "result-1.pt"):
        with pytest.raises(SandboxProtocolError):
            read_result(str(task), name, 1 << 20)


def test_frames_are_bounded_and_checked(tmp_path: Path) -> None:
    import io

    assert read_frame(io.BytesIO(b'{"type": "log"}\n')) == {"type": "log"}
    assert read_frame(io.BytesIO(b"")) is None
    for raw in (b"x" * (MAX_FRAME_BYTES + 10), b"not json\n", b"[1]\n", b'{"type": "log"}'):
        with pytest.raises(SandboxProtocolError):
            read_frame(io.BytesIO(raw))
    checked = checked_error({"code": "user_code_error", "message": "m" * 10_000})
    assert checked is not None and checked.message == "m" * 4096
    with pytest.raises(SandboxProtocolError):
        checked_error({"code": "made_up", "message": "x"})


CLONE_NEWUSER = 0x10000000


@pytest.mark.parametrize(("arch", "read_nr"), [(X86_64, 0), (AARCH64, 63)], ids=["x86_64", "aarch64"])
def test_seccomp_programs_give_each_syscall_its_verdict(arch, read_nr: int) -> None:  # type: ignore[no-untyped-def]
    # Run as the kernel would, so the aarch64 filter (no such machine here) is checked too;
    # test_seccomp.py checks the x86_64 one by behaviour inside the real sandbox.
    program = build_filter(arch)
    assert len(program) % 8 == 0 and len(program) // 8 < 4096
    verdict = functools.partial(run_filter, program, audit=arch.audit)
    assert verdict(read_nr) == ALLOW
    assert run_filter(program, read_nr, audit=arch.audit ^ 1) == ERRNO | errno.EPERM  # another ABI
    assert verdict(arch.clone3) == ERRNO | errno.ENOSYS  # libc falls back to clone
    for nr in arch.io_uring:
        assert verdict(nr) == ERRNO | errno.ENOSYS, nr
    for nr in arch.denied:
        assert verdict(nr) == ERRNO | errno.EPERM, nr
    for nr in (arch.clone, arch.unshare):
        assert verdict(nr, CLONE_NEWUSER | 0x11) == ERRNO | errno.EPERM, nr
        assert verdict(nr, 0x11) == ALLOW, nr  # a plain fork or thread is fine
    if arch.x32_bit is not None:
        assert verdict(arch.x32_bit | read_nr) == ERRNO | errno.EPERM  # the x32 ABI


def test_auto_refuses_clearly_when_nothing_can_isolate() -> None:
    code = (
        "from executor.sandbox._launch import resolve_mode\n"
        "try:\n"
        "    resolve_mode('auto', 65534)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc.code, exc)\n"
    )
    env = {"PATH": "/nonexistent", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.stdout.startswith("SandboxUnavailable sandbox_runner_error"), out.stdout + out.stderr
    assert "bubblewrap" in out.stdout and "ROUNDHOUSE_SANDBOX=off" in out.stdout
