"""The kernel's classic-BPF interpreter for the seccomp filter, in Python: the programs of
every architecture are checked here, not only the one this machine runs."""

from __future__ import annotations

import struct

ALLOW, ERRNO = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO (| errno)


def run_filter(program: bytes, nr: int, *args: int, audit: int) -> int:
    """What the kernel's classic-BPF interpreter returns for one syscall (the five
    instructions the filter uses); a jump out of the program raises IndexError."""
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    argv = (*args, 0, 0, 0, 0, 0, 0)[:6]
    data = struct.pack("<II8x6Q", nr & 0xFFFFFFFF, audit, *(arg & (1 << 64) - 1 for arg in argv))
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("<I", data, k)[0]
        elif code in (0x15, 0x35, 0x45):  # BPF_JMP | BPF_JEQ / BPF_JGE / BPF_JSET, K
            taken = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += jt if taken else jf
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x} at {pc - 1}")
