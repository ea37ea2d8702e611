"""Is a path on storage that other nodes write too? (stdlib only; loaded into training processes)

A path is shared when it lies under a CKPTWATCH_SHARED_PATHS prefix (colon-separated; also how
tests simulate shared storage on one host), or when the mount holding it (longest mount point
prefix in /proc/self/mountinfo, this process's own mount namespace: the node's view) has a
network or cluster file system type. The mount table is read once per MOUNTS_TTL seconds and
answers are cached per directory, so this costs a dict lookup per save after the first.
"""
from __future__ import annotations

import os
import re
import time

SHARED_PATHS_ENV = "CKPTWATCH_SHARED_PATHS"
MOUNTINFO = "/proc/self/mountinfo"
MOUNTS_TTL = 60.0
_CACHE_MAX = 4096

# Network and parallel file systems in the kernel (the type field of /proc/self/mountinfo):
# another node can write the same file. NFS (nfs, nfs4; also AWS EFS, Filestore, Azure Files
# NFS), SMB (cifs, smb3), Lustre (also FSx for Lustre), GPFS / Spectrum Scale, BeeGFS, CephFS
# (ceph), WekaFS, GlusterFS, PanFS, OrangeFS, AFS, the cluster block file systems (ocfs2,
# gfs2), a VM's host share (9p, virtiofs). docs/multihost.md lists them.
SHARED_FSTYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "ceph", "cephfs", "beegfs", "wekafs", "glusterfs",
    "cifs", "smb3", "smbfs", "9p", "panfs", "orangefs", "pvfs2", "afs", "ocfs2", "gfs2",
    "quobyte", "virtiofs", "fuse",
})

# FUSE file systems show as "fuse.<subtype>", the subtype being what the program names itself
# (checked against each one's mount output): over a network or an object store, so shared.
SHARED_FUSE = frozenset({
    "sshfs", "s3fs", "gcsfuse", "blobfuse", "blobfuse2", "goofys", "mountpoint-s3",
    "juicefs", "rclone", "ceph-fuse", "glusterfs", "alluxio-fuse", "s3backer", "s3ql",
    "geesefs", "mfs", "lizardfs", "davfs2", "cvmfs2",
})

# FUSE file systems that live on this node only: a container's root (fuse-overlayfs, rootless
# podman), LXC's /proc files, desktop portals, snaps and squashfs images, local overlays and
# encryption. Taking them for shared storage would name a hazard on a correct job.
LOCAL_FUSE = frozenset({
    "fuse-overlayfs", "lxcfs", "portal", "snapfuse", "squashfuse", "bindfs", "encfs",
    "gocryptfs", "cryfs", "securefs", "appimage", "archivemount", "fuse-zip", "ntfs-3g",
})


def is_shared_fstype(fstype: str) -> bool:
    """The kernel's network and parallel file systems, the FUSE ones over a network or an
    object store (SHARED_FUSE), and a FUSE file system we do not know: FUSE mounts on
    training nodes are most often network or object storage, and a false "shared" costs a
    hazard report about a path several ranks write anyway. The FUSE file systems known to be
    node-local (LOCAL_FUSE) are not shared; "fuseblk" (ntfs-3g, exfat on a local disk) is
    not FUSE-over-network either."""
    if fstype in SHARED_FSTYPES:
        return True
    if fstype.startswith("fuse."):
        return fstype[5:].lower() not in LOCAL_FUSE
    return False


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """[(mount point, fstype)] from /proc/<pid>/mountinfo text; unparsable lines skipped."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mounts.append((_unescape(fields[4]), right.split()[0]))
    return mounts


def _prefixes(environ) -> tuple[str, ...]:
    raw = environ.get(SHARED_PATHS_ENV, "")
    out = []
    for item in raw.split(":"):
        item = item.strip()
        if item:
            out.append(os.path.abspath(item).rstrip("/") or "/")
    return tuple(out)


def _under(path: str, prefix: str) -> bool:
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


class SharedPaths:
    """Answers shared(path) -> reason str ("CKPTWATCH_SHARED_PATHS", "mount:nfs4") or None."""

    def __init__(self, environ=None, mountinfo: str = MOUNTINFO,
                 clock=time.monotonic):
        env = os.environ if environ is None else environ
        self._prefixes = _prefixes(env)
        self._mountinfo = mountinfo
        self._clock = clock
        self._mounts: list[tuple[str, str]] = []
        self._loaded_at: float | None = None
        self._cache: dict[str, str | None] = {}

    def _load(self) -> None:
        now = self._clock()
        if self._loaded_at is not None and now - self._loaded_at < MOUNTS_TTL:
            return
        self._loaded_at = now
        self._cache.clear()
        try:
            with open(self._mountinfo, encoding="utf-8", errors="surrogateescape") as f:
                mounts = parse_mountinfo(f.read())
        except OSError:
            mounts = []
        # Longest mount point first: the first match is the mount holding the path.
        self._mounts = sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def shared(self, path: str) -> str | None:
        directory = os.path.dirname(path) or "/"
        self._load()
        if directory in self._cache:
            return self._cache[directory]
        reason = None
        for prefix in self._prefixes:
            if _under(path, prefix):
                reason = SHARED_PATHS_ENV
                break
        if reason is None:
            for mount_point, fstype in self._mounts:
                if _under(directory, mount_point.rstrip("/") or "/"):
                    if is_shared_fstype(fstype):
                        reason = f"mount:{fstype}"
                    break
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[directory] = reason
        return reason


_DIGITS = re.compile(r"\d+")


def names_rank_or_node(path: str, rank: int | None, node: str | None) -> bool:
    """Does the file name or its directory name carry the rank (as a whole number: "rank2",
    "model_2.pt", "2/") or the node name? Only the last two components are looked at: a
    random temporary directory higher up says nothing about who the file belongs to."""
    tail = "/".join(path.rstrip("/").split("/")[-2:])
    if node and node in tail:
        return True
    if rank is None:
        return False
    return str(rank) in _DIGITS.findall(tail)
