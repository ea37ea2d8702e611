"""The real agent process end to end: events in over the socket, collisions out in the journal,
/metrics and the log; bad input; signals; socket ownership; startup failures."""
import os
import random
import signal
import socket
import subprocess
import sys

import pytest

from agentproc import FAST, EventSender, launch_agent, overlapping_writes, start_agent
from helpers import wait_for
from ckptwatch import events


def test_collision_in_journal_metrics_and_log(workdir):
    with start_agent(workdir, *FAST) as agent:
        assert agent.get("/healthz")[0] == 200
        pid_a, pid_b = overlapping_writes(agent, "/ckpt/run1/last.pt")
        record = agent.wait_for_collision()
        assert record["kind"] == "concurrent" and record["scope"] == "node"
        assert record["path"] == "/ckpt/run1/last.pt"
        assert sorted(w["rank"] for w in record["writers"]) == [0, 1]
        assert {w["pid"] for w in record["writers"]} == {pid_a, pid_b}
        assert record["first"]["rank"] == 0 and record["last"]["rank"] == 1
        assert {w["site"] for w in record["writers"]} == {"train.py:10", "train.py:11"}
        wait_for(lambda: agent.metric("ckptwatch_collisions_total", kind="concurrent",
                                      scope="node") == 1)
        assert agent.metric("ckptwatch_events_received_total") == 4
        writes = [r for r in agent.journal_records() if r.get("type") == "write"]
        assert len(writes) == 2
        warning = [line for line in agent.log.splitlines() if "level=warning" in line]
        assert any(' msg="concurrent write collision" kind=concurrent '
                   'path=/ckpt/run1/last.pt ' in line for line in warning), agent.log
        assert "level=info" in agent.log and agent.socket in agent.log


def frame(payload: bytes) -> bytes:
    return events.HEADER.pack(len(payload)) + payload


def base_event(pid: int) -> dict:
    return {"v": 1, "type": "start", "node": "test-node", "pid": pid, "seq": 1,
            "path": "/ckpt/x.pt", "wall": 1.0, "mono": 1.0}


def test_bad_input_counted_and_collisions_still_detected(workdir):
    rng = random.Random(7)
    with start_agent(workdir, *FAST) as agent:
        def send(data: bytes) -> None:
            # Every bad client is its own process, as a broken or hostile sender would be.
            with EventSender(agent.socket, "/unused") as s:
                s.raw(data(s.pid) if callable(data) else data)

        send(bytes([0]) + bytes(rng.randrange(256) for _ in range(2000)))   # random garbage
        send(frame(b"{not json"))                                           # malformed
        send(events.encode(base_event(1))[:-3])                             # truncated
        send(events.HEADER.pack(events.MAX_FRAME_BYTES + 1) + b"x" * 64)   # oversized
        send(lambda pid: events.encode({**base_event(pid), "v": 2}))        # wrong version
        send(lambda pid: events.encode({k: v for k, v in base_event(pid).items()
                                        if k != "path"}))                  # incomplete
        send(events.encode(base_event(os.getpid())))                       # pid spoofing
        expected = {"oversized": 1, "unknown_version": 1, "incomplete": 1, "pid_mismatch": 1}

        def counted():
            got = {r: agent.metric("ckptwatch_events_rejected_total", reason=r) for r in
                   ("malformed", "truncated", "oversized", "unknown_version", "incomplete",
                    "pid_mismatch")}
            ok = all(got[r] >= n for r, n in expected.items()) and got["malformed"] >= 1 \
                and got["truncated"] >= 1 and sum(got.values()) >= 7
            return got if ok else None

        got = wait_for(counted, message="every rejection counted")
        # The random garbage lands as one of malformed / truncated / oversized.
        assert sum(got.values()) == 7, got
        assert agent.metric("ckptwatch_events_received_total") == 0
        assert agent.alive()

        overlapping_writes(agent, "/ckpt/after-bad-input.pt")
        record = agent.wait_for_collision()
        assert record["path"] == "/ckpt/after-bad-input.pt"
        assert agent.metric("ckptwatch_collisions_total", kind="concurrent") == 1


