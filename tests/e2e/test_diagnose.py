"""`ckptwatch diagnose` on real failures: real races corrupt real checkpoints while the real hook
reports them to a real private agent (so the journal is real), then a real torch.load or
safetensors load of the file fails and its traceback is the log diagnose reads.

- torch: a real torchrun job (4 ranks, gloo, CPU) whose every rank saves one path
  (monitor.cli.demo_job --save every-rank), under `ckptwatch run`;
- safetensors: four multiprocessing processes writing safetensors files (safetensors.torch.save)
  of different sizes in place to one path, seen by the agent's watcher (--watch.path;
  fanotify where the agent may use it: the hook covers torch.save);
- no collision: one process saves, then an uninstrumented writer truncates the file.

A race does not corrupt the file every time (the last writer may rewrite it whole): each race
runs until a load fails, at most ATTEMPTS times.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentproc import FAST, start_agent
from helpers import REPO_ROOT, subprocess_env, wait_for

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

ATTEMPTS = 5
COLLISION_CLASSES = {"zip_truncated", "zip_unreadable", "zip_record_corrupt", "record_size_mismatch",
                     "pickle_truncated", "pickle_garbage", "safetensors_truncated",
                     "safetensors_header_corrupt"}

LOAD_TORCH = r"""
import sys, torch
print(f"Restoring states from the checkpoint path at {sys.argv[1]}", flush=True)
state = torch.load(sys.argv[1], weights_only=False)
"""
LOAD_SAFETENSORS = r"""
import sys
from safetensors.torch import load_file
print(f"loading weights file {sys.argv[1]}", flush=True)
weights = load_file(sys.argv[1])
"""
RACE_SAFETENSORS = r"""
import multiprocessing as mp, os, sys

def save(rank, path, barrier):
    import torch
    from safetensors.torch import save
    # Tens of MB each, of different sizes: the writes overlap, and a mix does not load.
    data = save({"w": torch.arange(8_000_000 + 1_500_000 * rank, dtype=torch.float32)})
    barrier.wait()
    # Written in place, as safetensors before 0.6 and streaming writers do (0.8's save_file
    # writes a temporary file and renames it: its races leave a whole file, the last one).
    with open(path, "wb") as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i:i + (1 << 20)])

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=save, args=(r, sys.argv[1], barrier)) for r in range(4)]
    for rank, p in enumerate(procs):
        # In each child's environment from its start, where the agent's watcher reads it.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4")
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
"""
SAVE_THEN_TRUNCATE = r"""
import os, sys, torch
import ckptwatch
ckptwatch.install()
torch.save({"w": torch.arange(300_000)}, sys.argv[1])
with open(sys.argv[1], "r+b") as f:          # an uninstrumented writer cuts it short
    f.truncate(os.path.getsize(sys.argv[1]) // 3)
"""


def load_log(loader: str, path: str, log: str) -> bool:
    """Load `path` in a fresh process, its output (and traceback) into `log`; True if the
    load failed."""
    with open(log, "w") as fh:
        result = subprocess.run([sys.executable, "-c", loader, path], stdout=fh,
                                stderr=subprocess.STDOUT, env=subprocess_env(), timeout=120)
    return result.returncode != 0


def diagnose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monitor.cli", "diagnose", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=subprocess_env(),
                          timeout=120)


def journaled_verdict(agent, path):
    """The corrupt verdicts journaled for path (an earlier race that left the file whole has
    its ok verdict journaled too: the verdict on a collision's file)."""
    return [r for r in agent.journal_records()
            if r.get("type") == "verification" and r.get("path") == path
            and r.get("result") == "corrupt"]


def race_until_it_corrupts(agent, run_race, path, loader, log, job) -> dict:
    """Run the race until the load fails; return the collision the agent journaled."""
    for attempt in range(ATTEMPTS):
        before = len([r for r in agent.journal_records() if r.get("type") == "collision"])
        run_race()
        collision = wait_for(lambda: [r for r in agent.journal_records()
                                      if r.get("type") == "collision"
                                      and r["path"] == path][before:],
                             timeout=60, message=lambda: f"the collision:\n{agent.log[-3000:]}")
        if load_log(loader, path, log):
            agent.wait_judged()
            return collision[-1]
    pytest.skip(f"{ATTEMPTS} races of {job} all left a loadable file")


@pytest.fixture(scope="module")
def torch_race(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("dg-torch"))
    out = os.path.join(work, "ckpt")
    os.makedirs(out)
    path = os.path.join(out, "last.pt")
    log = os.path.join(work, "train.log")
    with start_agent(work, *FAST, "--verify.quiet", "0.5") as agent:
        def run_race():
            env = subprocess_env(CKPTWATCH_JOB="dg-torch", OMP_NUM_THREADS="1")
            cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket", agent.socket, "--",
                   sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "4", "-m", "monitor.cli.demo_job", "--out", out,
                   "--save", "every-rank", "--width", "1024"]
            result = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True,
                                    text=True, timeout=300)
            assert result.returncode == 0, result.stderr[-3000:]
        collision = race_until_it_corrupts(agent, run_race, path, LOAD_TORCH, log, "torchrun")
        wait_for(lambda: journaled_verdict(agent, path), timeout=30,
                 message=lambda: f"the agent's verdict:\n{agent.log[-3000:]}")
        yield {"path": path, "log": log, "journal": agent.journal, "collision": collision}


