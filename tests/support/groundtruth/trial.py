"""One trial: a schedule run by real writers against real agents, and its verdict.

    result = run_trial(make_schedule(seed, profile), workdir)
    assert result.verdict.ok, "\n".join(result.verdict.mismatches)

What runs: the job's store (torch's TCPStore server, as torchrun's master runs it, on
loopback), one real agent per simulated node (its own socket, journal and metrics port, named
as that node's hooks name it), the writer processes (groundtruth.writers) and this process
driving the rounds; then, once every agent has judged everything (agentproc.wait_idle), the
journals and /metrics are read (Observed) and checked (groundtruth.compare).
"""
from __future__ import annotations

import os
import random
import signal
import time
import uuid
from dataclasses import dataclass

from agentproc import launch_agent
from groundtruth.collect import observe
from groundtruth.compare import Observed, Verdict, check
from groundtruth.schedule import (KILLED, SEQUENTIAL, STAGGERED, STAY, TOGETHER, Round,
                                  Schedule)
from groundtruth.truth import TruthLog, TrueWrite
from groundtruth.writers import Writers
from helpers import wait_for
from jobstore import master_store

SETTLE = 0.3
JOB_SETTLE = 3.0
SAVE_TIMEOUT = 120.0
# After a victim is inside its save (the file open, its 64 MiB not yet written), the harness
# waits this long at most before its SIGKILL.
KILL_DELAY = 0.03


def agent_args(window: float) -> tuple[str, ...]:
    return ("--collision.window", str(window), "--collision.settle", str(SETTLE),
            "--collision.job-settle", str(JOB_SETTLE), "--verify.enabled", "false")


@dataclass
class TrialResult:
    schedule: Schedule
    job: str
    truth: list[TrueWrite]
    observed: list[Observed]
    verdict: Verdict
    seconds: float


class _Runner:
    def __init__(self, schedule: Schedule, workdir: str, agents: dict, writers: Writers,
                 truth: TruthLog):
        self.schedule, self.workdir = schedule, workdir
        self.agents, self.writers, self.truth = agents, writers, truth

    def path(self, rnd: Round) -> str:
        return os.path.join(self.workdir, rnd.path if rnd.shared else "local/" + rnd.path)

    def needed_after(self, n: int, slot) -> bool:
        """Does a round after round n save with `slot`'s own process?"""
        return any(s.slot == slot for r in self.schedule.rounds[n + 1:] for s in r.saves)

    def run(self, n: int, rnd: Round) -> None:
        rng = random.Random(f"{self.schedule.seed}/{n}")
        path = self.path(rnd)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        meet = os.path.join(self.workdir, "meet", f"r{n:02d}")
        ids = [f"r{n:02d}s{i}" for i in range(len(rnd.saves))]
        procs = [self.writers.get(s.slot) for s in rnd.saves]     # every one ready first
        if len(self.schedule.profile.nodes) > 1:
            # Without job scope a cross-node trial would judge node scope only.
            assert all(p.job_scope == "active" for p in procs), [p.job_scope for p in procs]
        victims = []

        def send(i: int) -> None:
            save = rnd.saves[i]
            folder, count = None, None
            if rnd.shape == TOGETHER:
                folder, count = meet, len(rnd.saves)
            elif save.exit == KILLED:
                # Held inside its save (file open, nothing written) until kill() releases it.
                folder, count = os.path.join(meet, ids[i]), 2
            if folder is not None:
                os.makedirs(folder, exist_ok=True)
            procs[i].send({"save": ids[i], "path": path, "numel": save.numel,
                           "delay": save.delay, "meet": folder, "count": count,
                           "exit": STAY if save.exit == KILLED else save.exit,
                           "fork": save.fork})
            if save.exit == KILLED:
                victims.append(i)
            elif save.exit != STAY and not save.fork:
                self.writers.replace(save.slot, self.needed_after(n, save.slot))

        def kill(i: int, hold: bool = False) -> None:
            """SIGKILL save i's process while it writes its 64 MiB: released from its meeting
            point (hold: once every other save of the round ended), then killed within
            KILL_DELAY."""
            folder = meet if rnd.shape == TOGETHER else os.path.join(meet, ids[i])
            wait_for(lambda: os.path.exists(os.path.join(folder, ids[i])),
                     timeout=SAVE_TIMEOUT, message=f"victim {ids[i]} inside its save")
            if rnd.shape != TOGETHER:
                if hold:
                    for j in range(len(rnd.saves)):
                        if j != i:
                            wait_end(j)
                open(os.path.join(folder, "release"), "w").close()
            time.sleep(rng.uniform(0.0, KILL_DELAY))     # part of the schedule, not a wait
            if rnd.saves[i].fork:
                pid = self.truth.find(ids[i], "start")["pid"]     # the forked child's
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30,
                         message=f"forked victim {pid} gone")
            else:
                pid = procs[i].pid
                procs[i].kill()
                self.writers.replace(rnd.saves[i].slot, self.needed_after(n, rnd.saves[i].slot))
            self.truth.killed(pid, procs[i].node)

        def wait_end(i: int) -> None:
            wait_for(lambda: self.truth.ended(ids[i]), timeout=SAVE_TIMEOUT,
                     message=f"save {ids[i]} to end")

        if rnd.shape == SEQUENTIAL:
            for i in range(len(rnd.saves)):
                send(i)
                if victims and victims[-1] == i:
                    kill(i)
                else:
                    wait_end(i)
            return
        if rnd.shape == TOGETHER:
            for i in range(len(rnd.saves)):
                send(i)
        else:       # STAGGERED: the others' delays count from the first one's start
            send(0)
            wait_for(lambda: self.truth.find(ids[0], "start"), timeout=SAVE_TIMEOUT,
                     message=f"save {ids[0]} to start")
            for i in range(1, len(rnd.saves)):
                send(i)
        for i in victims:
            # A first save killed while the others write: held until they ended, so they
            # are inside its interval.
            kill(i, hold=(rnd.shape == STAGGERED and i == 0))
        for i in range(len(rnd.saves)):
            if i not in victims:
                wait_end(i)


