"""`ckptwatch check -- CMD`: the CI gate, run as a user runs it (a real agent, real commands,
real torchrun jobs on CPU, real signals)."""
import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from helpers import REPO_ROOT, subprocess_env, wait_for
from incident import write_incident_journal
from monitor.cli import check


PY = sys.executable
CHECK = [PY, "-m", "monitor.cli", "check"]


def run_check(*args, timeout=300, **env):
    return subprocess.run([*CHECK, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env(OMP_NUM_THREADS=1, **env))


def torchrun(out, save, width=256):
    return ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "monitor.cli.demo_job",
            "--out", str(out), "--save", save, "--steps", "2", "--width", str(width)]


# ---------------------------------------------------------------------------- usage, status

def test_no_command_is_a_usage_error():
    for args in ([], ["--"], ["--format", "json", "--"]):
        result = run_check(*args)
        assert result.returncode == 2, result.stderr
        assert "no command given" in result.stderr
        assert "usage: ckptwatch check" in result.stderr


def test_help_shows_an_example():
    result = run_check("--help")
    assert result.returncode == 0
    assert "torchrun --standalone --nproc-per-node 2" in result.stdout
    assert "exit status: 1 if a collision" in result.stdout


def test_an_old_journal_is_refused(tmp_path):
    journal = tmp_path / "j.jsonl"
    journal.write_text('{"type":"write"}\n')
    result = run_check("--journal", str(journal), "--", PY, "-c", "pass")
    assert result.returncode == 2
    assert "exists already" in result.stderr


def test_failing_command_gives_its_own_exit_code_and_its_output_passes_through():
    result = run_check("--", PY, "-c", "import sys; print('to stdout'); "
                       "print('to stderr', file=sys.stderr); sys.exit(3)")
    assert result.returncode == 3, result.stderr
    assert result.stdout == "to stdout\n"            # CMD's stdout, nothing else
    assert result.stderr.startswith("to stderr\n")
    assert "command exit 3" in result.stderr


