"""Who may talk to the agent and what it reads for them (issue 8 defects 2 and 3, issue 11.4).

Real sockets, real files, real processes. The tests run as root and play the other local user
as uid 65534 (nobody): files are chowned to it, or a child process drops to it with setuid.
"""
import ctypes
import os
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from agentproc import launch_agent, start_agent
from helpers import REPO_ROOT, short_tmpdir, remove_tree, subprocess_env, wait_for
from receiver import Receiver
from ckptwatch import events
from exporters.journal import Journal
from monitor.ingest.server import IngestError, IngestServer

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays two users: needs root")


def _server(path, **kw):
    return IngestServer(path, lambda e: None, lambda r: None, **kw)


def _refused(path, **kw) -> str:
    srv = _server(path, **kw)
    with pytest.raises(IngestError) as info:
        srv.start()
    srv.stop()
    return str(info.value)


@pytest.fixture
def base():
    path = short_tmpdir("cwt")
    os.chmod(path, 0o755)
    yield path
    remove_tree(path)


# --- the agent's socket directory -----------------------------------------------------------

def test_agent_refuses_directory_owned_by_another_user(base):
    squat = os.path.join(base, "ckptwatch-0")
    os.mkdir(squat, 0o700)
    os.chown(squat, NOBODY, NOBODY)
    message = _refused(os.path.join(squat, "agent.sock"))
    assert "owned by uid 65534" in message
    assert os.listdir(squat) == []


@pytest.mark.e2e
def test_real_agent_exits_1_with_a_clear_message_on_a_squatted_directory(base, tmp_path):
    squat = os.path.join(base, "squat")
    os.mkdir(squat, 0o755)
    os.chown(squat, NOBODY, NOBODY)
    agent = launch_agent(str(tmp_path), socket=os.path.join(squat, "agent.sock"))
    try:
        assert agent.proc.wait(30) == 1
        assert "owned by uid 65534" in agent.log
    finally:
        agent.close()


def test_agent_refuses_a_symlinked_directory(base):
    real = os.path.join(base, "real")
    os.mkdir(real, 0o700)                       # ours, safe: only the link is wrong
    link = os.path.join(base, "link")
    os.symlink(real, link)
    assert "symbolic link" in _refused(os.path.join(link, "agent.sock"))
    assert os.listdir(real) == []


@pytest.mark.parametrize("mode", [0o777, 0o757, 0o1777, 0o770, 0o2770])
def test_agent_refuses_a_directory_others_can_write(base, mode):
    d = os.path.join(base, "open")
    os.mkdir(d)
    os.chmod(d, mode)
    assert "writable by" in _refused(os.path.join(d, "agent.sock"))


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o2750, 0o1770, 0o3770])
def test_agent_accepts_a_directory_only_it_can_change(base, mode):
    d = os.path.join(base, "ok")
    os.mkdir(d)
    os.chmod(d, mode)
    srv = _server(os.path.join(d, "agent.sock"))
    srv.start()
    try:
        assert srv.socket_intact()
    finally:
        srv.stop()


def test_agent_refuses_an_existing_socket_of_another_user(base):
    d = os.path.join(base, "d")
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


def test_agent_creates_its_directory_0700_or_0750_with_a_group(base):
    srv = _server(os.path.join(base, "new", "agent.sock"))
    srv.start()
    srv.stop()
    st = os.lstat(os.path.join(base, "new"))
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0
    srv = _server(os.path.join(base, "grp", "agent.sock"), socket_group=NOBODY)
    srv.start()
    srv.stop()
    st = os.lstat(os.path.join(base, "grp"))
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == NOBODY


@pytest.mark.e2e
def test_healthz_fails_when_the_socket_is_replaced(tmp_path):
    with start_agent(str(tmp_path)) as agent:
        assert agent.get("/healthz")[0] == 200
        os.unlink(agent.socket)
        thief = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        thief.bind(agent.socket)
        thief.listen(1)
        try:
            wait_for(lambda: agent.get("/healthz")[0] == 503, timeout=10,
                     message="/healthz to fail after the socket was replaced")
            assert "socket" in agent.get("/healthz")[1]
        finally:
            thief.close()


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
def runtime(base):
    """$XDG_RUNTIME_DIR with a listening ckptwatch/agent.sock; a system dir with none yet."""
    xdg = os.path.join(base, "xdg")
    os.makedirs(os.path.join(xdg, "ckptwatch"), 0o755)
    os.chmod(xdg, 0o755)
    rx = Receiver(os.path.join(xdg, "ckptwatch", "agent.sock")).start()
    yield {"XDG_RUNTIME_DIR": xdg}, rx, os.path.join(base, "system")
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


def test_hook_refuses_a_peer_of_another_user_behind_a_root_owned_file(base):
    """The file looks right (root's, in root's directory) but a nobody process listens on it."""
    d = os.path.join(base, "xdg", "ckptwatch")
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
        assert _hook({"XDG_RUNTIME_DIR": os.path.join(base, "xdg")},
                     os.path.join(base, "none")) == "unsent"
    finally:
        listener.kill()
        out = listener.communicate()[0]
    assert "got" not in out or "got 0" in out


