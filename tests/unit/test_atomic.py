"""ckptwatch.atomic (CKPTWATCH_POLICY=atomic): real torch.save into real files.

In-process tests call ckptwatch.atomic.save with torch's own save as the original; the ones
that need the whole hook, a crash or another user run a fresh Python process.
"""
import errno
import fnmatch
import io
import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from ckptwatch import atomic
from helpers import remove_tree, short_tmpdir, subprocess_env
from monitor.fs.options import CHECKPOINT_PATTERNS

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]

PY = sys.executable


def leftovers(directory) -> list:
    return [n for n in os.listdir(directory) if atomic.TEMP_MARK in n]


def counted(before: dict, name: str) -> int:
    return atomic.stats()[name] - before[name]


@pytest.fixture
def default_settings():
    atomic.configure({})
    yield
    atomic.configure()


def test_save_to_a_path_replaces_the_file_whole_and_leaves_no_temporary(tmp_path, default_settings):
    path = tmp_path / "last.pt"
    torch.save({"old": 1}, path)
    before = atomic.stats()
    result = atomic.save(torch.save, ({"w": torch.arange(10)},), {"f": str(path)})
    assert result is None
    assert torch.equal(torch.load(path)["w"], torch.arange(10))
    assert leftovers(tmp_path) == []
    assert counted(before, "atomic") == 1


def test_returns_what_the_original_returns_and_passes_every_argument(tmp_path):
    seen = {}

    def original(obj, f, pickle_protocol=2, **kwargs):
        seen.update(obj=obj, f=f, protocol=pickle_protocol, kwargs=kwargs)
        with open(f, "wb") as out:
            out.write(b"x" * 10)
        return "the original's value"

    obj = object()
    result = atomic.save(original, (obj, os.fsencode(tmp_path / "a.pt"), 4),
                         {"_use_new_zipfile_serialization": False})
    assert result == "the original's value"
    assert seen["obj"] is obj and seen["protocol"] == 4
    assert seen["kwargs"] == {"_use_new_zipfile_serialization": False}
    assert os.path.dirname(seen["f"]) == str(tmp_path) and atomic.TEMP_MARK in seen["f"]
    assert (tmp_path / "a.pt").read_bytes() == b"x" * 10


def test_legacy_format_loads(tmp_path):
    path = tmp_path / "legacy.pt"
    atomic.save(torch.save, ({"w": torch.ones(3)}, path), {"_use_new_zipfile_serialization": False})
    assert torch.equal(torch.load(path)["w"], torch.ones(3))
    assert leftovers(tmp_path) == []


def test_file_objects_and_bytesio_pass_through_unchanged(tmp_path):
    got = []

    def original(obj, f):
        got.append(f)

    buffer = io.BytesIO()
    with open(tmp_path / "open.pt", "wb") as handle:
        atomic.save(original, (1, buffer), {})
        atomic.save(original, (1,), {"f": handle})
    assert got[0] is buffer and got[1] is handle
    assert leftovers(tmp_path) == []


def test_an_error_removes_the_temporary_keeps_the_old_file_and_reraises_the_same_object(tmp_path):
    path = tmp_path / "last.pt"
    torch.save({"old": 1}, path)
    raised = RuntimeError("boom")

    def original(obj, f):
        with open(f, "wb") as out:
            out.write(b"half a checkpoint")
        raise raised

    with pytest.raises(RuntimeError) as info:
        atomic.save(original, (1, str(path)), {})
    assert info.value is raised
    assert torch.load(path) == {"old": 1}
    assert leftovers(tmp_path) == []


def test_an_unpicklable_object_fails_like_a_plain_save_and_leaves_nothing(tmp_path):
    path = tmp_path / "last.pt"
    torch.save({"old": 1}, path)
    with pytest.raises(Exception) as plain:
        torch.save({"f": lambda: 0}, tmp_path / "plain.pt")
    with pytest.raises(type(plain.value)):
        atomic.save(torch.save, ({"f": lambda: 0}, str(path)), {})
    assert torch.load(path) == {"old": 1}
    assert leftovers(tmp_path) == []


def test_the_mode_owner_and_group_of_an_existing_file_are_kept(tmp_path):
    path = tmp_path / "last.pt"
    torch.save(1, path)
    os.chmod(path, 0o640)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    atomic.save(torch.save, (2, str(path)), {})
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o640
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert torch.load(path) == 2


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_new_file_gets_the_mode_a_plain_open_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic.save(torch.save, (1, str(tmp_path / "new.pt")), {})
        torch.save(1, tmp_path / "plain.pt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.pt").st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(tmp_path / "plain.pt").st_mode) == 0o666 & ~umask


