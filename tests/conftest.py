import collections
import importlib.util
import os
import sys
import threading

import pytest

# The one place the shared helpers (tests/support/) are put on the path: test files in both
# tiers, and scripts run from them, import them by module name (`from helpers import wait_for`).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from helpers import remove_tree, short_tmpdir, wait_for  # noqa: E402

# Fixtures that tests of both tiers share and that belong with their support module's helpers
# (each module says what its fixtures are): a fixture is defined once, in one of these or below.
pytest_plugins = ["ckptsets", "jobstore", "metricsserve", "otheruser", "tlsfiles"]

# Tiers (markers registered in pyproject.toml). The tier is the path: every test under
# tests/e2e/ is marked `e2e` here (`-m "not e2e"` and `tests/unit` are the same fast tier), and
# one marked e2e anywhere else stops the run. A test marked `torch` skips, with the reason,
# where torch is not installed instead of failing.
_E2E_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e") + os.sep
_HAVE_TORCH = importlib.util.find_spec("torch") is not None
_UNGROUPED = pytest.StashKey[bool]()     # a test xdist should have grouped and did not


# The e2e lanes, by module, balanced by their cost in a whole-suite run (docs/decisions.md,
# "What each tier costs"): ~560 s and ~380 s of the 1,050 s of e2e on 2026-12-05. Lane "e2e-a"
# holds the multi-rank torchrun jobs whose verdicts depend on how writes fall (frameworks, job
# scope, multi-host, the soak, ground truth), "e2e-b" the file-system watcher's races and the
# CLI's end-to-end runs. A new e2e module that starts training jobs belongs in one of them.
_E2E_LANES = {
    **dict.fromkeys(("test_frameworks", "test_jobscope", "test_multihost", "test_resume_guard",
                     "test_torchrun", "test_soak", "test_groundtruth", "test_integrity",
                     "test_atomic", "test_jobscope_exit"), "e2e-a"),
    **dict.fromkeys(("test_fswatch", "test_check", "test_demo", "test_diagnose", "test_warn",
                     "test_dashboard", "test_acks", "test_exit_record", "test_resume",
                     "test_incomplete_set", "test_sets"), "e2e-b"),
}


def _lane_of(item):
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark is not None and mark.args else None


def _mark_the_tier(items):
    misplaced = []
    for item in items:
        if str(item.path).startswith(_E2E_DIR):
            item.add_marker(pytest.mark.e2e)
        elif item.get_closest_marker("e2e") is not None:
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError("marked e2e outside tests/e2e/ (the tier is the path: move "
                                "them there): " + ", ".join(misplaced))


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    # Before `-m` deselects anything (pytest's own hook runs inside this wrapper).
    _mark_the_tier(items)
    # scripts/test runs the suite on two pytest-xdist workers with --dist loadgroup. The marks
    # go on before xdist's own hook reads them (a wrapper runs first), and are checked after it.
    # - End-to-end tests run in two lanes (_E2E_LANES), each one test at a time, in collection
    #   order, on one worker: at most two e2e tests run at once. One lane held all of them
    #   until 2026-12-05 and took the whole run's wall time (1,050 s of e2e against 216 s of
    #   fast tier; the other worker idled for 14 minutes). Many of them count on the scheduler
    #   (ranks that save after a barrier overlap, a store answers within its timeout, the
    #   soak's latency bound): spread over both workers without lanes they failed where serial
    #   runs passed (docs/decisions.md). E2e modules in no lane (their writes are events a test
    #   sends or overlap by construction, or they start no job) are grouped by module like the
    #   fast tier's. CKPTWATCH_TEST_PARALLEL_E2E=1 spreads every e2e test over both workers.
    #   The lanes come first in the items (scripts/test passes --no-loadscope-reorder), so
    #   the two workers take one each before anything else.
    # - Other tests that share a module-scoped fixture stay on one worker, so its set-up is
    #   paid once; every other test goes wherever a worker is free.
    xdist = config.pluginmanager.hasplugin("xdist")
    if xdist:
        e2e_lanes = os.environ.get("CKPTWATCH_TEST_PARALLEL_E2E", "0") == "0"
        for item in items:
            lane = _E2E_LANES.get(item.module.__name__.rpartition(".")[2]) \
                if e2e_lanes and item.get_closest_marker("e2e") is not None else None
            if lane is not None:
                item.add_marker(pytest.mark.xdist_group(lane))
                continue
            info = getattr(item, "_fixtureinfo", None)
            scopes = {defs[-1].scope for defs in info.name2fixturedefs.values() if defs} \
                if info is not None else set()
            if "module" in scopes:
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    result = yield
    if xdist:
        # The lanes first, then the other groups largest first (what xdist's own reordering,
        # off in scripts/test, would do), so no big group is left for the end.
        lanes = sorted(set(_E2E_LANES.values()))
        sizes = collections.Counter(_lane_of(item) for item in items)
        items.sort(key=lambda item: (lanes.index(_lane_of(item)) if _lane_of(item) in lanes
                                     else len(lanes),
                                     -sizes[_lane_of(item)] if _lane_of(item) else 0))
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
        pytest.fail("pytest-xdist did not keep this test's xdist_group on one worker (pytest 9.2 "
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
def workdir(tmp_path):
    """tmp_path as a string, where the agent's journal and the hook's checkpoints go."""
    return str(tmp_path)


@pytest.fixture
def no_thread_leak():
    """Fail a test that leaves threads running (watchdog's habit)."""
    before = set(threading.enumerate())
    yield

    def leaked():
        return [t for t in threading.enumerate() if t not in before and t.is_alive()]
    wait_for(lambda: not leaked(), timeout=5, interval=0.05,
             message=lambda: f"no leaked threads: {leaked()}")


@pytest.fixture
def sock(sockdir):
    """The agent socket path tests listen on (a Receiver, a hand-driven server, an agent)."""
    return os.path.join(sockdir, "agent.sock")


@pytest.fixture
def make_emitter(no_thread_leak):
    """Private Emitters, each shut down after the test (no sender thread may leak)."""
    from ckptwatch.emitter import Emitter
    made = []

    def make(path, **kwargs):
        emitter = Emitter(path, **kwargs)
        made.append(emitter)
        return emitter

    yield make
    for emitter in made:
        emitter.shutdown(0.5)
