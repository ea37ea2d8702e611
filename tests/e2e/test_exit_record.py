"""Issue 16 item 2: a save is on record before its first byte, and its end as soon as it ends,
however the writer leaves -- os._exit (multiprocessing's children), SIGTERM's default action,
SIGKILL, a segfault, a normal exit -- so the agent's journal holds every write and the
collision between them.

Real processes: one driver script imports torch, installs the hook and starts the writers
(multiprocessing children, fork or spawn); a real agent (tests/support/agentproc.py) receives.
The writers' saves truly overlap: each one's state dict holds a Together, which the pickler
reaches inside torch.save (after the hook's start, before the file's first byte) and which
waits there until every writer of the round has reached it. So the truth is an overlap by
construction, not by timing luck, and the journal must say so every round.
"""
import json
import os
import subprocess
import sys

import pytest

from agentproc import start_agent
from helpers import subprocess_env, wait_for

pytestmark = pytest.mark.torch

AGENT = ("--collision.settle", "0.2", "--verify.enabled=false")
JOB = "exit-record"

DRIVER = r'''
import ctypes, json, multiprocessing, os, signal, sys, time
import torch
import ckptwatch
ckptwatch.install()          # module level: a spawned child installs it again when it imports us


def wait_until(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.001)


class Together:
    """Reached by the pickler inside torch.save: marks this writer as inside its save, then
    waits until `count` writers are."""
    def __init__(self, folder, name, count):
        self.folder, self.name, self.count = folder, name, count

    def __reduce__(self):
        open(os.path.join(self.folder, self.name), "w").close()
        wait_until(lambda: len(os.listdir(self.folder)) >= self.count, "the other writers")
        return (int, ())


def leave(how):
    if how == "return":          # multiprocessing: os._exit under fork, sys.exit under spawn
        return
    if how == "sigterm":         # the default action: no handler, no atexit, no finally
        os.kill(os.getpid(), signal.SIGTERM)
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segv":
        ctypes.string_at(0)
    time.sleep(30)
    raise SystemExit("still alive")


def writer(path, folder, name, count, how):
    torch.save({"w": torch.zeros(1024), "sync": Together(folder, name, count)}, path)
    leave(how)


def victim(path):
    """Saves 64 MiB to `path`: killed by the driver half-way through."""
    torch.save({"w": torch.zeros(16 * 1024 * 1024)}, path)
    time.sleep(30)


class Hold:
    """Inside its save, waits for `release` to exist."""
    def __init__(self, marks):
        self.marks = marks

    def __reduce__(self):
        open(os.path.join(self.marks, "holder-inside"), "w").close()
        wait_until(lambda: os.path.exists(os.path.join(self.marks, "release")), "the release")
        return (int, ())


def holder(path, marks):
    torch.save({"w": torch.zeros(1024), "hold": Hold(marks)}, path)


def read_some(fd, count):
    got = 0
    while got < count:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        got += len(chunk)
    return got


def killed_mid_write(ctx, path, marks):
    """A holder is inside its save of `path`; the victim starts a 64 MiB save of it and is
    SIGKILLed (torchrun tearing down a failed job) once 1 MiB of its bytes is out; then the
    holder finishes. `path` is a FIFO that we read, so "half-way" is ours to choose."""
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)    # a reader, so the writers' opens return
    hold = start(ctx, holder, path, marks)
    wait_until(lambda: os.path.exists(os.path.join(marks, "holder-inside")), "the holder")
    os.set_blocking(fd, True)
    doomed = start(ctx, victim, path)
    mid_write = read_some(fd, 1 << 20) >= 1 << 20 and doomed.exitcode is None
    doomed.kill()
    doomed.join(60)
    open(os.path.join(marks, "release"), "w").close()
    read_some(fd, 1 << 40)           # to the end: the holder's bytes, then every writer gone
    hold.join(60)
    os.close(fd)
    return {"path": path, "victim": doomed.pid, "holder": hold.pid, "mid_write": mid_write,
            "exitcodes": [doomed.exitcode, hold.exitcode]}


def start(ctx, target, *args):
    proc = ctx.Process(target=target, args=args)
    proc.start()
    return proc


def main():
    out, scenario, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    report = []
    for n in range(rounds):
        folder = os.path.join(out, f"round{n}")
        marks = os.path.join(folder, "marks")
        os.makedirs(marks)
        path = os.path.join(folder, "ckpt.pt")
        if scenario == "killed-mid-write":
            report.append(killed_mid_write(multiprocessing.get_context("fork"), path, marks))
            continue
        method, how = scenario.split("-")
        ctx = multiprocessing.get_context(method)
        procs = [start(ctx, writer, path, marks, f"w{i}", 2, how) for i in range(2)]
        for proc in procs:
            proc.join(60)
        report.append({"path": path, "pids": [p.pid for p in procs],
                       "exitcodes": [p.exitcode for p in procs]})
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
'''

