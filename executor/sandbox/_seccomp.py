"""A small seccomp filter for the sandbox, as raw classic-BPF bytes for ``bwrap --seccomp``.

Namespaces already keep tenant code off the network and out of the host's files; this
filter removes kernel surface the code has no use for and that has served escapes:
new user namespaces (``clone``/``unshare`` with ``CLONE_NEWUSER``; ``clone3`` is refused
with ENOSYS so that libc falls back to ``clone``, whose flags can be inspected),
``setns``, ``ptrace`` and ``process_vm_*``, the kernel keyring, ``bpf``,
``userfaultfd``, ``perf_event_open``, ``io_uring``, mounts, module loading and kexec.

Sockets: ``socket`` and ``socketpair`` make only the families tenant code needs —
``AF_UNIX`` (multiprocessing, CUDA IPC), ``AF_INET``/``AF_INET6`` (loopback only in the
sandbox's network namespace: ``torch.distributed``, NCCL's bootstrap) and ``AF_NETLINK``
with ``NETLINK_ROUTE`` alone (``getifaddrs``, ``getaddrinfo``). Every other family is
refused with EAFNOSUPPORT, what a kernel without that family answers, so libraries that
probe take it calmly. Above all ``AF_VSOCK``: vsock ignores network namespaces, and on a
VM it reaches the hypervisor's services. Refused too: ``AF_ALG``, ``AF_PACKET`` and the
long tail whose first use autoloads a module. Other netlink protocols (netfilter,
uevents, audit, ...) get EPROTONOSUPPORT. The kernel reads the family as an ``int``, so
the low 32 bits of the argument are what the filter compares.

A syscall of another architecture (i386 via ``int 0x80``, with its multiplexed
``socketcall``; x32) is refused outright with EPERM: its numbers would not match these
rules. Neither native ABI here has ``socketcall``, so ``socket``/``socketpair`` are the
only ways to make a socket (``io_uring``'s socket operation is refused with io_uring).

Hand-written rather than built with libseccomp (docs/SECURITY.md says why): the syscall
numbers below are checked against libseccomp's tables by ``tests/sandbox/test_seccomp.py``.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

from executor.errors import SandboxUnavailable

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
BPF_LD_W_ABS = 0x20
BPF_JMP_JEQ_K = 0x15
BPF_JMP_JGE_K = 0x35
BPF_JMP_JSET_K = 0x45
BPF_RET_K = 0x06
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM = errno.EPERM
ENOSYS = errno.ENOSYS
CLONE_NEWUSER = 0x10000000

OFFSET_NR = 0
OFFSET_ARCH = 4
OFFSET_ARG0_LOW = 16  # args[0], low 32 bits (little-endian)
OFFSET_ARG2_LOW = 32  # args[2], low 32 bits

# Socket families (linux/socket.h) the sandbox keeps; NETLINK_ROUTE is the one netlink protocol.
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
ALLOWED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
NETLINK_ROUTE = 0

# The rules, by syscall name; each architecture gives the numbers.
NOT_IMPLEMENTED = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")  # ENOSYS
DENIED = (  # EPERM
    "setns", "ptrace", "process_vm_readv", "process_vm_writev", "keyctl", "add_key",
    "request_key", "bpf", "userfaultfd", "perf_event_open", "mount", "umount2", "pivot_root",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "open_by_handle_at", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
)  # fmt: skip
NEWUSER_CHECKED = ("clone", "unshare")  # args[0] holds the flags
FAMILY_CHECKED = ("socket", "socketpair")  # args[0] the family, args[2] the protocol


@dataclass(frozen=True, eq=False)
class Arch:
    name: str
    audit: int  # AUDIT_ARCH_* (linux/audit.h), which is also libseccomp's SCMP_ARCH_*
    numbers: dict[str, int]  # every name of the rules above: its number here
    x32_bit: int | None = None

    @property
    def clone(self) -> int:
        return self.numbers["clone"]

    @property
    def unshare(self) -> int:
        return self.numbers["unshare"]

    @property
    def clone3(self) -> int:
        return self.numbers["clone3"]

    @property
    def io_uring(self) -> tuple[int, ...]:
        return tuple(self.numbers[name] for name in NOT_IMPLEMENTED[1:])

    @property
    def denied(self) -> tuple[int, ...]:
        return tuple(self.numbers[name] for name in DENIED)

    @property
    def socket(self) -> int:
        return self.numbers["socket"]

    @property
    def socketpair(self) -> int:
        return self.numbers["socketpair"]


# io_uring_*, move_mount .. fspick and clone3: the same numbers on both architectures.
COMMON = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "clone3": 435}
COMMON |= {"move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433}

X86_64 = Arch(
    name="x86_64",
    audit=0xC000003E,
    numbers=COMMON | {
        "clone": 56, "unshare": 272, "socket": 41, "socketpair": 53,
        "setns": 308, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "userfaultfd": 323,
        "perf_event_open": 298, "mount": 165, "umount2": 166, "pivot_root": 155,
        "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246,
        "kexec_file_load": 320, "open_by_handle_at": 304,
    },
    x32_bit=0x40000000,
)  # fmt: skip
AARCH64 = Arch(
    name="aarch64",
    audit=0xC00000B7,
    numbers=COMMON | {
        "clone": 220, "unshare": 97, "socket": 198, "socketpair": 199,
        "setns": 268, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "userfaultfd": 282,
        "perf_event_open": 241, "mount": 40, "umount2": 39, "pivot_root": 41,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "kexec_load": 104,
        "kexec_file_load": 294, "open_by_handle_at": 265,
    },
)  # fmt: skip
ARCHES = {"x86_64": X86_64, "amd64": X86_64, "aarch64": AARCH64, "arm64": AARCH64}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _errno(value: int) -> int:
    return SECCOMP_RET_ERRNO | value


def _family_rule(number: int) -> list[bytes]:
    """``socket``/``socketpair`` (``number``): the allowed families pass, netlink only as
    NETLINK_ROUTE; the rule ends in a verdict, so nothing after it sees these syscalls."""
    plain = (AF_UNIX, AF_INET, AF_INET6)
    block = [_insn(BPF_LD_W_ABS, OFFSET_ARG0_LOW)]
    for i, family in enumerate(plain):
        # To the final ALLOW: the other families' jumps, then the 5 instructions below.
        block.append(_insn(BPF_JMP_JEQ_K, family, jt=len(plain) - 1 - i + 5, jf=0))
    block += [
        _insn(BPF_JMP_JEQ_K, AF_NETLINK, jt=0, jf=3),
        _insn(BPF_LD_W_ABS, OFFSET_ARG2_LOW),
        _insn(BPF_JMP_JEQ_K, NETLINK_ROUTE, jt=2, jf=0),
        _insn(BPF_RET_K, _errno(errno.EPROTONOSUPPORT)),
        _insn(BPF_RET_K, _errno(errno.EAFNOSUPPORT)),
        _insn(BPF_RET_K, SECCOMP_RET_ALLOW),
    ]
    return [_insn(BPF_JMP_JEQ_K, number, jt=0, jf=len(block)), *block]


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
    for number in (arch.socket, arch.socketpair):
        program += _family_rule(number)
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


def host_filter() -> bytes:
    """The filter for this machine's architecture. Where it has none, tenant code is not
    run under bwrap at all (fail closed): without the filter nothing refuses vsock."""
    machine = platform.machine().lower()
    arch = ARCHES.get(machine)
    if arch is None:
        raise SandboxUnavailable(
            f"the sandbox has no seccomp filter for this architecture ({machine or 'unknown'}): "
            "tenant code is not run under bwrap here (x86_64 and aarch64 are supported)"
        )
    return build_filter(arch)
