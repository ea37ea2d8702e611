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
(item 1) starts the tree's real agent, a victim torch process and an attacker as uid 65534; the
stalled store (item 2) runs tests/e2e/test_jobscope_exit.py's run_ranks on the tree.

The job's store (item 3, cases store-*) runs a real TCPStore, one real agent per node and two
real ranks of a simulated 2-node job under the tree's hook (`warn`), and an attacker process
that writes at the keys THAT tree reads: f503c65's slot keys PREFIX/<h>/<epoch>/<i> with their
counter .../n and its ticket counter PREFIX/t; this tree's write logs PREFIX/p/<h> and exit
count PREFIX/x (the prefix is the one the rank's own job scope reports). Recorded: each rank's
exit code and peak RSS (wait4), its stderr (bytes, raw ESC, C++ frame lines), job scope's
state, whether a later save of one path by both ranks is still exchanged (a rank's
remote_reported counter), and what the agents' journals hold.
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


# Item 3: the job's store as input. A real TCPStore (in the case's process), one real agent per
# node and 2 real ranks of a simulated 2-node job (WORLD_SIZE 2, LOCAL_WORLD_SIZE 1: job scope
# on) with the tree's hook under `warn`; an attacker process (the tree's python, a plain torch
# TCPStore client) writes into the store at the keys THAT tree reads (its own layout: f503c65's
# PREFIX/<h>/<epoch>/n slot counter, PREFIX/<h>/<epoch>/<i> JSON slots and PREFIX/t ticket
# counter; this tree's PREFIX/p/<h> write log and PREFIX/x exit count). The prefix is the one
# the rank's own job scope reports (scope.prefix), so neither tree's key rules are copied here.
_RANK3 = r"""
import json, os, resource, sys, time
import torch
import ckptwatch
ckptwatch.install()
from ckptwatch import jobscope
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    scope = jobscope.instance()
    if scope is not None and scope.state != "connecting":
        break
    time.sleep(0.02)
scope = jobscope.instance()
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])
def say(**kw):
    kw.update(state=scope.state, stats={k: v for k, v in scope.stats().items()
                                        if isinstance(v, (int, str))}, hwm_kib=hwm())
    print(json.dumps(kw), flush=True)
say(ready=True, prefix=scope.prefix, pid=os.getpid())
for line in sys.stdin:
    cmd = json.loads(line)
    for path in cmd.get("save", []):
        torch.save({"w": torch.zeros(64)}, path)
    say(done=True)
"""

_ATTACK3 = r"""
import json, sys, time
import torch.distributed as dist
port, prefix, what, arg = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
new = prefix.startswith("/")      # this tree: a raw-wire prefix; torch's client adds the "/"
key0 = prefix.lstrip("/")
store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
try:
    from ckptwatch.jobkeys import path_hash
except ImportError:
    from ckptwatch.jobscope import path_hash
ESC = "\x1b[2J\x1b]0;pwned\x07"
now = time.time()
epoch = int(now // 60)            # f503c65's default 60 s window
if what == "garbage":             # arg: the paths the ranks save next
    blob = bytes(range(256)) * (4096 * arg["mib"])
    if new:                       # one write log per path
        for p in arg["paths"][:arg["n"]]:
            store.set(f"{key0}/p/{path_hash(p)}", blob)
    else:                         # the slots of the first path's epoch: one reader pulls all
        base = f"{key0}/{path_hash(arg['paths'][0])}/{epoch}"
        for i in range(1, arg["n"] + 1):
            store.set(f"{base}/{i}", blob)
        store.set(f"{base}/n", str(arg["n"]))
elif what in ("fake-start", "fake-end"):
    site, path = ESC + "/evil.py\n2026-12-05 INFO forged log line:1", arg["path"]
    end = now + 1.0 if what == "fake-end" else None
    if new:
        line = ({"k": "s", "n": "ghost-node", "p": 4242, "q": 1, "r": 1, "l": 0, "ws": 2,
                 "lws": 1, "nr": 1, "w": now - 1.0, "site": site, "func": ESC + "f"}
                if end is None else
                {"k": "e", "n": "ghost-node", "p": 4242, "q": 1, "w": end, "b": 100,
                 "o": "ok", "sh": "nfs"})
        store.append(f"{key0}/p/{path_hash(path)}", "\n" + json.dumps(line) + "\n")
    else:
        base = f"{key0}/{path_hash(path)}/{epoch}"
        rec = {"node": "ghost-node", "pid": 4242, "rank": 1, "local_rank": 0,
               "world_size": 2, "local_world_size": 1, "node_rank": 1, "seq": 1,
               "path": path, "site": site, "func": ESC + "f", "shared": "nfs",
               "sw": now - 1.0, "ew": end, "ts": None, "te": None, "bytes": 100,
               "outcome": "ok" if end else None}
        # Ended already, 3 s in the future (walls decide without tickets): the rank reports
        # it at its first read, while the agent still holds the rank's own write.
        rec.update(ew=now + 3.0, outcome="ok")
        if end is None:
            store.set(f"{base}/n", "1000")  # the ranks' slots come after ours
        store.set(f"{base}/1000", json.dumps(rec))
elif what == "counter":
    key = f"{key0}/x" if new else f"{key0}/t"    # exit count / ticket counter
    store.set(key, ESC + "not-a-number")
print("attacked", what, flush=True)
"""

_STORE3 = r"""
import json, os, select, subprocess, sys, time
repo, tree, case = sys.argv[1], os.getcwd(), sys.argv[2]
sys.path[:0] = [os.path.join(repo, "tests", "support")]
import torch.distributed as dist
from helpers import free_port, short_tmpdir, remove_tree
port = free_port()
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
wd = os.path.realpath(short_tmpdir("cws3"))
other = os.path.join(wd, "elsewhere")      # a shared prefix that is not the checkpoint dir
os.mkdir(other)
agents, ranks, errs = [], [], []
def journal(i):
    try:
        return [json.loads(l) for l in open(os.path.join(wd, f"j{i}.jsonl")) if l.strip()]
    except (OSError, ValueError):
        return []
def wait(cond, t):
    end = time.monotonic() + t
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())
def ask(i, cmd, t=90):
    p = ranks[i]
    p.stdin.write(json.dumps(cmd) + "\n"); p.stdin.flush()
    if not select.select([p.stdout], [], [], t)[0]:
        return None
    line = p.stdout.readline()
    return json.loads(line) if line else None
def attack(what, arg):
    subprocess.run([sys.executable, "-c", ATTACK, str(port), prefix, what, json.dumps(arg)],
                   check=True, timeout=120, stdout=subprocess.DEVNULL)
out = {}
try:
    for i in range(2):
        agents.append(subprocess.Popen(
            [sys.executable, "agent.py", "--node.name", f"node-{i}", "--ingest.socket",
             os.path.join(wd, f"a{i}.sock"), "--journal.path", os.path.join(wd, f"j{i}.jsonl"),
             "--verify.enabled", "false", "--collision.settle", "0.3",
             # a write is held job-settle seconds for other nodes' reports of it
             "--collision.job-settle", "5", "--web.listen-address", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(wd, f"agent{i}.err"), "w")))
    assert wait(lambda: all(os.path.exists(os.path.join(wd, f"a{i}.sock")) for i in range(2)),
                60), "agents"
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(i),
                    "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                    "GROUP_RANK": str(i), "CKPTWATCH_NODE": f"node-{i}",
                    "CKPTWATCH_JOB": "store3", "CKPTWATCH_POLICY": "warn",
                    "OMP_NUM_THREADS": "1", "PYTHONPATH": tree,
                    "CKPTWATCH_SOCKET": os.path.join(wd, f"a{i}.sock"),
                    # hazard case: node-1 does not see the checkpoint dir as shared
                    "CKPTWATCH_SHARED_PATHS": other if (case == "hazard" and i == 1) else wd})
        errs.append(os.path.join(wd, f"rank{i}.err"))
        ranks.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, cwd=wd,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=open(errs[i], "w"), text=True))
    ready = [json.loads(p.stdout.readline()) for p in ranks]
    prefix = ready[0]["prefix"]
    out["ready"] = [r["state"] for r in ready]
    def exchanged(name):
        # A later save of one path by both ranks: does either rank report the other's write?
        path = os.path.join(wd, name)
        before = [r["stats"].get("remote_reported", 0) for r in [ask(0, {}), ask(1, {})]
                  if r is not None]
        if len(before) < 2:
            return "ranks gone"
        ask(0, {"save": [path]}); ask(1, {"save": [path]})
        t0 = time.monotonic()
        got = wait(lambda: any((r := ask(i, {}, 10)) is not None and
                               r["stats"].get("remote_reported", 0) > before[i]
                               for i in range(2)), 20)
        return f"yes ({time.monotonic() - t0:.1f} s)" if got else "no (20 s)"
    if case == "garbage":
        n, mib = int(sys.argv[3]), int(sys.argv[4])
        paths = [os.path.join(wd, f"g{i}.pt") for i in range(n)]
        attack("garbage", {"paths": paths, "n": n, "mib": mib})
        t0 = time.monotonic()
        r = [ask(i, {"save": paths}) for i in range(2)]
        out["saves_s"] = round(time.monotonic() - t0, 1)
        time.sleep(3.0)      # let the readers pull what was planted (polls at 0.2 s, doubling)
        r = [ask(i, {}, 30) for i in range(2)]
        out["after_attack"] = [None if x is None else
                               {"state": x["state"], "hwm_mib": x["hwm_kib"] >> 10,
                                **{k: x["stats"].get(k) for k in ("oversized", "errors")
                                   if k in x["stats"]}} for x in r]
        out["later_save_exchanged"] = exchanged("later.pt")
    elif case == "fake":
        path = os.path.join(wd, "f.pt")
        attack("fake-start", {"path": path})
        ask(0, {"save": [path]})
        attack("fake-end", {"path": path})
        # a hazard naming the ghost comes at once; wait for a collision naming it
        wait(lambda: any("ghost-node" in json.dumps(r) and r.get("type") != "hazard"
                         for r in journal(0)), 20)
        # the notice (warn) to rank 0, if any, is printed when it arrives
        wait(lambda: "evil" in open(errs[0], errors="replace").read(), 5)
        ghost = [r for r in journal(0) if "ghost-node" in json.dumps(r)]
        out["journal_node0_naming_ghost"] = [(r.get("type"), r.get("scope")) for r in ghost]
        out["journal_node0_types"] = sorted({str(r.get("type")) for r in journal(0)})
        out["rank0_remote_reported"] = (ask(0, {}) or {}).get("stats", {}).get("remote_reported")
        out["agent0_stderr"] = ascii(open(os.path.join(wd, "agent0.err"), errors="replace").read()[-600:])
        out["rank0_stderr"] = ascii(open(errs[0], errors="replace").read()[-400:])
    elif case == "counter":
        attack("counter", {})
        ask(0, {"save": [os.path.join(wd, "c.pt")]}); ask(1, {"save": [os.path.join(wd, "c.pt")]})
        time.sleep(1.0)
        out["state_after_a_save"] = [x and x["state"] for x in (ask(0, {}), ask(1, {}))]
        out["later_save_exchanged"] = exchanged("later.pt")
    elif case == "hazard":
        path = os.path.join(wd, "h.pt")
        ask(0, {"save": [path]}); ask(1, {"save": [path]})
        wait(lambda: any(r.get("type") == "hazard" for r in journal(1)), 15)
        wait(lambda: any(r.get("type") == "hazard" for r in journal(0)), 5)
        out["hazards_in_journal"] = {f"node-{i}": [(r.get("hazard") or r.get("kind"),
                                                    r.get("shared")) for r in journal(i)
                                                   if r.get("type") == "hazard"]
                                     for i in range(2)}
        out["agent1_stderr_rejects"] = sum(
            ("reject" in l.lower() or "invalid" in l.lower())
            for l in open(os.path.join(wd, "agent1.err"), errors="replace"))
    codes, hwm = [], []
    for p in ranks:
        p.stdin.close()
        end = time.monotonic() + 60
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                codes.append(os.waitstatus_to_exitcode(status)); hwm.append(usage.ru_maxrss >> 10)
                p.returncode = codes[-1]
                break
            if time.monotonic() > end:
                p.kill(); codes.append("hung"); hwm.append(None)
                break
            time.sleep(0.1)
    out["rank_exit"], out["rank_peak_rss_mib"] = codes, hwm
    stderr = [open(e, "rb").read() for e in errs]
    out["rank_stderr_bytes"] = [len(s) for s in stderr]
    out["rank_stderr_raw_esc"] = [s.count(b"\x1b") for s in stderr]
    out["rank_stderr_cpp_frames"] = [s.count(b"frame #") + s.count(b"Exception raised from")
                                     for s in stderr]
finally:
    for p in ranks + agents:
        if p.poll() is None:
            p.kill(); p.wait()
    remove_tree(wd)
print(json.dumps(out))
"""


def _store3_said(r: dict) -> str:
    """The case's JSON line, compact, for the table."""
    try:
        got = json.loads(r["out"].strip().splitlines()[-1])
    except (IndexError, ValueError):
        return last_line(r["out"] + "\n" + r["err"])
    got.pop("agent0_stderr", None)
    tail = got.pop("rank0_stderr", None)
    said = "; ".join(f"{k} {json.dumps(v)}" for k, v in got.items())
    if tail is not None:
        said += f"; rank0 stderr ends {tail[-160:]}"
    return said


def _store3_script() -> str:
    return f"RANK = {_RANK3!r}\nATTACK = {_ATTACK3!r}\n" + _STORE3


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
        "store-garbage": ("3", f"{GARBAGE[0]} x {GARBAGE[1]} MiB garbage values at the keys "
                          "the ranks read", ["-c", _store3_script(), REPO, "garbage",
                                             str(GARBAGE[0]), str(GARBAGE[1])],
                          _store3_said),
        "store-fake-record": ("3", "one well-formed fake record, node that does not exist, "
                              "escape codes in its call site",
                              ["-c", _store3_script(), REPO, "fake"],
                              _store3_said),
        "store-counter": ("3", "a non-numeric value where the tree reads a counter",
                          ["-c", _store3_script(), REPO, "counter"],
                          _store3_said),
        "store-hazard-shared": ("3", "hazard learnt on a node that does not see the path shared",
                                ["-c", _store3_script(), REPO, "hazard"],
                                _store3_said),
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
LONGER = {"store-stall": 180.0, "store-garbage": 180.0, "store-fake-record": 180.0,
          "store-counter": 180.0, "store-hazard-shared": 180.0}
GARBAGE = (64, 4)    # values x MiB (item 3)


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
