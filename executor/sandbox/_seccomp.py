"""A small seccomp filter for the sandbox, as raw classic-BPF bytes for ``bwrap --seccomp``.

Namespaces already keep tenant code off the network and out of the host's files; this
filter removes kernel surface the code has no use for and that has served escapes:
new user namespaces (``clone``/``unshare`` with ``CLONE_NEWUSER``; ``clone3`` is refused
with ENOSYS so that libc falls back to ``clone``, whose flags can be inspected),
``setns``, ``ptrace`` and ``process_vm_*``, the kernel keyring, ``bpf``,
``userfaultfd``, ``perf_event_open``, ``io_uring``, mounts, module loading and kexec.
A syscall of another architecture (i386 via ``int 0x80``, x32) is refused outright: its
numbers would not match these rules.
"""

from __future__ import annotations

import platform
import struct
from dataclasses import dataclass

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
BPF_LD_W_ABS = 0x20
BPF_JMP_JEQ_K = 0x15
BPF_JMP_JGE_K = 0x35
BPF_JMP_JSET_K = 0x45
BPF_RET_K = 0x06
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM = 1
ENOSYS = 38
CLONE_NEWUSER = 0x10000000

OFFSET_NR = 0
OFFSET_ARCH = 4
OFFSET_ARG0_LOW = 16  # args[0], low 32 bits (little-endian)


@dataclass(frozen=True)
class Arch:
    audit: int
    clone: int
    unshare: int
    clone3: int
    io_uring: tuple[int, ...]
    denied: tuple[int, ...]
    x32_bit: int | None = None


# move_mount, fsopen, fsconfig, fsmount, fspick: the same numbers on both architectures.
NEW_MOUNT_API = (429, 430, 431, 432, 433)

X86_64 = Arch(
    audit=0xC000003E,
    clone=56,
    unshare=272,
    clone3=435,
    io_uring=(425, 426, 427),
    # setns, ptrace, process_vm_readv/writev, keyctl, add_key, request_key, bpf,
    # userfaultfd, perf_event_open, mount, umount2, pivot_root, init/finit/delete_module,
    # kexec_load, kexec_file_load, open_by_handle_at, fsopen..fsmount..move_mount.
    denied=(
        308,
        101,
        310,
        311,
        250,
        248,
        249,
        321,
        323,
        298,
        165,
        166,
        155,
        175,
        313,
        176,
        246,
        320,
        304,
        *NEW_MOUNT_API,
    ),
    x32_bit=0x40000000,
)
AARCH64 = Arch(
    audit=0xC00000B7,
    clone=220,
    unshare=97,
    clone3=435,
    io_uring=(425, 426, 427),
    denied=(
        268,
        117,
        270,
        271,
        219,
        217,
        218,
        280,
        282,
        241,
        40,
        39,
        41,
        105,
        273,
        106,
        104,
        294,
        265,
        *NEW_MOUNT_API,
    ),
)
ARCHES = {"x86_64": X86_64, "amd64": X86_64, "aarch64": AARCH64, "arm64": AARCH64}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _errno(value: int) -> int:
    return SECCOMP_RET_ERRNO | value


def build_filter(arch: Arch) -> bytes:
    """The filter program; every jump is relative to the instruction after it."""
    program: list[bytes] = [
        _insn(BPF_LD_W_ABS, OFFSET_ARCH),
        _insn(BPF_JMP_JEQ_K, arch.audit, jt=1, jf=0),
        _insn(BPF_RET_K, _errno(EPERM)),
        _insn(BPF_LD_W_ABS, OFFSET_NR),
    ]
    if arch.x32_bit is not None:
        program += [_insn(BPF_JMP_JGE_K, arch.x32_bit, jt=0, jf=1), _insn(BPF_RET_K, _errno(EPERM))]
    for number in (arch.clone3, *arch.io_uring):
        program += [_insn(BPF_JMP_JEQ_K, number, jt=0, jf=1), _insn(BPF_RET_K, _errno(ENOSYS))]
    for number in arch.denied:
        program += [_insn(BPF_JMP_JEQ_K, number, jt=0, jf=1), _insn(BPF_RET_K, _errno(EPERM))]
    for number in (arch.clone, arch.unshare):
        program += [
            _insn(BPF_JMP_JEQ_K, number, jt=0, jf=4),
            _insn(BPF_LD_W_ABS, OFFSET_ARG0_LOW),
            _insn(BPF_JMP_JSET_K, CLONE_NEWUSER, jt=0, jf=1),
            _insn(BPF_RET_K, _errno(EPERM)),
            _insn(BPF_RET_K, SECCOMP_RET_ALLOW),
        ]
    program.append(_insn(BPF_RET_K, SECCOMP_RET_ALLOW))
    return b"".join(program)


def host_filter() -> bytes | None:
    """The filter for this machine's architecture, or None where it has no rules."""
    arch = ARCHES.get(platform.machine().lower())
    return build_filter(arch) if arch is not None else None
