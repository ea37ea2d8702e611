import importlib.util
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import remove_tree, short_tmpdir  # noqa: E402

# Tiers (markers registered in pyproject.toml): `-m "not e2e"` is the fast tier; a test marked
# `torch` skips, with the reason, where torch is not installed instead of failing.
_HAVE_TORCH = importlib.util.find_spec("torch") is not None
_UNGROUPED = pytest.StashKey[bool]()     # a test xdist should have grouped and did not


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    # scripts/test runs the suite on pytest-xdist workers with --dist loadgroup. Tests that
    # share a module-scoped fixture (a torchrun job, a built wheel, a soak run) are kept on one
    # worker, so that set-up is paid once, as in a serial run; every other test goes wherever
    # a worker is free. The marks go on before xdist's own hook reads them (a wrapper runs
    # first), and are checked after it.
    xdist = config.pluginmanager.hasplugin("xdist")
    if xdist:
        for item in items:
            info = getattr(item, "_fixtureinfo", None)
            scopes = {defs[-1].scope for defs in info.name2fixturedefs.values() if defs} \
                if info is not None else set()
            if "module" in scopes:
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    result = yield
    # xdist groups by a suffix it appends to the node id; pytest 9.2 ignores that and the
    # groups silently fall apart (pytest-xdist issue 1386), each worker then building the
    # shared fixtures again. The grouped tests fail instead (pytest_runtest_setup).
    if xdist and getattr(config.option, "loadgroup", False):
        for item in items:
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
                item.stash[_UNGROUPED] = True
    return result


def pytest_runtest_setup(item):
    if item.stash.get(_UNGROUPED, False):
        pytest.fail("pytest-xdist did not keep this module's tests on one worker (pytest 9.2 "
                    "with xdist 3.8); use the versions pinned in requirements-test.txt",
                    pytrace=False)
    if not _HAVE_TORCH and item.get_closest_marker("torch") is not None:
        pytest.skip("needs torch (pip install -r requirements-test.txt)")


@pytest.fixture
def sockdir():
    """A short temporary directory for Unix sockets (tmp_path can exceed 108 bytes)."""
    path = short_tmpdir()
    yield path
    remove_tree(path)


@pytest.fixture
def no_thread_leak():
    """Fail a test that leaves threads running (watchdog's habit)."""
    before = set(threading.enumerate())
    yield
    import time
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not leaked:
            return
        time.sleep(0.05)
    raise AssertionError(f"leaked threads: {leaked}")
