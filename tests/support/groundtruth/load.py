"""CPU load: busy processes at twice the core count, for as long as the block runs."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys


@contextlib.contextmanager
def cpu_load(factor: int = 2):
    """`factor` x os.cpu_count() processes spinning; killed (by their pids) on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL)
             for _ in range(factor * (os.cpu_count() or 1))]
    try:
        yield len(procs)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
