"""monitor.detect.merge: a save seen by the hook and the watcher is one write with two witnesses."""
from monitor.detect.merge import SourceMerger


class Clock:
    def __init__(self):
        self.now = 10.3     # the same clock the events were stamped with

    def __call__(self):
        return self.now


def hook(kind, pid, seq, start, end=None, path="/c/last.pt", node="n1", rank=0):
    ev = {"v": 1, "type": kind, "node": node, "pid": pid, "seq": seq, "path": path,
          "rank": rank, "job": "j", "wall": 0.0, "mono": start if kind == "start" else end}
    if kind == "end":
        ev.update(start_mono=start, start_wall=0.0, outcome="ok", bytes=1)
    return ev


def fs(kind, pid, seq, start, end=None, path="/c/last.pt"):
    ev = hook(kind, pid, seq, start, end, path=path, node="agent-node", rank=None)
    ev["source"] = "fs"
    ev["job"] = None
    return ev


def test_fs_copy_of_a_hooked_save_is_merged_not_forwarded():
    clock = Clock()
    m = SourceMerger(delay=0.25, clock=clock)
    # inotify sees the open first; the hook's events arrive a moment later.
    m.fs_event(fs("start", 7, 2**48, 10.01))
    m.hook_event(hook("start", 7, 1, 10.0))
    m.fs_event(fs("end", 7, 2**48, 10.01, 10.2))
    m.hook_event(hook("end", 7, 1, 10.0, 10.21))
    assert m.due() == ([], [])                       # still held
    clock.now += 0.3
    forward, seen = m.due()
    assert forward == []
    assert seen == [("/c/last.pt", ("n1", 7, 1))]
    assert m.merged_total == 1


def test_a_writer_the_hook_cannot_see_is_forwarded():
    clock = Clock()
    m = SourceMerger(delay=0.1, clock=clock)
    m.hook_event(hook("start", 7, 1, 10.0))
    m.hook_event(hook("end", 7, 1, 10.0, 10.2))
    m.fs_event(fs("start", 8, 2**48, 10.05))          # another pid: not the hook's write
    m.fs_event(fs("start", 7, 2**48 + 1, 12.0))       # same pid, after its save: a new write
    clock.now += 0.2
    forward, seen = m.due()
    assert [(e["pid"], e["seq"]) for e in forward] == [(8, 2**48), (7, 2**48 + 1)]
    assert seen == []


def test_forwarded_fs_write_takes_the_identity_the_hook_reported_for_its_pid():
    clock = Clock()
    m = SourceMerger(delay=0.1, clock=clock)
    m.hook_event(hook("start", 7, 1, 10.0, node="pod-7", rank=3))
    m.hook_event(hook("end", 7, 1, 10.0, 10.1, node="pod-7", rank=3))
    m.fs_event(fs("start", 7, 2**48, 10.3, path="/c/other.safetensors"))
    clock.now += 0.2
    (event,), _ = m.due()
    assert (event["node"], event["rank"], event["job"], event["source"]) == (
        "pod-7", 3, "j", "fs")


def test_merged_start_drops_its_end_too():
    clock = Clock()
    m = SourceMerger(delay=0.1, clock=clock)
    m.hook_event(hook("start", 7, 1, 10.0))
    m.fs_event(fs("start", 7, 2**48, 10.01))
    clock.now += 0.2
    assert m.due()[0] == []
    m.fs_event(fs("end", 7, 2**48, 10.01, 10.5))
    clock.now += 0.2
    forward, seen = m.due()
    assert forward == [] and seen == []


def test_hook_writes_long_gone_are_forgotten():
    clock = Clock()
    m = SourceMerger(delay=0.1, window=5.0, clock=clock)
    for seq in range(100):
        m.hook_event(hook("start", 7, seq, 10.0, path=f"/c/{seq}.pt"))
        m.hook_event(hook("end", 7, seq, 10.0, 10.1, path=f"/c/{seq}.pt"))
    clock.now = 30.0
    m.due()
    assert m._hook_writes == {}


def test_hook_writes_remembered_are_bounded_whatever_a_sender_reports():
    """Starts that never end (on one path, and on fresh paths) and many short writes within
    the window are remembered up to a bound, not one entry per event: the soak's flood of
    1,000,000 frames kept hundreds of thousands, tens of MB, swept every second."""
    import tracemalloc
    clock = Clock()
    m = SourceMerger(delay=0.1, max_paths=1000, clock=clock)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq in range(20_000):     # unbounded, this alone would hold ~15 MB
            m.hook_event(hook("start", 7, seq, 10.0, path="/c/open.pt"))      # never end
            m.hook_event(hook("start", 8, seq, 10.0, path=f"/c/{seq}.pt"))   # fresh paths
            m.hook_event(hook("start", 9, seq, 10.0, path=f"/c/{seq % 64}.pt"))
            m.hook_event(hook("end", 9, seq, 10.0, 10.1, path=f"/c/{seq % 64}.pt"))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 2 << 20, f"{grown} bytes"
    assert m.remembered <= 1000
    # The latest writes of a (pid, path) are still there to merge with.
    m.fs_event(fs("start", 7, 2**48, 10.01, path="/c/open.pt"))
    clock.now += 0.2
    forward, [(path, (_, pid, seq))] = m.due()
    assert forward == [] and (path, pid) == ("/c/open.pt", 7) and seq >= 19_990
