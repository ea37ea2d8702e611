"""Every `ckptwatch` command on a user's mistake: exit 2 and one line on stderr saying what is
wrong and what to do, never a traceback and never a pass on input it did not read (issue 20
item 5). The real CLI runs in a subprocess; cases that need an unreadable file run it without
the capabilities that let root read a mode-000 file (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)
when the tests run as root."""
import ctypes
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import REPO_ROOT, subprocess_env

PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def _without_dac_capabilities():
    """In the child before exec: root's bypass of file modes leaves its bounding set, so the
    program it runs gets it in no capability set (it reads a mode-000 file as anyone would)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            os._exit(99)


def unprivileged_kw() -> dict:
    return {"preexec_fn": _without_dac_capabilities} if os.geteuid() == 0 else {}


def ckptwatch(*args, cwd=None, unprivileged=False, timeout=60, **kw):
    extra = unprivileged_kw() if unprivileged else {}
    return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=cwd or REPO_ROOT,
                          env=kw.pop("env", None) or subprocess_env(), capture_output=True,
                          text=True, timeout=timeout, **extra, **kw)


def one_line(result) -> str:
    """The single stderr line of a usage error (asserting there is exactly one)."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def place():
    """A directory an unprivileged user can reach (pytest's tmp_path is under a 0700 one),
    holding the inputs the cases name."""
    top = tempfile.mkdtemp(prefix="ckptwatch-cli-")
    os.chmod(top, 0o755)
    with open(os.path.join(top, "passwd"), "w") as fh:
        fh.write("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/bin/false\n")
    with open(os.path.join(top, "README.md"), "w") as fh:
        fh.write("# not a checkpoint\n")
    with open(os.path.join(top, "secret.pt"), "wb") as fh:
        fh.write(b"PK\x03\x04 whatever")
    os.chmod(os.path.join(top, "secret.pt"), 0)
    os.symlink("loop.pt", os.path.join(top, "loop.pt"))
    for name in ("locked", "tree/locked", "empty", "docs", "walk"):
        os.makedirs(os.path.join(top, name))
    with open(os.path.join(top, "locked", "train.py"), "w") as fh:
        fh.write("import torch\ntorch.save({}, 'x.pt')\n")
    with open(os.path.join(top, "tree", "locked", "last.pt"), "wb") as fh:
        fh.write(b"")
    with open(os.path.join(top, "walk", "secret.pt"), "wb") as fh:
        fh.write(b"PK\x03\x04 whatever")
    os.chmod(os.path.join(top, "walk", "secret.pt"), 0)
    with open(os.path.join(top, "docs", "notes.txt"), "w") as fh:
        fh.write("no python here\n")
    os.chmod(os.path.join(top, "locked"), 0)
    os.chmod(os.path.join(top, "tree", "locked"), 0)
    os.mkfifo(os.path.join(top, "fifo.jsonl"))
    yield top
    for name in ("locked", "tree/locked"):
        os.chmod(os.path.join(top, name), 0o755)
    shutil.rmtree(top, ignore_errors=True)


