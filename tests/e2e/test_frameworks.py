"""ckptwatch against real training code nobody here wrote: transformers Trainer, accelerate and
Lightning, 2 ranks on CPU (gloo), each under `ckptwatch run` with a real agent process.

What each framework writes, and what the hook saw, is recorded in docs/frameworks.md. Correct
framework code must give no collision at all (a false alarm would teach users to ignore us);
the classic unguarded save must give exactly one. The training scripts live in
tests/frameworks/. Each test skips when its framework is not installed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from agentproc import start_agent
from helpers import REPO_ROOT, remove_tree, short_tmpdir, wait_for

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

SCRIPTS = os.path.join(REPO_ROOT, "tests", "frameworks")
SETTLE = 0.5
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


@pytest.fixture(scope="module")
def agent():
    workdir = short_tmpdir("cwf")
    with start_agent(workdir, "--collision.settle", str(SETTLE)) as proc:
        yield proc
    remove_tree(workdir)


@pytest.fixture
def outdir():
    path = short_tmpdir("cwfo")
    yield path
    remove_tree(path)


def run_job(agent, name: str, command: list[str]) -> str:
    """Run command under `ckptwatch run` (the real CLI) with a fresh CKPTWATCH_JOB; return it."""
    job = f"fw-{name}-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    # HF_HUB_OFFLINE: nothing may reach a model hub; the scripts build models from configs.
    env.update({"CKPTWATCH_JOB": job, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"})
    cmd = [sys.executable, "-m", "monitor.cli", "run", "--socket", agent.socket, "--", *command]
    result = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=150)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return job


def records_of(agent, job: str, kind: str) -> list[dict]:
    return [r for r in agent.journal_records() if r.get("type") == kind and r.get("job") == job]


def framework_file(module) -> str:
    """The directory a framework package is installed in (call sites must point into it)."""
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


# --- transformers Trainer ----------------------------------------------------------------------

def test_transformers_trainer_checkpoints_are_recorded_and_not_a_collision(agent, outdir):
    transformers = pytest.importorskip("transformers")
    out = os.path.join(outdir, "hf")
    job = run_job(agent, "hf", [*TORCHRUN, os.path.join(SCRIPTS, "hf_trainer.py"), "--out", out])

    # Per checkpoint (steps 2 and 4): rank 0 torch.saves optimizer.pt, scheduler.pt and
    # training_args.bin and writes model.safetensors through safetensors (save_pretrained);
    # every rank saves its own rng_state_{rank}.pth.
    expected = {os.path.join(out, f"checkpoint-{step}", name): rank
                for step in (2, 4)
                for name, rank in (("model.safetensors", 0), ("optimizer.pt", 0),
                                   ("scheduler.pt", 0), ("training_args.bin", 0),
                                   ("rng_state_0.pth", 0), ("rng_state_1.pth", 1))}
    writes = wait_for(lambda: len(records_of(agent, job, "write")) >= len(expected)
                      and records_of(agent, job, "write"),
                      timeout=30, message=f"{len(expected)} write records of {job}")
    agent.wait_judged()
    writes = records_of(agent, job, "write")
    assert {w["path"]: w["rank"] for w in writes} == expected
    assert len(writes) == len(expected), [(w["path"], w["rank"]) for w in writes]
    assert all(w["outcome"] == "ok" and w["bytes"] == os.path.getsize(w["path"])
               for w in writes)
    assert {os.path.basename(w["path"]): w.get("writer") for w in writes}["model.safetensors"] \
        == "safetensors"
    assert {w.get("writer") for w in writes if not w["path"].endswith(".safetensors")} == {None}
    # The call site is transformers' own code (the Trainer), not torch's and not ours.
    hf_dir = framework_file(transformers)
    assert all(w["site"].startswith(hf_dir) for w in writes), {w["site"] for w in writes}
    # Each rank wrote only its own rng_state file: separate paths, no collision of any kind.
    assert records_of(agent, job, "collision") == []
    assert not agent.metric("ckptwatch_collisions_total", training_job=job)
    assert agent.metric("ckptwatch_writes_total", training_job=job, rank="1") == 2


# --- accelerate --------------------------------------------------------------------------------

def test_accelerate_save_state_is_not_a_collision(agent, outdir):
    accelerate = pytest.importorskip("accelerate")
    state = os.path.join(outdir, "state")
    job = run_job(agent, "acc-state", [*TORCHRUN, os.path.join(SCRIPTS, "accel_job.py"),
                                       "--out", outdir, "--save", "state"])
    # save_state: the main process writes model.safetensors (safetensors) and torch.saves
    # optimizer.bin; each process saves its own random_states_{i}.pkl.
    expected = {os.path.join(state, "model.safetensors"): 0,
                os.path.join(state, "optimizer.bin"): 0,
                os.path.join(state, "random_states_0.pkl"): 0,
                os.path.join(state, "random_states_1.pkl"): 1}
    wait_for(lambda: len(records_of(agent, job, "write")) >= len(expected), timeout=30,
             message=f"{len(expected)} write records of {job}")
    agent.wait_judged()
    writes = records_of(agent, job, "write")
    assert {w["path"]: w["rank"] for w in writes} == expected
    assert len(writes) == len(expected)
    acc_dir = framework_file(accelerate)
    assert all(w["site"].startswith(acc_dir) for w in writes), {w["site"] for w in writes}
    assert records_of(agent, job, "collision") == []
    assert not agent.metric("ckptwatch_collisions_total", training_job=job)


def test_accelerate_unguarded_torch_save_is_one_collision_naming_both_ranks(agent, outdir):
    """Both ranks save model.pt after wait_for_everyone(). Whether their writes overlap is up
    to the scheduler (on a quiet machine a 16 MiB save can end before the other rank leaves the
    barrier): overlapping writes are one concurrent collision, back-to-back ones one redundant
    collision (the ground-truth checker, tests/e2e/test_groundtruth.py, holds the agent to the
    right kind); either way one collision naming both ranks at the user's line."""
    pytest.importorskip("accelerate")
    path = os.path.join(outdir, "model.pt")
    script = os.path.join(SCRIPTS, "accel_job.py")
    job = run_job(agent, "acc-bug", [*TORCHRUN, script, "--out", outdir, "--save", "unguarded"])
    found = wait_for(lambda: records_of(agent, job, "collision"), timeout=90,
                     message=f"collision record of {job}; agent log:\n{agent.log[-3000:]}")
    agent.wait_judged()
    found = records_of(agent, job, "collision")
    assert len(found) == 1, found
    c = found[0]
    assert c["path"] == path and c["kind"] in ("concurrent", "redundant") and \
        c["scope"] == "node", c
    assert sorted(w["rank"] for w in c["writers"]) == [0, 1]
    assert len({w["pid"] for w in c["writers"]}) == 2
    # The call site is the user's unguarded line in the script.
    assert all(w["site"].startswith(script + ":") and w["func"] == "main"
               for w in c["writers"]), [w["site"] for w in c["writers"]]
    if c["kind"] == "concurrent":
        assert c["overlap_seconds"] > 0
    assert agent.metric("ckptwatch_collisions_total", training_job=job, kind=c["kind"],
                        scope="node") == 1


