"""`ckptwatch demo` — the README's first command — runs end to end and says what it saw."""
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, subprocess_env

pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def test_demo_reports_the_buggy_job_and_not_the_fixed_one():
    result = subprocess.run([sys.executable, "-m", "monitor.cli", "demo"], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "concurrent collision, 4 writers" in out
    for rank in range(4):
        assert f"rank{rank}@" in out
    assert ('ckptwatch_collisions_total{kind="concurrent",scope="node",source="hook",'
            'training_job="buggy"} 1.0') in out
    assert not [line for line in out.splitlines()
                if "ckptwatch_collisions_total" in line and 'training_job="fixed"' in line]
    assert "buggy/last.pt: COLLISION reported" in out
    assert "fixed/last.pt: no collision reported" in out
    assert "fix: guard this call site with a global-rank-0 check" in out
