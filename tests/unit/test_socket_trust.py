"""Who may talk to the agent and what it reads for them (issue 8 defects 2 and 3, issue 11.4):
the socket directory, the hook's choice of socket, journal modes, reading with the sender's
rights (the real agent process refusing and reading: tests/e2e/test_socket_trust.py).

Real sockets, real files, real processes. The tests run as root and play the other local user
as uid 65534 (nobody): files are chowned to it, or a child process drops to it with setuid.
"""
import os
import socket
import stat
import struct
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO_ROOT, subprocess_env
from otheruser import NOBODY, needs_root
from receiver import Receiver
from exporters.journal import Journal
from monitor.ingest.server import IngestError, IngestServer

pytestmark = needs_root


def _server(path, **kw):
    return IngestServer(path, lambda e: None, lambda r: None, **kw)


def _refused(path, **kw) -> str:
    srv = _server(path, **kw)
    with pytest.raises(IngestError) as info:
        srv.start()
    srv.stop()
    return str(info.value)


# --- the agent's socket directory -----------------------------------------------------------

def test_agent_refuses_directory_owned_by_another_user(public_dir):
    squat = os.path.join(public_dir, "ckptwatch-0")
    os.mkdir(squat, 0o700)
    os.chown(squat, NOBODY, NOBODY)
    message = _refused(os.path.join(squat, "agent.sock"))
    assert "owned by uid 65534" in message
    assert os.listdir(squat) == []


def test_agent_refuses_a_symlinked_directory(public_dir):
    real = os.path.join(public_dir, "real")
    os.mkdir(real, 0o700)                       # ours, safe: only the link is wrong
    link = os.path.join(public_dir, "link")
    os.symlink(real, link)
    assert "symbolic link" in _refused(os.path.join(link, "agent.sock"))
    assert os.listdir(real) == []


@pytest.mark.parametrize("mode", [0o777, 0o757, 0o1777, 0o770, 0o2770])
def test_agent_refuses_a_directory_others_can_write(public_dir, mode):
    d = os.path.join(public_dir, "open")
    os.mkdir(d)
    os.chmod(d, mode)
    assert "writable by" in _refused(os.path.join(d, "agent.sock"))


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o2750, 0o1770, 0o3770])
def test_agent_accepts_a_directory_only_it_can_change(public_dir, mode):
    d = os.path.join(public_dir, "ok")
    os.mkdir(d)
    os.chmod(d, mode)
    srv = _server(os.path.join(d, "agent.sock"))
    srv.start()
    try:
        assert srv.socket_intact()
    finally:
        srv.stop()


def test_agent_refuses_an_existing_socket_of_another_user(public_dir):
    d = os.path.join(public_dir, "d")
    os.mkdir(d, 0o755)
    path = os.path.join(d, "agent.sock")
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    planted.bind(path)                          # not listening: looks like a stale socket
    os.chown(path, NOBODY, NOBODY)
    try:
        before = os.lstat(path)
        assert "owned by uid 65534" in _refused(path)
        after = os.lstat(path)
        assert (before.st_ino, before.st_dev) == (after.st_ino, after.st_dev)
    finally:
        planted.close()


def test_agent_creates_its_directory_0700_or_0750_with_a_group(public_dir):
    srv = _server(os.path.join(public_dir, "new", "agent.sock"))
    srv.start()
    srv.stop()
    st = os.lstat(os.path.join(public_dir, "new"))
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0
    srv = _server(os.path.join(public_dir, "grp", "agent.sock"), socket_group=NOBODY)
    srv.start()
    srv.stop()
    st = os.lstat(os.path.join(public_dir, "grp"))
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == NOBODY


# --- the hook's choice of socket ------------------------------------------------------------

_HOOK = r'''
import os, sys
from ckptwatch import emitter, paths
paths.SYSTEM_SOCKET_DIR = sys.argv[1]
if len(sys.argv) > 2:      # imported as root (the repo may be private), then become the user
    uid = int(sys.argv[2])
    os.setgid(uid); os.setgroups([]); os.setuid(uid)
e = emitter.get_emitter()
e.emit({"v": 1, "type": "start", "node": "n", "pid": os.getpid(), "seq": 1, "rank": 0,
        "path": "/ckpt/x.pt", "site": "t.py:1", "func": "f", "wall": 1.0, "mono": 1.0})
print("sent" if e.flush(3.0) else "unsent", flush=True)
'''


