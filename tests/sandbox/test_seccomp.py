"""The seccomp filter, by behaviour: tenant code in the real sandbox asks the kernel for what
the filter removes (``executor/sandbox/_seccomp.py``), and each request is refused with the
filter's answer, then a normal round still runs.

Each call is made in a child of the runner (so a call the filter let through would change
nothing for the runner), and its arguments are chosen so that the kernel would answer
something else without the filter — verified on Linux 6.18 as root and as an unprivileged
uid: ``bpf`` EINVAL, ``io_uring_setup`` EFAULT, ``userfaultfd`` a descriptor, ``mount``
EFAULT, ``setns`` EBADF, ``unshare(CLONE_NEWUSER)`` success, ``int 0x80`` getpid the pid,
``socket(AF_VSOCK)`` a descriptor (this host is a Firecracker VM).
So an answer of the filter's is the filter's doing, not a missing privilege's.

The programs of both architectures are also run here as the kernel would run them (the
aarch64 one has no machine here), and their syscall numbers are checked against
libseccomp's tables (the reason the filter is hand-written: docs/SECURITY.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import platform
import signal

import pytest

from executor.errors import SandboxUnavailable
from executor.sandbox import _seccomp
from executor.sandbox._seccomp import AARCH64, X86_64, Arch, build_filter, host_filter
from tests.support.bpf import ALLOW, ERRNO, run_filter

MACHINE = platform.machine().lower()
ARCH = {"x86_64": 0, "amd64": 0, "aarch64": 1, "arm64": 1}.get(MACHINE)
UFFD_USER_MODE_ONLY = 1  # allowed to an unprivileged uid even where vm.unprivileged_userfaultfd is 0
CLONE_NEWUSER = 0x10000000

# name: ((number on x86_64, on aarch64), arguments, the filter's answer)
SYSCALLS = {
    "bpf": ((321, 280), (0, 0, 0), errno.EPERM),  # BPF_MAP_CREATE without attributes
    "io_uring_setup": ((425, 425), (1, 0), errno.ENOSYS),  # no params: EFAULT unfiltered
    "userfaultfd": ((323, 282), (UFFD_USER_MODE_ONLY | os.O_CLOEXEC,), errno.EPERM),
    "mount": ((165, 40), (0, 0, 0, 0, 0), errno.EPERM),  # no target: EFAULT unfiltered
    "setns": ((308, 268), (-1, 0), errno.EPERM),  # no namespace descriptor: EBADF unfiltered
    "unshare_newuser": ((272, 97), (CLONE_NEWUSER,), errno.EPERM),
}

# Tenant code's tools: a raw syscall, machine code on a page of its own, a call in a child.
HELPERS = """
import ctypes, errno, json, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def syscall(number, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(arg) for arg in args))
    return ret, ctypes.get_errno() if ret == -1 else 0

def machine_code(code):
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    return function(), 0  # a raw syscall's error comes back as -errno, not in errno

