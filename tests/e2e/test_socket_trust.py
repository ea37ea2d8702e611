"""Who may talk to the real agent process and what it reads for them (issue 8 defects 2 and
3): a squatted socket directory, a replaced socket, files the sender could not read (the rules
themselves, in this process: tests/unit/test_socket_trust.py). Runs as root and plays uid
65534 (nobody)."""
import os
import socket
import stat
import subprocess
import sys
import time

from agentproc import launch_agent, start_agent
from helpers import subprocess_env, wait_for
from openwatch import OpenWatch
from otheruser import NOBODY, needs_root

pytestmark = needs_root


def test_real_agent_exits_1_with_a_clear_message_on_a_squatted_directory(public_dir, tmp_path):
    squat = os.path.join(public_dir, "squat")
    os.mkdir(squat, 0o755)
    os.chown(squat, NOBODY, NOBODY)
    agent = launch_agent(str(tmp_path), socket=os.path.join(squat, "agent.sock"))
    try:
        assert agent.proc.wait(30) == 1
        assert "owned by uid 65534" in agent.log
    finally:
        agent.close()


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


def test_agent_never_reads_a_file_the_sender_could_not(public_dir, tmp_path):
    secret = os.path.join(public_dir, "shadow")
    with open(secret, "wb") as f:
        f.write(SECRET)
    os.chmod(secret, 0o600)
    hidden_dir = os.path.join(public_dir, "private")
    os.mkdir(hidden_dir, 0o700)
    hidden = os.path.join(hidden_dir, "public.pt")       # 0644, but in a 0700 directory
    with open(hidden, "wb") as f:
        f.write(SECRET)
    os.chmod(hidden, 0o644)
    mine = os.path.join(public_dir, "nobody")
    os.mkdir(mine, 0o755)
    os.chown(mine, NOBODY, NOBODY)
    readable = os.path.join(mine, "ckpt.pt")             # the sender's own: verified
    with open(readable, "wb") as f:
        f.write(SECRET)
    os.chown(readable, NOBODY, NOBODY)
    sockdir = os.path.join(public_dir, "sock")
    os.mkdir(sockdir, 0o755)
    watches = [OpenWatch(secret), OpenWatch(hidden)]
    with start_agent(str(tmp_path), "--verify.quiet", "0.2", "--ingest.socket-mode", "0666",
                     socket=os.path.join(sockdir, "agent.sock")) as agent:
        subprocess.run([sys.executable, "-c", _SENDER, agent.socket, str(NOBODY), secret,
                        hidden, readable], env=subprocess_env(), check=True, timeout=60)
        wait_for(lambda: any(r.get("type") == "verification" and r["path"] == readable
                             for r in agent.journal_records()), timeout=20,
                 message=f"the sender's own file verified; log:\n{agent.log}")
        # The other two were reported first: an agent that was going to open them would
        # have within the second that follows (their verification was due with this one).
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
