"""Exporter conventions on the command line: --version everywhere, exact flag names only."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ckptwatch.version import __version__
from helpers import REPO_ROOT, subprocess_env
from monitor.agent import config
from monitor.cli import main as cli

COMMANDS = ([], ["agent"], ["run"], ["report"], ["scan"], ["lint"], ["demo"])


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "ckptwatch")
def test_version_on_every_command(command, capsys):
    with pytest.raises(SystemExit) as info:
        code = cli.main([*command, "--version"])
        raise SystemExit(code)            # `agent` returns its code instead of exiting
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ckptwatch {__version__}"


def test_agent_script_version():
    result = subprocess.run([sys.executable, "agent.py", "--version"], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, f"ckptwatch {__version__}")


@pytest.mark.parametrize("flag", ["--web.listen-addr=:1", "--web.listen=:1", "--log.lev=debug",
                                  "--config.f=x.yml", "--web.telemetry=/m"])
def test_agent_refuses_abbreviated_flags(flag):
    with pytest.raises(config.ConfigError, match="unknown flag"):
        config.load([flag])


def test_agent_exits_2_on_an_abbreviated_flag():
    result = subprocess.run([sys.executable, "agent.py", "--web.listen-addr=127.0.0.1:0"],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "unknown flag '--web.listen-addr" in result.stderr


@pytest.mark.parametrize("argv", [["report", "--jour", "x.jsonl"], ["report", "--form", "json"],
                                  ["scan", "--dee", "/tmp"], ["lint", "--assume", "x.py"],
                                  ["run", "--sock", "/x", "--", "true"], ["demo", "--npr", "2"]])
def test_subcommands_refuse_abbreviated_flags(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_run_passes_version_after_the_separator_to_the_command():
    args = cli.build_parser().parse_args(["run", "--", "python", "--version"])
    assert args.cmd == ["--", "python", "--version"]
