"""The wheel built from this repository (in a subprocess, ~10 s): what it installs and what it
does not."""
import os
import subprocess
import sys
import zipfile

import pytest

from helpers import REPO_ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    # A copy of the tracked files (as they are now, uncommitted edits included) keeps build/
    # and *.egg-info out of the work tree, and untracked files out of the wheel.
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src, dst = os.path.join(REPO_ROOT, name), build / "src" / name
        if os.path.isfile(src):
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(open(src, "rb").read())
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "-w", str(out), str(build / "src")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (path,) = [p for p in out.iterdir() if p.suffix == ".whl"]
    return path


def test_wheel_installs_no_top_level_agent_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"ckptwatch", "monitor", "exporters"}, top
    assert "agent.py" not in names


def test_wheel_carries_the_bootstrap_license_and_one_version(wheel):
    from ckptwatch.version import __version__
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckptwatch/bootstrap/sitecustomize.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert os.path.basename(wheel).startswith(f"ckptwatch-{__version__}-")
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text
    assert "Requires-Dist: watchdog<8,>=7.1" in text
    entry = zipfile.ZipFile(wheel).read(
        [n for n in names if n.endswith("entry_points.txt")][0]).decode()
    assert "ckptwatch = monitor.cli.main:main" in entry
