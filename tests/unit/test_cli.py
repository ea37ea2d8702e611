"""The `ckptwatch` command itself: every subcommand is reachable and says what it does."""
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, subprocess_env


def ckptwatch(*args, **kw):
    return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=REPO_ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60, **kw)


def test_no_command_prints_help_and_exits_2():
    result = ckptwatch()
    assert result.returncode == 2
    for command in ("demo", "agent", "run", "report", "scan"):
        assert f"ckptwatch {command}" in result.stdout


@pytest.mark.parametrize("command", ["run", "report", "scan", "demo"])
def test_subcommand_help(command):
    result = ckptwatch(command, "--help")
    assert result.returncode == 0 and "usage: ckptwatch " + command in result.stdout


def test_agent_help_is_the_agents_own():
    result = ckptwatch("agent", "--help")
    assert result.returncode == 0 and "--web.listen-address" in result.stdout


def test_run_without_a_command_is_a_usage_error():
    result = ckptwatch("run", "--")
    assert result.returncode == 2 and result.stderr


@pytest.mark.torch
def test_scan_finds_a_corrupt_file_and_exits_1(tmp_path):
    import torch
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"w": torch.arange(1000)}, good)
    data = good.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    result = ckptwatch("scan", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("ok") and line.endswith("good.pt") for line in lines)
    assert any(line.startswith("corrupt") and line.endswith("bad.pt") for line in lines)
    assert ckptwatch("scan", str(good)).returncode == 0
    assert ckptwatch("scan", str(tmp_path / "missing")).returncode == 2
