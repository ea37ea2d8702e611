"""ckptwatch.bootstrap: sitecustomize start-up, post-import hook, chaining, kill switch.

Every case runs a fresh interpreter with the bootstrap directory on PYTHONPATH, the way
`ckptwatch run` starts processes. A tiny fake `torch` package (save + serialization) makes the
import-machinery cases fast and runnable in a Python without torch or ckptwatch installed; real
torch is used where it matters.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO_ROOT, subprocess_env
from ckptwatch.bootstrap import BOOTSTRAP_DIR
from receiver import Receiver

PY = sys.executable
# The interpreter behind the venv: no torch, no ckptwatch in its site-packages.
BASE_PY = getattr(sys, "_base_executable", None) or sys.executable

FAKE_TORCH = {
    "torch/__init__.py": """
        import os
        IMPORTS = int(os.environ.get("FAKE_TORCH_FAIL_FIRST", "0"))
        if IMPORTS and not os.path.exists(os.environ["FAKE_TORCH_MARK"]):
            open(os.environ["FAKE_TORCH_MARK"], "w").close()
            raise ImportError("fake torch failed to import")
        from torch import serialization
        from torch.serialization import save
        """,
    "torch/serialization.py": """
        def save(obj, f, *args, **kwargs):
            with open(f, "wb") as fh:
                fh.write(repr(obj).encode())
        """,
    "torch/extra.py": "VALUE = 42\n",
}


@pytest.fixture
def fake_torch(tmp_path):
    root = tmp_path / "fake"
    for rel, text in FAKE_TORCH.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text))
    return str(root)


def bootstrap_env(*extra_path, repo_on_path=True, **env):
    """Like `ckptwatch run`: bootstrap first on PYTHONPATH, then extra_path entries."""
    base = subprocess_env(**env)
    entries = [BOOTSTRAP_DIR, *extra_path]
    if repo_on_path:
        entries.append(REPO_ROOT)
    base["PYTHONPATH"] = os.pathsep.join(entries)
    return base


def run(code: str, env: dict, cwd: str, python: str = PY) -> dict:
    out = subprocess.run([python, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bare_python_without_ckptwatch_installed_gets_patched_on_import(fake_torch, sock,
                                                                        tmp_path):
    probe = subprocess.run([BASE_PY, "-c", "import monitor"], cwd=str(tmp_path),
                           capture_output=True, env={"PATH": os.environ["PATH"]})
    if probe.returncode == 0:
        pytest.skip("the base interpreter already has ckptwatch installed")
    env = bootstrap_env(fake_torch, repo_on_path=False, CKPTWATCH_SOCKET=sock)
    with Receiver(sock) as rx:
        result = run("""
            import importlib, json, sys
            from ckptwatch import hook
            before = "torch" in sys.modules
            import torch
            torch.save({"a": 1}, "x.pt")
            print(json.dumps({"before": before, "installed": hook.is_installed()}))
            """, env, str(tmp_path), python=BASE_PY)
        assert result == {"before": False, "installed": True}
        (end,) = rx.wait_count("end", 1)
        assert end["path"] == str(tmp_path / "x.pt") and end["outcome"] == "ok"


def test_post_import_hook_leaves_the_import_system_as_it_was(fake_torch, tmp_path):
    result = run("""
        import importlib, importlib.machinery, json, sys
        from ckptwatch import hook
        def watching():
            return any(type(f).__name__ == "TorchImportWatcher" for f in sys.meta_path)
        watching_before = watching()
        import torch
        import torch.extra
        loader = torch.__loader__
        state = {
            "watching_before": watching_before,
            "installed": hook.is_installed(),
            "watcher_removed": not watching(),
            "loader_type": isinstance(loader, importlib.machinery.SourceFileLoader),
            "loader_clean": "exec_module" not in vars(loader),
            "spec_loader_same": torch.__spec__.loader is loader,
            "submodule": torch.extra.VALUE,
        }
        reloaded = importlib.reload(torch)
        state["reload_ok"] = reloaded is torch
        print(json.dumps(state))
        """, bootstrap_env(fake_torch), str(tmp_path))
    assert result == {"watching_before": True, "installed": True, "watcher_removed": True,
                      "loader_type": True, "loader_clean": True, "spec_loader_same": True,
                      "submodule": 42, "reload_ok": True}


def test_failed_torch_import_is_untouched_and_a_retry_is_patched(fake_torch, tmp_path):
    mark = str(tmp_path / "failed-once")
    result = run("""
        import json, sys
        from ckptwatch import hook
        try:
            import torch
            first = "imported"
        except ImportError as exc:
            first = str(exc)
        sys.modules.pop("torch", None)
        import torch
        print(json.dumps({"first": first, "installed": hook.is_installed()}))
        """, bootstrap_env(fake_torch, FAKE_TORCH_FAIL_FIRST="1", FAKE_TORCH_MARK=mark),
        str(tmp_path))
    assert result == {"first": "fake torch failed to import", "installed": True}


@pytest.mark.torch
def test_real_torch_is_patched_right_after_import(sock, tmp_path):
    with Receiver(sock) as rx:
        result = run("""
            import json, os
            import torch
            from torch import save        # bound after the post-import patch: reported
            from ckptwatch import hook
            save(torch.zeros(2), "early.pt")
            print(json.dumps({"installed": hook.is_installed(), "pid": os.getpid()}))
            """, bootstrap_env(CKPTWATCH_SOCKET=sock), str(tmp_path))
        assert result["installed"] is True
        (end,) = rx.wait_count("end", 1)
        assert end["pid"] == result["pid"]
        assert end["path"] == str(tmp_path / "early.pt")
        assert end["site"] == "<string>:6"


def test_process_without_torch_pays_nothing(tmp_path):
    result = run("""
        import json, sys, threading
        print(json.dumps({"torch": "torch" in sys.modules,
                          "hook": "ckptwatch.hook" in sys.modules,
                          "emitter": "ckptwatch.emitter" in sys.modules,
                          "threads": threading.active_count(),
                          "watching": [type(f).__name__ for f in sys.meta_path
                                       if type(f).__name__ == "TorchImportWatcher"]}))
        """, bootstrap_env(), str(tmp_path))
    assert result == {"torch": False, "hook": False, "emitter": False, "threads": 1,
                      "watching": ["TorchImportWatcher"]}


def test_initialize_installs_at_once_when_torch_is_already_imported(fake_torch, tmp_path):
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([fake_torch, REPO_ROOT])
    result = run("""
        import json, torch
        from ckptwatch import bootstrap
        from ckptwatch import hook
        bootstrap.initialize()
        print(json.dumps({"installed": hook.is_installed()}))
        """, env, str(tmp_path))
    assert result == {"installed": True}


def test_disable_turns_the_bootstrap_off(fake_torch, tmp_path):
    result = run("""
        import json, sys
        import torch
        print(json.dumps({"bootstrap": "ckptwatch.bootstrap" in sys.modules,
                          "hook": "ckptwatch.hook" in sys.modules,
                          "patched": hasattr(torch.save, "__ckptwatch_original__")}))
        """, bootstrap_env(fake_torch, CKPTWATCH_DISABLE="1"), str(tmp_path))
    assert result == {"bootstrap": False, "hook": False, "patched": False}


USER_SITECUSTOMIZE = """
import os
os.environ["USER_SITECUSTOMIZE_RAN"] = "yes"
MARKER = "user"
"""


@pytest.mark.parametrize("disable", ["", "1"])
def test_chains_to_the_users_sitecustomize(fake_torch, tmp_path, disable):
    user_dir = tmp_path / "usersite"
    user_dir.mkdir()
    (user_dir / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    result = run("""
        import json, os, sys
        import sitecustomize, torch
        print(json.dumps({"ran": os.environ.get("USER_SITECUSTOMIZE_RAN"),
                          "module": getattr(sitecustomize, "MARKER", None),
                          "patched": hasattr(torch.save, "__ckptwatch_original__")}))
        """, bootstrap_env(str(user_dir), fake_torch, CKPTWATCH_DISABLE=disable),
        str(tmp_path))
    assert result == {"ran": "yes", "module": "user", "patched": not disable}


def test_broken_user_sitecustomize_does_not_break_start_up(fake_torch, tmp_path):
    user_dir = tmp_path / "usersite"
    user_dir.mkdir()
    (user_dir / "sitecustomize.py").write_text("raise RuntimeError('user bug')\n")
    out = subprocess.run([PY, "-c", "import torch, json; print(json.dumps("
                          "hasattr(torch.save, '__ckptwatch_original__')))"],
                         env=bootstrap_env(str(user_dir), fake_torch), cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "true"
    assert "user bug" in out.stderr          # reported, as Python itself would


@pytest.mark.parametrize("kind", ["module", "package"])
@pytest.mark.parametrize("order", ["monitor-first", "torch-first"])
def test_users_own_monitor_module_is_not_shadowed(fake_torch, sock, tmp_path, order, kind):
    # The agent's package is called `monitor`, a name a training repo may use for a module or a
    # package of its own; the training side (`ckptwatch`) must neither need nor shadow it.
    project = tmp_path / "project"
    project.mkdir()
    if kind == "module":
        (project / "monitor.py").write_text("WHO = 'user'\n")
    else:
        (project / "monitor").mkdir()
        (project / "monitor" / "__init__.py").write_text("WHO = 'user'\n")
    imports = "import monitor, torch" if order == "monitor-first" else "import torch, monitor"
    (project / "train.py").write_text(textwrap.dedent(f"""
        import json, os
        {imports}
        torch.save(1, "x.pt")
        print(json.dumps({{"who": getattr(monitor, "WHO", None),
                          "patched": hasattr(torch.save, "__ckptwatch_original__")}}))
        """))
    with Receiver(sock) as rx:
        out = subprocess.run([PY, str(project / "train.py")],
                             env=bootstrap_env(fake_torch, CKPTWATCH_SOCKET=sock),
                             cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"who": "user", "patched": True}
        (end,) = rx.wait_count("end", 1)
        assert end["path"] == str(tmp_path / "x.pt")
