"""ckptwatch.sharedfs: which paths other nodes write too (mount table, CKPTWATCH_SHARED_PATHS)."""
from ckptwatch.sharedfs import SharedPaths, is_shared_fstype, names_rank_or_node, parse_mountinfo

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /mnt/nfs rw,relatime shared:2 - nfs4 10.0.0.5:/export rw,vers=4.2
31 22 0:41 / /mnt/nfs/local rw shared:3 - tmpfs tmpfs rw
32 22 0:42 / /mnt/s3\\040bucket rw shared:4 - fuse.s3fs s3fs rw
33 22 0:43 / /lustre rw - lustre 10.0.0.6@tcp:/fs rw
garbage line
"""


def shared_paths(tmp_path, env=None):
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO)
    return SharedPaths(env or {}, mountinfo=str(table))


def test_parse_mountinfo_unescapes_and_skips_garbage():
    mounts = parse_mountinfo(MOUNTINFO)
    assert ("/mnt/s3 bucket", "fuse.s3fs") in mounts and len(mounts) == 5


def test_the_longest_mount_decides(tmp_path):
    s = shared_paths(tmp_path)
    assert s.shared("/mnt/nfs/run/last.pt") == "mount:nfs4"
    assert s.shared("/mnt/nfs/local/last.pt") is None           # a local mount inside it
    assert s.shared("/mnt/s3 bucket/x.pt") == "mount:fuse.s3fs"
    assert s.shared("/lustre/a/b.pt") == "mount:lustre"
    assert s.shared("/home/u/last.pt") is None
    assert s.shared("/mnt/nfsx/last.pt") is None                # a prefix, not a parent


def test_ckptwatch_shared_paths_marks_more(tmp_path):
    s = shared_paths(tmp_path, {"CKPTWATCH_SHARED_PATHS": "/data/ckpt:/scratch/"})
    assert s.shared("/data/ckpt/last.pt") == "CKPTWATCH_SHARED_PATHS"
    assert s.shared("/scratch/x/y.pt") == "CKPTWATCH_SHARED_PATHS"
    assert s.shared("/data/ckpt2/last.pt") is None


def test_fstypes():
    assert all(map(is_shared_fstype, ("nfs", "cephfs", "gpfs", "beegfs", "wekafs",
                                      "glusterfs", "fuse.juicefs")))
    assert not any(map(is_shared_fstype, ("ext4", "xfs", "tmpfs", "overlay")))


# The types as /proc/self/mountinfo shows them for the network and object-store file systems
# docs/multihost.md lists (fuse.sshfs seen on the test hosts, tests/e2e/test_multihost.py).
NETWORK_TYPES = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph",
                 "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.blobfuse2", "fuse.goofys",
                 "fuse.mountpoint-s3", "fuse.juicefs", "fuse.rclone", "fuse.ceph-fuse")
# Node-local FUSE: a rootless container's root, LXC's /proc files, a desktop portal, a snap.
LOCAL_TYPES = ("fuse.fuse-overlayfs", "fuse.lxcfs", "fuse.portal", "fuse.snapfuse",
               "fuse.squashfuse", "fuse.gocryptfs", "fuseblk")


def test_network_and_object_store_mounts_are_shared_and_named(tmp_path):
    lines = [f"{40 + i} 22 0:{60 + i} / /mnt/m{i} rw - {fstype} src rw"
             for i, fstype in enumerate(NETWORK_TYPES + LOCAL_TYPES)]
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO + "\n".join(lines) + "\n")
    s = SharedPaths({}, mountinfo=str(table))
    for i, fstype in enumerate(NETWORK_TYPES):
        assert s.shared(f"/mnt/m{i}/ckpt/last.pt") == f"mount:{fstype}"
    for i, fstype in enumerate(LOCAL_TYPES, start=len(NETWORK_TYPES)):
        assert s.shared(f"/mnt/m{i}/ckpt/last.pt") is None, fstype


def test_an_unknown_fuse_file_system_counts_as_shared():
    # Most FUSE mounts on training nodes are network or object storage (docs/multihost.md).
    assert is_shared_fstype("fuse.somethingnew") and is_shared_fstype("fuse")


def test_names_rank_or_node_looks_at_whole_numbers_in_the_last_two_components():
    assert names_rank_or_node("/ckpt/rank2/last.pt", 2, "node-b")
    assert names_rank_or_node("/ckpt/last-rank2.pt", 2, "node-b")
    assert names_rank_or_node("/ckpt/node-b/last.pt", 2, "node-b")
    assert not names_rank_or_node("/ckpt/last.pt", 2, "node-b")
    assert not names_rank_or_node("/ckpt/last-12.pt", 2, "node-b")        # 12 is not 2
    assert not names_rank_or_node("/tmp/cwx2a/run/last.pt", 2, "node-b")   # too high up