# --- Lightning ---------------------------------------------------------------------------------

def run_lightning(agent, out: str) -> str:
    # A plain `python script.py`: Lightning's subprocess launcher re-executes sys.argv for
    # rank 1, with our PYTHONPATH bootstrap inherited through the environment.
    return run_job(agent, "pl", [sys.executable, os.path.join(SCRIPTS, "lightning_job.py"),
                                 "--out", out, "--probe"])


@pytest.fixture(scope="module")
def lightning_run(agent):
    """One Lightning job shared by the Lightning tests: (job id, output dir)."""
    pytest.importorskip("lightning")
    out = short_tmpdir("cwfl")
    job = run_lightning(agent, out)
    # The probes are the last saves of the job: once both are journaled, everything is.
    wait_for(lambda: len([w for w in records_of(agent, job, "write")
                          if "probe-rank" in w["path"]]) == 2,
             timeout=30, message=f"probe writes of {job}")
    agent.wait_judged()
    yield job, out
    remove_tree(out)


def test_lightning_ddp_every_process_is_instrumented_and_no_collision(agent, lightning_run):
    job, out = lightning_run
    ckpts = sorted(os.listdir(os.path.join(out, "ckpt")))
    assert ckpts == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    probes = {w["path"]: w for w in records_of(agent, job, "write") if "probe-rank" in w["path"]}
    # Both processes (rank 1 is re-executed by Lightning) ran with the hook and knew their rank.
    assert {(p, w["rank"]) for p, w in probes.items()} == {
        (os.path.join(out, f"probe-rank{r}.pt"), r) for r in (0, 1)}
    assert len({w["pid"] for w in probes.values()}) == 2
    assert records_of(agent, job, "collision") == []
    assert not agent.metric("ckptwatch_collisions_total", training_job=job)