# (args with {d} for the directory above, run unprivileged, what the one stderr line says)
CASES = {
    # report
    "report-misspelt-flag": (["report", "--jurnal", "x"], False,
                             "ckptwatch report: unrecognized arguments: --jurnal x; did you "
                             "mean --journal?"),
    "report-bad-format": (["report", "--format", "xml"], False,
                          "ckptwatch report: argument --format: invalid choice"),
    "report-not-a-journal": (["report", "--journal", "{d}/passwd"], False,
                             "is not a ckptwatch journal"),
    "report-fifo": (["report", "--journal", "{d}/fifo.jsonl"], False,
                    "is not a regular file"),
    "report-device": (["report", "--journal", "/dev/zero"], False, "is not a regular file"),
    "report-unreadable-dir": (["report", "--journal", "{d}/locked"], True,
                              "cannot read directory"),
    "report-dir-without-journals": (["report", "--journal", "{d}/empty"], False,
                                    "no *.jsonl journal in directory"),
    "report-missing": (["report", "--journal", "{d}/nothing.jsonl"], False, "no journal at"),
    # scan
    "scan-negative-rate": (["scan", "--max-rate", "-5", "{d}/README.md"], False,
                           "argument --max-rate: expected a number > 0, got '-5'"),
    "scan-nan-rate": (["scan", "--max-rate", "nan", "{d}/README.md"], False,
                      "argument --max-rate: expected a number > 0"),
    "scan-unreadable-file": (["scan", "{d}/secret.pt"], True,
                             "secret.pt: cannot read: Permission denied; run scan as a user"),
    "scan-device": (["scan", "/dev/null"], False, "/dev/null: not read: a character device"),
    "scan-symlink-loop": (["scan", "{d}/loop.pt"], False, "a symbolic link loop"),
    "scan-not-a-checkpoint": (["scan", "{d}/README.md"], False,
                              "README.md: not a known checkpoint format; name a checkpoint"),
    "scan-nothing-found": (["scan", "{d}/empty"], False, "no checkpoint files under"),
    "scan-unreadable-file-in-a-walk": (["scan", "{d}/walk"], True,
                                       "secret.pt: cannot read: Permission denied"),
    "scan-unreadable-subdir": (["scan", "{d}/tree"], True,
                               "cannot read directory: Permission denied"),
    # lint
    "lint-unreadable-dir": (["lint", "{d}/locked"], True,
                            "cannot read directory {d}/locked: Permission denied"),
    "lint-no-python": (["lint", "{d}/docs"], False, "no Python files under"),
    "lint-bad-size": (["lint", "--max-file-size", "-1", "{d}/docs"], False,
                      "argument --max-file-size"),
    "lint-infinite-size": (["lint", "--max-file-size", "1e400", "{d}/docs"], False,
                           "argument --max-file-size: expected a number > 0, got '1e400'"),
    "lint-misspelt-flag": (["lint", "--formt", "json", "{d}/docs"], False,
                           "did you mean --format?"),
    # demo: numbers checked before anything starts
    "demo-zero-ranks": (["demo", "--nproc", "0"], False,
                        "argument --nproc: expected a whole number from 2 to 16, got '0'"),
    "demo-one-rank": (["demo", "--nproc", "1"], False, "got '1'"),
    "demo-too-many-ranks": (["demo", "--nproc", "1000000"], False, "got '1000000'"),
    "demo-not-a-number": (["demo", "--nproc", "four"], False, "got 'four'"),
    # check, diagnose, run
    "check-negative-timeout": (["check", "--timeout", "-1", "--", "true"], False,
                               "argument --timeout: expected a number >= 0"),
    "check-no-command": (["check", "--"], False, "no command given"),
    "check-journal-in-a-missing-directory": (["check", "--journal", "{d}/no/such/j.jsonl",
                                              "--", "true"], False,
                                             "its directory does not exist"),
    "diagnose-not-a-journal": (["diagnose", "{d}/README.md", "--journal", "{d}/passwd"],
                               False, "is not a ckptwatch journal"),
    "diagnose-missing-log": (["diagnose", "{d}/no-such.log"], False, "cannot read"),
    "run-misspelt-flag": (["run", "--sockt", "x", "--", "true"], False,
                          "did you mean --socket?"),
    "unknown-command": (["reprot"], False, "ckptwatch: argument COMMAND: invalid choice"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mistake_is_exit_2_and_one_line(case, place):
    args, unprivileged, says = CASES[case]
    result = ckptwatch(*[a.format(d=place) for a in args], unprivileged=unprivileged,
                       cwd=place)
    line = one_line(result)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert says.format(d=place) in line, line
    prefix = "ckptwatch" if case == "unknown-command" else f"ckptwatch {args[0]}:"
    assert line.startswith(prefix), line
    assert not os.path.exists(os.path.join(place, "no")), "a directory was created"


def test_a_usage_error_names_the_subcommands_help_not_the_top_level_usage():
    result = ckptwatch("report", "--jurnal", "x")
    assert "usage: ckptwatch [-h]" not in result.stderr
    assert result.stderr.rstrip().endswith("(see ckptwatch report --help)")


def test_scan_still_reports_the_other_paths_of_an_incomplete_scan(place):
    empty = os.path.join(place, "tree", "empty.pt")
    open(empty, "wb").close()
    result = ckptwatch("scan", "--format", "json", "{}/README.md".format(place), empty)
    import json
    doc = json.loads(result.stdout)
    assert result.returncode == 2 and doc["exit_code"] == 2
    assert doc["unread"] == [f"{place}/README.md"]
    assert {f["status"] for f in doc["files"]} == {"unverifiable", "corrupt"}


def test_scan_of_a_walked_tree_leaves_what_it_does_not_read_by_design_alone(place):
    """In a walked directory, a FIFO named like a checkpoint is listed, not waited on, and
    does not make the scan incomplete (only a read that failed does)."""
    tree = os.path.join(place, "walk-by-design")
    os.makedirs(tree)
    open(os.path.join(tree, "empty.pt"), "wb").close()      # corrupt: 0 bytes
    os.mkfifo(os.path.join(tree, "pipe.pt"))
    result = ckptwatch("scan", tree)
    assert result.returncode == 1, result.stderr
    assert result.stderr == ""
    assert "not read: a FIFO" in result.stdout


def test_lint_of_a_readable_tree_still_exits_on_its_findings(place):
    tree = os.path.join(place, "code")
    os.makedirs(tree)
    with open(os.path.join(tree, "train.py"), "w") as fh:
        fh.write("import torch\nimport torch.distributed as dist\ndist.init_process_group()\n"
                 "torch.save({}, 'x.pt')\n")
    result = ckptwatch("lint", tree)
    assert result.returncode == 1 and "CKW001" in result.stdout and result.stderr == ""


# ---------------------------------------------------------------------------- the agent

def test_agent_journal_in_a_missing_directory_is_refused_and_not_created(tmp_path):
    journal = tmp_path / "no" / "such" / "dir" / "j.jsonl"
    result = ckptwatch("agent", "--journal.path", str(journal), "--ingest.socket",
                       str(tmp_path / "a.sock"), "--web.listen-address", "127.0.0.1:0")
    assert result.returncode == 2
    assert f"the directory {journal.parent} does not exist" in one_line(result)
    assert not (tmp_path / "no").exists()


def test_agent_watch_path_that_is_a_file_is_refused(tmp_path):
    afile = tmp_path / "f.txt"
    afile.write_text("x")
    result = ckptwatch("agent", "--watch.path", str(afile), "--journal.path",
                       str(tmp_path / "j.jsonl"))
    assert result.returncode == 2
    assert "is not a directory" in one_line(result)


def test_agent_warns_about_a_watch_path_that_does_not_exist(tmp_path):
    """A missing watch root is armed when it appears (monitor.fs.watch), so the agent starts,
    but says so instead of starting as if it watched it."""
    missing = tmp_path / "not-yet"
    proc = subprocess.Popen(
        [sys.executable, "-m", "monitor.cli", "agent", "--watch.path", str(missing),
         "--journal.path", str(tmp_path / "j.jsonl"), "--ingest.socket",
         str(tmp_path / "a.sock"), "--web.listen-address", "127.0.0.1:0",
         "--watch.mode", "polling"],
        cwd=REPO_ROOT, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:            # ends when the agent exits; stops at "started"
            lines.append(line)
            if "ckptwatch agent started" in line:
                break
        warned = [line for line in lines if "level=warn" in line]
        assert warned and "does not exist" in warned[0] and f"path={missing}" in warned[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_agent_py_version_and_a_missing_dependency_without_a_traceback():
    """`python -S` has no site-packages: the agent's dependencies are missing, as before
    `pip install`."""
    script = os.path.join(REPO_ROOT, "agent.py")
    env = {"PATH": os.environ.get("PATH", "")}
    version = subprocess.run([sys.executable, "-S", script, "--version"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert (version.returncode, version.stderr) == (0, "")
    assert version.stdout.startswith("ckptwatch ")
    run = subprocess.run([sys.executable, "-S", script], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert "is not installed" in one_line(run) and "pip install" in run.stderr


def test_agent_mistakes_are_one_line_each():
    result = ckptwatch("agent", "--collision.window", "-3", "--log.level", "loud")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2
    assert all(line.startswith("ckptwatch agent: --") for line in lines)
    assert lines[-1].endswith("(see ckptwatch agent --help)")


# ---------------------------------------------------------------------------- Ctrl-C

def _reading_stdin(pid: int) -> bool:
    """The process waits in a read of a pipe (its stdin here)."""
    try:
        with open(f"/proc/{pid}/wchan") as fh:
            if "pipe_read" in fh.read():
                return True
        with open(f"/proc/{pid}/syscall") as fh:
            return fh.read().startswith("0 0x0 ")      # read(0, ...) on x86-64
    except OSError:
        return False


def _interruptible() -> None:
    """In the child before exec: SIGINT at its default, as for a command in the foreground of
    a terminal, where a Ctrl-C comes from. A shell without job control starts a background job
    (`scripts/test ... &` in a script, as CI and load runs do) with SIGINT ignored, every
    process under it inherits that, and Python installs no KeyboardInterrupt handler for an
    ignored SIGINT: the command then never sees the signal and runs to its end (issue 22:
    `assert 0 == 130`, seen only on the loaded runs, which ran the suite that way)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignores(pid: int, sig: int) -> bool:
    """The process ignores sig (its SigIgn mask in /proc)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def wait_for(condition, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_ctrl_c_is_exit_130_and_one_line():
    proc = subprocess.Popen([sys.executable, "-m", "monitor.cli", "diagnose", "-"],
                            cwd=REPO_ROOT, env=subprocess_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_interruptible)
    try:
        wait_for(lambda: _reading_stdin(proc.pid), what="diagnose to read its stdin")
        assert not _ignores(proc.pid, signal.SIGINT), "a Ctrl-C could not reach it"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line] == ["ckptwatch diagnose: interrupted"]


def _session_members(sid: int) -> list:
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(name))
    return members


@pytest.mark.torch
def test_ctrl_c_in_demo_stops_the_job_and_the_agent_and_says_one_line():
    proc = subprocess.Popen([sys.executable, "-m", "monitor.cli", "demo", "--nproc", "2"],
                            cwd=REPO_ROOT, env=subprocess_env(OMP_NUM_THREADS=1),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_interruptible)
    try:
        assert not _ignores(proc.pid, signal.SIGINT), "a Ctrl-C could not reach it"
        workdir = None
        for line in proc.stdout:
            if "Working directory: " in line:
                workdir = line.rsplit("Working directory: ", 1)[1].strip()
            if line.startswith("[2/4]"):
                break
        assert workdir and os.path.isdir(workdir)
        # The buggy job runs: wait until torchrun has started its ranks, then Ctrl-C.
        wait_for(lambda: os.path.isdir(os.path.join(workdir, "buggy"))
                 or len(_session_members(proc.pid)) > 3, what="the demo job")
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "ckptwatch demo: interrupted"
    assert not os.path.exists(workdir)
    wait_for(lambda: not _session_members(proc.pid), timeout=30,
             what="the demo's job and agent to exit")


def test_report_of_an_unreadable_journal_file(place):
    journal = os.path.join(place, "j.jsonl")
    with open(journal, "w") as fh:
        fh.write('{"type": "write"}\n')
    os.chmod(journal, 0)
    result = ckptwatch("report", "--journal", journal, unprivileged=True, cwd=place)
    assert result.returncode == 2
    assert "cannot read journal" in one_line(result)


def test_modes_kept_for_the_fixture_cleanup(place):
    """The fixture's unreadable directories really are unreadable to the unprivileged run
    (else the cases above would pass for the wrong reason)."""
    result = subprocess.run(["ls", os.path.join(place, "locked")], capture_output=True,
                            **unprivileged_kw())
    assert result.returncode != 0
    assert not stat.S_IMODE(os.stat(os.path.join(place, "locked")).st_mode)


# ---------------------------------------------------------------------------- a bug

def test_a_bug_is_one_line_and_exit_70_and_v_shows_the_traceback(monkeypatch, capsys,
                                                                   tmp_path):
    """Not the user's mistake, still not a traceback on their screen: one line saying it is
    a bug and how to see more (EX_SOFTWARE, so a CI gate cannot take it for 0, 1 or 2)."""
    from monitor.cli import main as cli_main
    from monitor.cli import report

    def broken(args, out=None, err=None):
        raise TypeError("'int' object is not iterable")
    monkeypatch.setattr(report, "run", broken)
    journal = str(tmp_path / "j.jsonl")
    assert cli_main.main(["report", "--journal", journal]) == 70
    err = capsys.readouterr().err
    assert err == ("ckptwatch report: internal error: TypeError: 'int' object is not "
                   "iterable (a bug in ckptwatch; run it again with -v for the traceback)\n")
    with pytest.raises(TypeError):
        cli_main.main(["report", "-v", "--journal", journal])