def test_a_symlink_survives_and_its_target_is_replaced(tmp_path):
    real = tmp_path / "store" / "epoch3.pt"
    real.parent.mkdir()
    torch.save(1, real)
    link = tmp_path / "last.pt"
    link.symlink_to(real)
    atomic.save(torch.save, (2, str(link)), {})
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert torch.load(real) == 2
    assert leftovers(tmp_path) == [] and leftovers(real.parent) == []


def test_a_target_that_is_not_a_regular_file_is_written_the_plain_way(tmp_path):
    before = atomic.stats()
    atomic.save(torch.save, (1, "/dev/null"), {})
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert counted(before, "fallback_not_regular") == 1


def test_a_read_only_target_fails_as_a_plain_save_would():
    # A rename could replace a file the job may not write; the save must fail instead, with
    # the plain save's own error. Root may write anything, so as root the child runs as nobody.
    top = short_tmpdir("cwr")
    os.chmod(top, 0o777)
    path = pathlib.Path(top) / "ro.pt"
    torch.save(1, path)
    os.chmod(path, 0o444)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    script = textwrap.dedent(f"""
        import json, os, torch
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        from ckptwatch import atomic

        def error_of(save):
            try:
                save()
            except Exception as exc:
                return type(exc).__name__

        plain = error_of(lambda: torch.save(2, {str(path)!r}))
        ours = error_of(lambda: atomic.save(torch.save, (2, {str(path)!r}), {{}}))
        print(json.dumps({{"plain": plain, "ours": ours, "stats": atomic.stats()}}))
        """)
    try:
        out = subprocess.run([PY, "-c", script], env=subprocess_env(), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["plain"] is not None and result["ours"] == result["plain"]
        assert result["stats"]["fallback_not_regular"] == 1
        assert torch.load(path) == 1
        assert leftovers(top) == []
    finally:
        remove_tree(top)


def test_without_rename_support_the_save_is_plain_and_counted(tmp_path, monkeypatch):
    # No filesystem here refuses rename, so os.replace is made to fail as one would (EXDEV,
    # as some FUSE and object-store mounts do).
    def no_rename(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(atomic.os, "replace", no_rename)
    before = atomic.stats()
    path = tmp_path / "last.pt"
    atomic.save(torch.save, ({"w": 3},), {"f": str(path)})
    monkeypatch.undo()
    assert torch.load(path) == {"w": 3}
    assert leftovers(tmp_path) == []
    assert counted(before, "fallback_no_rename") == 1


def test_a_directory_we_cannot_write_falls_back_to_a_plain_save():
    # A writable checkpoint in a directory the job may not create files in: the temporary file
    # cannot be made, so the save overwrites the file in place, as without ckptwatch. As root,
    # the child runs as nobody (root could create files anywhere), so the tree is 0755.
    top = short_tmpdir("cwa")
    os.chmod(top, 0o755)
    directory = pathlib.Path(top) / "ro"
    directory.mkdir()
    path = directory / "last.pt"
    torch.save(1, path)
    script = textwrap.dedent(f"""
        import json, os, sys, torch
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        from ckptwatch import atomic
        atomic.save(torch.save, (2, {str(path)!r}), {{}})
        print(json.dumps(atomic.stats()))
        """)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    os.chmod(directory, 0o555)
    try:
        out = subprocess.run([PY, "-c", script], env=subprocess_env(), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout.strip().splitlines()[-1])
        assert stats["fallback_no_temp"] == 1 and stats["atomic"] == 0
        assert torch.load(path) == 2
    finally:
        os.chmod(directory, 0o755)
        remove_tree(top)


def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "last.pt"
    torch.save({"epoch": 1, "w": torch.ones(1000)}, path)
    script = textwrap.dedent(f"""
        import os, signal, torch
        from ckptwatch import atomic

        def dies_halfway(obj, f):
            with open(f, "wb") as out:
                out.write(b"PK" + b"\\0" * 100000)
                out.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        atomic.save(dies_halfway, ({{"epoch": 2}}, {str(path)!r}), {{}})
        """)
    out = subprocess.run([PY, "-c", script], env=subprocess_env(), capture_output=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL
    state = torch.load(path)
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(1000))
    # The killed process's temporary file stays behind (documented): hidden, and never a name
    # the agent takes for a checkpoint.
    (left,) = leftovers(tmp_path)
    assert left.startswith(".last.pt" + atomic.TEMP_MARK)


@pytest.mark.parametrize("name", ["last.pt", "model.safetensors", "x.distcp", "c.ckpt",
                                  "pytorch_model.bin", "w.pth", "é" * 200 + ".pt", "a" * 255])
def test_temporary_names_never_match_the_checkpoint_patterns_and_fit_name_max(name):
    temp = atomic.temp_name(name, 4194304, os.urandom(6).hex())
    assert temp.startswith(".")
    assert not any(fnmatch.fnmatch(temp, pattern) for pattern in CHECKPOINT_PATTERNS)
    assert len(os.fsencode(temp)) <= 255


@pytest.fixture
def fsyncs(monkeypatch):
    """Every fsync the process makes, as (what the descriptor names, the target's bytes at that
    moment), still done for real. A seam on os.fsync: counting them with strace would cost a
    traced child per test for the same answer."""
    calls = []
    real = os.fsync

    def recording(fd):
        target = recording.target
        calls.append((os.readlink(f"/proc/self/fd/{fd}"),
                      target.read_bytes() if target is not None and target.exists() else None))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    recording.target = None
    yield recording, calls
    atomic.configure()


def test_the_default_atomic_save_renames_without_fsync(tmp_path, fsyncs):
    # issue 22: two fsyncs made a 4 KiB atomic save 2.8x a plain one. The default keeps what
    # atomic is for -- concurrent writers leave one whole file, a crashed save leaves the old
    # one -- and leaves durability against power loss to CKPTWATCH_ATOMIC_DURABLE.
    recording, calls = fsyncs
    atomic.configure({})
    path = tmp_path / "last.pt"
    recording.target = path
    torch.save({"old": 1}, path)
    before = atomic.stats()
    atomic.save(torch.save, ({"w": torch.arange(10)}, str(path)), {})
    assert calls == []
    assert torch.equal(torch.load(path)["w"], torch.arange(10))
    assert counted(before, "atomic") == 1 and leftovers(tmp_path) == []


@pytest.mark.parametrize("setting", ["1", "yes", "true", " ON "])
def test_durable_mode_fsyncs_the_file_before_the_rename_and_the_directory_after(
        tmp_path, fsyncs, setting):
    recording, calls = fsyncs
    atomic.configure({atomic.DURABLE_ENV: setting})
    path = tmp_path / "last.pt"
    recording.target = path
    torch.save({"old": 1}, path)
    old = path.read_bytes()
    atomic.save(torch.save, ({"w": torch.arange(10)}, str(path)), {})
    new = path.read_bytes()
    assert new != old
    (file_name, file_seen), (dir_name, dir_seen) = calls
    # The temporary file is on disk before it replaces the target; the directory entry after.
    assert os.path.basename(file_name).startswith(".last.pt" + atomic.TEMP_MARK)
    assert file_seen == old
    assert dir_name == str(tmp_path) and dir_seen == new


def test_durable_mode_without_the_directory_fsync(tmp_path, fsyncs):
    recording, calls = fsyncs
    atomic.configure({atomic.DURABLE_ENV: "1", atomic.DIR_FSYNC_ENV: "0"})
    path = tmp_path / "last.pt"
    atomic.save(torch.save, ({"w": 1}, str(path)), {})
    assert [os.path.basename(name).startswith(".last.pt" + atomic.TEMP_MARK)
            for name, _ in calls] == [True]


def test_durability_settings():
    atomic.configure({})
    assert (atomic._durable, atomic._dir_fsync) == (False, False)
    for off in ("0", "", "no", "off", "false", "maybe"):
        atomic.configure({atomic.DURABLE_ENV: off})
        assert atomic._durable is False, off
    atomic.configure({atomic.DURABLE_ENV: "1"})
    assert (atomic._durable, atomic._dir_fsync) == (True, True)
    atomic.configure({atomic.DURABLE_ENV: "1", atomic.DIR_FSYNC_ENV: "0"})
    assert (atomic._durable, atomic._dir_fsync) == (True, False)
    # The directory fsync alone is not a mode: without durability nothing is fsynced.
    atomic.configure({atomic.DIR_FSYNC_ENV: "1"})
    assert (atomic._durable, atomic._dir_fsync) == (False, False)
    atomic.configure()
