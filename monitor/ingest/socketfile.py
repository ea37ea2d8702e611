"""The ingest socket's file: who may own its directory, what may already sit at its path, and
removing it only while it is still the socket we bound.

Trust (ckptwatch.paths.directory_problem, the rules the hook applies too): a directory another
user can change lets them replace our socket and receive every event; one they own, or a
symbolic link, may have been planted before we started. Refuse, never repair someone else's.
A socket at the path is replaced only when nobody answers on it (an agent that died without
cleaning up); one that answers is another agent, running.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from ckptwatch import paths

log = logging.getLogger("ckptwatch.ingest")


class IngestError(RuntimeError):
    """The ingest socket cannot be set up; the message says why and what to do."""


class AgentAlreadyRunning(IngestError):
    """Another agent is alive and answering on the socket path."""


class SocketFile:
    """The socket file at `path`: prepare() before binding, bind(listener), intact() while
    serving, unlink_if_ours() at the end."""

    def __init__(self, path: str, mode: int = 0o660, group: int | str | None = None):
        self.path = path
        self._mode = mode
        self._group = group
        self._identity: tuple[int, int] | None = None   # (st_dev, st_ino) of our socket file

    def bind(self, listener: socket.socket) -> None:
        """Bind `listener` to the path and give the file its mode and group. Raises OSError."""
        listener.bind(self.path)
        st = os.lstat(self.path)
        self._identity = (st.st_dev, st.st_ino)
        os.chmod(self.path, self._mode)
        if self._group is not None:
            os.chown(self.path, -1, self.resolve_group(self._group))

    def intact(self) -> bool:
        """Is the file at our path still the socket we bound? False once it was removed or
        replaced (by anyone who could write the directory): hooks would then send elsewhere."""
        if self._identity is None:
            return False
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def prepare(self) -> None:
        """Make the directory if missing, check it and whatever is at the path. Raises
        AgentAlreadyRunning or IngestError."""
        directory = os.path.dirname(self.path) or "."
        self.make_directory(directory)
        uid = os.geteuid()
        problem = paths.directory_problem(directory, uid)
        if problem is not None:
            raise IngestError(
                f"refusing socket directory: {problem}. Use a directory owned by the agent's "
                "user (or root) that no other user can write (0700; 0750, or 1770 with the "
                "sticky bit, for a --ingest.socket-group), or choose another --ingest.socket")
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise IngestError(f"{self.path} exists and is not a socket; refusing to replace it "
                              "(remove it yourself or choose another --ingest.socket)")
        if st.st_uid not in (uid, 0):
            raise IngestError(f"{self.path} is owned by uid {st.st_uid}, not by the agent's "
                              f"uid {uid} or root; refusing to use or remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except ConnectionRefusedError:
            # Nobody listens: a socket left by an agent that died without cleaning up.
            log.info("replacing stale socket", extra={"fields": {"path": self.path}})
            os.unlink(self.path)
            return
        except OSError as exc:
            if exc.errno == errno.EAGAIN:   # backlog full: someone is listening
                raise AgentAlreadyRunning(self.already_running_message()) from exc
            raise IngestError(f"cannot tell whether {self.path} is in use: "
                              f"{exc.strerror or exc}") from exc
        finally:
            probe.close()
        raise AgentAlreadyRunning(self.already_running_message())

    def make_directory(self, directory: str) -> None:
        """Create the socket directory if missing: 0700, or 0750 and our group with
        --ingest.socket-group, or 0755 when the socket mode lets others connect."""
        try:
            os.lstat(directory)
            return
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise IngestError(f"cannot inspect socket directory {directory}: "
                              f"{exc.strerror or exc}") from exc
        mode = 0o750 if self._group is not None else 0o700
        if self._mode & 0o006:
            mode |= 0o005
        try:
            os.makedirs(os.path.dirname(directory) or ".", mode=0o755, exist_ok=True)
            os.mkdir(directory, 0o700)     # then widened: never more open than meant, even
            if self._group is not None:    # for a moment
                os.chown(directory, -1, self.resolve_group(self._group))
            os.chmod(directory, mode)
        except FileExistsError:
            pass                # created meanwhile by someone: the trust check decides
        except OSError as exc:
            raise IngestError(f"cannot create socket directory {directory}: "
                              f"{exc.strerror or exc}") from exc

    def already_running_message(self) -> str:
        return (f"another ckptwatch agent is already listening on {self.path}; stop it first "
                "or choose another --ingest.socket")

    def unlink_if_ours(self) -> None:
        # Only remove the file we created: a newer agent may have replaced it meanwhile.
        if self._identity is None:
            return
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove socket", extra={"fields": {"path": self.path,
                                                                     "error": exc}})
        self._identity = None

    @staticmethod
    def resolve_group(group: int | str) -> int:
        if isinstance(group, int):
            return group
        import grp
        try:
            return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise OSError(errno.EINVAL, f"unknown group {group!r}") from None