def run_trial(schedule: Schedule, workdir: str, progress=lambda text: None) -> TrialResult:
    """Run `schedule` in `workdir` (short: agent sockets live there) and check it."""
    began = time.monotonic()
    profile = schedule.profile
    job = f"gt{schedule.seed}-{uuid.uuid4().hex[:6]}"
    shared = os.path.join(workdir, "shared")
    logs = os.path.join(workdir, "logs")
    for d in (shared, logs):
        os.makedirs(d, exist_ok=True)
    store = master_store()
    agents: dict = {}
    truth = TruthLog(os.path.join(workdir, "truth.jsonl"))
    writers = None
    try:
        for node in profile.nodes:
            home = os.path.join(workdir, f"agent-{node}")
            os.makedirs(home)
            agents[node] = launch_agent(home, *agent_args(profile.window), "--node.name", node,
                                        socket=os.path.join(home, "s"))
        # The writers start (import torch, reach the store) while the agents do; a writer's
        # hook connects to its agent's socket when it first has something to send.
        used = sorted({s.slot for r in schedule.rounds for s in r.saves})
        writers = Writers(profile, agents, truth.path, job, store.port, shared, logs, used)
        for agent in agents.values():
            wait_for(agent.ready, timeout=60, message=lambda: f"agent up\n{agent.log}")
        progress(f"seed {schedule.seed}: {len(agents)} agents up, {len(used)} writers starting")
        runner = _Runner(schedule, workdir, agents, writers, truth)
        for n, rnd in enumerate(schedule.rounds):
            runner.run(n, rnd)
            progress(f"seed {schedule.seed}: round {n} {rnd.shape} {rnd.path} "
                     f"{[(s.slot, s.exit) for s in rnd.saves]}")
        for agent in agents.values():
            agent.wait_idle(timeout=120)
        observed = [observe(agent, node, job) for node, agent in agents.items()]
        writes = truth.writes()
    finally:
        if writers is not None:
            writers.close()
        for agent in agents.values():
            agent.close()
        truth.close()
        del store
    verdict = check(writes, observed, lambda p: p.startswith(shared + os.sep),
                    profile.window, label=f"seed {schedule.seed}: ")
    return TrialResult(schedule, job, writes, observed, verdict, time.monotonic() - began)