def test_lightning_checkpoint_writes_are_recorded(agent, lightning_run):
    """Lightning torch.saves into an io.BytesIO and writes the bytes through fsspec (a
    temporary file moved onto the .ckpt): the fsspec writer reports each .ckpt, by rank 0,
    at Lightning's own call site."""
    lightning = pytest.importorskip("lightning")
    job, out = lightning_run
    ckpt_writes = [w for w in records_of(agent, job, "write") if w["path"].endswith(".ckpt")]
    assert {w["path"] for w in ckpt_writes} == {os.path.join(out, "ckpt", name) for name in
                                                ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                 "last.ckpt")}
    assert {(w["rank"], w["writer"], w["outcome"]) for w in ckpt_writes} == {(0, "fsspec", "ok")}
    assert all(w["site"].startswith(framework_file(lightning)) for w in ckpt_writes)


def test_lightning_rank0_identity_is_complete_after_an_early_save(agent, lightning_run):
    job, out = lightning_run
    writes = {w["path"]: w for w in records_of(agent, job, "write")}
    assert os.path.join(out, "config.pt") in writes   # the early save happened, on rank 0
    probes = [writes[os.path.join(out, f"probe-rank{r}.pt")] for r in (0, 1)]
    assert [(w["rank"], w["local_rank"], w["world_size"]) for w in probes] == [
        (0, 0, 2), (1, 1, 2)]
    assert probes[0]["master"] is not None and probes[0]["master"] == probes[1]["master"]
    # Lightning exports NODE_RANK (not torchrun's GROUP_RANK).
    assert [w["node_rank"] for w in probes] == [0, 0]


# --- the filesystem watcher as the backstop (issue 3) ------------------------------------------

@pytest.fixture
def watching_agent(outdir):
    """An agent that also watches `outdir` (inotify): writers the hook cannot see."""
    workdir = short_tmpdir("cww")
    # A short window: a redundant-write chain is reported once the window after its last
    # write has passed, and the tests wait for that.
    with start_agent(workdir, "--collision.settle", "1.0", "--collision.window", "3",
                     "--watch.path", outdir, "--watch.mode", "inotify",
                     "--verify.quiet", "0.5") as proc:
        yield proc
    remove_tree(workdir)


