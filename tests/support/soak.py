"""The combined hostile soak of issue 8: one real agent under every attack at once.

    figures = run_soak(workdir)   # tests/e2e/test_soak.py asserts them, bench/soak.py prints them

One agent (`python agent.py`, default flags plus --watch.path on a directory, so dropped
checkpoints are verified) while, concurrently:
  1. flood processes send FRAMES frames over the socket: valid start/end pairs carrying
     VALUES distinct training_job / rank values, starts that never end, malformed JSON,
     incomplete and unknown-version events, events claiming another pid, "dropped" reports,
     and now and then an oversized length (the agent closes that connection; the flooder
     reconnects);
  2. one holder process opens HELD connections and keeps them (half idle, half in the middle
     of a frame);
  3. a memo-bomb checkpoint and other hostile files are dropped into the watched directory;
  4. a scraper fetches /metrics (plain and gzip) and /healthz over and over;
and, mid-flood, real collisions: two well-behaved sender processes overlap on a fresh path, and
the time from the second end to the collision record in the journal is measured.

The agent's VmRSS and VmHWM (peak) are sampled from /proc/<pid>/status throughout.
"""
from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field

from agentproc import EventSender, start_agent
from helpers import subprocess_env, wait_for

import corpus

FRAMES = 1_000_000          # frames the flood sends, in all
VALUES = 200_000            # distinct label values among them
FLOODERS = 4                # flood processes (the pid cap is 16 connections each)
FLOOD_CONNECTIONS = 4       # connections per flood process
HELD = 1024                 # connections the holder opens from one process
COLLISIONS = 3              # real collisions measured during the flood
REAL_JOB = "soak-real"


# A flood process: argv socket, frames, index, processes, values, connections.
# Each cycle of 20 frames: 6 valid start/end pairs (the next label value of this process, so
# the first pass over its share names every value once), 3 starts that never end (one path of
# its own, then fresh ones), 2 malformed, 1 incomplete, 1 unknown version, 1 pid mismatch;
# every 25,000 frames a "dropped" report and an oversized length on one connection.
_FLOOD = r'''
import os, socket, struct, sys, time
path, total, index, procs, values, nconn = sys.argv[1], *map(int, sys.argv[2:])
pid = os.getpid()
H = struct.Struct(">I")

def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s

conns = [connect() for _ in range(nconn)]
mine = list(range(index, values, procs))
START = (b'{"v":1,"type":"start","node":"forged","pid":%d,"seq":%d,"rank":%d,"job":"%s",'
         b'"world_size":%d,"path":"/flood/%d/%d.pt","site":"x.py:1","func":"f",'
         b'"wall":%.3f,"mono":%.6f}')
END = (b'{"v":1,"type":"end","node":"forged","pid":%d,"seq":%d,"rank":%d,"job":"%s",'
       b'"world_size":%d,"path":"/flood/%d/%d.pt","site":"x.py:1","func":"f",'
       b'"wall":%.3f,"mono":%.6f,"start_wall":%.3f,"start_mono":%.6f,"bytes":1000,'
       b'"outcome":"ok"}')
BAD = [b'{"v":1,"type":"start"', b'[1,2,3]', b'\xff\xfe not utf-8',
       b'{"v":1,"type":"start","node":"n","pid":%d,"seq":1}' % pid,
       b'{"v":99,"type":"start","node":"n","pid":%d}' % pid]
DROPPED = b'{"v":1,"type":"dropped","node":"n","pid":%d,"count":1000}' % pid

def label(value):
    # even values: a new job (rank 0); odd ones: a new rank of one wide job
    return (b"flood-%d" % value, 0) if value % 2 == 0 else (b"flood-wide", value)

sent = seq = k = 0
out = []
while sent < total:
    wall, mono = time.time(), time.monotonic()
    for _ in range(20):
        pos = sent % 20
        if pos < 12:
            if pos % 2 == 0:
                job, rank = label(mine[k % len(mine)])
                k += 1
                seq += 1
                out.append(START % (pid, seq, rank, job, rank + 1, index, seq % 4096,
                                    wall, mono))
            else:
                out.append(END % (pid, seq, rank, job, rank + 1, index, seq % 4096, wall,
                                  mono, wall, mono))
        elif pos < 15:
            seq += 1
            out.append(START % (pid, seq, 0, b"flood-open", 1, index,
                                (-1 if pos == 12 else 10000 + seq), wall, mono))
        elif pos < 19:
            out.append(BAD[(sent // 20 + pos) % len(BAD)])
        else:
            out.append(START % (pid + 1, seq, 0, b"flood-forged", 1, index, 0, wall, mono))
        sent += 1
    if sent % 2000 == 0 or sent >= total:
        data = b"".join(H.pack(len(p)) + p for p in out)
        out.clear()
        c = (sent // 2000) % nconn
        try:
            conns[c].sendall(data)
        except OSError:
            conns[c] = connect()
        if sent % 25000 == 0:
            conns[c].sendall(H.pack(len(DROPPED)) + DROPPED)
            conns[c].sendall(H.pack(0xFFFFFFF0) + b"x" * 100)   # oversized: agent closes
            conns[c].close()
            conns[c] = connect()
for c in conns:
    c.close()
print(sent, flush=True)
'''

