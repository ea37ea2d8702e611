"""The queue between ingest and the agent's loop (monitor/ingest/inbox.py): batches in order,
a bounded take, and a wait that ends within its timeout even when a signal interrupts it
(issue 22: an agent told to stop by SIGTERM never left its loop and was SIGKILLed)."""
import subprocess
import sys
import textwrap
import threading
import time

from helpers import REPO_ROOT, subprocess_env
from monitor.ingest.inbox import BATCH, Inbox

# In a fresh interpreter: signal handlers run only in a main thread, and a wait that never
# ends must not hang the test run. A late batch (LATE s) ends the wait of a queue that ignores
# its timeout: take() then returns it instead of nothing.
LATE = 10.0
_SIGNALLED_WAIT = textwrap.dedent(f"""
    import os, signal, threading, time
    from monitor.ingest.inbox import Inbox

    inbox = Inbox()
    handled = []

    def slow_handler(signum, frame):
        # The handler -- or, on a loaded machine, the wait for the GIL before it runs --
        # ends after the take's deadline.
        time.sleep(0.5)
        handled.append(signum)

    signal.signal(signal.SIGUSR1, slow_handler)
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    threading.Timer({LATE}, inbox.put, ([{{"type": "late"}}],)).start()
    started = time.monotonic()
    got = inbox.take(0.2)
    print(len(handled), len(got), round(time.monotonic() - started, 2), flush=True)
    os._exit(0)
""")


def test_a_take_interrupted_by_a_signal_returns_within_its_timeout():
    """SIGTERM's handler runs in the loop's wait; when it ends past the wait's deadline the
    wait must still end (queue.SimpleQueue.get(timeout) waits forever then on CPython
    3.10-3.12, so the agent's loop never saw `stop`)."""
    result = subprocess.run([sys.executable, "-c", _SIGNALLED_WAIT], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True,
                            timeout=LATE + 50)
    assert result.returncode == 0, result.stderr
    handled, got, seconds = result.stdout.split()
    assert handled == "1", "the signal did not interrupt the wait"
    assert got == "0", (f"take(0.2) waited {seconds}s, until a batch came: a signal made it "
                        "ignore its timeout")
    assert float(seconds) < LATE


def test_take_returns_batches_in_order_and_counts_the_backlog():
    inbox = Inbox()
    assert inbox.take(0) == [] and inbox.backlog() == 0
    inbox.put([{"n": 1}, {"n": 2}])
    inbox.put([{"n": 3}])
    assert inbox.backlog() == 3
    assert [e["n"] for e in inbox.take(0)] == [1, 2, 3]
    assert inbox.backlog() == 0 and inbox.oldest_wait() == 0.0


def test_a_take_stops_adding_batches_at_about_BATCH_events():
    inbox = Inbox()
    for _ in range(3):
        inbox.put([{}] * (BATCH // 2))
    assert len(inbox.take(0)) == BATCH
    assert inbox.backlog() == BATCH // 2
    assert len(inbox.take(0)) == BATCH // 2


def test_a_waiting_take_returns_the_batch_put_meanwhile():
    inbox = Inbox()
    threading.Timer(0.05, inbox.put, ([{"type": "start"}],)).start()
    started = time.monotonic()
    assert inbox.take(30.0) == [{"type": "start"}]
    assert time.monotonic() - started < 25.0       # woken by the put, not by the timeout


def test_done_acknowledges_what_was_taken():
    inbox = Inbox()
    inbox.put([{}])
    inbox.put([{}])
    inbox.take(0)
    assert inbox.finished() == 0
    inbox.done()
    assert inbox.finished() == 2
