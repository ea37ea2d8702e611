"""The import boundaries (pyproject.toml [tool.importlinter], docs/architecture.md) hold.

import-linter checks the declared contracts; the stdlib-only rule for ckptwatch is also checked
positively here, on import-linter's own import graph (grimp), because a forbidden list can only
name the third-party packages someone thought of.
"""
from __future__ import annotations

import os
import re

import subprocess
import tomllib          # the tests run on 3.11+ (the agent supports 3.10)
import sys

import pytest

from helpers import REPO_ROOT, subprocess_env

pytest.importorskip("importlinter", reason="import-linter not installed (requirements-test.txt)")
import grimp  # noqa: E402  (import-linter's graph builder, installed with it)


def _lint_imports() -> subprocess.CompletedProcess:
    # The console script sits next to the interpreter running the tests (venv) or on PATH.
    script = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    cmd = [script] if os.path.exists(script) else ["lint-imports"]
    return subprocess.run(cmd + ["--no-cache"], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    result = _lint_imports()
    assert result.returncode == 0, f"import contracts broken:\n{result.stdout}\n{result.stderr}"
    # The configuration was read, every contract of it: with no contracts lint-imports would
    # also exit 0, and one it could not parse would not be listed.
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        declared = [c["name"] for c in tomllib.load(f)["tool"]["importlinter"]["contracts"]]
    assert len(declared) >= 8
    for name in declared:
        assert re.search(rf"^{re.escape(name)} KEPT", result.stdout, re.M), (name, result.stdout)
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout)
    assert kept and int(kept.group(1)) == len(declared), result.stdout


def test_ckptwatch_imports_only_the_standard_library():
    graph = grimp.build_graph("ckptwatch", include_external_packages=True)
    outside = {m for m in graph.modules if m != "ckptwatch" and not m.startswith("ckptwatch.")}
    not_stdlib = sorted(m for m in outside
                        if m not in sys.stdlib_module_names and m != "__future__")
    assert not_stdlib == [], f"ckptwatch imports non-stdlib modules: {not_stdlib}"


def test_exporters_reach_no_monitor_module_but_the_model():
    # The contract ignores the edges to monitor.detect.model; this sees through them: nothing
    # the exporters import, directly or through the model, is another module of monitor.
    graph = grimp.build_graph("exporters", "monitor", "ckptwatch")
    reached = graph.find_upstream_modules("exporters", as_package=True)
    of_monitor = sorted(m for m in reached if m == "monitor" or m.startswith("monitor."))
    assert of_monitor == ["monitor.detect.model"], of_monitor