def _hook(env, system_dir, as_user=None):
    argv = [sys.executable, "-c", _HOOK, system_dir] + ([str(as_user)] if as_user else [])
    out = subprocess.run(argv, env=subprocess_env(**env), capture_output=True, text=True,
                         timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture
def runtime(public_dir):
    """$XDG_RUNTIME_DIR with a listening ckptwatch/agent.sock; a system dir with none yet."""
    xdg = os.path.join(public_dir, "xdg")
    os.makedirs(os.path.join(xdg, "ckptwatch"), 0o755)
    os.chmod(xdg, 0o755)
    rx = Receiver(os.path.join(xdg, "ckptwatch", "agent.sock")).start()
    yield {"XDG_RUNTIME_DIR": xdg}, rx, os.path.join(public_dir, "system")
    rx.stop()


def test_hook_sends_to_its_own_runtime_socket(runtime):
    env, rx, system = runtime
    assert _hook(env, system) == "sent"
    rx.wait_count("start", 1)


def test_hook_refuses_a_socket_owned_by_another_user(runtime):
    env, rx, system = runtime
    os.chown(rx.path, NOBODY, NOBODY)
    assert _hook(env, system) == "unsent"
    assert rx.connections == 0


def test_hook_refuses_a_socket_directory_owned_by_another_user(runtime):
    env, rx, system = runtime
    os.chown(os.path.dirname(rx.path), NOBODY, NOBODY)
    assert _hook(env, system) == "unsent"
    assert rx.connections == 0


def test_hook_refuses_a_peer_of_another_user_behind_a_root_owned_file(public_dir):
    """The file looks right (root's, in root's directory) but a nobody process listens on it."""
    d = os.path.join(public_dir, "xdg", "ckptwatch")
    os.makedirs(d, 0o755)
    os.chown(d, NOBODY, NOBODY)
    path = os.path.join(d, "agent.sock")
    listener = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, socket, sys, time
            os.setgid({NOBODY}); os.setgroups([]); os.setuid({NOBODY})
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind({path!r}); s.listen(8)
            print("ready", flush=True)
            c, _ = s.accept()
            print("accepted", flush=True)
            c.settimeout(5)
            print("got", len(c.recv(65536)), flush=True)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "ready"
        os.chown(path, 0, 0)
        os.chown(d, 0, 0)
        assert _hook({"XDG_RUNTIME_DIR": os.path.join(public_dir, "xdg")},
                     os.path.join(public_dir, "none")) == "unsent"
    finally:
        listener.kill()
        out = listener.communicate()[0]
    assert "got" not in out or "got 0" in out


def test_hook_as_a_user_accepts_the_root_agents_socket(runtime):
    env, rx, system = runtime
    os.chmod(rx.path, 0o666)
    assert _hook(env, system, as_user=NOBODY) == "sent"
    rx.wait_count("start", 1)


def test_hook_tries_the_system_socket_first(runtime, public_dir):
    env, rx, system = runtime
    os.mkdir(system, 0o755)
    sysrx = Receiver(os.path.join(system, "agent.sock")).start()
    try:
        assert _hook(env, system) == "sent"
        sysrx.wait_count("start", 1)
        assert rx.connections == 0
        # An untrusted system socket is skipped: the per-user one gets the event.
        os.chown(sysrx.path, NOBODY, NOBODY)
        assert _hook(env, system) == "sent"
        rx.wait_count("start", 1)
    finally:
        sysrx.stop()


def test_explicit_socket_wins_over_the_system_socket(runtime, public_dir):
    env, rx, system = runtime
    os.mkdir(system, 0o755)
    sysrx = Receiver(os.path.join(system, "agent.sock")).start()
    try:
        assert _hook({"CKPTWATCH_SOCKET": rx.path}, system) == "sent"
        rx.wait_count("start", 1)
        assert sysrx.connections == 0
    finally:
        sysrx.stop()


# --- what the agent reads on a sender's behalf ----------------------------------------------

def test_journal_files_are_0640_or_stricter_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        path = str(tmp_path / "j" / "journal.jsonl")
        journal = Journal(path, max_bytes=200, backups=2)
        for i in range(10):
            assert journal.write({"type": "finding", "i": i, "pad": "x" * 50})
        journal.close()
        loose = tmp_path / "loose.jsonl"
        loose.write_text("")
        os.chmod(loose, 0o666)
        Journal(str(loose)).close()
    finally:
        os.umask(old)
    files = [path, path + ".1", path + ".2", str(loose)]
    modes = {f: stat.S_IMODE(os.stat(f).st_mode) for f in files}
    assert all(m & 0o137 == 0 for m in modes.values()), {f: oct(m) for f, m in modes.items()}
    assert stat.S_IMODE(os.stat(tmp_path / "j").st_mode) & 0o027 == 0


# --- the pieces: whose rights a due path is read with, and open_as ---------------------------

from monitor.verify.rights import Rights, open_as  # noqa: E402
from monitor.verify.worker import MAX_SENDERS, VerifySchedule  # noqa: E402

ALICE = Rights(NOBODY, NOBODY, frozenset({NOBODY}))


def test_schedule_reads_with_the_senders_rights_unless_the_watcher_saw_the_write():
    s = VerifySchedule(quiet=1.0)
    s.write_started("/c/hook.pt", 1.0, ALICE)
    s.write_finished("/c/hook.pt", "j", 1.0)
    s.write_started("/c/fs.pt", 1.0, ALICE)
    s.write_started("/c/fs.pt", 1.0, watched=True)
    s.write_finished("/c/fs.pt", "", 1.0)
    s.write_finished("/c/nobody.pt", "", 1.0)           # no start seen: nobody's rights
    many = [Rights(1000 + i, 1000) for i in range(MAX_SENDERS + 3)]
    for sender in many:
        s.write_started("/c/many.pt", 1.0, sender)
    s.write_finished("/c/many.pt", "", 1.0)
    due = {p: readers for p, _, _, readers in s.due(5.0)}
    assert due == {"/c/hook.pt": (ALICE,), "/c/fs.pt": None, "/c/nobody.pt": (),
                   "/c/many.pt": tuple(many[-MAX_SENDERS:])}


def _file(path, mode, uid=0, gid=0, data=b"x"):
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    os.chown(path, uid, gid)
    return path


def _can(path, sender=ALICE) -> bool:
    try:
        os.close(open_as(path, sender))
        return True
    except OSError:
        return False


def test_open_as_follows_the_kernels_rules_for_the_sender(public_dir):
    _file(os.path.join(public_dir, "world"), 0o644)
    _file(os.path.join(public_dir, "root-only"), 0o600)
    _file(os.path.join(public_dir, "group"), 0o640, gid=NOBODY)
    _file(os.path.join(public_dir, "own"), 0o400, uid=NOBODY)
    locked = os.path.join(public_dir, "locked")
    os.mkdir(locked, 0o700)
    _file(os.path.join(locked, "world"), 0o644)
    os.symlink("root-only", os.path.join(public_dir, "to-secret"))
    os.symlink(os.path.join(locked, "world"), os.path.join(public_dir, "into-locked"))
    os.symlink("../" + os.path.basename(public_dir) + "/world", os.path.join(public_dir, "round-trip"))
    os.symlink("loop", os.path.join(public_dir, "loop"))
    os.mkfifo(os.path.join(public_dir, "fifo"), 0o666)
    expect = {"world": True, "root-only": False, "group": True, "own": True,
              "locked/world": False, "to-secret": False, "into-locked": False,
              "round-trip": True, "loop": False, "fifo": False, "missing": False}
    got = {name: _can(os.path.join(public_dir, name)) for name in expect}
    assert got == expect
    assert _can(os.path.join(public_dir, "root-only"), Rights(0, 0, frozenset({0}), read_all=True))
    assert not _can("relative/path")


def test_open_as_refuses_a_file_with_an_acl_it_cannot_evaluate(public_dir):
    path = _file(os.path.join(public_dir, "acl"), 0o644)
    # An ACL whose owning-group entry is --- while the mode's group bits (the mask) say r--.
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in
                                          [(0x01, 6, 0xFFFFFFFF), (0x04, 0, 0xFFFFFFFF),
                                           (0x10, 4, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF)])
    try:
        os.setxattr(path, "system.posix_acl_access", acl)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs here: {exc}")
    assert not _can(path, Rights(NOBODY, 0, frozenset({0})))
    assert _can(path, Rights(0, 0, frozenset({0})))     # the owner's entry is exact
