"""inotify on one file: did anybody open or read it? (A test's proof that something was never
opened on a stranger's behalf.)"""
from __future__ import annotations

import ctypes
import os

IN_OPEN, IN_ACCESS = 0x20, 0x01


class OpenWatch:
    """inotify on one file: did anybody open it?"""

    def __init__(self, path):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        assert libc.inotify_add_watch(self.fd, path.encode(), IN_OPEN | IN_ACCESS) >= 0

    def opened(self) -> bool:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return False
        return bool(data)

    def close(self):
        os.close(self.fd)
