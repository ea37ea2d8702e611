"""The image's default command and build context, run for real: the agent started as the
image's user with its directories (and without them, the control), and the wheel built from
what the build stage copies (deploy/Dockerfile; the static checks are tests/unit/test_deploy.py)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from dockerfile import IMAGE_DIRS, default_command, dockerfile_stages, final_stage, image_env
from helpers import REPO_ROOT


def _run_default_command(root, port):
    """The image's ENTRYPOINT + CMD, as uid/gid of its USER with the image's HOME, with the
    image's paths moved under `root` and the metrics port made free. The process keeps only
    CAP_DAC_READ_SEARCH, so that uid 65532 can read this machine's Python under /root (0700);
    it grants no write anywhere, which is what the default command's trouble was."""
    uid, gid = final_stage()["USER"][-1].split(":")
    args = []
    for a in default_command()[2:]:
        a = a.replace("/run/ckptwatch", root + "/run/ckptwatch")
        a = a.replace("/var/lib/ckptwatch", root + "/var/lib/ckptwatch")
        args.append(f"--web.listen-address=127.0.0.1:{port}"
                    if a.startswith("--web.listen-address=") else a)
    env = {"HOME": root + image_env()["HOME"], "PATH": os.environ.get("PATH", "/usr/bin"),
           "PYTHONPATH": REPO_ROOT, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
           "--inh-caps=-all,+dac_read_search", "--ambient-caps=-all,+dac_read_search",
           sys.executable, "-m", "monitor.cli.main", "agent", *args]
    return subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True), int(uid)


def _image_root(with_dirs: bool) -> str:
    root = tempfile.mkdtemp(prefix="ckw-image-", dir="/tmp")
    os.chmod(root, 0o755)
    for d in ("run", "var/lib", "home"):
        os.makedirs(os.path.join(root, d), mode=0o755)
    if with_dirs:
        uid, gid = final_stage()["USER"][-1].split(":")
        subprocess.run(["sh", IMAGE_DIRS, uid, gid], env={**os.environ, "ROOT": root},
                       check=True, timeout=30)
    return root


needs_setpriv_as_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to start the agent as the image's uid")


@needs_setpriv_as_root
def test_image_default_command_starts_as_its_user():
    import urllib.request
    from helpers import free_port, wait_for
    root = _image_root(with_dirs=True)
    port = free_port()
    proc, uid = _run_default_command(root, port)
    try:
        def healthy():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz",
                                              timeout=1).status == 200
            except OSError:
                return False
        wait_for(healthy, timeout=30, message="the image's default command to serve /healthz")
        st = os.lstat(os.path.join(root, "run/ckptwatch/agent.sock"))
        assert st.st_uid == uid
        with open(f"/proc/{proc.pid}/status") as f:
            status = f.read()
        assert re.search(rf"^Uid:\s+{uid}\s+{uid}", status, re.M), status
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode == 0, out


@needs_setpriv_as_root
def test_image_default_command_fails_without_its_directories():
    """The control: the same command as the same user without the image's directories fails
    (the original image's defect: it cannot create /run/ckptwatch; the agent now refuses a
    journal directory that does not exist before it gets there), so the test above can fail."""
    from helpers import free_port
    root = _image_root(with_dirs=False)
    try:
        proc, _ = _run_default_command(root, free_port())
        out, _ = proc.communicate(timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode != 0
    assert ("Permission denied" in out or "does not exist" in out) and "/ckptwatch" in out, out


def test_dockerfile_build_context_builds_the_package():
    """What the build stage COPYs is enough to build the wheel (the old Dockerfile left out
    ckptwatch/ and LICENSE, and its `pip install .` would have failed)."""
    try:
        import setuptools
    except ImportError:
        pytest.skip("setuptools not installed")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"pyproject.toml needs setuptools>=77, have {setuptools.__version__}")
    src = tempfile.mkdtemp(prefix="ckw-context-")
    try:
        for kind, arg in dockerfile_stages()[0][1]:
            if kind != "COPY":
                continue
            *sources, dest = arg.split()
            for s in sources:
                target = os.path.join(src, dest.lstrip("./") if len(sources) == 1
                                      and not dest.endswith("/") else s)
                path = os.path.join(REPO_ROOT, s)
                if os.path.isdir(path):
                    shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.copy(path, target)
        out = os.path.join(src, "dist")
        result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                                 "--no-build-isolation", "-q", "-w", out, src],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert [n for n in os.listdir(out) if n.startswith("ckptwatch-")]
    finally:
        shutil.rmtree(src, ignore_errors=True)
