"""Issue 17 before/after: each hostile input of the issue, on an old tree and this one, side by
side in one run (docs/security.md, "Issue 17: before and after").

    .venv/bin/python bench/hostile_probe.py --old /work/wt/base-f503c65 [--only CASE ...]

Every case runs `ckptwatch` (or a few lines of Python) of one tree in its own process group,
with that tree first on PYTHONPATH and that tree's .venv python when it has one, capped at
--cap-gib of address space (RLIMIT_AS: a process that reads forever fails with MemoryError
instead of hurting a shared machine) and --timeout seconds of wall time (a hang is "timeout").
Recorded per run: peak RSS of the process (wait4's ru_maxrss), wall seconds, exit code, and
what the case looks for in the output (a count, a traceback's last line). Old and new runs
alternate, case by case, so both see the same load.

Sizes are scaled down from the issue's where the old code would pass the caps anyway (the
issue's 1 M hazards and 2 M writes: 200 k here; 40 s of slowloris: 20 s). The notice attack
(item 1) and the stalled store (item 2) need a real agent, a victim torch process, a second uid
and torchrun: their figures come from tests/e2e/test_hostile_notices.py and
tests/e2e/test_jobscope_exit.py, not from this script.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))
sys.path.insert(0, REPO)

WALL0 = 1_764_457_487.0
ESC = "\x1b[2J\x1b]0;pwned\x07"


def _python(tree: str) -> str:
    own = os.path.join(tree, ".venv", "bin", "python")
    return own if os.path.exists(own) else sys.executable


def run(tree: str, argv: list, cap: int, timeout: float) -> dict:
    """One run: argv after `python`, in `tree`; what it cost and said."""
    def limit():
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    env = dict(os.environ, PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1")
    t0 = time.monotonic()
    proc = subprocess.Popen([_python(tree), *argv], cwd=tree, env=env, preexec_fn=limit,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    wall = time.monotonic() - t0
    return {"timed_out": timed_out, "exit": None if timed_out else proc.returncode,
            "wall_s": round(wall, 1), "out": out.decode("utf-8", "replace"),
            "err": err.decode("utf-8", "replace")}


def run_measured(tree: str, argv: list, cap: int, timeout: float) -> dict:
    """run() through a tiny wrapper that forks the case and reports its ru_maxrss (wait4:
    the peak of the case's process, or of the largest descendant it waited for). A case
    killed at the time cap has no figure ("?")."""
    wrapper = textwrap.dedent("""
        import os, sys
        pid = os.fork()
        if pid == 0:
            os.execv(sys.executable, [sys.executable] + sys.argv[1:])
        _, status, usage = os.wait4(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sys.stderr.write("\\n@@rss_kib=%d code=%d\\n" % (usage.ru_maxrss, code))
        sys.exit(code & 0xff)
    """)
    got = run(tree, ["-c", wrapper, *argv], cap, timeout)
    rss, code = None, got["exit"]
    for line in got["err"].splitlines():
        if line.startswith("@@rss_kib="):
            parts = dict(p.split("=") for p in line[2:].split())
            rss, code = int(parts["rss_kib"]) >> 10, int(parts["code"])
    got["err"] = "\n".join(l for l in got["err"].splitlines() if not l.startswith("@@"))
    got["rss_mib"], got["exit"] = rss, (None if got["timed_out"] else code)
    return got


def last_line(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return ascii(lines[-1][:240]) if lines else ""


# ---- inputs ---------------------------------------------------------------------------------

def _hazard(i: int) -> str:
    return json.dumps({"type": "hazard", "wall": WALL0 + i * 0.001, "path": f"/ckpt/p{i}.pt",
                       "hazard": "every_rank_writes", "job": "bench-job", "ranks": [0, 1],
                       "nodes": ["n0", "n1"], "shared": "nfs", "source": "job"})


def make_inputs(work: str, n_records: int) -> dict:
    import report_journals                      # bench/report_journals.py's generator
    paths = {}

    def d(name):
        p = os.path.join(work, name)
        os.mkdir(p)
        return p
    # lint
    fifo_dir = d("lint_fifo")
    os.mkfifo(os.path.join(fifo_dir, "train.py"))
    zero_dir = d("lint_zero")
    os.symlink("/dev/zero", os.path.join(zero_dir, "zero.py"))
    big = os.path.join(d("lint_big"), "big.py")
    with open(big, "wb") as f:
        f.write(b"import torch.distributed\n")
        chunk = b"x = [1, 2, 3]\n" * 100_000
        while f.tell() < 200 << 20:
            f.write(chunk)
    latin = os.path.join(d("lint_latin1"), "train.py")
    with open(latin, "wb") as f:
        f.write("# -*- coding: latin-1 -*-\nimport torch.distributed\nimport torch\n"
                "name = 'café.pt'\ntorch.save({}, name)\n".encode("latin-1"))
    paths.update(lint_fifo=fifo_dir, lint_zero=zero_dir, lint_big=os.path.dirname(big),
                 lint_latin1=latin)
    # report: journal directories holding what is not a file
    jfifo = d("report_fifo")
    report_journals.generate(os.path.join(jfifo, "a.jsonl"), "hazards", 10)
    os.mkfifo(os.path.join(jfifo, "b.jsonl"))
    jzero = d("report_zero")
    report_journals.generate(os.path.join(jzero, "a.jsonl"), "hazards", 10)
    os.symlink("/dev/zero", os.path.join(jzero, "b.jsonl"))
    paths.update(report_fifo=jfifo, report_zero=jzero)
    # report: large journals
    hz = os.path.join(work, "hazards.jsonl")
    report_journals.generate(hz, "hazards", n_records)
    wr = os.path.join(work, "writes.jsonl")
    report_journals.generate(wr, "writes", n_records)
    paths.update(report_hazards=hz, report_writes=wr)
    # report: odd records, each group after ten good hazards
    for group, lines in {
        "nested": ["[" * 3000 + "]" * 3000,
                   '{"type": "hazard", "path": ' + "[" * 3000 + "]" * 3000 + "}"],
        "types": [json.dumps(r) for r in (
            {"type": "hazard", "path": "/h1", "ranks": "0,1", "writers": "rank0",
             "hazard": ["k"], "shared": {"x": 1}, "job": ["j"], "wall": "soon"},
            {"type": "hazard", "path": {"a": 1}},
            {"type": "verification", "path": "/v1", "result": ["corrupt"], "cause": 7,
             "bytes": "big", "collision_id": {}},
            {"type": "write", "path": "/w", "pid": 1, "node": "n", "start_wall": "x"})],
        "ranks": [json.dumps({"type": "hazard", "wall": WALL0, "path": "/h", "job": "j",
                              "hazard": "every_rank_writes", "ranks": ESC + "0,1"})],
    }.items():
        p = os.path.join(work, f"odd_{group}.jsonl")
        with open(p, "w") as f:
            f.write("".join(_hazard(i) + "\n" for i in range(10)))
            f.write("".join(line + "\n" for line in lines))
        paths[f"report_{group}"] = p
    # scan: a link out of the tree to a secret; a pickle that calls os.system
    tree = d("scan_link")
    secret = os.path.join(work, "shadow")
    with open(secret, "wb") as f:
        f.write(b"root:$6$SECRETSECRET:19000:0:99999:7:::\n")
    os.symlink(secret, os.path.join(tree, "stolen.pt"))
    paths["scan_link"] = tree
    paths["secret_hex"] = b"root:$6$S"[:8].hex(" ")
    evil = d("scan_evil")
    import torch

    class CallsOsSystem:
        def __reduce__(self):
            return (os.system, ("exit 0",))
    torch.save({"w": torch.ones(2), "x": CallsOsSystem()}, os.path.join(evil, "evil.pt"))
    paths["scan_evil"] = evil
    # web config: a hash with a salt bcrypt refuses, and a cost-31 one
    import bcrypt
    good = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
    for name, h in {"salt": good[:28] + "z" + good[29:],
                    "cost31": good[:4] + "31" + good[6:]}.items():
        p = os.path.join(work, f"web_{name}.yml")
        with open(p, "w") as f:
            f.write(f"basic_auth_users:\n  prometheus: '{h}'\n")
        paths[f"web_{name}"] = p
    return paths


# ---- the cases ------------------------------------------------------------------------------

_WEB_LOAD = """
import base64, sys
from exporters import webconfig
try:
    cfg = webconfig.load(sys.argv[1])
except Exception as e:
    print("refused at start:", str(e)[:200]); sys.exit(2)
print("started with users", sorted(cfg.users))
if sys.argv[2] == "login":
    from exporters.webconfig import BasicAuth
    auth = BasicAuth(cfg.users)
    try:
        ok = auth.check("Basic " + base64.b64encode(b"prometheus:s3cret").decode())
        print("right password accepted:", bool(ok))
    except Exception as e:
        print("right password ->", type(e).__name__, e)
"""

_AUTH = """
import base64, bcrypt, statistics, time
from exporters.webconfig import BasicAuth
auth = BasicAuth({"ci": bcrypt.hashpw(b"a", bcrypt.gensalt(4)),
                  "prometheus": bcrypt.hashpw(b"b", bcrypt.gensalt(12))})
def median_ms(user):
    out = []
    for i in range(3):
        header = "Basic " + base64.b64encode(f"{user}:wrong{i}".encode()).decode()
        t = time.perf_counter()
        auth.check(header)
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1000
print(f"unknown user {median_ms('mallory'):.1f} ms, cost-12 user "
      f"{median_ms('prometheus'):.1f} ms")
"""

_SLOWLORIS = """
import os, socket, subprocess, sys, tempfile, threading, time, urllib.request
seconds = float(sys.argv[1])
d = tempfile.mkdtemp(prefix="ckw-slow-")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
agent = subprocess.Popen([sys.executable, "agent.py", "--web.listen-address",
                          f"127.0.0.1:{port}", "--ingest.socket", d + "/a.sock",
                          "--journal.path", d + "/j.jsonl", "--verify.enabled", "false"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
url = f"http://127.0.0.1:{port}/metrics"
try:
    t = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read(); break
        except Exception:
            if time.monotonic() - t > 30: print("agent never answered"); sys.exit(3)
            time.sleep(0.2)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    for c in socks:
        c.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n")
    stop = threading.Event()
    def trickle():
        while not stop.wait(4.0):
            for c in socks:
                try: c.sendall(b"a")
                except OSError: pass
    threading.Thread(target=trickle, daemon=True).start()
    time.sleep(0.5)
    ok = tried = 0
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        tried += 1
        try:
            urllib.request.urlopen(url, timeout=2).read(); ok += 1
        except Exception:
            pass
        time.sleep(1.0)
    stop.set()
    print(f"{ok} of {tried} scrapes answered")
finally:
    agent.kill(); agent.wait()
    subprocess.run(["rm", "-rf", d])
"""


# Item 1: a local user (uid 65534) points the root agent at another process through a
# "remote" report naming the agent's node and the victim's pid, with a hostile call site.
# Agent, victim (torch + the hook under warn) and attacker all from the tree under test.
_NOTICE = r"""
import json, os, subprocess, sys, tempfile, time
kind = sys.argv[1]
saves_after = 30
pub = tempfile.mkdtemp(prefix="ckw-notice-")
os.chmod(pub, 0o755)
sock = os.path.join(pub, "agent.sock")
journal = os.path.join(pub, "journal.jsonl")
fifo = os.path.join(pub, "trap.py")
os.mkfifo(fifo, 0o666)
site = {"dev_zero": "/dev/zero:1", "fifo": fifo + ":1",
        "escape": "\x1b[2J\x1b]0;pwned\x07\n2026-12-05 INFO forged log line:1"}[kind]
attacked = os.path.join(pub, "attacker.pt")
agent = subprocess.Popen([sys.executable, "agent.py", "--node.name", "victim-node",
                          "--ingest.socket", sock, "--ingest.socket-mode", "0666",
                          "--journal.path", journal, "--verify.enabled", "false",
                          "--collision.settle", "0.3", "--collision.job-settle", "0.3",
                          "--web.listen-address", "127.0.0.1:0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def records():
    try:
        return [json.loads(l) for l in open(journal) if l.strip()]
    except (OSError, ValueError):
        return []
def wait(cond, t):
    end = time.monotonic() + t
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False
victim, report, arrived, named = None, None, 0, None
try:
    assert wait(lambda: os.path.exists(sock), 30), "agent socket"
    env = dict(os.environ, CKPTWATCH_POLICY="warn", CKPTWATCH_SOCKET=sock,
               CKPTWATCH_NODE="victim-node", OMP_NUM_THREADS="1")
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, os.path.join(pub, "v.pt"),
                               str(saves_after)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = json.loads(victim.stdout.readline())
    subprocess.run([sys.executable, "-c", ATTACKER, sock, "65534", str(ready["pid"]), site,
                    attacked, "victim-node"], check=True, timeout=30)
    # Judged: the attacker's write is in the journal, then a second for the notice.
    wait(lambda: any(r.get("path") == attacked for r in records()), 15)
    time.sleep(1.0)
    victim.stdin.write("go\n"); victim.stdin.flush()
    line = victim.stdout.readline()
    report = json.loads(line) if line else None
    wait(lambda: sum(1 for r in records() if r.get("type") == "write"
                     and r.get("pid") == ready["pid"]) >= 1 + saves_after, 15)
    time.sleep(0.5)
    recs = records()
    arrived = sum(1 for r in recs if r.get("type") == "write" and r.get("pid") == ready["pid"]) - 1
    named = any(ready["pid"] in [w.get("pid") for w in (r.get("writers") or [r])
                                 if isinstance(w, dict)]
                for r in recs if r.get("path") == attacked)
finally:
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
    stderr = ""
    if victim is not None:
        try:
            victim.stdin.close()
        except OSError:
            pass
        try:
            victim.wait(20)
        except subprocess.TimeoutExpired:
            victim.kill(); victim.wait()
        stderr = victim.stderr.read()
    agent.terminate(); agent.wait(10)
    subprocess.run(["rm", "-rf", pub])
if report is None:
    print(f"victim gave no report ({stderr.strip().splitlines()[-1:]}); {arrived} of "
          f"{saves_after} later saves reached the agent; journal names it a writer: {named}")
else:
    print(f"victim VmHWM {ready['hwm'] >> 10} -> {report['hwm'] >> 10} MiB, notices read "
          f"{report['notices']['read']}, {arrived} of {saves_after} later saves reached the "
          f"agent, {stderr.count(chr(27))} ESC in its stderr, journal names it a writer of "
          f"the attacker's file: {named}")
"""


def _notice_script() -> str:
    """The end-to-end test's own victim and attacker (one definition), run by _NOTICE."""
    src = open(os.path.join(REPO, "tests", "e2e", "test_hostile_notices.py")).read()
    parts = {}
    for name in ("_VICTIM", "_ATTACKER"):
        head = name + " = r" + "'" * 3
        start = src.index(head) + len(head)
        parts[name] = src[start:src.index("'" * 3 + "\n", start)]
    victim = parts["_VICTIM"].replace("'" * 3 + " + str(SAVES_AFTER) + r" + "'" * 3,
                                      "int(sys.argv[2])")
    victim = victim.replace("(3 << 30, 3 << 30)", "(2 << 30, 2 << 30)")
    return f"VICTIM = {victim!r}\nATTACKER = {parts['_ATTACKER']!r}\n" + _NOTICE


# Item 2: 8 ranks (tests/support/jobrank.py, the tree's ckptwatch) save, then the store
# stalls for 4 s while they exit (tests/e2e/test_jobscope_exit.py's own run_ranks, StallProxy).
_STALL = r"""
import collections, importlib.util, os, sys, time
repo, tree = sys.argv[1], os.getcwd()
sys.path[:0] = [os.path.join(repo, "tests", "support")]
import torch.distributed as dist
from helpers import free_port, short_tmpdir, remove_tree
from stallproxy import StallProxy
spec = importlib.util.spec_from_file_location(
    "exit_test", os.path.join(repo, "tests", "e2e", "test_jobscope_exit.py"))
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
port = free_port()
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
workdir = short_tmpdir("cwst")
proxy = StallProxy(port)
try:
    results = mod.run_ranks(port, proxy.port, proxy, workdir, pythonpath=tree)
finally:
    proxy.close()
    remove_tree(workdir)
codes = collections.Counter(c for c, _, _ in results)
aborts = sum("terminate called" in e for _, e, _ in results)
print(f"rank exit codes {dict(codes)}, 'terminate called' in {aborts} of {len(results)}, "
      f"last exit {max(s for _, _, s in results):.1f} s after the go")
"""


def cases(p: dict, seconds: float) -> dict:
    """name -> (item, sub-case, argv, what to show of the result)."""
    cli = ["-m", "monitor.cli"]

    def count_esc(r):
        return f"{(r['out'] + r['err']).count(chr(27))} raw ESC"
    return {
        "notice-dev-zero": ("1", "notice with site /dev/zero:1 to another process",
                            ["-c", _notice_script(), "dev_zero"], lambda r: last_line(r["out"])),
        "notice-fifo": ("1", "notice with a FIFO site to another process",
                        ["-c", _notice_script(), "fifo"], lambda r: last_line(r["out"])),
        "notice-escape": ("1", "notice with escape codes and a forged log line",
                          ["-c", _notice_script(), "escape"], lambda r: last_line(r["out"])),
        "store-stall": ("2", "store stalls 4 s and recovers while 8 ranks exit",
                        ["-c", _STALL, REPO], lambda r: last_line(r["out"])),
        "lint-fifo": ("5", "lint on a *.py FIFO", cli + ["lint", p["lint_fifo"]], None),
        "lint-zero": ("5", "lint on *.py -> /dev/zero", cli + ["lint", p["lint_zero"]], None),
        "lint-200MB": ("5", "lint on a 200 MB *.py", cli + ["lint", p["lint_big"]], None),
        "scan-link": ("7", "scan: link out of the tree to a secret",
                      cli + ["scan", p["scan_link"]],
                      lambda r: "secret bytes printed" if p["secret_hex"] in r["out"]
                      else "no secret byte"),
        "scan-os-system": ("7", "scan: a .pt whose pickle calls os.system",
                           cli + ["scan", p["scan_evil"]],
                           lambda r: "says it names posix.system" if "posix.system"
                           in r["out"] else "plain ok, nothing said"),
        "report-fifo": ("5", "report: journal dir holding a FIFO",
                        cli + ["report", "--journal", p["report_fifo"]], None),
        "report-zero": ("5", "report: journal dir holding a /dev/zero link",
                        cli + ["report", "--journal", p["report_zero"]], None),
        "report-hazards-table": ("6", "report: 200 k hazards, table",
                                 cli + ["report", "--journal", p["report_hazards"],
                                        "-o", os.devnull], None),
        "report-hazards-json": ("6", "report: 200 k hazards, JSON",
                                cli + ["report", "--journal", p["report_hazards"],
                                       "--format", "json", "-o", os.devnull], None),
        "report-writes-html": ("6", "report: 200 k writes, html",
                               cli + ["report", "--journal", p["report_writes"],
                                      "--format", "html", "-o", os.devnull], None),
        "report-nested": ("6", "report: 3,000-deep nesting",
                          cli + ["report", "--journal", p["report_nested"]], None),
        "report-types": ("6", "report: fields of wrong types",
                         cli + ["report", "--journal", p["report_types"]], None),
        "report-string-ranks": ("6", "report: a string `ranks` with ESC",
                                cli + ["report", "--journal", p["report_ranks"]], count_esc),
        "web-bad-salt": ("8", "web config: bcrypt hash with an invalid salt",
                         ["-c", _WEB_LOAD, p["web_salt"], "login"],
                         lambda r: last_line(r["out"])),
        "web-cost31": ("8", "web config: cost-31 hash",
                       ["-c", _WEB_LOAD, p["web_cost31"], "nologin"],
                       lambda r: last_line(r["out"])),
        "web-unknown-user": ("8", "basic auth: unknown user vs cost-12 user (wrong password)",
                             ["-c", _AUTH], lambda r: last_line(r["out"])),
        "lint-latin1": ("9", "lint: latin-1 file with a PEP 263 line",
                        cli + ["lint", p["lint_latin1"]], None),
        "slowloris": ("4", f"16 slowloris connections, a scrape a second for {seconds:.0f} s",
                      ["-c", _SLOWLORIS, str(seconds)], lambda r: last_line(r["out"])),
    }


# Cases that start eight torch processes get more than --timeout (stated in the table).
LONGER = {"store-stall": 180.0}


def summary(r: dict, show) -> str:
    if r["timed_out"]:
        said = "timeout"
    elif show is not None:
        said = show(r)
    else:
        said = last_line(r["out"] + "\n" + r["err"]) if r["exit"] else last_line(r["out"])
    rss = "?" if r["rss_mib"] is None else f"{r['rss_mib']} MiB"
    code = "killed" if r["timed_out"] else r["exit"]
    return f"{rss} / {r['wall_s']} s / exit {code}: {said}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the old checkout (f503c65)")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=20.0, help="slowloris duration")
    parser.add_argument("--cap-gib", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    cap = int(args.cap_gib * (1 << 30))
    trees = [("before", os.path.abspath(args.old)), ("after", REPO)]
    work = tempfile.mkdtemp(prefix="ckw-probe-")
    print(f"load: {open('/proc/loadavg').read().split()[:3]}; cap {args.cap_gib} GiB "
          f"address space, {args.timeout:.0f} s", flush=True)
    plan = cases(make_inputs(work, args.records), args.seconds)
    rows = []
    for name, (item, what, argv, show) in plan.items():
        if args.only and name not in args.only:
            continue
        got = {}
        for label, tree in trees:
            timeout = LONGER.get(name, args.timeout)
            got[label] = summary(run_measured(tree, argv, cap, timeout),
                                 show).replace(work, "$TMP")
            print(f"{name:<22} {label:<6} {got[label]}", flush=True)
        rows.append((item, what, got["before"], got["after"]))
    print(f"load: {open('/proc/loadavg').read().split()[:3]}")
    print("\n| item | sub-case | before (f503c65) | after |\n|---|---|---|---|")
    for item, what, before, after in rows:
        print(f"| {item} | {what} | {before} | {after} |".replace("\\x1b", "ESC"))
    subprocess.run(["rm", "-rf", work])
    return 0


if __name__ == "__main__":
    sys.exit(main())
