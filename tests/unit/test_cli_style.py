"""Colour, -q/-v and the human format's name, the same on every `ckptwatch` command
(monitor/cli/style.py). Colour is checked on a real pseudo-terminal (the pty module): on it
by default, off with NO_COLOR set (https://no-color.org) and off when output is a pipe."""
import json
import os
import pty
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, subprocess_env
from monitor.cli import style

ESC = "\x1b["
COMMANDS = ("run", "check", "report", "scan", "lint", "diagnose", "demo")


def on_terminal(*args, env=None, timeout=60) -> tuple[int, str]:
    """Run the CLI with stdout and stderr on a pseudo-terminal; (exit code, what it showed)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "monitor.cli", *args], cwd=REPO_ROOT,
                            env=env or subprocess_env(), stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:             # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout=timeout), b"".join(chunks).decode("utf-8", "replace")


def piped(*args, env=None):
    return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=REPO_ROOT,
                          env=env or subprocess_env(), capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def corrupt(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"")           # 0 bytes: corrupt, no torch needed
    return str(path)


@pytest.fixture
def journal(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text(json.dumps({"type": "write", "path": "/x/last.pt"}) + "\n")
    return str(path)


@pytest.fixture
def finding(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import torch\nimport torch.distributed as dist\n"
                    "dist.init_process_group()\ntorch.save({}, 'x.pt')\n")
    return str(path)


def _env(**extra):
    env = subprocess_env(**extra)
    if "NO_COLOR" not in extra:
        env.pop("NO_COLOR", None)
    return env


@pytest.mark.parametrize("args, coloured", [
    (lambda f: ["scan", f["corrupt"]], f"{ESC}31;1mcorrupt{ESC}0m"),
    (lambda f: ["lint", f["finding"]], f"{ESC}31;1mCKW001{ESC}0m"),
    (lambda f: ["report", "--journal", f["journal"]], f"{ESC}32mno collisions"),
], ids=["scan", "lint", "report"])
def test_colour_on_a_terminal_only_and_never_with_no_color(args, coloured, corrupt, journal,
                                                            finding):
    argv = args({"corrupt": corrupt, "journal": journal, "finding": finding})
    code, shown = on_terminal(*argv, env=_env())
    assert coloured in shown, shown
    # NO_COLOR with any non-empty value turns it off; an empty one does not (no-color.org).
    code_off, plain = on_terminal(*argv, env=_env(NO_COLOR="1"))
    assert ESC not in plain and code_off == code
    _, empty_value = on_terminal(*argv, env=_env(NO_COLOR=""))
    assert coloured in empty_value
    result = piped(*argv, env=_env())
    assert ESC not in result.stdout + result.stderr and result.returncode == code


def test_painter_follows_isatty_and_no_color():
    class Tty:
        def isatty(self):
            return True
    assert style.Painter(Tty(), environ={})("x", "bad") == f"{ESC}31;1mx{ESC}0m"
    assert style.Painter(Tty(), environ={"NO_COLOR": "yes"})("x", "bad") == "x"
    assert style.Painter(None, environ={})("x", "bad") == "x"          # no isatty at all


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_q_and_v(command):
    result = piped(command, "--help")
    assert result.returncode == 0
    assert "-q, --quiet" in result.stdout and "-v, --verbose" in result.stdout


def test_agent_has_q_and_v_as_log_levels():
    from monitor.agent.config import load
    assert load(["-q"]).log_level == "error"
    assert load(["-v"]).log_level == "debug"
    assert load(["-v", "--log.level", "warn"]).log_level == "warn"   # the explicit flag wins
    result = piped("agent", "--help")
    assert "-q, --quiet" in result.stdout and "-v, --verbose" in result.stdout


def test_q_and_v_together_is_a_usage_error(corrupt):
    result = piped("scan", "-q", "-v", corrupt)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1


def test_scan_q_prints_only_what_is_wrong_and_v_what_was_read(corrupt, tmp_path):
    normal = piped("scan", corrupt)
    quiet = piped("scan", "-q", corrupt)
    verbose = piped("scan", "-v", corrupt)
    assert normal.returncode == quiet.returncode == verbose.returncode == 1
    assert "1 files" in normal.stdout and "1 files" not in quiet.stdout
    assert quiet.stdout.startswith("corrupt") and quiet.stderr == ""
    assert "ckptwatch scan: read 1 file(s)" in verbose.stderr


def test_report_q_prints_nothing_when_clean(journal):
    assert piped("report", "--journal", journal).stdout.startswith("no collisions")
    quiet = piped("report", "-q", "--journal", journal)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    verbose = piped("report", "-v", "--journal", journal)
    assert "ckptwatch report: read 1 file(s) of 1 journal(s)" in verbose.stderr


def test_lint_v_says_how_many_files_it_read(finding):
    verbose = piped("lint", "-v", finding)
    assert verbose.returncode == 1
    assert verbose.stderr == "ckptwatch lint: read 1 file(s), 1 finding(s)\n"


def test_lint_calls_its_human_format_table_and_still_takes_text(finding):
    table = piped("lint", "--format", "table", finding)
    text = piped("lint", "--format", "text", finding)
    default = piped("lint", finding)
    assert table.returncode == text.returncode == default.returncode == 1
    assert table.stdout == text.stdout == default.stdout and "CKW001" in table.stdout
    assert "{table,json,text}" in piped("lint", "--help").stdout


def test_run_v_says_where_events_go():
    result = piped("run", "-v", "--socket", "/tmp/x.sock", "--", sys.executable, "-c", "pass")
    assert result.returncode == 0
    assert "events go to /tmp/x.sock" in result.stderr


def test_check_colours_its_verdict_and_q_keeps_only_it():
    """check's report goes to stderr, after CMD's output: on a terminal its verdict line is
    coloured; -q leaves only that line when checkpointing was safe."""
    code, shown = on_terminal("check", "-q", "--", sys.executable, "-c", "pass",
                              env=_env(), timeout=180)
    assert code == 0, shown
    assert f"{ESC}32mckptwatch check: OK: no collision" in shown
    assert "command exit 0" not in shown
    result = piped("check", "--", sys.executable, "-c", "pass", env=_env())
    assert result.returncode == 0 and ESC not in result.stderr
    assert "ckptwatch check: command exit 0" in result.stderr
