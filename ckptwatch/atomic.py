"""CKPTWATCH_POLICY=atomic: a save to a path writes a temporary file and renames it into place.

Loaded into training processes: standard library only.

save(original, args, kwargs) does what `original(*args, **kwargs)` (torch.save) would do, but
for a str / bytes / os.PathLike target it:
  1. creates `.{name}.ckptwatch-tmp-{pid}-{random}` in the target's directory (O_EXCL, so it
     never opens a file somebody planted there), with the mode a plain open would give a new
     file (0666 & ~umask), or the existing file's mode (and owner and group, where allowed);
  2. calls the original save with that temporary path in place of the target (every other
     argument untouched: pickle_module, _use_new_zipfile_serialization, ...);
  3. os.replace()s it onto the target.
Concurrent writers then leave one complete file (the last rename wins), and a process that
crashes or is killed mid-save leaves the previous checkpoint as it was.

Durability is a separate choice (docs/decisions.md, "atomic without fsync"):
CKPTWATCH_ATOMIC_DURABLE=1 also fsyncs the temporary file before the rename and the directory
after it, so the new checkpoint survives a power loss or a kernel crash too (without it, the
kernel writes the data back in its own time: such a crash right after a save can leave the
previous checkpoint or, on some filesystems, an empty file). It costs two fsyncs per save,
1.6-2.8x a plain 4 KiB save on a local disk (docs/performance.md).
CKPTWATCH_ATOMIC_DIR_FSYNC=0 drops the directory fsync from the durable mode; without
CKPTWATCH_ATOMIC_DURABLE it changes nothing. The temporary name never matches the agent's
checkpoint patterns (it ends in "-<hex>"), and its leading dot keeps it out of `ls` and of a
resume script's glob("ckpt_*") while it exists.

Whatever fails in our own steps, the save is done the plain way instead, counted in stats():
no temporary file can be made (directory not writable, read-only or full filesystem, name
too long), the rename or the fsync fails (a filesystem without rename or fsync support), the
target exists but is not a regular file (/dev/null, a FIFO) or is not writable by us (a plain
save would fail on it, and so does ours, with its own error). An exception from the original
save removes the temporary file and is re-raised as the same object.

Choices and limits:
- A symbolic link is followed: the temporary file is written next to the link's final target
  and replaces the target, so the link survives and keeps pointing at the new checkpoint.
- A hard-linked target is replaced by a new file: its other names keep the previous content
  (every rename-based save behaves so). ACLs and extended attributes are not copied.
- torch names the archive inside a checkpoint after the file it writes; written under the
  temporary name, the archive's top-level folder is ".{name}" instead of "{stem}". torch.load
  does not care; a tool that opens the zip by member name would.
- A process killed between steps 1 and 3 (SIGKILL, power loss) leaves its temporary file
  behind; the checkpoint itself is intact. Such files are safe to delete.
"""
from __future__ import annotations

import os
import stat

TEMP_MARK = ".ckptwatch-tmp-"
DURABLE_ENV = "CKPTWATCH_ATOMIC_DURABLE"
DIR_FSYNC_ENV = "CKPTWATCH_ATOMIC_DIR_FSYNC"
_ON = ("1", "true", "yes", "on")
_NAME_BYTES = 200         # of the target's name kept in the temporary name (NAME_MAX is 255)
_PLAIN_TYPES = (str, bytes, os.PathLike)

_durable = False          # fsync the file before the rename (CKPTWATCH_ATOMIC_DURABLE)
_dir_fsync = False        # and the directory after it (durable, unless DIR_FSYNC=0)
_counters = {
    "atomic": 0,                 # saves done through a temporary file and a rename
    "fallback_not_regular": 0,   # target exists and is not a regular file we may write
    "fallback_no_temp": 0,       # no temporary file could be made next to the target
    "fallback_no_fsync": 0,      # fsync of the temporary file failed (durable mode)
    "fallback_no_rename": 0,     # os.replace failed (filesystem without rename support)
    "owner_not_kept": 0,         # the existing file's owner/group could not be given
    "dir_fsync_errors": 0,       # directory fsync failed after the rename (durable mode;
                                 # the save is done)
    "cleanup_errors": 0,         # a temporary file could not be removed
}


