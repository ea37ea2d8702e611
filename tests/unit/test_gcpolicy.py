"""The agent process's collector settings (monitor.agent.gcpolicy), in a process of their own: they
are process-wide, and this test process must keep its own."""
import os
import subprocess
import sys

from helpers import REPO_ROOT


def test_configure_sets_the_thresholds_and_freezes_what_exists():
    code = ("import gc; from monitor.agent import gcpolicy; gcpolicy.configure(); "
            "print(gc.get_threshold() == (gcpolicy.GEN0_THRESHOLD, gcpolicy.GEN1_THRESHOLD, "
            "gcpolicy.GEN2_THRESHOLD), gc.get_freeze_count() > 1000, gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": REPO_ROOT}, check=True).stdout
    assert out.split() == ["True", "True", "True"]


def test_importing_the_daemon_leaves_the_collector_alone():
    """Only main() (the agent process) changes the settings, not a test or tool that imports
    monitor.agent.daemon."""
    code = ("import gc; before = gc.get_threshold(); import monitor.agent.daemon; "
            "print(gc.get_threshold() == before, gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": REPO_ROOT}, check=True).stdout
    assert out.split() == ["True", "0"]
