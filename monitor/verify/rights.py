"""A hook process's rights, and opening a file only as far as those rights go.

The agent runs as root, its senders do not: an event naming /etc/shadow must not make the agent
read /etc/shadow for them. So the ingest server takes each connection's credentials from the
kernel (SO_PEERCRED uid/gid, then Groups/CapEff from /proc/<pid>/status, once per connection)
and open_as() walks an event's path the way the kernel would for that sender: every directory
must be searchable by the sender, every symbolic link is resolved by us (never followed blindly),
and the final file must be a regular file the sender may read. The check is made on the very
objects (O_PATH descriptors) that are then opened, so swapping a name mid-walk gains nothing.

Conservative where it cannot be exact: a file or directory carrying a POSIX ACL counts as not
accessible unless the sender owns it (named ACL entries are not evaluated); capabilities count
only for a sender in the agent's own user namespace (root in a rootless container is not root
here). A denied path is simply not verified.
"""
from __future__ import annotations

import errno
import os
import stat
from collections import deque
from dataclasses import dataclass

MAX_LINKS = 40                     # the kernel's own limit on symbolic links in one lookup
_CAP_DAC_OVERRIDE = 1 << 1
_CAP_DAC_READ_SEARCH = 1 << 2
_R, _X = 4, 1
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Rights:
    """What the process on the other end of a connection may read."""

    uid: int
    gid: int
    groups: frozenset = frozenset()
    read_all: bool = False         # CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH in our user ns


def peer_rights(pid: int, uid: int, gid: int, proc_root: str = "/proc"
                ) -> tuple[Rights, int | None]:
    """(Rights, namespace pid) of a peer, from SO_PEERCRED values and /proc/<pid>/status.
    Without a readable status: its primary group only, no capabilities, no namespace pid."""
    groups, caps, ns_pid = {gid}, 0, None
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    ns_pid = int(line.split()[-1])
                elif line.startswith(b"Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
                elif line.startswith(b"CapEff:"):
                    caps = int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    if caps and not _same_user_namespace(pid, proc_root):
        caps = 0
    read_all = bool(caps & (_CAP_DAC_OVERRIDE | _CAP_DAC_READ_SEARCH))
    return Rights(uid, gid, frozenset(groups), read_all), ns_pid


def _same_user_namespace(pid: int, proc_root: str) -> bool:
    try:
        return os.readlink(f"{proc_root}/{pid}/ns/user") == \
            os.readlink(f"{proc_root}/self/ns/user")
    except OSError:
        return False


def _has_acl(fd: int) -> bool:
    try:
        os.getxattr(f"/proc/self/fd/{fd}", "system.posix_acl_access")
    except OSError as exc:
        return exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)
    return True


def allows(st: os.stat_result, fd: int, sender: Rights, want: int) -> bool:
    """Would the kernel grant `sender` the `want` bits (4 read, 1 search) on this object?"""
    if sender.read_all:
        return True
    mode = st.st_mode
    if st.st_uid == sender.uid:
        return (mode >> 6) & want == want
    if _has_acl(fd):
        return False               # named entries and the mask are not evaluated: refuse
    if st.st_gid in sender.groups:
        return (mode >> 3) & want == want
    return mode & want == want


def open_as(path: str, sender: Rights) -> int:
    """A read-only descriptor of the regular file `path`, if `sender` could open it for
    reading itself. PermissionError (with the reason) otherwise; the caller closes the fd."""
    if not path.startswith("/"):
        raise PermissionError(errno.EACCES, "relative path")
    parts = deque(path.split("/"))
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    links = 0
    try:
        while parts:
            name = parts.popleft()
            if name in ("", "."):
                continue
            if not allows(os.fstat(fd), fd, sender, _X):
                raise PermissionError(errno.EACCES, "a directory on the path is not searchable")
            nfd = os.open(name, _PATH_FLAGS, dir_fd=fd)
            st = os.fstat(nfd)
            if stat.S_ISLNK(st.st_mode):
                os.close(nfd)
                links += 1
                if links > MAX_LINKS:
                    raise PermissionError(errno.ELOOP, "too many symbolic links")
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                parts.extendleft(reversed(target.split("/")))
                continue
            if parts and any(parts):       # an intermediate component: must be a directory
                if not stat.S_ISDIR(st.st_mode):
                    os.close(nfd)
                    raise PermissionError(errno.ENOTDIR, "not a directory on the path")
                os.close(fd)
                fd = nfd
                continue
            try:
                if not stat.S_ISREG(st.st_mode):
                    raise PermissionError(errno.EACCES, "not a regular file")
                if not allows(st, nfd, sender, _R):
                    raise PermissionError(errno.EACCES, "not readable by the sender")
                rfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                              | os.O_CLOEXEC, dir_fd=fd)
            finally:
                os.close(nfd)
            got = os.fstat(rfd)
            if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                os.close(rfd)
                raise PermissionError(errno.EACCES, "the file changed during the check")
            return rfd
        raise PermissionError(errno.EACCES, "not a regular file")
    finally:
        os.close(fd)