def test_command_killed_by_a_signal_gives_128_plus_signum():
    result = run_check("--", PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert "killed by SIGKILL" in result.stderr


def test_missing_command_is_127():
    result = run_check("--", "no-such-command-ckptwatch")
    assert result.returncode == 127
    assert "command not found" in result.stderr


# ---------------------------------------------------------------------------- the verdict

def test_hazard_records_of_any_kind_fail_the_check(tmp_path):
    """Job scope's hazard records (whatever their fields) count; the incident journal holds
    collisions, a corrupt verdict and one hazard."""
    journal = str(tmp_path / "j.jsonl")
    write_incident_journal(journal)
    found = check.read_findings(journal)
    assert found.counts["hazards"] == 1
    assert found.hazards[0]["hazard"] == "shared_path_no_guard"
    assert found.counts["corrupt"] == 1
    assert found.counts["collisions"] >= 2
    # A hazard alone is enough.
    only_hazard = check.Findings(hazards=[{"type": "hazard"}])
    only_hazard.counts["hazards"] = 1
    outcome = check.Outcome(["x"], 0, only_hazard)
    assert (outcome.verdict, outcome.exit_code) == ("unsafe", 1)
    assert "1 hazard(s)" in check.render_table(outcome)
    # ... and a clean journal passes with the command's status.
    clean = check.Outcome(["x"], 4, check.Findings())
    assert (clean.verdict, clean.exit_code) == ("command_failed", 4)
    incomplete = check.Outcome(["x"], 0, check.Findings(), judged=False, incomplete="timeout")
    assert (incomplete.verdict, incomplete.exit_code) == ("incomplete", 1)


@pytest.mark.torch
def test_corrupt_checkpoint_in_a_watched_directory_fails_the_check(tmp_path):
    """A process that is not Python (no hook) leaves a truncated .pt in a watched directory:
    the agent's watcher sees it and its verifier finds it corrupt. Unwatched, nothing is seen:
    the verdict comes from --watch.path."""
    import torch
    buf = io.BytesIO()
    torch.save({"w": torch.arange(50_000)}, buf)
    source = tmp_path / "good.bin"
    source.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    watched = tmp_path / "ckpt"
    watched.mkdir()
    target = watched / "model.pt"
    writer = ["sh", "-c", f"cat {source} > {target}"]

    result = run_check("--watch.path", str(watched), "--format", "json", "--", *writer)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "unsafe"
    assert report["command_exit_code"] == 0
    assert [v["path"] for v in report["corrupt"]] == [str(target)]
    assert report["corrupt"][0]["result"] == "corrupt"
    assert report["counts"]["corrupt"] == 1

    target.unlink()
    result = run_check("--", *writer)
    assert result.returncode == 0, result.stderr
    assert "0 corrupt checkpoint(s)" in result.stderr


@pytest.mark.torch
def test_unguarded_two_rank_job_fails(tmp_path):
    result = run_check("--", *torchrun(tmp_path / "out", "every-rank"))
    assert result.returncode == 1, result.stderr[-3000:]
    err = result.stderr
    assert "collision, 2 writers" in err
    assert "demo_job.py" in err                       # the call site
    assert "fix: guard this call site" in err
    assert "FAIL: checkpointing is unsafe" in err
    assert result.stdout == ""                        # the job prints nothing; nor do we


@pytest.mark.torch
def test_guarded_two_rank_job_passes_and_json_has_the_documented_shape(tmp_path):
    out = tmp_path / "out"
    keep = tmp_path / "keep"
    # Hook only: with --watch.path, a watcher's change notice handled after the hook's end
    # sometimes leaves the path never verified (an agent issue, see the check report notes).
    result = run_check("--format", "json", "--keep", str(keep), "--", *torchrun(out, "rank0"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert set(report) == {"verdict", "exit_code", "command", "command_exit_code", "judged",
                           "incomplete", "counts", "collisions", "hazards", "corrupt",
                           "journal", "agent_log"}
    assert report["verdict"] == "safe" and report["exit_code"] == 0
    assert report["command"][:2] == ["torchrun", "--standalone"]
    assert report["command_exit_code"] == 0 and report["judged"] is True
    assert report["collisions"] == report["hazards"] == report["corrupt"] == []
    assert report["counts"]["writes"] >= 1
    assert report["counts"]["verified_by_result"] == {"ok": 1}, report   # last.pt, once
    assert report["journal"] == str(keep / "journal.jsonl")
    assert os.path.exists(report["journal"]) and os.path.exists(report["agent_log"])


@pytest.mark.torch
def test_the_verdict_waits_for_a_verification_still_to_come(tmp_path):
    """The checkpoint is verified 8 s after its save (--verify.quiet 8), longer than the 1 s
    of --idle and than the command's exit after the save: the verdict is there only because
    check waits for ckptwatch_verifications_pending to reach 0."""
    result = run_check("--format", "json", "--verify.quiet", "8", "--", PY, "-c",
                       "import sys, torch; torch.save({'w': torch.zeros(8)}, sys.argv[1])",
                       str(tmp_path / "model.pt"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["counts"]["writes"] == 1
    assert report["counts"]["verified_by_result"] == {"ok": 1}, report


# ---------------------------------------------------------------------------- signals

_TRAPPER = textwrap.dedent("""
    import os, signal, sys, time
    marker = sys.argv[1]
    def on_term(signum, frame):
        with open(marker + ".term", "w") as fh:
            fh.write("SIGTERM")
        sys.exit(7)
    signal.signal(signal.SIGTERM, on_term)
    with open(marker + ".ready", "w") as fh:
        fh.write(os.environ.get("CKPTWATCH_SOCKET", ""))
    time.sleep(120)
""")


def _start_trapped(tmp_path):
    marker = str(tmp_path / "cmd")
    proc = subprocess.Popen([*CHECK, "--", PY, "-c", _TRAPPER, marker], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env())
    wait_for(lambda: os.path.exists(marker + ".ready"), timeout=60,
             message="the command to start")
    socket = open(marker + ".ready").read()
    family = psutil.Process(proc.pid).children(recursive=True)
    return proc, marker, socket, family


def test_sigterm_is_forwarded_and_the_agent_is_gone(tmp_path):
    proc, marker, socket, family = _start_trapped(tmp_path)
    assert socket and os.path.exists(socket)
    assert len(family) == 2                           # the agent and CMD
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert open(marker + ".term").read() == "SIGTERM"
    assert proc.returncode == 7, err                  # CMD's own status
    assert "command exit 7" in err
    assert not os.path.exists(socket)
    assert not os.path.exists(os.path.dirname(socket))
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_sigkilled_check_takes_its_agent_with_it(tmp_path):
    proc, marker, socket, family = _start_trapped(tmp_path)
    cmd = [p for p in family if "-c" in p.cmdline()]
    agent = [p for p in family if p not in cmd]
    assert len(agent) == 1
    try:
        proc.kill()
        proc.wait(timeout=30)     # CMD, still running, holds the output pipes: no communicate
        psutil.wait_procs(agent, timeout=20)
        assert not agent[0].is_running()
    finally:
        for p in cmd:
            p.kill()
        proc.communicate(timeout=30)


# ---------------------------------------------------------------------------- docs

EXAMPLE = os.path.join(REPO_ROOT, "docs", "examples", "pre-merge-check.sh")


@pytest.mark.torch
def test_pre_merge_script_fails_an_unguarded_job():
    result = subprocess.run(
        ["sh", EXAMPLE, "--save", "every-rank", "--width", "256"], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=300,
        env=subprocess_env(CKPTWATCH=f"{PY} -m monitor.cli", TRAIN="-m monitor.cli.demo_job",
                           PATH=os.path.dirname(PY) + os.pathsep + os.environ["PATH"]))
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "FAIL: checkpointing is unsafe" in result.stderr
    assert "pre-merge: checkpointing is unsafe" in result.stderr


def test_github_actions_example_runs_the_pre_merge_script():
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load(open(os.path.join(REPO_ROOT, "docs", "examples",
                                                "github-actions.yml")))
    steps = [s for job in workflow["jobs"].values() for s in job["steps"]]
    assert any("docs/examples/pre-merge-check.sh" in s.get("run", "") for s in steps)
    page = open(os.path.join(REPO_ROOT, "docs", "check.md")).read()
    assert "## CI gate: ckptwatch check" in page
    assert "examples/pre-merge-check.sh" in page
    assert "docs/check.md" in open(os.path.join(REPO_ROOT, "README.md")).read()
