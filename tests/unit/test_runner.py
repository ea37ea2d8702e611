"""monitor.cli.run: `ckptwatch run` environment and exec, with real child processes."""
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import subprocess_env
from monitor.cli import run as runner
from ckptwatch.bootstrap import BOOTSTRAP_DIR
from receiver import Receiver

PY = sys.executable


def test_build_env_prepends_bootstrap_and_keeps_existing_path():
    environ = {"PYTHONPATH": f"/a{os.pathsep}/b", "HOME": "/home/x"}
    env = runner.build_env(environ, "/run/agent.sock")
    assert env["PYTHONPATH"].split(os.pathsep) == [BOOTSTRAP_DIR, "/a", "/b"]
    assert env["CKPTWATCH_SOCKET"] == "/run/agent.sock"
    assert env["HOME"] == "/home/x"
    assert environ == {"PYTHONPATH": f"/a{os.pathsep}/b", "HOME": "/home/x"}  # not mutated


def test_build_env_without_socket_or_pythonpath_and_nested_runs():
    env = runner.build_env({"CKPTWATCH_SOCKET": "/keep.sock"})
    assert env["PYTHONPATH"] == BOOTSTRAP_DIR
    assert env["CKPTWATCH_SOCKET"] == "/keep.sock"
    # `ckptwatch run -- ckptwatch run -- ...` does not stack the bootstrap twice.
    assert runner.build_env(env)["PYTHONPATH"] == BOOTSTRAP_DIR


def test_relative_socket_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runner.build_env({}, "agent.sock")["CKPTWATCH_SOCKET"] == str(tmp_path / "agent.sock")


@pytest.mark.parametrize("argv", [[], ["--"]])
def test_no_command_is_a_usage_error(argv, capsys):
    assert runner.run(argv) == 2
    assert "no command" in capsys.readouterr().err


def test_unknown_command_exits_127(capsys):
    assert runner.run(["ckptwatch-no-such-command-xyz", "arg"]) == 127
    assert "command not found: ckptwatch-no-such-command-xyz" in capsys.readouterr().err


def test_non_executable_file_exits_126(tmp_path, capsys):
    target = tmp_path / "script.sh"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o644)
    assert runner.run([str(target)]) == 126
    assert "cannot execute" in capsys.readouterr().err


@pytest.mark.torch
def test_run_execs_a_real_python_child_with_the_hook_active(sock, tmp_path):
    child_code = textwrap.dedent("""
        import os, sys, torch
        torch.save({"x": torch.ones(2)}, "model.pt")
        sys.exit(3)
        """)
    launcher = ("import sys; from monitor.cli.run import run; "
                f"sys.exit(run(sys.argv[1:], socket={sock!r}))")
    with Receiver(sock) as rx:
        out = subprocess.run([PY, "-c", launcher, "--", PY, "-c", child_code],
                             env=subprocess_env(), cwd=str(tmp_path), capture_output=True,
                             text=True, timeout=120)
        # exec: the child's own exit status is ours.
        assert out.returncode == 3, out.stderr
        (end,) = rx.wait_count("end", 1)        # a short save's only event (its end)
        assert end["path"] == str(tmp_path / "model.pt")
        assert end["outcome"] == "ok" and end["bytes"] == os.path.getsize(tmp_path / "model.pt")