def test_hook_as_a_user_accepts_the_root_agents_socket(runtime):
    env, rx, system = runtime
    os.chmod(rx.path, 0o666)
    assert _hook(env, system, as_user=NOBODY) == "sent"
    rx.wait_count("start", 1)


def test_hook_tries_the_system_socket_first(runtime, base):
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


def test_explicit_socket_wins_over_the_system_socket(runtime, base):
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


_SENDER = r'''
import os, socket, sys, time
from ckptwatch import events
sock_path, uid = sys.argv[1], int(sys.argv[2])
os.setgid(uid); os.setgroups([]); os.setuid(uid)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sock_path)
for seq, path in enumerate(sys.argv[3:], 1):
    now = time.time(), time.monotonic()
    base = {"v": 1, "node": "n", "pid": os.getpid(), "rank": 0, "seq": seq, "path": path,
            "site": "t.py:1", "func": "f"}
    s.sendall(events.encode({**base, "type": "start", "wall": now[0], "mono": now[1]}))
    s.sendall(events.encode({**base, "type": "end", "wall": now[0] + 0.01,
                             "mono": now[1] + 0.01, "start_wall": now[0],
                             "start_mono": now[1], "bytes": 100, "outcome": "ok"}))
s.close()
'''

SECRET = b"root:$6$SECRETSECRETSECRET:19000:0:99999:7:::\n"


@pytest.mark.e2e
def test_agent_never_reads_a_file_the_sender_could_not(base, tmp_path):
    secret = os.path.join(base, "shadow")
    with open(secret, "wb") as f:
        f.write(SECRET)
    os.chmod(secret, 0o600)
    hidden_dir = os.path.join(base, "private")
    os.mkdir(hidden_dir, 0o700)
    hidden = os.path.join(hidden_dir, "public.pt")       # 0644, but in a 0700 directory
    with open(hidden, "wb") as f:
        f.write(SECRET)
    os.chmod(hidden, 0o644)
    mine = os.path.join(base, "nobody")
    os.mkdir(mine, 0o755)
    os.chown(mine, NOBODY, NOBODY)
    readable = os.path.join(mine, "ckpt.pt")             # the sender's own: verified
    with open(readable, "wb") as f:
        f.write(SECRET)
    os.chown(readable, NOBODY, NOBODY)
    sockdir = os.path.join(base, "sock")
    os.mkdir(sockdir, 0o755)
    watches = [OpenWatch(secret), OpenWatch(hidden)]
    with start_agent(str(tmp_path), "--verify.quiet", "0.2", "--ingest.socket-mode", "0666",
                     socket=os.path.join(sockdir, "agent.sock")) as agent:
        subprocess.run([sys.executable, "-c", _SENDER, agent.socket, str(NOBODY), secret,
                        hidden, readable], env=subprocess_env(), check=True, timeout=60)
        wait_for(lambda: any(r.get("type") == "verification" and r["path"] == readable
                             for r in agent.journal_records()), timeout=20,
                 message=f"the sender's own file verified; log:\n{agent.log}")
        time.sleep(1.0)
        records = agent.journal_records()
        journal_bytes = open(agent.journal, "rb").read()
        log_text = agent.log
    opened = [w.opened() for w in watches]
    for w in watches:
        w.close()
    assert opened == [False, False], "the agent opened a file the sender could not read"
    assert {r["path"] for r in records if r.get("type") == "verification"} == {readable}
    for blob in (journal_bytes, log_text.encode()):
        assert b"SECRET" not in blob
        assert SECRET[:8].hex(" ").encode() not in blob and SECRET[:4].hex().encode() not in blob
    assert stat.S_IMODE(os.stat(agent.journal).st_mode) & 0o137 == 0


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


def test_open_as_follows_the_kernels_rules_for_the_sender(base):
    _file(os.path.join(base, "world"), 0o644)
    _file(os.path.join(base, "root-only"), 0o600)
    _file(os.path.join(base, "group"), 0o640, gid=NOBODY)
    _file(os.path.join(base, "own"), 0o400, uid=NOBODY)
    locked = os.path.join(base, "locked")
    os.mkdir(locked, 0o700)
    _file(os.path.join(locked, "world"), 0o644)
    os.symlink("root-only", os.path.join(base, "to-secret"))
    os.symlink(os.path.join(locked, "world"), os.path.join(base, "into-locked"))
    os.symlink("../" + os.path.basename(base) + "/world", os.path.join(base, "round-trip"))
    os.symlink("loop", os.path.join(base, "loop"))
    os.mkfifo(os.path.join(base, "fifo"), 0o666)
    expect = {"world": True, "root-only": False, "group": True, "own": True,
              "locked/world": False, "to-secret": False, "into-locked": False,
              "round-trip": True, "loop": False, "fifo": False, "missing": False}
    got = {name: _can(os.path.join(base, name)) for name in expect}
    assert got == expect
    assert _can(os.path.join(base, "root-only"), Rights(0, 0, frozenset({0}), read_all=True))
    assert not _can("relative/path")


def test_open_as_refuses_a_file_with_an_acl_it_cannot_evaluate(base):
    path = _file(os.path.join(base, "acl"), 0o644)
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
