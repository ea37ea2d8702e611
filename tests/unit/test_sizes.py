"""monitor.detect.sizes: finished writes of one path by different processes that differ in size."""
from monitor.detect.model import Finding, Write, Writer
from monitor.detect.sizes import SizeHistory


def w(pid, nbytes, end, path="/c/last.pt", outcome="ok"):
    return Write(writer=Writer("n", pid, rank=pid - 10, job="j"), path=path, seq=1,
                 start_wall=1000.0 + end - 0.1, start_mono=end - 0.1, end_wall=1000.0 + end,
                 end_mono=end, bytes=nbytes, outcome=outcome)


def test_different_processes_leaving_different_sizes_is_a_fluctuation():
    h = SizeHistory(window=60, tolerance=0.01)
    assert h.finished(w(10, 1000, 1.0)) is None
    f = h.finished(w(11, 900, 1.2))
    assert f.kind == "size_fluctuation" and (f.get("size_before"), f.get("size_after")) == \
        (1000, 900)
    assert [x["rank"] for x in f.writers] == [0, 1] and f.job == "j"
    rec = f.to_record()
    assert (rec["type"], rec["path"], rec["rule"], rec["size_after"]) == \
        ("size_fluctuation", "/c/last.pt", "finished sizes differ", 900)
    assert Finding.from_record(rec) == f


def test_within_tolerance_same_process_outside_window_or_failed_saves_are_not():
    h = SizeHistory(window=60, tolerance=0.01)
    h.finished(w(10, 1000, 1.0))
    assert h.finished(w(11, 995, 2.0)) is None            # 0.5 %: within tolerance
    assert h.finished(w(11, 5000, 3.0)) is None           # same process: its own business
    assert h.finished(w(12, 100, 100.0)) is None          # a minute later: another run's save
    assert h.finished(w(13, 50, 100.5, outcome="OSError")) is None
    assert h.finished(w(14, 100, 101.0, path="/c/other.pt")) is None


def test_bounded():
    h = SizeHistory(max_paths=5)
    for i in range(50):
        h.finished(w(10, 10, float(i), path=f"/c/{i}.pt"))
    assert len(h._last) == 5


def test_ends_arriving_out_of_order_are_compared_in_the_order_they_happened():
    # Two processes' ends come on two connections, read in no fixed order: the agent can
    # see the later write first. before/after follow the writes' end times, and the file's
    # last known size stays the later write's.
    h = SizeHistory(window=60, tolerance=0.01)
    assert h.finished(w(11, 700, 1.2)) is None
    f = h.finished(w(10, 1000, 1.0))
    assert (f.get("size_before"), f.get("size_after")) == (1000, 700)
    assert [x["rank"] for x in f.writers] == [0, 1]
    g = h.finished(w(12, 2000, 2.0))                       # compared with the 700 of t=1.2
    assert (g.get("size_before"), g.get("size_after")) == (700, 2000)