def test_sigterm_stops_cleanly_and_flushes_pending_collision(workdir):
    # settle of 60 s: the collision can only reach the journal through the shutdown flush.
    agent = start_agent(workdir, "--collision.settle", "60")
    try:
        overlapping_writes(agent, "/ckpt/flush.pt")
        assert agent.collisions() == []
        assert agent.stop(signal.SIGTERM) == 0
        assert not os.path.exists(agent.socket)
        collisions = agent.collisions()
        assert len(collisions) == 1 and collisions[0]["path"] == "/ckpt/flush.pt"
        assert "Traceback" not in agent.log
    finally:
        agent.close()


def test_sigint_also_stops_cleanly(workdir):
    with start_agent(workdir) as agent:
        assert agent.stop(signal.SIGINT) == 0
        assert not os.path.exists(agent.socket)


def test_second_agent_on_live_socket_exits_1(workdir):
    with start_agent(workdir) as first:
        second = launch_agent(workdir, socket=first.socket, log_name="second.log")
        try:
            second.proc.wait(30)
            assert second.proc.returncode == 1
            assert "already listening on " + first.socket in second.log
        finally:
            second.close()
        # The first agent keeps its socket and keeps working.
        assert os.path.exists(first.socket) and first.get("/healthz")[0] == 200
        with EventSender(first.socket, "/ckpt/a.pt") as s:
            s.start()
            wait_for(lambda: first.metric("ckptwatch_events_received_total") == 1)


def test_stale_socket_of_killed_agent_is_replaced(workdir):
    killed = start_agent(workdir)
    try:
        assert killed.stop(signal.SIGKILL) == -signal.SIGKILL
        assert os.path.exists(killed.socket)     # left behind, nobody listening
        with start_agent(workdir, socket=killed.socket) as agent:
            with EventSender(agent.socket, "/ckpt/b.pt") as s:
                s.start()
                wait_for(lambda: agent.metric("ckptwatch_events_received_total") == 1)
            assert "stale" in agent.log
    finally:
        killed.close()


def test_port_in_use_exits_1(workdir):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        agent = launch_agent(workdir, port=busy.getsockname()[1])
        try:
            agent.proc.wait(30)
            assert agent.proc.returncode == 1
            assert "cannot serve metrics on 127.0.0.1:" in agent.log
            assert not os.path.exists(agent.socket)
        finally:
            agent.close()


def test_unusable_journal_path_exits_1(workdir):
    blocker = os.path.join(workdir, "not-a-dir")
    with open(blocker, "w") as fh:
        fh.write("x")
    agent = launch_agent(workdir, "--journal.path", os.path.join(blocker, "journal.jsonl"))
    try:
        agent.proc.wait(30)
        assert agent.proc.returncode == 1
        assert "cannot open journal " + os.path.join(blocker, "journal.jsonl") in agent.log
        assert not os.path.exists(agent.socket)
    finally:
        agent.close()


TRAINER = r"""
import os, sys
import torch
import ckptwatch
ckptwatch.install()
out = sys.argv[1]
for line in sys.stdin:                      # one save per line from the test
    torch.save({"step": int(line)}, os.path.join(out, f"step{int(line)}.pt"))
    print("saved", flush=True)
"""


@pytest.mark.torch
def test_instrumented_process_keeps_reporting_across_an_agent_restart(workdir, sockdir):
    """The real hook in a real Python process, the real agent stopped and started again on the
    same socket: the process never notices, and the new agent gets its later saves."""
    from helpers import subprocess_env
    sock = os.path.join(sockdir, "agent.sock")
    env = subprocess_env(CKPTWATCH_SOCKET=sock, CKPTWATCH_JOB="restart", RANK="0")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, workdir], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        def save(step):
            trainer.stdin.write(f"{step}\n")
            trainer.stdin.flush()
            assert trainer.stdout.readline() == "saved\n"

        first_dir, second_dir = os.path.join(workdir, "a1"), os.path.join(workdir, "a2")
        os.makedirs(first_dir), os.makedirs(second_dir)
        with start_agent(first_dir, *FAST, socket=sock) as agent:
            save(1)
            wait_for(lambda: agent.metric("ckptwatch_writes_total", training_job="restart",
                                          rank="0"),
                     message="first agent saw step 1")
            assert agent.stop() == 0
        save(2)                                      # no agent at all: the save still works
        with start_agent(second_dir, *FAST, socket=sock) as agent:
            save(3)
            wait_for(lambda: {r["path"] for r in agent.journal_records()
                              if r.get("type") == "write"} >= {os.path.join(workdir, "step3.pt")},
                     timeout=15, message="second agent saw step 3")
    finally:
        trainer.stdin.close()
        assert trainer.wait(timeout=30) == 0
    assert all(os.path.exists(os.path.join(workdir, f"step{i}.pt")) for i in (1, 2, 3))


