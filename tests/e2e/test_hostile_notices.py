"""Issue 17 item 1, end to end: a local user cannot make the root agent attack another user's
training process through the warn policy's notices.

Real agent, a real victim (root, torch + the hook under CKPTWATCH_POLICY=warn, connected and
reading notices) and a real attacker (uid 65534) on the agent's socket. The attacker sends a
start for a path of its own, a "remote" report whose writer names the agent's node and the
victim's pid with a hostile call site, and the end. On the old code the agent took the
victim for a writer of the attacker's file (journal), sent it a notice, and the hook handed
the site to warnings.warn_explicit as a file name: "/dev/zero:1" grew the victim by gigabytes,
a FIFO blocked its sender thread for good (its next saves never reached the agent).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from agentproc import start_agent
from helpers import subprocess_env, wait_for
from otheruser import NOBODY, needs_root

pytest.importorskip("torch")

pytestmark = [needs_root, pytest.mark.torch]

NODE = "victim-node"
SAVES_AFTER = 30

_VICTIM = r'''
import json, os, resource, sys, time
# The old code reads /dev/zero into this process: cap it so a failing run fails, not the host.
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import torch, ckptwatch
from ckptwatch import emitter, policy
ckptwatch.install()
path = sys.argv[1]


def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])


torch.save({"x": 1}, path)                    # connects: its hello asks for notices
assert emitter.get_emitter().flush(10)
print(json.dumps({"pid": os.getpid(), "hwm": hwm_kib()}), flush=True)
sys.stdin.readline()                          # the attack is over and judged
time.sleep(1.0)                               # five notice polls of the sender thread
before = hwm_kib()
for _ in range(''' + str(SAVES_AFTER) + r'''):
    torch.save({"x": 2}, path)
flushed = emitter.get_emitter().flush(10)
print(json.dumps({"hwm_before": before, "hwm": hwm_kib(), "flushed": flushed,
                  "notices": emitter.get_emitter().notices, "policy": policy.stats()}),
      flush=True)
'''

_ATTACKER = r'''
import json, os, socket, sys, time
from ckptwatch import events
sock_path, uid, victim, site, path, node = sys.argv[1:7]
os.setgid(int(uid)); os.setgroups([]); os.setuid(int(uid))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sock_path)
me = {"v": 1, "node": "elsewhere", "pid": os.getpid(), "rank": 1, "job": "j", "seq": 1,
      "path": path, "site": "attack.py:1", "func": "f"}
wall, mono = time.time(), time.monotonic()
s.sendall(events.encode({**me, "type": "start", "wall": wall, "mono": mono}))
s.sendall(events.encode({
    "v": 1, "type": "remote", "node": "elsewhere", "pid": os.getpid(), "seq": 1, "path": path,
    "wall": wall, "writer": {"node": node, "pid": int(victim), "rank": 0, "job": "j"},
    "wseq": 1, "start_wall": wall, "end_wall": wall + 0.5, "start_mono": mono,
    "end_mono": mono + 0.5, "outcome": "ok", "site": site, "func": "f"}))
s.sendall(events.encode({**me, "type": "end", "wall": wall + 0.6, "mono": mono + 0.6,
                         "start_wall": wall, "start_mono": mono, "bytes": 1,
                         "outcome": "ok"}))
time.sleep(0.5)
s.close()
'''


@pytest.mark.parametrize("site_kind", ["dev_zero", "fifo"])
def test_a_local_user_cannot_point_the_agent_at_another_process(public_dir, tmp_path,
                                                                site_kind):
    sockdir = os.path.join(public_dir, "sock")
    os.mkdir(sockdir, 0o755)
    fifo = os.path.join(public_dir, "trap.py")
    os.mkfifo(fifo, 0o666)
    site = "/dev/zero:1" if site_kind == "dev_zero" else f"{fifo}:1"
    victim_path = str(tmp_path / "victim.pt")
    attacked_path = os.path.join(public_dir, "attacker.pt")
    with start_agent(str(tmp_path), "--node.name", NODE, "--collision.settle", "0.3",
                     "--collision.job-settle", "0.3", "--ingest.socket-mode", "0666",
                     "--verify.enabled", "false",
                     socket=os.path.join(sockdir, "agent.sock")) as agent:
        env = subprocess_env(CKPTWATCH_POLICY="warn", CKPTWATCH_SOCKET=agent.socket,
                             CKPTWATCH_NODE=NODE, OMP_NUM_THREADS="1")
        victim = subprocess.Popen([sys.executable, "-c", _VICTIM, victim_path], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            ready = json.loads(victim.stdout.readline())
            subprocess.run([sys.executable, "-c", _ATTACKER, agent.socket, str(NOBODY),
                            str(ready["pid"]), site, attacked_path, NODE],
                           env=subprocess_env(), check=True, timeout=60)
            agent.wait_judged()
            victim.stdin.write("go\n")
            victim.stdin.flush()
            line = victim.stdout.readline()
            report = json.loads(line) if line else None
        finally:
            # Release an open() of the FIFO the old code blocked in, then end the victim.
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            try:
                victim.stdin.close()
            except OSError:
                pass
            try:
                victim.wait(30)
            except subprocess.TimeoutExpired:
                victim.kill()
                victim.wait()
            stderr = victim.stderr.read()
        wait_for(lambda: sum(1 for r in agent.journal_records() if r.get("type") == "write"
                             and r.get("pid") == ready["pid"]) >= 1 + SAVES_AFTER,
                 timeout=20, message=lambda: f"the victim's saves in the journal; victim "
                                             f"report {report}, stderr:\n{stderr[-2000:]}")
        agent.wait_judged()
        records = agent.journal_records()
        rejected = agent.metric("ckptwatch_remote_writes_rejected_total", reason="local_writer")
    assert report is not None, f"the victim did not report (stderr:\n{stderr[-2000:]})"
    # Nothing reached the victim: no notice, no warning, no growth, every save reported.
    assert report["notices"]["read"] == 0, report
    assert report["policy"]["warned"] == 0 and "CheckpointCollisionWarning" not in stderr
    assert report["hwm"] - ready["hwm"] < 64 << 10, (ready, report)       # KiB
    assert report["flushed"], report
    # The journal never names the victim as a writer of the attacker's file.
    for r in records:
        if r.get("path") == attacked_path:
            assert ready["pid"] not in [w.get("pid") for w in r.get("writers", [r])], r
    assert not [r for r in records if r.get("type") == "collision"], records
    assert rejected == 1
