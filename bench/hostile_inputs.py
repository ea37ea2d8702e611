"""What hostile inputs cost, old code and new side by side (issue 17; docs/security.md).

Each measurement runs in a child process on one source tree (its directory first on
PYTHONPATH), capped at --cap-gib of address space so an old tree that reads forever fails
instead of the host. With --old, every measurement runs on the old tree and on this one, one
after the other, in the same minutes:

  slowloris   16 connections send a request line, then one header byte every 4 s, while a
              scrape is tried every second for --seconds: scrapes answered, first answer
  auth        basic auth with users `ci` (bcrypt cost 4, listed first) and `prometheus` (cost
              12): median time of a wrong password for an unknown user and for `prometheus`
  lint-big    `ckptwatch lint` over a 200 MB generated *.py: seconds, peak RSS, verdict
  lint-zero   `ckptwatch lint` over a directory holding `zero.py -> /dev/zero`

    python bench/hostile_inputs.py [--old PATH-TO-OLD-CHECKOUT] [--only NAME ...]

(The notice attack's figures come from tests/e2e/test_hostile_notices.py's processes; scan's
and the verifier's FIFO races from tests/unit/test_scan.py and test_verifier.py, which block
on the old code: there is no "time" to give for a hang.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import json, resource, sys, time
cap = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
"""

_SLOWLORIS = """
import socket, threading, urllib.request
from exporters.metrics.collector import build_registry
from exporters.metrics.server import MetricsServer
from exporters.metrics.state import MetricsState
seconds = float(sys.argv[2])
srv = MetricsServer("127.0.0.1:0", build_registry(MetricsState()))
srv.start()
socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(16)]
for s in socks:
    s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n")
stop = threading.Event()
def trickle():
    while not stop.wait(4.0):
        for s in socks:
            try:
                s.sendall(b"a")
            except OSError:
                pass
threading.Thread(target=trickle, daemon=True).start()
time.sleep(0.5)
ok = refused = 0
first = None
t0 = time.monotonic()
while time.monotonic() - t0 < seconds:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as r:
            r.read()
        ok += 1
        first = first if first is not None else round(time.monotonic() - t0, 3)
    except Exception:
        refused += 1
    time.sleep(1.0)
stop.set()
print(json.dumps({"scrapes_answered": ok, "scrapes_failed": refused,
                  "first_answer_s": first, "drops": srv.drops()}))
"""

_AUTH = """
import base64, statistics, bcrypt
from exporters.webconfig import BasicAuth
auth = BasicAuth({"ci": bcrypt.hashpw(b"a", bcrypt.gensalt(4)),
                  "prometheus": bcrypt.hashpw(b"b", bcrypt.gensalt(12))})
def median_ms(user):
    out = []
    for i in range(5):
        header = "Basic " + base64.b64encode(f"{user}:wrong{i}".encode()).decode()
        t = time.perf_counter()
        auth.check(header)
        out.append(time.perf_counter() - t)
    return round(statistics.median(out) * 1000, 1)
print(json.dumps({"unknown_user_ms": median_ms("mallory"),
                  "real_user_wrong_password_ms": median_ms("prometheus")}))
"""

_LINT = """
from monitor.cli import lint
t = time.monotonic()
try:
    findings, _ = lint.lint_paths([sys.argv[2]])
    said = [[f.code, f.message] for f in findings]
except MemoryError:
    said = "MemoryError"
rchar = next(int(l.split()[1]) for l in open("/proc/self/io") if l.startswith("rchar"))
print(json.dumps({"result": said, "seconds": round(time.monotonic() - t, 1),
                  "peak_MiB": peak_mib(), "bytes_read": rchar}))
"""


def run(tree: str, script: str, args: list, cap: int, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(script)
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(cap), *map(str, args)],
                              cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"result": f"no answer within {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"exit": proc.returncode, "stderr": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", help="an old checkout to measure side by side")
    parser.add_argument("--only", nargs="*", default=None,
                        choices=("slowloris", "auth", "lint-big", "lint-zero"))
    parser.add_argument("--seconds", type=float, default=40.0, help="slowloris duration")
    parser.add_argument("--cap-gib", type=float, default=4.0)
    args = parser.parse_args()
    cap = int(args.cap_gib * (1 << 30))
    trees = ([("old", os.path.abspath(args.old))] if args.old else []) + [("new", REPO)]
    work = tempfile.mkdtemp(prefix="ckw-hostile-")
    big, zero = os.path.join(work, "big"), os.path.join(work, "zero")
    os.mkdir(big)
    os.mkdir(zero)
    with open(os.path.join(big, "big.py"), "wb") as f:
        f.write(b"import torch.distributed\n")
        chunk = b"x = [1, 2, 3]\n" * 100_000
        while f.tell() < 200 << 20:
            f.write(chunk)
    os.symlink("/dev/zero", os.path.join(zero, "zero.py"))
    plan = {"slowloris": (_SLOWLORIS, [args.seconds], args.seconds + 60),
            "auth": (_AUTH, [], 300), "lint-big": (_LINT, [big], 600),
            "lint-zero": (_LINT, [zero], 300)}
    try:
        print(f"load: {os.getloadavg()[0]:.2f} (1 min)")
        for name, (script, extra, timeout) in plan.items():
            if args.only and name not in args.only:
                continue
            for label, tree in trees:
                print(f"{name:<10} {label}: {json.dumps(run(tree, script, extra, cap, timeout))}",
                      flush=True)
    finally:
        os.unlink(os.path.join(zero, "zero.py"))
        os.unlink(os.path.join(big, "big.py"))
        os.rmdir(big)
        os.rmdir(zero)
        os.rmdir(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