TEARING_TRAINER = r"""
import os, sys
import torch
import ckptwatch
ckptwatch.install()
out = sys.argv[1]
torch.save({"w": torch.arange(100_000)}, os.path.join(out, "good.pt"))
bad = os.path.join(out, "torn.pt")
torch.save({"w": torch.arange(100_000)}, bad)
# An uninstrumented writer (another job, a copy tool) cuts the file right after the save.
with open(bad, "r+b") as f:
    f.truncate(os.path.getsize(bad) // 2)
"""


@pytest.mark.torch
def test_agent_verifies_finished_checkpoints_and_flags_a_torn_one(workdir, sockdir):
    from helpers import subprocess_env
    with start_agent(workdir, *FAST, "--verify.quiet", "0.5") as agent:
        out = os.path.join(workdir, "ckpt")
        os.makedirs(out)
        env = subprocess_env(CKPTWATCH_SOCKET=agent.socket, CKPTWATCH_JOB="verify", RANK="0")
        subprocess.run([sys.executable, "-c", TEARING_TRAINER, out], env=env, check=True,
                       timeout=120)
        corrupt = wait_for(lambda: [r for r in agent.journal_records()
                                    if r.get("type") == "verification"], timeout=20,
                           message="a verification record")
        assert [(r["path"], r["result"], r["cause"]) for r in corrupt] == [
            (os.path.join(out, "torn.pt"), "corrupt", "truncated")]
        assert agent.metric("ckptwatch_checkpoint_verifications_total", result="ok") == 1
        assert agent.metric("ckptwatch_checkpoint_verifications_total", result="corrupt") == 1
        assert agent.metric("ckptwatch_corrupt_checkpoints_total", reason="truncated") == 1
        assert agent.metric("ckptwatch_corrupt_checkpoints_total", reason="torn") == 0
    assert f'msg="corrupt checkpoint" path={os.path.join(out, "torn.pt")} ' in agent.log


def test_different_processes_leaving_different_sizes_is_a_size_fluctuation(workdir):
    path = "/ckpt/sizes/last.pt"
    with start_agent(workdir, *FAST) as agent:
        with EventSender(agent.socket, path, rank=0, job="sizes") as a, \
                EventSender(agent.socket, path, rank=1, job="sizes") as b:
            a.start()
            a.end(1_000_000)
            b.start()
            b.end(700_000)          # one after the other: no overlap, but not the same file
            wait_for(lambda: agent.metric("ckptwatch_size_fluctuations_total",
                                          training_job="sizes"),
                     message="size fluctuation")
        (f,) = wait_for(lambda: [r for r in agent.journal_records()
                                 if r.get("type") == "size_fluctuation"],
                        message="size fluctuation journal record")
        assert (f["path"], f["size_before"], f["size_after"]) == (path, 1_000_000, 700_000)
        assert [w["rank"] for w in f["writers"]] == [0, 1]
    assert 'msg="size fluctuation" path=/ckpt/sizes/last.pt ' in agent.log


def test_wait_judged_returns_only_after_a_pending_collision_is_journaled(workdir):
    """The absence tests rest on AgentProcess.wait_judged(): it must not return while a
    finding about earlier events is still pending (here: a collision in its 4 s settle)."""
    with start_agent(workdir, "--collision.settle", "4") as agent:
        path = os.path.join(workdir, "model.pt")
        overlapping_writes(agent, path)
        assert agent.collisions() == []          # still settling
        agent.wait_judged()
        assert [c["path"] for c in agent.collisions()] == [path]