def configure(environ=None) -> None:
    """Read CKPTWATCH_ATOMIC_DURABLE (off unless 1/true/yes/on) and, in the durable mode,
    CKPTWATCH_ATOMIC_DIR_FSYNC (on unless 0/false/no/off)."""
    global _durable, _dir_fsync
    env = os.environ if environ is None else environ
    _durable = env.get(DURABLE_ENV, "").strip().lower() in _ON
    _dir_fsync = _durable and env.get(DIR_FSYNC_ENV, "1").strip().lower() not in (
        "0", "false", "no", "off")


def stats() -> dict:
    return dict(_counters)


def temp_name(name: str, pid: int, token: str) -> str:
    """The temporary file's name for a target called `name` (no directory part)."""
    while len(os.fsencode(name)) > _NAME_BYTES:
        name = name[:-1]
    return f".{name}{TEMP_MARK}{pid}-{token}"


def save(original, args: tuple, kwargs: dict):
    """original(*args, **kwargs), made atomic for a path target (see module doc)."""
    target = args[1] if len(args) > 1 else kwargs.get("f")
    if not isinstance(target, _PLAIN_TYPES):
        return original(*args, **kwargs)        # file object, BytesIO: untouched
    try:
        plan = _plan(os.fsdecode(os.fspath(target)))
    except Exception:
        plan = None
        _counters["fallback_no_temp"] += 1
    if plan is None:
        return original(*args, **kwargs)
    final, fd, temp = plan
    if len(args) > 1:
        args = args[:1] + (temp,) + args[2:]
    else:
        kwargs = dict(kwargs, f=temp)
    try:
        result = original(*args, **kwargs)
    except BaseException:
        _discard(fd, temp)
        raise
    if _durable:
        try:
            os.fsync(fd)
        except BaseException as exc:
            _discard(fd, temp)
            if not isinstance(exc, Exception):
                raise
            _counters["fallback_no_fsync"] += 1
            return _plain(original, args, kwargs, target)
    try:
        os.close(fd)
        os.replace(temp, final)
    except BaseException as exc:
        _discard(None, temp)
        if not isinstance(exc, Exception):
            raise
        _counters["fallback_no_rename"] += 1
        return _plain(original, args, kwargs, target)
    _counters["atomic"] += 1
    if _dir_fsync:
        _fsync_directory(os.path.dirname(final))
    return result


def _plain(original, args, kwargs, target):
    """The save again, the plain way, onto the user's own target."""
    if len(args) > 1:
        args = args[:1] + (target,) + args[2:]
    else:
        kwargs = dict(kwargs, f=target)
    return original(*args, **kwargs)


def _plan(path: str):
    """(final path, fd, temporary path) for an atomic save to `path`, or None (counted) when
    the save must be plain."""
    final = os.path.abspath(path)
    try:
        if stat.S_ISLNK(os.lstat(final).st_mode):
            final = os.path.realpath(final)      # replace the target, keep the link
        st = os.stat(final)
    except FileNotFoundError:
        st = None
    except OSError:
        _counters["fallback_not_regular"] += 1   # a dangling or looping link, EACCES...
        return None
    if st is not None and (not stat.S_ISREG(st.st_mode) or not os.access(final, os.W_OK)):
        _counters["fallback_not_regular"] += 1
        return None
    directory, name = os.path.split(final)
    if not name:
        _counters["fallback_not_regular"] += 1
        return None
    temp = os.path.join(directory, temp_name(name, os.getpid(), os.urandom(6).hex()))
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o666)
    except OSError:
        _counters["fallback_no_temp"] += 1
        return None
    if st is not None:
        _keep_permissions(fd, st)
    return final, fd, temp


def _keep_permissions(fd: int, st: os.stat_result) -> None:
    try:
        mine = os.fstat(fd)
        if (mine.st_uid, mine.st_gid) != (st.st_uid, st.st_gid):
            os.fchown(fd, st.st_uid, st.st_gid)
    except OSError:
        _counters["owner_not_kept"] += 1         # not root: the file becomes ours
    try:
        os.fchmod(fd, stat.S_IMODE(st.st_mode))  # after chown, which clears setuid/setgid
    except OSError:
        _counters["owner_not_kept"] += 1


def _discard(fd, temp: str) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.unlink(temp)
    except FileNotFoundError:
        pass
    except OSError:
        _counters["cleanup_errors"] += 1


def _fsync_directory(directory: str) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        _counters["dir_fsync_errors"] += 1


configure()