# The holder: argv socket, count. Opens `count` connections from this one process; every
# other one sends the start of a frame it never finishes. Prints "held", then waits for stdin
# to close.
_HOLDER = r'''
import socket, struct, sys
path, count = sys.argv[1], int(sys.argv[2])
held = []
for i in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        if i % 2:
            s.send(struct.pack(">I", 60000) + b'{"v":1,' + b" " * 4000)
    except OSError:
        pass
    held.append(s)
print("held", flush=True)
sys.stdin.read()
'''


def hostile_files(directory: str) -> dict[str, str]:
    """Drop hostile checkpoints into `directory`; {name: path}. The memo bomb is the one the
    issue names; the others claim huge sizes or amplify work."""
    import struct
    files = {
        "memo_bomb.pt": corpus.torch_zip_bytes(corpus.memo_bomb_pickle(2 ** 27)),
        "put_bomb.pt": corpus.torch_zip_bytes(b"\x80\x02Np99999999999\n."),
        "binbytes_claim.pt": corpus.torch_zip_bytes(
            b"\x80\x03\x8e" + struct.pack("<Q", 2 ** 62) + b"."),
        "frame_claim.pt": corpus.torch_zip_bytes(
            b"\x80\x04\x95" + struct.pack("<Q", 2 ** 40) + b"N."),
        "sets.pt": corpus.torch_zip_bytes(b"\x80\x04" + b"\x8f" * (8 << 20) + b"."),
        "header_claim.safetensors": struct.pack("<Q", 2 ** 60) + b"{}",
    }
    paths = {}
    for name, data in files.items():
        paths[name] = os.path.join(directory, name)
        with open(paths[name], "wb") as f:
            f.write(data)
    return paths


def proc_memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in bytes."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kb = line.split()[:2]
                values[key] = int(kb) * 1024
    return values["VmRSS:"], values["VmHWM:"]


class JournalTail:
    """Reads the journal's new lines as they are written, across rotations (the open file is
    read to its end before the new one is opened), and keeps only lines that mention one of
    the paths asked for: the flood writes hundreds of thousands of records."""

    def __init__(self, path: str):
        self.path = path
        self._fh = None
        self._ino = None
        self._rest = b""
        self.lines: list[bytes] = []
        self.watch: set[bytes] = set()

    def _keep(self, data: bytes) -> None:
        data = self._rest + data
        *lines, self._rest = data.split(b"\n")
        for line in lines:
            if any(w in line for w in self.watch):
                self.lines.append(line)

    def poll(self) -> None:
        if self._fh is not None:
            self._keep(self._fh.read())
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            return
        if ino != self._ino:            # created or rotated: finish the old, open the new
            if self._fh is not None:
                self._keep(self._fh.read())
                self._fh.close()
                self._rest = b""
            self._fh = open(self.path, "rb")
            self._ino = ino
            self._keep(self._fh.read())

    def records(self, needle: bytes) -> list[dict]:
        import json
        return [json.loads(line) for line in self.lines if needle in line]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


@dataclass
class Figures:
    frames: int = 0
    flood_seconds: float = 0.0
    events_received: float = 0.0
    rejected: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    evicted: dict = field(default_factory=dict)
    starts_refused: dict = field(default_factory=dict)
    label_values: dict = field(default_factory=dict)
    label_overflowed: dict = field(default_factory=dict)
    collision_latencies: list = field(default_factory=list)
    peak_rss: int = 0               # VmHWM at the end
    max_sampled_rss: int = 0
    rss_after: int = 0
    rss_samples: list = field(default_factory=list)     # (seconds since start, VmRSS)
    scrapes: int = 0
    scrape_errors: list = field(default_factory=list)
    metrics_max_bytes: int = 0
    metrics_max_gzip_bytes: int = 0
    scrape_max_seconds: float = 0.0
    health_statuses: dict = field(default_factory=dict)
    unhealthy_reasons: set = field(default_factory=set)
    healthy_again_seconds: float | None = None
    verdicts: dict = field(default_factory=dict)         # hostile file name -> (result, cause)
    agent_alive: bool = True

    @property
    def accepted_per_second(self) -> float:
        return self.events_received / self.flood_seconds if self.flood_seconds else 0.0