EXIT_CODES = {"return": 0, "sigterm": -15, "sigkill": -9, "segv": -11}


def run_driver(tmp_path, agent, scenario: str, rounds: int) -> list[dict]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, str(script), str(out), scenario, str(rounds)],
                          env=subprocess_env(CKPTWATCH_SOCKET=agent.socket, CKPTWATCH_JOB=JOB),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def records_of(agent, path: str, kind: str) -> list[dict]:
    return [r for r in agent.journal_records() if r.get("type") == kind and r.get("path") == path]


def assert_both_on_record(agent, path: str, pids: list[int], outcome: dict) -> None:
    """Both writes journaled with their outcome, and one concurrent collision naming both."""
    def journaled():
        writes = records_of(agent, path, "write")
        collisions = records_of(agent, path, "collision")
        return len(writes) >= 2 and collisions and (writes, collisions)

    writes, collisions = wait_for(journaled, timeout=30, message=lambda: (
        f"both writes of {path} and their collision in the journal: "
        f"{records_of(agent, path, 'write')} {records_of(agent, path, 'collision')}"
        f"\nagent log:\n{agent.log}"))
    assert sorted((w["pid"], w["outcome"]) for w in writes) == sorted(outcome.items())
    assert len(collisions) == 1 and collisions[0]["kind"] == "concurrent"
    assert sorted(w["pid"] for w in collisions[0]["writers"]) == sorted(pids)
    assert {w["pid"]: w["outcome"] for w in collisions[0]["writers"]} == outcome


# fork-return: the case (multiprocessing children leave through os._exit), a few rounds.
# spawn-return: a fresh interpreter that saves and ends normally (sys.exit, atexit runs).
@pytest.mark.parametrize("scenario,rounds", [
    ("fork-return", 3), ("spawn-return", 1), ("fork-sigterm", 1), ("fork-sigkill", 1),
    ("fork-segv", 1)])
def test_writers_that_leave_right_after_saving_are_on_record(tmp_path, workdir, sockdir,
                                                             scenario, rounds):
    how = scenario.split("-")[1]
    with start_agent(str(workdir), *AGENT, socket=os.path.join(sockdir, "a.sock")) as agent:
        report = run_driver(tmp_path, agent, scenario, rounds)
        assert len(report) == rounds
        for one in report:
            assert one["exitcodes"] == [EXIT_CODES[how]] * 2, one
            assert_both_on_record(agent, one["path"], one["pids"],
                                  {pid: "ok" for pid in one["pids"]})


def test_a_writer_killed_mid_write_is_lost_and_in_its_collision(tmp_path, workdir, sockdir):
    with start_agent(str(workdir), *AGENT, socket=os.path.join(sockdir, "a.sock")) as agent:
        (one,) = run_driver(tmp_path, agent, "killed-mid-write", 1)
        # The victim died by SIGKILL with bytes in the file and its save not returned.
        assert one["exitcodes"] == [-9, 0] and one["mid_write"], one
        assert_both_on_record(agent, one["path"], [one["victim"], one["holder"]],
                              {one["victim"]: "lost", one["holder"]: "ok"})