def test_node_is_the_agents_own_not_the_senders_claim(workdir):
    """One process naming two nodes is still one writer: no collision with itself, and its
    writes are journaled under the agent's --node.name (issue 8 item 7a)."""
    with start_agent(workdir, *FAST, "--node.name", "agent-node") as agent:
        code = r'''
import os, socket, sys, time
from ckptwatch import events
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
def ev(kind, node, seq, t0):
    e = {"v": 1, "type": kind, "node": node, "pid": os.getpid(), "seq": seq,
         "path": "/ckpt/forged.pt", "wall": time.time(), "mono": time.monotonic(),
         "job": "forge", "rank": 0}
    if kind == "end":
        e.update(start_wall=t0[0], start_mono=t0[1], bytes=10, outcome="ok")
    return events.encode(e)
t0 = (time.time(), time.monotonic())
s.sendall(ev("start", "node-a", 1, t0) + ev("start", "node-b", 1, t0)
          + ev("end", "node-a", 1, t0) + ev("end", "node-b", 1, t0))
sys.stdin.read()      # stay alive until the agent has everything
'''
        from helpers import subprocess_env
        proc = subprocess.Popen([sys.executable, "-c", code, agent.socket],
                                stdin=subprocess.PIPE, env=subprocess_env())
        try:
            wait_for(lambda: (agent.metric("ckptwatch_events_received_total") or 0) >= 4,
                     message="4 events received")
            agent.wait_judged()
        finally:
            proc.stdin.close()
            proc.wait(10)
        assert agent.collisions() == []
        writes = [r for r in agent.journal_records() if r["type"] == "write"]
        # (The second end of the same (pid, seq) stands alone: still the same one writer.)
        assert writes and {(w["node"], w["pid"]) for w in writes} == {("agent-node",
                                                                         proc.pid)}


def test_a_flood_of_open_starts_does_not_delay_a_real_collision(workdir):
    """20,000 starts that never end, on one path, from one live process; then two other
    processes collide on that path: journaled within 5 s (issue 8 item 5)."""
    import time

    path = "/ckpt/flooded.pt"
    with start_agent(workdir) as agent, EventSender(agent.socket, path, job="flood") as flood:
        # One raw write of 20,000 start frames (a real process, its own pid).
        code = r'''
import os, socket, sys, time
from ckptwatch import events
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
frames = [events.encode({"v": 1, "type": "start", "node": "n", "pid": os.getpid(), "seq": i,
                         "path": sys.argv[2], "wall": time.time(), "mono": time.monotonic(),
                         "job": "flood"}) for i in range(20000)]
s.sendall(b"".join(frames))
print("sent", flush=True)
sys.stdin.read()
'''
        from helpers import subprocess_env
        flooder = subprocess.Popen([sys.executable, "-c", code, agent.socket, path],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env=subprocess_env())
        try:
            assert flooder.stdout.readline().strip() == "sent"
            flood.start()       # and one more open write, from yet another live process
            began = time.monotonic()
            overlapping_writes(agent, path, job="flood")
            collision = agent.wait_for_collision(timeout=5.0)
            took = time.monotonic() - began
            assert took < 5.0
            assert {w["pid"] for w in collision["writers"] if w["outcome"] == "ok"} and \
                len({w["pid"] for w in collision["writers"]}) >= 3
            refused = agent.metric("ckptwatch_detector_starts_refused_total",
                                   reason="writer_open_limit")
            assert refused and refused > 19_000
        finally:
            flooder.stdin.close()
            flooder.wait(10)


def test_a_hazard_is_noticed_to_the_hook_that_asked(workdir):
    """warn policy + job scope: a hazard event from a hook that asked for notices comes back
    to it as a notice of kind "hazard" (the agent publishes hazards like every finding)."""
    code = r'''
import json, os, socket, sys, time
from ckptwatch import events
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
base = {"v": 1, "node": "n", "pid": os.getpid(), "path": "/shared/ckpt/last.pt",
        "rank": 2, "local_rank": 0, "world_size": 4, "job": "hz", "master": "10.0.0.1:29500",
        "restart": 0, "site": "train.py:7", "func": "save"}
s.sendall(events.encode({**base, "type": "start", "seq": 1, "wall": time.time(),
                         "mono": time.monotonic(), "notices": True}))
s.sendall(events.encode({**base, "type": "hazard", "seq": 1, "kind": "local_rank_guard",
                         "shared": "CKPTWATCH_SHARED_PATHS", "ranks": [2], "nodes": ["n"],
                         "wall": time.time()}))
reader = events.FrameReader(events.MAX_NOTICE_BYTES)
s.settimeout(20)
frames = []
while not frames:
    data = s.recv(65536)
    if not data:
        break
    frames += reader.feed(data)
print(json.dumps([events.decode_notice(f) for f in frames]))
'''
    from helpers import subprocess_env
    with start_agent(workdir, *FAST) as agent:
        out = subprocess.run([sys.executable, "-c", code, agent.socket], env=subprocess_env(),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        import json
        (notice,) = json.loads(out.stdout)
        assert notice["kind"] == "hazard" and notice["path"] == "/shared/ckpt/last.pt"
        assert notice["site"] == "train.py:7"
