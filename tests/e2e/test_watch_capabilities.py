"""Which capabilities the filesystem watcher needs to name writers of another user's files, and
what happens without them: the facts behind the Helm chart's daemonset.watchCapabilities and
docs/operating.md ("Watching directories").

The real agent runs as uid 0 with every capability but the ones under test removed from its
bounding set (setpriv), as Kubernetes runs a container with `capabilities: {drop: [ALL],
add: [...]}` and `runAsUser: 0`. Two processes of another user (uid 65534), knowing nothing of
ckptwatch, hold one checkpoint open for writing at the same time in a watched directory of
theirs. Needs root and setpriv (util-linux); skipped elsewhere.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from agentproc import AgentProcess
from helpers import remove_tree, short_tmpdir, subprocess_env, wait_for
from monitor.cli.launcher import agent_command
from otheruser import NOBODY, NOGROUP

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="runs the agent as root with chosen capabilities: "
                                       "needs root and setpriv")

WRITER = r"""
import os, sys, time
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[3]))
with open(sys.argv[1], "wb") as f:
    f.write(b"x" * 4096); f.flush()
    print("writing", flush=True)
    sys.stdin.read()                 # hold it open until the test is done
"""


class CappedAgent(AgentProcess):
    """The agent as uid 0 with only `caps` (setpriv's bounding set: all others dropped)."""

    def __init__(self, workdir, caps, *extra):
        super().__init__(workdir, *extra, env=subprocess_env())
        self.caps = caps

    def launch(self):
        bounding = ",".join(["-all"] + [f"+{c.lower()}" for c in self.caps])
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all",
                 *agent_command(*self.args)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=self._env,
                cwd=self.workdir)
        return self


def writer(path: str, rank: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env.update(RANK=str(rank), CKPTWATCH_JOB="other-user")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(NOGROUP), str(NOBODY)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "writing\n"
    return proc


def race(caps, mode, named):
    """Two uid-65534 writers overlapping on one file in a watched directory of theirs (mode);
    the agent has `caps`; `named`: whether it should be able to name them. Returns (the
    collisions it journaled, its metrics, its log)."""
    workdir = short_tmpdir("cwc")
    os.chmod(workdir, 0o755)
    root = os.path.join(workdir, "ckpt")
    os.makedirs(root)
    os.chown(root, NOBODY, NOGROUP)
    os.chmod(root, mode)
    path = os.path.join(root, "last.pt")
    agent = CappedAgent(workdir, caps, "--watch.path", root, "--watch.attribution", "proc",
                        "--collision.settle", "0.5", "--verify.enabled", "false")
    try:
        agent.start()
        writers = [writer(path, 0)]
        try:
            writers.append(writer(path, 1))
            # Both hold it open now. Wait for what proves the outcome: both writers named
            # (active writes of their job), or, where they cannot be, the agent having looked
            # (a /proc scan for each open) or the directory being unwatchable.
            if named:
                wait_for(lambda: agent.metric("ckptwatch_active_writes",
                                              training_job="other-user") == 2, timeout=20,
                         message=lambda: f"both writers named:\n{agent.log[-3000:]}")
            else:
                wait_for(lambda: (agent.metric("ckptwatch_attributions_total") or 0) >= 2
                         or agent.metric("ckptwatch_fs_watch_up", root_dir=root) == 0,
                         timeout=20, message=lambda: f"the watcher's look:\n{agent.log[-3000:]}")
        finally:
            for w in writers:
                w.stdin.close()
                assert w.wait(timeout=30) == 0
        def collisions():
            return [r for r in agent.journal_records()
                    if r.get("type") == "collision" and r["path"] == path]
        if named:
            # The watcher's writes reach the detector later than a hook's (attribution, the
            # source merger's delay), so wait_judged() alone would not cover them.
            wait_for(collisions, timeout=20, message=lambda: f"the collision:\n{agent.log}")
        agent.wait_judged()
        found = collisions()
        metrics = {name: agent.metric(name, **labels) for name, labels in (
            ("ckptwatch_attribution_denied_total", {}),
            ("ckptwatch_fs_watch_up", {"root_dir": root}))}
        return found, metrics, agent.log
    finally:
        agent.close()
        remove_tree(workdir)


def test_without_sys_ptrace_writers_of_another_user_stay_unnamed():
    found, metrics, log = race([], 0o755, named=False)
    assert found == []
    assert metrics["ckptwatch_attribution_denied_total"] > 0
    assert metrics["ckptwatch_fs_watch_up"] == 1          # the directory itself is watched
    assert "needs CAP_SYS_PTRACE" in log


def test_sys_ptrace_names_them_and_finds_the_collision():
    found, metrics, _ = race(["SYS_PTRACE"], 0o755, named=True)
    assert len(found) == 1 and found[0]["kind"] == "concurrent"
    assert sorted(w["rank"] for w in found[0]["writers"]) == [0, 1]
    assert {w["job"] for w in found[0]["writers"]} == {"other-user"}


def test_a_private_directory_needs_dac_read_search_too():
    # watchdog skips an inotify watch refused with EACCES silently: on f503c65 such a root
    # was reported watched (ckptwatch_fs_watch_up 1) while no event ever came.
    found, metrics, log = race(["SYS_PTRACE"], 0o700, named=False)
    assert found == [] and metrics["ckptwatch_fs_watch_up"] == 0
    assert "cannot read a watched root" in log and "CAP_DAC_READ_SEARCH" in log
    found, metrics, _ = race(["SYS_PTRACE", "DAC_READ_SEARCH"], 0o700, named=True)
    assert len(found) == 1 and metrics["ckptwatch_fs_watch_up"] == 1
    assert sorted(w["rank"] for w in found[0]["writers"]) == [0, 1]
