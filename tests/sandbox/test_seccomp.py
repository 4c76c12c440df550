"""The seccomp filter, by behaviour: tenant code in the real sandbox asks the kernel for what
the filter removes (``executor/sandbox/_seccomp.py``), and each request is refused with the
filter's answer, then a normal round still runs.

Each call is made in a child of the runner (so a call the filter let through would change
nothing for the runner), and its arguments are chosen so that the kernel would answer
something else without the filter — verified on Linux 6.18 as root and as an unprivileged
uid: ``bpf`` EINVAL, ``io_uring_setup`` EFAULT, ``userfaultfd`` a descriptor, ``mount``
EFAULT, ``setns`` EBADF, ``unshare(CLONE_NEWUSER)`` success, ``int 0x80`` getpid the pid.
So an answer of the filter's is the filter's doing, not a missing privilege's.
"""

from __future__ import annotations

import errno
import os
import platform
import signal

import pytest

pytestmark = [pytest.mark.needs_sandbox, pytest.mark.timeout(300)]

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

# Tenant code: ``CALL`` runs in a child; the report says what was tried and what came back.
PROBE = """
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

out = {'attempt': __ATTEMPT__, **in_child(lambda: __CALL__)}
out['seccomp'] = next(line.split()[1] for line in open('/proc/self/status') if line.startswith('Seccomp:'))
__CONTROL__
save_report(out)
"""

# x86_64 machine code: mov eax, NR; int 0x80 (the i386 ABI) or syscall (the native one); ret.
I386_GETPID = b"\xb8\x14\x00\x00\x00\xcd\x80\xc3"  # getpid is 20 on i386
X86_64_GETPID = b"\xb8\x27\x00\x00\x00\x0f\x05\xc3"  # and 39 on x86_64


def probe(attempt: str, call: str, control: str = "") -> str:
    code = PROBE.replace("__ATTEMPT__", repr(attempt)).replace("__CALL__", call)
    return code.replace("__CONTROL__", control)


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