def test_unguarded_safetensors_save_is_a_collision_and_the_file_is_whole(watching_agent, outdir):
    """Every rank calling safetensors' save_file on one path: the classic bug. safetensors
    writes a temporary file and renames it into place, so nothing interleaves and the file is
    whole (no corrupt verdict), but the writes overlap: the hook reports them as what they are,
    a concurrent collision of both ranks through safetensors, the last rename silently winning
    -- as it does for torch.save under the `atomic` policy (docs/decisions.md: the collision
    is still reported, only the damage is gone)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("safetensors")
    agent = watching_agent
    script = os.path.join(SCRIPTS, "accel_job.py")
    job = run_job(agent, "acc-st-fs", [*TORCHRUN, script, "--out", outdir,
                                       "--save", "unguarded-safetensors"])
    path = os.path.join(outdir, "model.safetensors")
    wait_for(lambda: agent.metric("ckptwatch_checkpoint_verifications_total", result="ok"),
             timeout=30, message="the watcher verified the renamed-in file")
    found = wait_for(lambda: records_of(agent, job, "collision"), timeout=30,
                     message=f"the collision on {path}\n{agent.log[-3000:]}")
    agent.wait_judged()
    found = records_of(agent, job, "collision")
    assert {c["path"] for c in found} == {path}
    assert "concurrent" in {c["kind"] for c in found}
    writers = [w for c in found for w in c["writers"]]
    assert {w["rank"] for w in writers} == {0, 1}
    assert {w.get("writer") for w in writers if w["source"] == "hook"} == {"safetensors"}
    assert all(w["site"].startswith(script + ":") for w in writers if w["source"] == "hook")
    assert not agent.metric("ckptwatch_checkpoint_verifications_total", result="corrupt")
    from safetensors.torch import load_file
    assert len(load_file(path)) == 8          # 4 layers x (weight, bias), whole


def test_watcher_sees_lightning_checkpoints_and_no_collision(watching_agent, outdir):
    pytest.importorskip("lightning")
    agent = watching_agent
    job = run_job(agent, "pl-fs", [sys.executable, os.path.join(SCRIPTS, "lightning_job.py"),
                                   "--out", outdir])
    # Every .ckpt Lightning wrote (through fsspec, no torch.save) is seen finished and
    # verified; ModelCheckpoint deletes the older one, which may go before it is verified.
    def verified():
        ok = agent.metric("ckptwatch_checkpoint_verifications_total", result="ok") or 0
        gone = agent.metric("ckptwatch_checkpoint_verifications_total", result="gone") or 0
        return ok >= 2 and ok + gone >= 3
    wait_for(verified, timeout=30, message="verified .ckpt files")
    agent.wait_judged()
    assert not [r for r in agent.journal_records() if r.get("type") == "collision"]
    assert not agent.metric("ckptwatch_checkpoint_verifications_total", result="corrupt")
    assert job


def test_watcher_and_hook_on_the_trainer_raise_no_false_alarm(watching_agent, outdir):
    """transformers' Trainer with both sources: the hook sees its torch.saves, the watcher
    every file it writes (model.safetensors goes through a temporary file and a rename). A
    correct job: one writer per checkpoint file, so no collision of any kind (the window is
    3 s here, so a redundant chain would have closed), no size fluctuation, nothing corrupt."""
    pytest.importorskip("transformers")
    agent = watching_agent
    out = os.path.join(outdir, "hf")
    job = run_job(agent, "hf-fs", [*TORCHRUN, os.path.join(SCRIPTS, "hf_trainer.py"),
                                   "--out", out])
    models = [os.path.join(out, f"checkpoint-{step}", "model.safetensors") for step in (2, 4)]
    wait_for(lambda: (agent.metric("ckptwatch_checkpoint_verifications_total", result="ok")
                      or 0) >= 10, timeout=30, message="the checkpoints verified")
    agent.wait_idle()                    # every chain closed (window 3 s): nothing pending
    assert not [r for r in agent.journal_records() if r.get("type") == "collision"]
    assert not agent.metric("ckptwatch_collisions_total")
    assert not agent.metric("ckptwatch_size_fluctuations_total")
    assert not agent.metric("ckptwatch_checkpoint_verifications_total", result="corrupt")
    if agent.metric("ckptwatch_attribution_method", method="fanotify"):
        # The safetensors writes are attributed to the process that wrote them, rank 0: the
        # hook reports them, and the watcher's view of the rename merges into the hook's.
        fs_writes = [r for r in agent.journal_records()
                     if r.get("type") == "write" and r["path"] in models]
        assert sorted(r["path"] for r in fs_writes) == sorted(models), fs_writes
        assert {(r["rank"], r["job"], r["source"], r.get("writer")) for r in fs_writes} == {
            (0, job, "hook", "safetensors")}


# --- torch.distributed.checkpoint (issue 18) ---------------------------------------------------

def dcp_files(out: str) -> list:
    return sorted(os.listdir(os.path.join(out, "dcp")))


def test_dcp_no_dist_on_every_rank_names_every_writer_of_every_file(agent, outdir):
    """dcp.save(no_dist=True) on both ranks into one directory: both write __0_0.distcp and
    .metadata. Each file is a concurrent collision naming both ranks, through DCP's writer,
    at the user's dcp.save line."""
    pytest.importorskip("torch.distributed.checkpoint")
    script = os.path.join(SCRIPTS, "dcp_job.py")
    job = run_job(agent, "dcp-nodist", [*TORCHRUN, script, "--out", outdir, "--save", "no-dist"])
    files = [os.path.join(outdir, "dcp", name) for name in ("__0_0.distcp", ".metadata")]
    found = wait_for(lambda: {c["path"] for c in records_of(agent, job, "collision")
                              if c["kind"] == "concurrent"} >= set(files)
                     and records_of(agent, job, "collision"), timeout=60,
                     message=f"collisions on {files}; agent log:\n{agent.log[-3000:]}")
    agent.wait_judged()
    found = records_of(agent, job, "collision")
    assert {c["path"] for c in found} == set(files)
    for path in files:
        concurrent = [c for c in found if c["path"] == path and c["kind"] == "concurrent"]
        assert concurrent, (path, found)
        writers = [w for c in found if c["path"] == path for w in c["writers"]]
        assert {w["rank"] for w in writers} == {0, 1}
        assert {w["writer"] for w in writers} == {"dcp"}
        assert all(w["site"].startswith(script + ":") and w["func"] == "main"
                   for w in writers), {w["site"] for w in writers}
    # Every write of the job was one of these two files (the tensors' own torch.saves inside
    # a shard are part of the shard's write).
    assert {w["path"] for w in records_of(agent, job, "write")} == set(files)