def in_child(call):
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(write_end, json.dumps(call()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(child, 0)
    said = os.read(read_end, 4096)
    os.close(read_end)
    ret, err = json.loads(said) if said else (None, None)
    killed = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return {'ret': ret, 'errno': err, 'errno_name': errno.errorcode.get(err), 'signal': killed}
"""

# Tenant code: ``CALL`` runs in a child; the report says what was tried and what came back.
PROBE = (
    HELPERS
    + """
out = {'attempt': __ATTEMPT__, **in_child(lambda: __CALL__)}
out['seccomp'] = next(line.split()[1] for line in open('/proc/self/status') if line.startswith('Seccomp:'))
__CONTROL__
save_report(out)
"""
)

# x86_64 machine code: mov eax, NR; int 0x80 (the i386 ABI) or syscall (the native one); ret.
I386_GETPID = b"\xb8\x14\x00\x00\x00\xcd\x80\xc3"  # getpid is 20 on i386
X86_64_GETPID = b"\xb8\x27\x00\x00\x00\x0f\x05\xc3"  # and 39 on x86_64


def probe(attempt: str, call: str, control: str = "") -> str:
    code = PROBE.replace("__ATTEMPT__", repr(attempt)).replace("__CALL__", call)
    return code.replace("__CONTROL__", control)


@pytest.mark.needs_sandbox
@pytest.mark.timeout(300)
@pytest.mark.skipif(ARCH is None, reason=f"no syscall numbers for {MACHINE}")
@pytest.mark.parametrize("name", list(SYSCALLS))
def test_a_syscall_the_filter_removes_is_refused(world, name: str) -> None:  # type: ignore[no-untyped-def]
    numbers, args, answer = SYSCALLS[name]
    assert ARCH is not None
    result = world.attack(probe(name, f"syscall({numbers[ARCH]}, *{args!r})"))
    report = world.completed(result)
    assert report["attempt"] == name and report["signal"] is None, report  # the call was made
    assert report["seccomp"] == "2", report  # the runner is under a filter
    assert report["ret"] == -1 and report["errno"] == answer, (
        f"{name}{args} came back {report['ret']} ({report['errno_name']}), "
        f"the filter answers {errno.errorcode[answer]}"
    )
    world.healthy()


@pytest.mark.needs_sandbox
@pytest.mark.timeout(300)
@pytest.mark.skipif(ARCH != 0, reason="int 0x80 is x86's")
def test_a_32_bit_syscall_is_refused(world) -> None:  # type: ignore[no-untyped-def]
    # A static i386 binary would need a 32-bit libc (gcc -m32 cannot link here): a code page
    # mapped with ctypes makes the same i386 syscall from the runner's own 64-bit process.
    control = f"out['control'] = in_child(lambda: machine_code({X86_64_GETPID!r}))"
    result = world.attack(probe("int 0x80", f"machine_code({I386_GETPID!r})", control))
    report = world.completed(result)
    # The code page runs: the same getpid through the native ABI answers a pid.
    assert report["control"]["signal"] is None and report["control"]["ret"] > 0, report
    assert report["attempt"] == "int 0x80" and report["seccomp"] == "2", report
    # The filter answers a syscall of another ABI with EPERM; a kernel without the i386 ABI
    # kills the caller with SIGSEGV before any filter sees it.
    assert report["ret"] == -errno.EPERM or report["signal"] == signal.SIGSEGV, report
    world.healthy()


# -- sockets: only the families tenant code needs ---------------------------------------------

NEEDED = {1: "AF_UNIX", 2: "AF_INET", 10: "AF_INET6", 16: "AF_NETLINK"}
AF_VSOCK, AF_NETLINK, NETLINK_ROUTE = 40, 16, 0
SOCKET_NR = {0: 41, 1: 198}
# x86_64 machine code for the foreign ABIs, each asking for an AF_VSOCK stream socket (rbx,
# which int 0x80 takes the first argument in, is saved: the caller's ABI keeps it).
I386_SOCKETCALL = (
    b"\x53\xb8\x66\x00\x00\x00\xbb\x01\x00\x00\x00\x31\xc9\xcd\x80\x5b\xc3"  # (SYS_SOCKET, NULL)
)
I386_SOCKET = b"\x53\xb8\x67\x01\x00\x00\xbb\x28\x00\x00\x00\xb9\x01\x00\x00\x00\x31\xd2\xcd\x80\x5b\xc3"
X32_SOCKET = b"\xb8\x29\x00\x00\x40\xbf\x28\x00\x00\x00\xbe\x01\x00\x00\x00\x31\xd2\x0f\x05\xc3"

# Tenant code: every family with every socket type, by socket() and socketpair(); each netlink
# protocol; the family with high bits the kernel ignores; the foreign ABIs; then what tenant
# code needs: a loopback TCP connection and the interface list (netlink).
SOCKETS = (
    HELPERS
    + """
import socket
KINDS = (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET, socket.SOCK_RAW)

def outcome(ret, fds):
    err = ctypes.get_errno()
    for fd in fds if ret >= 0 else ():
        os.close(fd)
    return 'made' if ret >= 0 else errno.errorcode.get(err, str(err))

def make(family, kind, protocol=0):
    ctypes.set_errno(0)
    fd = libc.socket(family, kind, protocol)
    return outcome(fd, [fd])

def make_pair(family, kind):
    fds = (ctypes.c_int * 2)()
    ctypes.set_errno(0)
    return outcome(libc.socketpair(family, kind, 0, fds), list(fds))

def raw_socket(family):
    ret, err = syscall(__SOCKET_NR__, family, socket.SOCK_STREAM, 0)
    return outcome(ret, [ret]) if ret >= 0 else errno.errorcode.get(err, str(err))

def vsock_listen():
    try:
        with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as vsock:
            vsock.bind((socket.VMADDR_CID_ANY, 9999))
            vsock.listen()
            return 'listening'
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def loopback():
    with socket.socket() as server:
        server.bind(('127.0.0.1', 0))
        server.listen()
        with socket.create_connection(server.getsockname(), timeout=10) as client:
            conn, _ = server.accept()
            with conn:
                client.sendall(b'ok')
                return conn.recv(2).decode()

out = {
    'socket': {f: sorted({make(f, kind) for kind in KINDS}) for f in range(64)},
    'socketpair': {f: sorted({make_pair(f, kind) for kind in KINDS}) for f in range(64)},
    'netlink': {p: make(socket.AF_NETLINK, socket.SOCK_RAW, p) for p in range(32)},
    'high_bits': {f: raw_socket((1 << 32) | f) for f in (socket.AF_UNIX, socket.AF_VSOCK)},
    'vsock_listen': vsock_listen(),
    'loopback': loopback(),
    'interfaces': [name for _, name in socket.if_nameindex()],
}
if __X86__:
    out['foreign'] = {name: in_child(lambda: machine_code(code)) for name, code in __FOREIGN__}
save_report(out)
"""
)


@pytest.mark.needs_sandbox
@pytest.mark.timeout(300)
@pytest.mark.skipif(ARCH is None, reason=f"no syscall numbers for {MACHINE}")
def test_tenant_code_makes_only_the_socket_families_it_needs(world) -> None:  # type: ignore[no-untyped-def]
    assert ARCH is not None
    foreign = [("i386 socketcall", I386_SOCKETCALL), ("i386 socket", I386_SOCKET), ("x32 socket", X32_SOCKET)]
    code = SOCKETS.replace("__SOCKET_NR__", str(SOCKET_NR[ARCH])).replace("__X86__", str(ARCH == 0))
    report = world.completed(world.attack(code.replace("__FOREIGN__", repr(foreign))))
    for call in ("socket", "socketpair"):
        made = {
            int(f): said
            for f, said in report[call].items()
            if int(f) not in NEEDED and said != ["EAFNOSUPPORT"]
        }
        assert not made, f"{call}() of a family tenant code has no need for: {made}"
    assert report["vsock_listen"] == "EAFNOSUPPORT", report["vsock_listen"]
    # The kernel reads the family as an int: high bits change nothing, for the rule neither.
    assert report["high_bits"] == {"1": "made", "40": "EAFNOSUPPORT"}, report["high_bits"]
    for family in NEEDED:
        assert "made" in report["socket"][str(family)], (NEEDED[family], report["socket"][str(family)])
    assert "made" in report["socketpair"]["1"], report["socketpair"]["1"]
    netlink = report["netlink"]
    assert netlink.pop(str(NETLINK_ROUTE)) == "made" and set(netlink.values()) == {"EPROTONOSUPPORT"}, netlink
    assert report["loopback"] == "ok" and "lo" in report["interfaces"], report
    for name, said in report.get("foreign", {}).items():
        # The filter answers another ABI with EPERM before any number is looked at (a kernel
        # built without the i386 ABI kills an int 0x80 with SIGSEGV first): never a socket.
        assert said["ret"] == -errno.EPERM or said["signal"] == signal.SIGSEGV, (name, said)
    world.healthy()


FOREIGN_AUDIT = {"x86_64": 0x40000003, "aarch64": 0x40000028}  # i386, 32-bit ARM
READ_NR = {"x86_64": 0, "aarch64": 63}


@pytest.mark.parametrize("arch", [X86_64, AARCH64], ids=["x86_64", "aarch64"])
def test_the_programs_make_only_the_needed_socket_families(arch: Arch) -> None:
    # Every architecture's program as the kernel runs it (no aarch64 machine here).
    verdict = functools.partial(run_filter, build_filter(arch), audit=arch.audit)
    for nr in (arch.socket, arch.socketpair):
        for family in (*range(64), 0xFFFF, 0xFFFFFFFF):
            for high in (0, 1 << 32):  # the kernel reads the low 32 bits (an int)
                expected = ALLOW if family in NEEDED else ERRNO | errno.EAFNOSUPPORT
                assert verdict(nr, high | family, 1, NETLINK_ROUTE) == expected, (nr, high | family)
        for protocol in range(32):
            expected = ALLOW if protocol == NETLINK_ROUTE else ERRNO | errno.EPROTONOSUPPORT
            assert verdict(nr, AF_NETLINK, 3, protocol) == expected, (nr, protocol)
        # Another ABI's socket or socketcall (102 on i386) never reaches the rule.
        for number in (nr, 102):
            assert (
                run_filter(build_filter(arch), number, 1, audit=FOREIGN_AUDIT[arch.name])
                == ERRNO | errno.EPERM
            )
    if arch.x32_bit is not None:
        assert verdict(arch.x32_bit | arch.socket, 1, 1, 0) == ERRNO | errno.EPERM
    assert verdict(READ_NR[arch.name], AF_VSOCK, 1, 5) == ALLOW  # the rule holds for sockets only


@functools.cache
def _libseccomp() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int
    return lib


@pytest.mark.parametrize("arch", [X86_64, AARCH64], ids=["x86_64", "aarch64"])
def test_the_syscall_numbers_are_libseccomps(arch: Arch) -> None:
    # The filter is hand-written (docs/SECURITY.md), its numbers typed: libseccomp's tables
    # (libseccomp2, on every Debian and Ubuntu host: apt needs it) check every one.
    lib = _libseccomp()
    if lib is None:
        if os.environ.get("CI") == "true":
            pytest.fail("libseccomp.so.2 is missing in CI (make system-deps installs libseccomp2)")
        pytest.skip("libseccomp.so.2 is not installed (apt-get install libseccomp2)")
    rules = (_seccomp.NOT_IMPLEMENTED, _seccomp.DENIED, _seccomp.NEWUSER_CHECKED, _seccomp.FAMILY_CHECKED)
    assert arch.numbers.keys() == {name for names in rules for name in names}
    theirs = {name: lib.seccomp_syscall_resolve_name_arch(arch.audit, name.encode()) for name in arch.numbers}
    assert theirs == arch.numbers


def test_an_architecture_without_a_filter_runs_no_tenant_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_seccomp.platform, "machine", lambda: "riscv64")
    with pytest.raises(SandboxUnavailable, match="no seccomp filter for this architecture"):
        host_filter()