@pytest.fixture(scope="module")
def safetensors_race(tmp_path_factory):
    pytest.importorskip("safetensors")
    work = str(tmp_path_factory.mktemp("dg-st"))
    path = os.path.join(work, "ckpt", "model.safetensors")
    os.makedirs(os.path.dirname(path))
    log = os.path.join(work, "train.log")
    with start_agent(work, *FAST, "--verify.quiet", "0.5", "--watch.path",
                     os.path.dirname(path)) as agent:
        script = os.path.join(work, "race.py")      # spawn re-imports the main module
        with open(script, "w") as f:
            f.write(RACE_SAFETENSORS)

        def run_race():
            env = subprocess_env(CKPTWATCH_SOCKET=agent.socket, CKPTWATCH_JOB="dg-st")
            subprocess.run([sys.executable, script, path], env=env, check=True, timeout=300)
        collision = race_until_it_corrupts(agent, run_race, path, LOAD_SAFETENSORS, log,
                                           "safetensors")
        yield {"path": path, "log": log, "journal": agent.journal, "collision": collision}


def test_a_torchrun_race_behind_a_torch_load_traceback(torch_race):
    result = diagnose(torch_race["log"], "--journal", torch_race["journal"])
    print("\n$ ckptwatch diagnose train.log --journal journal.jsonl\n" + result.stdout)
    assert result.returncode == 1, result.stdout + result.stderr
    answer = json.loads(diagnose(torch_race["log"], "--journal", torch_race["journal"],
                                 "--format", "json").stdout)
    assert answer["failure"]["class"] in COLLISION_CLASSES, answer["failure"]
    assert answer["file"] == torch_race["path"]
    assert answer["file_named_at"]["how"] == "log"          # "Restoring states from ..."
    collision = answer["collision"]
    assert collision["kind"] == "concurrent" and collision["id"] == torch_race["collision"]["id"]
    ranks = {w["rank"] for w in collision["writers"]}
    assert len(ranks) >= 2 and ranks <= {0, 1, 2, 3}
    assert collision["first"]["rank"] in ranks and collision["last"]["rank"] in ranks
    assert answer["verification"]["result"] == "corrupt"
    assert "dist.get_rank() == 0" in answer["fix"][0]
    text = result.stdout
    for needle in ("written by a concurrent write collision", "first to start:",
                   "last to finish:", "verdict    corrupt", "fix: guard this call site",
                   "then       do not resume from this file", torch_race["path"]):
        assert needle in text, needle


def test_a_safetensors_race_behind_a_safetensors_error(safetensors_race):
    with open(safetensors_race["log"]) as f:
        assert "SafetensorError" in f.read()
    result = diagnose(safetensors_race["log"], "--journal", safetensors_race["journal"],
                      "--format", "json")
    assert result.returncode == 1, result.stdout + result.stderr
    answer = json.loads(result.stdout)
    assert answer["failure"]["class"].startswith("safetensors_"), answer["failure"]
    assert answer["file"] == safetensors_race["path"]
    assert answer["collision"]["kind"] == "concurrent"
    ranks = {w["rank"] for w in answer["collision"]["writers"]}
    assert len(ranks) >= 2 and ranks <= {0, 1, 2, 3}
    print("\n" + diagnose(safetensors_race["log"], "--journal",
                          safetensors_race["journal"]).stdout)


def test_several_nodes_journals_merged(torch_race, safetensors_race, tmp_path):
    """Journals of several agents (here: two), by name or as a directory: the file's own
    collision is found among them."""
    result = diagnose(torch_race["log"], "--journal", safetensors_race["journal"],
                      "--journal", torch_race["journal"], "--format", "json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["collision"]["id"] == torch_race["collision"]["id"]
    both = tmp_path / "journals"
    both.mkdir()
    for name, race in (("node-a.jsonl", torch_race), ("node-b.jsonl", safetensors_race)):
        (both / name).write_bytes(open(race["journal"], "rb").read())
    result = diagnose(safetensors_race["log"], "--journal", str(both), "--format", "json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["collision"]["id"] == safetensors_race["collision"]["id"]


def test_from_standard_input(torch_race):
    with open(torch_race["log"]) as f:
        result = subprocess.run([sys.executable, "-m", "monitor.cli", "diagnose", "-",
                                 "--journal", torch_race["journal"]], stdin=f,
                                capture_output=True, text=True, cwd=REPO_ROOT,
                                env=subprocess_env(), timeout=120)
    assert result.returncode == 1 and "ckptwatch diagnose: standard input" in result.stdout


def test_a_file_cut_short_without_a_collision_exits_0(tmp_path):
    path = str(tmp_path / "ckpt" / "last.pt")
    os.makedirs(os.path.dirname(path))
    log = str(tmp_path / "train.log")
    with start_agent(str(tmp_path), *FAST, "--verify.quiet", "0.5") as agent:
        env = subprocess_env(CKPTWATCH_SOCKET=agent.socket, CKPTWATCH_JOB="dg-cut", RANK="0")
        subprocess.run([sys.executable, "-c", SAVE_THEN_TRUNCATE, path], env=env, check=True,
                       timeout=120)
        assert load_log(LOAD_TORCH, path, log)
        wait_for(lambda: journaled_verdict(agent, path), timeout=30,
                 message=lambda: f"the agent's verdict:\n{agent.log[-3000:]}")
        agent.wait_judged()
        result = diagnose(log, "--journal", agent.journal, "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    answer = json.loads(result.stdout)
    assert answer["failure"]["class"] == "zip_truncated"
    assert answer["file"] == path and answer["collision"] is None
    assert answer["verification"]["result"] == "corrupt"
    assert len(answer["writes"]) == 1 and answer["writes"][0]["rank"] == 0
    assert answer["fix"][0].startswith("no collision on record")