@pytest.mark.parametrize("mode", ["dist", "async"])
def test_dcp_correct_save_each_shard_its_rank_and_no_collision(agent, outdir, mode):
    pytest.importorskip("torch.distributed.checkpoint")
    script = os.path.join(SCRIPTS, "dcp_job.py")
    job = run_job(agent, f"dcp-{mode}", [*TORCHRUN, script, "--out", outdir, "--save", mode])
    names = dcp_files(outdir)
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"], names
    expected = {os.path.join(outdir, "dcp", "__0_0.distcp"): 0,
                os.path.join(outdir, "dcp", "__1_0.distcp"): 1,
                os.path.join(outdir, "dcp", ".metadata"): 0}
    wait_for(lambda: len(records_of(agent, job, "write")) >= 3, timeout=30,
             message=f"3 write records of {job}")
    agent.wait_judged()
    writes = records_of(agent, job, "write")
    assert {w["path"]: w["rank"] for w in writes} == expected
    assert len(writes) == 3
    assert all(w["writer"] == "dcp" and w["outcome"] == "ok"
               and w["bytes"] == os.path.getsize(w["path"]) for w in writes)
    # async_save writes on its executor thread: the site is still the user's call.
    assert all(w["site"].startswith(script + ":") for w in writes), [w["site"] for w in writes]
    assert records_of(agent, job, "collision") == []
    assert not agent.metric("ckptwatch_collisions_total", training_job=job)


# --- two simulated nodes, shared storage: safetensors and fsspec through job scope (issue 18) --

@pytest.fixture(scope="module")
def node_agents():
    from twonodes import two_agents
    with two_agents() as agents:
        yield agents


def job_collisions_on(agent, job: str, path: str) -> list:
    return [c for c in records_of(agent, job, "collision")
            if c["scope"] == "job" and c["path"] == path]


def assert_job_collision_on_both(agents, job: str, path: str, kind: str, site_dir: str):
    """The same scope="job" collision on `path` on both agents: both nodes' ranks, each
    writer -- the local one and the other node's, passed on by job scope -- said which
    library wrote (None: torch.save, which does not say), the call sites inside `site_dir`."""
    found = {}
    for node, agent in agents.items():
        found[node] = wait_for(lambda: job_collisions_on(agent, job, path), timeout=90,
                               message=f"a job collision on {path} on {node}\n{agent.log[-3000:]}")
        c = found[node][0]
        assert {w["rank"] for w in c["writers"]} == {0, 1}, c["writers"]
        assert {w["node"] for w in c["writers"]} == {"node-a", "node-b"}
        assert {w.get("writer") for w in c["writers"]} == {kind}, c["writers"]
        assert all(w["site"] and w["site"].startswith(site_dir) for w in c["writers"]), \
            [w["site"] for w in c["writers"]]
    # Every agent tells the same story: once both have judged, the same job collisions on
    # `path`, each with the same id, kind and writers (a later save may make a second one).
    stories = {}

    def same_story():
        for node, agent in agents.items():
            agent.wait_judged()
            stories[node] = sorted(
                (c["id"], c["kind"], sorted((w["node"], w["pid"], w["rank"], w.get("seq"))
                                            for w in c["writers"]))
                for c in job_collisions_on(agent, job, path))
        return len({repr(story) for story in stories.values()}) == 1

    wait_for(same_story, timeout=30, message=lambda: f"two stories on {path}: {stories}")


