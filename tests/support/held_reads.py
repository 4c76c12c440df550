"""Reads of one file held at a point a test chooses: fanotify's permission events, the kernel's
hook for an access decision (linux/fanotify.h; root, as the sandboxed worker needs anyway). A
test can so stop a process inside the read it chose (an apply mid-write, say) instead of racing
it with a signal."""

from __future__ import annotations

import ctypes
import os
import select
import struct
import time
from collections.abc import Callable
from pathlib import Path

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
FAN_CLOEXEC, FAN_CLASS_CONTENT, FAN_MARK_ADD, FAN_ACCESS_PERM, FAN_ALLOW = 0x1, 0x4, 0x1, 0x20000, 0x1
AT_FDCWD = -100
_FAN_EVENT = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_FAN_RESPONSE = struct.Struct("=iI")  # fd, response


class HeldReads:
    """Every read of one file waits for this test's answer: fanotify's permission events, the
    kernel's hook for an access decision (root, as the sandboxed worker needs anyway). A test
    can so stop a process inside a read it chose, instead of racing it with a signal."""

    def __init__(self, path: Path) -> None:
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_LARGEFILE
        self.fd = _LIBC.fanotify_init(FAN_CLOEXEC | FAN_CLASS_CONTENT, flags)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "fanotify_init")
        if _LIBC.fanotify_mark(self.fd, FAN_MARK_ADD, FAN_ACCESS_PERM, AT_FDCWD, os.fsencode(path)) < 0:
            errno = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(errno, f"fanotify_mark {path}")

    def __enter__(self) -> HeldReads:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # the kernel lets every read still waiting go on

    def hold(self, pid: int, nth: int, when: Callable[[], bool], timeout_s: float = 120) -> None:
        """Let reads go until process ``pid`` makes its ``nth`` read since ``when()`` first
        held; leave that one unanswered (``pid`` blocked in it) until the ``with`` ends."""
        seen = 0
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"process {pid} made {seen} of {nth} reads in {timeout_s} s"
            _len, _vers, _reserved, _meta_len, _mask, event_fd, reader = _FAN_EVENT.unpack(
                os.read(self.fd, _FAN_EVENT.size)
            )
            if reader == pid and (seen or when()):
                seen += 1
                if seen == nth:
                    os.close(event_fd)  # unanswered: the read waits for the group's end
                    return
            os.write(self.fd, _FAN_RESPONSE.pack(event_fd, FAN_ALLOW))
            os.close(event_fd)
