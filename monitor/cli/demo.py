"""`ckptwatch demo`: the whole product in one command, on CPU, in about half a minute.

It starts a private agent (its own socket, journal and metrics port), runs a real 4-rank
torchrun job (gloo) in which every rank saves to one path under `ckptwatch run`, then the fixed
job (only global rank 0 saves), and prints the report, the metric lines and whether each
checkpoint still loads.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from monitor.cli.launcher import AgentProcess
from monitor.cli.style import NORMAL, QUIET, VERBOSE, Painter

# What -q keeps: the report and the verdicts on the checkpoints, not the steps before them.
_level = [NORMAL]


def _say(text: str = "", level: int = NORMAL) -> None:
    if _level[0] >= level:
        print(text, flush=True)


class JobFailed(Exception):
    """A demo job exited non-zero: the message names it and where its output is."""


def _run_job(workdir: str, sock: str, nproc: int, mode: str, job: str) -> float:
    from monitor.cli import run as runner
    out = os.path.join(workdir, job)
    env = runner.build_env(os.environ, sock)
    env["CKPTWATCH_JOB"] = job
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "-m", "monitor.cli.demo_job", "--out", out, "--save", mode,
           "--width", "2048"]   # 32 MiB of weights: long enough saves to overlap for sure
    started = time.monotonic()
    log_path = os.path.join(workdir, f"{job}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C: torchrun passes SIGTERM on to its workers (a SIGKILL would orphan them).
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    if _level[0] >= VERBOSE:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            sys.stderr.write(fh.read()[-20000:])
    if code != 0:
        raise JobFailed(f"the {job} job failed (exit {code}); its output: {log_path}")
    return time.monotonic() - started


def _collisions(journal: str) -> list[dict]:
    from exporters.journal import read_records
    return [r for r in read_records(journal) if r.get("type") == "collision"]


def _load_verdict(path: str, collided: bool) -> str:
    import torch
    from monitor.cli.demo_job import consistency
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # the point of the demo is to show this failure
        return f"torch.load FAILS: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    mixed = consistency(state)
    if mixed:
        return "torch.load succeeds, but the contents are MIXED:\n    " + mixed
    verdict = f"torch.load succeeds and holds rank {state['writer_rank']}'s checkpoint"
    if collided:
        verdict += "\n    (one writer's bytes won this time; the next run may tear the file)"
    return verdict


def _metric_lines(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    wanted = ("ckptwatch_collisions_total", "ckptwatch_writes_total",
              "ckptwatch_last_collision_timestamp_seconds",
              "ckptwatch_checkpoint_verifications_total", "ckptwatch_corrupt_checkpoints_total")
    # Zero-valued series (pre-created so alerts work from the start) are noise here.
    return [line for line in text.splitlines()
            if line.startswith(wanted) and not line.endswith(" 0.0")]


def _agent_verdict(journal: str, path: str) -> str | None:
    from exporters.journal import read_records
    for r in read_records(journal):
        if r.get("type") == "verification" and r.get("path") == path:
            link = f", written by collision {r['collision_id']}" if r.get("collision_id") else ""
            return f"the agent verified it: {r['result'].upper()} ({r['cause']}{link})"
    return None


def run(nproc: int = 4, keep: bool = False, verbosity: int = NORMAL) -> int:
    """The demo; 0 when it showed what it should, 1 when not or a job failed (one line; the
    working directory is kept for its logs), 2 without torch. Ctrl-C stops the job and the
    agent and removes the working directory (KeyboardInterrupt goes on to main: exit 130)."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        print("ckptwatch demo: needs torch in this Python: pip install torch", file=sys.stderr)
        return 2
    _level[0] = verbosity
    workdir = tempfile.mkdtemp(prefix="ckptwatch-demo-")
    try:
        return _demo(workdir, nproc)
    except (JobFailed, RuntimeError) as exc:    # RuntimeError: the agent did not start
        keep = True
        print(f"ckptwatch demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            _say(f"\nkept: {workdir} (journal.jsonl, agent.log, checkpoints)")


def _demo(workdir: str, nproc: int) -> int:
    _say(f"ckptwatch demo: a {nproc}-rank CPU job (torchrun, gloo) in which every rank saves")
    _say("to one checkpoint path, then the same job fixed. Working directory: " + workdir)
    agent = AgentProcess(workdir, "--collision.settle", "0.5", "--verify.quiet", "0.5",
                         log_level="warning")
    sock, journal, url = agent.socket, agent.journal, agent.url
    try:
        agent.start(timeout=20)
        _say(f"\n[1/4] agent running: socket {sock}, metrics {url}/metrics")
        _say("[2/4] buggy job: every rank calls torch.save(state, '.../buggy/last.pt')")
        took = _run_job(workdir, sock, nproc, "every-rank", "buggy")
        _say(f"      finished in {took:.1f}s")
        _say("[3/4] fixed job: only global rank 0 saves (dist.get_rank() == 0)")
        took = _run_job(workdir, sock, nproc, "rank0", "fixed")
        _say(f"      finished in {took:.1f}s")
        # Both files are verified once quiet (--verify.quiet 0.5 after their last write), and a
        # collision is final before its file is quiet (--collision.settle 0.5): when both
        # verdicts are in the journal, so is every collision these jobs made.
        checkpoints = [os.path.join(workdir, job, "last.pt") for job in ("buggy", "fixed")]
        deadline = time.monotonic() + 30
        while (not all(_agent_verdict(journal, p) for p in checkpoints)
               and time.monotonic() < deadline):
            time.sleep(0.2)
        paint = Painter(sys.stdout)
        _say("[4/4] what ckptwatch saw\n")
        from monitor.cli import report
        from monitor.cli.journalview import load
        collisions = load(journal)
        _say(report.render_table(collisions, width=80), QUIET)
        _say("\nmetrics (" + url + "/metrics):", QUIET)
        for line in _metric_lines(url):
            _say("  " + line, QUIET)
        _say("\ncheckpoints on disk:", QUIET)
        for job in ("buggy", "fixed"):
            path = os.path.join(workdir, job, "last.pt")
            hit = any(c["path"] == path for c in _collisions(journal))
            seen = (paint("COLLISION reported", "bad") if hit
                    else paint("no collision reported", "good"))
            _say(f"  {job}/last.pt: {seen}", QUIET)
            _say(f"    {_load_verdict(path, hit)}", QUIET)
            verdict = _agent_verdict(journal, path)
            if verdict:
                _say(f"    {verdict}", QUIET)
        buggy_hit = any(c["path"].endswith("/buggy/last.pt") for c in _collisions(journal))
        fixed_hit = any(c["path"].endswith("/fixed/last.pt") for c in _collisions(journal))
        if not buggy_hit or fixed_hit:
            _say("\nunexpected: the demo did not see what it should (see agent.log)", QUIET)
            return 1
        _say("\nThe fix: guard the save with a global-rank-0 check, e.g.\n"
             "    if torch.distributed.get_rank() == 0:\n"
             "        torch.save(state, path)", QUIET)
        return 0
    finally:
        agent.close()