def test_transformers_save_on_each_node_weights_are_one_safetensors_write(node_agents):
    """TrainingArguments(save_on_each_node=True), 2 nodes x 1 rank, shared output. Every
    node's local rank 0 torch.saves optimizer.pt, scheduler.pt and training_args.bin (the job
    collisions tests/e2e/test_jobscope.py checks), but transformers 5.24 writes the weights
    only on global rank 0: save_pretrained's `save_on_this_rank` also requires
    torch.distributed rank 0. So model.safetensors is seen, through safetensors, by rank 0
    alone, and is in no collision: no false alarm on the weights, a collision on the rest."""
    transformers = pytest.importorskip("transformers")
    from twonodes import run_two_nodes
    job, out = run_two_nodes(node_agents, "hf-each",
                             [os.path.join(SCRIPTS, "hf_trainer.py"), "--save-on-each-node"])
    optimizer = os.path.join(out, "checkpoint-2", "optimizer.pt")
    assert_job_collision_on_both(node_agents, job, optimizer, None, framework_file(transformers))
    weights = {os.path.join(out, f"checkpoint-{step}", "model.safetensors") for step in (2, 4)}
    for agent in node_agents.values():
        agent.wait_judged()
    writes = [w for agent in node_agents.values() for w in records_of(agent, job, "write")
              if w["path"] in weights]
    assert sorted((w["path"], w["rank"], w["writer"], w["node"]) for w in writes) == sorted(
        (path, 0, "safetensors", "node-a") for path in weights)
    assert all(w["site"].startswith(framework_file(transformers)) for w in writes)
    assert not [c for agent in node_agents.values() for c in records_of(agent, job, "collision")
                if c["path"] in weights]


def test_accelerate_save_on_each_node_safetensors_weights_are_a_job_collision(node_agents):
    accelerate = pytest.importorskip("accelerate")
    from twonodes import run_two_nodes
    job, out = run_two_nodes(node_agents, "acc-each",
                             [os.path.join(SCRIPTS, "accel_job.py"), "--save", "state-each-node"])
    weights = os.path.join(out, "state", "model.safetensors")
    assert_job_collision_on_both(node_agents, job, weights, "safetensors",
                                 framework_file(accelerate))


@pytest.fixture(scope="module")
def lightning_io_run(node_agents):
    """One two-node Lightning job shared by the two guard tests: it saves under the
    `local_rank == 0` guard to local.ckpt, then under `global_rank == 0` to global.ckpt
    (tests/frameworks/lightning_io_job.py). (job id, output dir). Each test asserts on its own
    path; that the bug's collision does not spill onto the correct save's path is part of
    what the global test checks."""
    pytest.importorskip("lightning")
    from twonodes import run_two_nodes
    yield run_two_nodes(node_agents, "pl-io",
                        [os.path.join(SCRIPTS, "lightning_io_job.py"), "--guard", "local",
                         "--guard", "global"])


def test_lightning_checkpoint_io_under_a_local_rank_guard_is_a_job_collision(node_agents,
                                                                              lightning_io_run):
    """trainer.strategy.checkpoint_io.save_checkpoint under `local_rank == 0`, 2 nodes: torch
    saves into a BytesIO, fsspec writes a temporary file and moves it onto local.ckpt -- the
    move is the write of local.ckpt, on each node, one job collision."""
    lightning = pytest.importorskip("lightning")
    job, out = lightning_io_run
    assert_job_collision_on_both(node_agents, job, os.path.join(out, "local.ckpt"), "fsspec",
                                 framework_file(lightning))


def test_lightning_checkpoint_io_under_a_global_rank_guard_is_nothing(node_agents,
                                                                      lightning_io_run):
    job, out = lightning_io_run
    path = os.path.join(out, "global.ckpt")
    agent = node_agents["node-a"]
    wait_for(lambda: len([w for w in records_of(agent, job, "write") if w["path"] == path]) == 3,
             timeout=30, message="rank 0's three writes of global.ckpt")
    for agent in node_agents.values():
        agent.wait_judged()
        # The job's only collisions are the local guard's, on its own path.
        assert {c["path"] for c in records_of(agent, job, "collision")} <= {
            os.path.join(out, "local.ckpt")}
        assert not [h for h in records_of(agent, job, "hazard") if h["path"] == path]
    writes = [w for agent in node_agents.values() for w in records_of(agent, job, "write")
              if w["path"] == path]
    assert {(w["rank"], w["writer"], w["node"]) for w in writes} == {(0, "fsspec", "node-a")}