class _Background(threading.Thread):
    """Runs `step` every `interval` seconds until stopped; exceptions are kept, not raised."""

    def __init__(self, step, interval: float):
        super().__init__(daemon=True)
        self._step, self._interval = step, interval
        self._stop_event = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._step()
            except Exception as exc:       # noqa: BLE001 -- reported in the figures
                self.errors.append(repr(exc))
            self._stop_event.wait(self._interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)


def _scrape(url: str, gzip_ok: bool) -> tuple[int, int, float]:
    """(compressed or plain size, plain size, seconds) of one /metrics scrape."""
    headers = {"Accept-Encoding": "gzip"} if gzip_ok else {}
    started = time.monotonic()
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers),
                                timeout=30) as resp:
        body = resp.read()
        encoding = resp.headers.get("Content-Encoding")
    took = time.monotonic() - started
    plain = gzip.decompress(body) if encoding == "gzip" else body
    return len(body), len(plain), took


def _health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=10) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _sum_by(samples, name: str, label: str) -> dict:
    out: dict = {}
    for s in samples:
        if s.name == name:
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0) + s.value
    return out


def run_soak(workdir: str, frames: int = FRAMES, values: int = VALUES,
             flooders: int = FLOODERS, held: int = HELD, collisions: int = COLLISIONS,
             progress=lambda msg: None) -> Figures:
    """Run the whole soak against a fresh agent in `workdir`; return what was measured."""
    figures = Figures()
    root = os.path.join(workdir, "ckpt")
    real_dir = os.path.join(workdir, "real")
    os.makedirs(root)
    os.makedirs(real_dir)
    started = time.monotonic()
    with start_agent(workdir, "--watch.path", root, "--log.level", "info") as agent:
        pid = agent.pid
        tail = JournalTail(agent.journal)
        tail.watch.add(root.encode())
        tail.watch.add(real_dir.encode())

        def sample_memory():
            rss, hwm = proc_memory(pid)
            figures.rss_samples.append((round(time.monotonic() - started, 2), rss))
            figures.max_sampled_rss = max(figures.max_sampled_rss, rss)
            figures.peak_rss = hwm

        def scrape_once():
            gzip_ok = figures.scrapes % 2 == 1
            size, plain, took = _scrape(agent.url, gzip_ok)
            figures.scrapes += 1
            figures.metrics_max_bytes = max(figures.metrics_max_bytes, plain)
            if gzip_ok:
                figures.metrics_max_gzip_bytes = max(figures.metrics_max_gzip_bytes, size)
            figures.scrape_max_seconds = max(figures.scrape_max_seconds, took)
            status, body = _health(agent.url)
            figures.health_statuses[status] = figures.health_statuses.get(status, 0) + 1
            if status != 200:
                figures.unhealthy_reasons.add(body.strip()[:120])

        sampler = _Background(sample_memory, 0.1)
        scraper = _Background(scrape_once, 0.5)
        sampler.start()
        scraper.start()
        pairs = []
        holder = flood = None
        try:
            # The well-behaved senders connect first, as a training job's hooks would have.
            for i in range(collisions):
                path = os.path.join(real_dir, f"{uuid.uuid4().hex}.pt")
                pairs.append((path, EventSender(agent.socket, path, rank=0, job=REAL_JOB),
                              EventSender(agent.socket, path, rank=1, job=REAL_JOB)))
            for _, a, b in pairs:          # connected once they answer a command
                a.raw(b"")
                b.raw(b"")
            holder = subprocess.Popen([sys.executable, "-c", _HOLDER, agent.socket, str(held)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=subprocess_env())
            assert holder.stdout.readline().strip() == b"held"
            progress(f"holder opened {held} connections")
            files = hostile_files(root)
            share = frames // flooders
            flood_started = time.monotonic()
            flood = [subprocess.Popen(
                [sys.executable, "-c", _FLOOD, agent.socket,
                 str(share + (frames % flooders if i == 0 else 0)), str(i), str(flooders),
                 str(values), str(FLOOD_CONNECTIONS)],
                stdout=subprocess.PIPE, env=subprocess_env()) for i in range(flooders)]
            progress(f"{flooders} flood processes sending {frames:,} frames")
            # Real collisions, spread over the flood while it runs.
            for n, (path, a, b) in enumerate(pairs):
                time.sleep(4.0 if n == 0 else 6.0)
                if all(p.poll() is not None for p in flood):
                    progress("flood over before a collision was sent")
                a.start()
                b.start()
                a.end()
                b.end()
                ended = time.monotonic()
                needle = path.encode()

                def journaled():
                    tail.poll()
                    return any(b'"collision"' in line and needle in line
                               for line in tail.lines)
                wait_for(journaled, timeout=60, interval=0.01,
                         message=f"the real collision on {path}")
                figures.collision_latencies.append(time.monotonic() - ended)
                progress(f"collision {n + 1} journaled "
                         f"{figures.collision_latencies[-1]:.2f}s after its second end")
            for p in flood:
                out, _ = p.communicate(timeout=600)
                figures.frames += int(out.strip() or 0)
            figures.flood_seconds = time.monotonic() - flood_started
            progress(f"flood over: {figures.frames:,} frames in {figures.flood_seconds:.1f}s")
            # Recovery: healthy again, and the hostile files judged.
            recovered = time.monotonic()
            wait_for(lambda: _health(agent.url)[0] == 200, timeout=120, interval=0.1,
                     message="/healthz 200 after the flood")
            figures.healthy_again_seconds = time.monotonic() - recovered

            def verdicts():
                tail.poll()
                for rec in tail.records(b'"verification"'):
                    name = os.path.basename(rec["path"])
                    if name in files:
                        figures.verdicts[name] = (rec["result"], rec.get("cause"))
                return len(figures.verdicts) == len(files)
            try:            # what is missing is the caller's to judge (figures.verdicts)
                wait_for(verdicts, timeout=30, interval=0.2)
            except AssertionError:
                pass
        finally:
            for _, a, b in pairs:
                a.close()
                b.close()
            for p in flood or []:
                if p.poll() is None:
                    p.kill()
                p.wait()
                p.stdout.close()
            if holder is not None:
                holder.stdin.close()
                holder.wait(30)
                holder.stdout.close()
            scraper.stop()
            sampler.stop()
            tail.close()
        figures.scrape_errors = scraper.errors + sampler.errors
        figures.agent_alive = agent.alive()
        samples = agent.samples()
        value = {s.name: s.value for s in samples if not s.labels}
        figures.events_received = value.get("ckptwatch_events_received_total", 0.0)
        figures.rejected = _sum_by(samples, "ckptwatch_events_rejected_total", "reason")
        figures.refused = _sum_by(samples, "ckptwatch_ingest_connections_refused_total",
                                  "reason")
        figures.evicted = _sum_by(samples, "ckptwatch_ingest_connections_evicted_total",
                                  "reason")
        figures.starts_refused = _sum_by(samples, "ckptwatch_detector_starts_refused_total",
                                         "reason")
        figures.label_values = _sum_by(samples, "ckptwatch_label_values", "label")
        figures.label_overflowed = _sum_by(samples, "ckptwatch_label_values_overflowed_total",
                                           "label")
        figures.rss_after, figures.peak_rss = proc_memory(pid)
    return figures


def describe(f: Figures) -> str:
    """The figures as the README quotes them."""
    mib = 1 << 20
    lines = [
        f"flood: {f.frames:,} frames in {f.flood_seconds:.1f} s; events accepted "
        f"{f.events_received:,.0f} ({f.accepted_per_second:,.0f}/s)",
        "rejected: " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(f.rejected.items())),
        "connections refused: " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(f.refused.items()))
        + "; evicted: " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(f.evicted.items())),
        "starts refused: " + ", ".join(f"{k} {v:,.0f}"
                                       for k, v in sorted(f.starts_refused.items())),
        "label values held: " + ", ".join(f"{k} {v:,.0f}"
                                          for k, v in sorted(f.label_values.items()))
        + "; overflowed: " + ", ".join(f"{k} {v:,.0f}"
                                       for k, v in sorted(f.label_overflowed.items())),
        "real collisions journaled after the second end: "
        + ", ".join(f"{s:.2f} s" for s in f.collision_latencies),
        f"agent RSS: peak (VmHWM) {f.peak_rss / mib:.0f} MiB, highest sampled "
        f"{f.max_sampled_rss / mib:.0f} MiB, at the end {f.rss_after / mib:.0f} MiB",
        f"/metrics: {f.scrapes} scrapes, largest {f.metrics_max_bytes:,} bytes "
        f"({f.metrics_max_gzip_bytes:,} gzip), slowest {f.scrape_max_seconds * 1000:.0f} ms",
        f"/healthz: {dict(sorted(f.health_statuses.items()))}; "
        + (f"200 again {f.healthy_again_seconds:.1f} s after the flood"
           if f.healthy_again_seconds is not None else "never 200 again")
        + ("; unhealthy: " + " | ".join(sorted(f.unhealthy_reasons))
           if f.unhealthy_reasons else ""),
        "hostile files: " + ", ".join(f"{k} {r}/{c}" for k, (r, c) in sorted(f.verdicts.items())),
    ]
    if f.scrape_errors:
        lines.append("scrape/sample errors: " + "; ".join(f.scrape_errors[:5]))
    return "\n".join(lines)
