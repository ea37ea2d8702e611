"""ckptwatch.hook: every import/install/uninstall order runs in a fresh Python process.

Each child script reports what it saw as one JSON line on stdout; the events it sent are
collected by a real Unix socket receiver in the test process.
"""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import subprocess_env
from receiver import Receiver

pytestmark = [pytest.mark.torch]

PY = sys.executable


@pytest.fixture
def rx(sock):
    with Receiver(sock) as receiver:
        yield receiver


def run_script(workdir: str, body: str, sock: str, **env) -> dict:
    """Run body as workdir/child.py in a fresh interpreter; return its last stdout JSON line."""
    script = os.path.join(workdir, "child.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(body))
    out = subprocess.run([PY, script], env=subprocess_env(CKPTWATCH_SOCKET=sock, **env),
                         cwd=workdir, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def line_of(workdir: str, marker: str) -> int:
    """1-based line number of the line containing marker in workdir/child.py."""
    with open(os.path.join(workdir, "child.py")) as f:
        for number, line in enumerate(f, 1):
            if marker in line:
                return number
    raise AssertionError(marker)


def test_install_after_import_reports_the_save(rx, sock, workdir):
    result = run_script(workdir, """
        import json, os, torch, ckptwatch
        ok = ckptwatch.install()
        def save_checkpoint():
            torch.save({"w": torch.zeros(4)}, "ckpt.pt")  # SAVE-HERE
        save_checkpoint()
        print(json.dumps({"ok": ok, "pid": os.getpid(), "size": os.path.getsize("ckpt.pt")}))
        """, sock, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        GROUP_RANK="0", TORCHELASTIC_RUN_ID="job-1", TORCHELASTIC_RESTART_COUNT="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", CKPTWATCH_NODE="node-x")
    assert result["ok"] is True
    (end,) = rx.wait_count("end", 1)
    rx.wait_drained()
    # A short save is normally reported by its end alone (ckptwatch/emitter.py); its start is
    # sent only if the save is still running a turn or two of the sender later (a loaded
    # machine can make it so): either way every event describes the same write.
    starts = rx.of_type("start")
    assert len(starts) <= 1
    path = os.path.join(workdir, "ckpt.pt")
    site = f"{os.path.join(workdir, 'child.py')}:{line_of(workdir, 'SAVE-HERE')}"
    for event in [end] + starts:
        assert event["pid"] == result["pid"]
        assert event["path"] == path
        assert event["site"] == site
        assert event["func"] == "save_checkpoint"
        assert (event["rank"], event["local_rank"], event["world_size"],
                event["local_world_size"], event["node_rank"]) == (1, 1, 2, 2, 0)
        assert (event["job"], event["restart"], event["master"], event["node"]) == \
            ("job-1", 0, "127.0.0.1:29500", "node-x")
        assert event["seq"] == 1
    assert end["outcome"] == "ok"
    assert end["bytes"] == result["size"]
    assert end["start_wall"] <= end["wall"] and end["start_mono"] <= end["mono"]
    for start in starts:
        assert end["start_wall"] == start["wall"] and end["start_mono"] == start["mono"]
    assert rx.rejects == []


def test_install_twice_unininstall_twice_no_double_wrap(rx, sock, workdir):
    result = run_script(workdir, """
        import json, torch, torch.serialization, ckptwatch
        from ckptwatch import hook
        original = torch.save
        first, second = ckptwatch.install(), ckptwatch.install()
        wrapped = torch.save
        same = torch.save is torch.serialization.save
        inner = getattr(torch.save, hook.MARKER)
        torch.save(1, "a.pt")
        u1, u2 = ckptwatch.uninstall(), ckptwatch.uninstall()
        torch.save(2, "b.pt")   # not reported any more
        print(json.dumps({"first": first, "second": second, "same": same,
                          "inner_is_original": inner is original,
                          "wrapped": wrapped is not original,
                          "restored": torch.save is original
                                      and torch.serialization.save is original,
                          "u1": u1, "u2": u2, "installed": hook.is_installed()}))
        """, sock)
    assert result == {"first": True, "second": False, "same": True, "inner_is_original": True,
                      "wrapped": True, "restored": True, "u1": True, "u2": False,
                      "installed": False}
    rx.wait_count("end", 1)
    rx.wait_drained()
    assert [e["path"] for e in rx.of_type("end")] == [os.path.join(workdir, "a.pt")]
    assert {e["path"] for e in rx.events} == {os.path.join(workdir, "a.pt")}


def test_install_before_torch_import_patches_when_torch_arrives(rx, sock, workdir):
    result = run_script(workdir, """
        import json, sys, ckptwatch
        early = ckptwatch.install()
        imported_early = "torch" in sys.modules
        import torch
        from ckptwatch import hook
        torch.save(1, "early.pt")
        print(json.dumps({"early": early, "imported_early": imported_early,
                          "installed": hook.is_installed(),
                          "again": ckptwatch.install()}))
        """, sock)
    assert result == {"early": False, "imported_early": False, "installed": True,
                      "again": False}
    (end,) = rx.wait_count("end", 1)
    assert end["path"] == os.path.join(workdir, "early.pt")


def test_uninstall_leaves_a_later_foreign_wrapper_alone(rx, sock, workdir):
    result = run_script(workdir, """
        import functools, json, torch, torch.serialization, ckptwatch
        original = torch.save
        ckptwatch.install()
        ours = torch.save
        calls = []
        @functools.wraps(ours)             # copies our marker attribute too
        def theirs(*args, **kwargs):
            calls.append(1)
            return ours(*args, **kwargs)
        torch.save = theirs
        restored = ckptwatch.uninstall()
        after_uninstall = {"torch_save_is_theirs": torch.save is theirs,
                           "serialization_restored": torch.serialization.save is original}
        torch.save(1, "quiet.pt")          # goes through theirs -> our (inactive) wrapper
        reinstalled = ckptwatch.install()
        torch.save(2, "loud.pt")           # ours(theirs(ours-inactive)): reported once
        print(json.dumps({"restored": restored, **after_uninstall,
                          "reinstalled": reinstalled, "calls": len(calls)}))
        """, sock)
    assert result == {"restored": True, "torch_save_is_theirs": True,
                      "serialization_restored": True, "reinstalled": True, "calls": 2}
    rx.wait_count("end", 1)
    rx.wait_drained()   # the child has exited: a (wrong) second pair would be here now
    assert [os.path.basename(e["path"]) for e in rx.of_type("end")] == ["loud.pt"]
    assert {os.path.basename(e["path"]) for e in rx.events} == {"loud.pt"}


def test_return_value_and_exception_identity(rx, sock, workdir):
    result = run_script(workdir, """
        import json, torch, torch.serialization, ckptwatch
        sentinel = object()
        boom = OSError(28, "No space left on device")
        def fake_save(obj, f, *args, **kwargs):
            open(f, "wb").write(b"x" * 3)
            if obj == "fail":
                raise boom
            return sentinel
        torch.save = torch.serialization.save = fake_save
        ckptwatch.install()
        returned = torch.save("ok", "ret.pt", pickle_protocol=4)
        try:
            torch.save("fail", "err.pt")
            caught = None
        except OSError as exc:
            caught = exc
        tb = caught.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        print(json.dumps({"same_return": returned is sentinel, "same_exc": caught is boom,
                          "raised_in": tb.tb_frame.f_code.co_name}))
        """, sock)
    assert result == {"same_return": True, "same_exc": True, "raised_in": "fake_save"}
    ends = rx.wait_count("end", 2)
    outcome = {os.path.basename(e["path"]): (e["outcome"], e["bytes"]) for e in ends}
    assert outcome == {"ret.pt": ("ok", 3), "err.pt": ("OSError", 3)}


def test_real_torch_failure_records_the_exception_type(rx, sock, workdir):
    result = run_script(workdir, """
        import json, torch, ckptwatch
        ckptwatch.install()
        try:
            torch.save(1, "no/such/dir/x.pt")
        except Exception as exc:
            print(json.dumps({"type": type(exc).__name__}))
        """, sock)
    (end,) = rx.wait_count("end", 1)
    assert end["outcome"] == result["type"] == "RuntimeError"
    assert end["bytes"] is None
    assert end["path"] == os.path.join(workdir, "no/such/dir/x.pt")


def test_path_kinds_and_file_objects(rx, sock, workdir):
    result = run_script(workdir, """
        import io, json, os, pathlib, torch, ckptwatch
        ckptwatch.install()
        torch.save(1, "rel.pt")
        torch.save(2, pathlib.Path("pathlike.pt"))
        try:
            torch.save(3, b"bytes.pt")           # torch itself rejects bytes paths
            bytes_error = None
        except AttributeError as exc:
            bytes_error = type(exc).__name__
        with open("fileobj.pt", "wb") as f:
            torch.save({"t": torch.ones(3)}, f)
            told = f.tell()
        buf = io.BytesIO()
        torch.save(4, buf)                      # not a file write: not reported
        print(json.dumps({"bytes_error": bytes_error, "told": told,
                          "buffer_written": len(buf.getvalue()) > 0}))
        """, sock)
    assert result["bytes_error"] == "AttributeError" and result["buffer_written"]
    ends = rx.wait_count("end", 4)
    rx.wait_drained()
    got = {os.path.basename(e["path"]): e for e in rx.of_type("end")}
    assert set(got) == {"rel.pt", "pathlike.pt", "bytes.pt", "fileobj.pt"}
    assert all(e["path"] == os.path.join(workdir, name) for name, e in got.items())
    assert got["bytes.pt"]["outcome"] == "AttributeError"
    assert got["fileobj.pt"]["bytes"] == result["told"] > 0
    assert len(ends) == 4 and len(rx.of_type("start")) <= 4


def test_many_saves_into_one_open_file_are_one_write(rx, sock, workdir):
    result = run_script(workdir, """
        import json, torch, ckptwatch
        from ckptwatch import hook
        ckptwatch.install()
        with open("shard.distcp", "wb") as f:
            for i in range(200):
                torch.save(torch.full((4,), i), f)    # what torch.distributed.checkpoint does
        with open("shard.distcp", "ab") as f:          # a new open file is a new write
            torch.save(1, f)
        print(json.dumps(hook.stats()))
        """, sock)
    assert result["reported"] == 2 and result["coalesced"] == 199
    rx.wait_count("end", 2)
    rx.wait_drained()
    assert len(rx.of_type("end")) == 2 and len(rx.events) <= 4


def test_agent_absent_save_succeeds_without_waiting(workdir, sockdir):
    missing = os.path.join(sockdir, "nobody-listens.sock")
    started = time.monotonic()
    result = run_script(workdir, """
        import json, time, torch, ckptwatch
        from ckptwatch.emitter import get_emitter
        ckptwatch.install()
        slowest = 0.0
        for i in range(20):
            t0 = time.monotonic()
            torch.save(i, "x.pt")
            slowest = max(slowest, time.monotonic() - t0)
        stats = get_emitter().stats()
        print(json.dumps({"slowest": slowest, "loaded": torch.load("x.pt"),
                          "queued": stats["queued"], "direct": stats["direct"],
                          "unconnected": stats["fallback"]["unconnected"]}))
        """, missing, CKPTWATCH_FLUSH_TIMEOUT="30")
    assert result["loaded"] == 19
    # Kept for when the agent comes back: both frames of every save, none written.
    assert result["queued"] == 40 and result["direct"] == 0
    assert result["unconnected"] == 40
    # Loose bounds only: no save waits for a connect (2 s socket timeout), and exit does not
    # wait out the 30 s flush timeout when nobody listens.
    assert result["slowest"] < 1.0
    assert time.monotonic() - started < 25


def test_the_start_is_in_the_agents_socket_before_the_first_byte(workdir, sockdir):
    # Issue 16 item 2. The child is its own agent: inside torch.save, when the pickler reaches
    # the probe (the file is open and still empty), the save's start must already be readable
    # on the socket, and its end the moment torch.save returns -- so a process killed at any
    # point has left its record. (It failed on the code that held a short save's start back.)
    result = run_script(workdir, """
        import json, os, socket, torch, ckptwatch
        from ckptwatch import events
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.environ["CKPTWATCH_SOCKET"])
        listener.listen(1)
        listener.setblocking(False)
        ckptwatch.install()
        reader, conns = events.FrameReader(), []

        def in_the_socket():
            try:
                if not conns:
                    conns.append(listener.accept()[0])
                    conns[0].setblocking(False)
                got = []
                while True:
                    got += [json.loads(p)["type"] for p in reader.feed(conns[0].recv(65536))]
            except BlockingIOError:
                return got

        seen = {}
        class Probe:
            def __reduce__(self):
                seen["inside"] = in_the_socket()
                seen["bytes_inside"] = os.path.getsize("ckpt.pt")
                return (int, ())

        torch.save({"w": torch.zeros(4), "probe": Probe()}, "ckpt.pt")
        seen["after"] = in_the_socket()
        print(json.dumps(seen))
        """, os.path.join(sockdir, "own.sock"))
    assert result == {"inside": ["hello", "start"], "bytes_inside": 0, "after": ["end"]}


def test_agent_restarted_mid_run(sock, workdir):
    script = os.path.join(workdir, "child.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent("""
            import sys, torch, ckptwatch
            ckptwatch.install()
            for line in sys.stdin:
                torch.save(1, line.strip())
                print("saved", flush=True)
            """))
    child = subprocess.Popen([PY, script], env=subprocess_env(CKPTWATCH_SOCKET=sock),
                             cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)

    def save(name):
        child.stdin.write(name + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "saved"

    try:
        with Receiver(sock) as first:
            save("before.pt")
            first.wait_count("end", 1)
        save("during.pt")                       # agent down
        with Receiver(sock) as second:
            save("after.pt")
            second.wait_count("end", 2)
            child.stdin.close()
            assert child.wait(30) == 0
            names = [os.path.basename(e["path"]) for e in second.of_type("end")]
        assert [os.path.basename(e["path"]) for e in first.of_type("end")] == ["before.pt"]
        assert names == ["during.pt", "after.pt"]
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_fork_child_events_carry_the_child_pid(rx, sock, workdir):
    result = run_script(workdir, """
        import json, os, torch, ckptwatch
        from ckptwatch.emitter import get_emitter
        ckptwatch.install()
        torch.save(0, "parent.pt")
        pid = os.fork()
        if pid == 0:
            torch.save(1, "child.pt")
            os._exit(0 if get_emitter().flush(5) else 3)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"parent": os.getpid(), "child": pid,
                          "status": os.waitstatus_to_exitcode(status)}))
        """, sock)
    assert result["status"] == 0
    rx.wait_count("end", 2)
    by_name = {os.path.basename(e["path"]): e for e in rx.of_type("end")}
    assert by_name["parent.pt"]["pid"] == result["parent"]
    assert by_name["child.pt"]["pid"] == result["child"]
    assert by_name["child.pt"]["seq"] > by_name["parent.pt"]["seq"]
    peer_of = {(e["type"], e["pid"]): p for e, p in zip(rx.events, rx.peer_pids)}
    assert all(event_pid == peer for (_, event_pid), peer in peer_of.items())
    assert rx.rejects == []


def test_disabled_install_is_a_no_op(rx, sock, workdir):
    result = run_script(workdir, """
        import json, torch, ckptwatch
        from ckptwatch import hook
        original = torch.save
        ok = ckptwatch.install()
        torch.save(1, "x.pt")
        print(json.dumps({"ok": ok, "untouched": torch.save is original,
                          "installed": hook.is_installed()}))
        """, sock, CKPTWATCH_DISABLE="1")
    assert result == {"ok": False, "untouched": True, "installed": False}
    rx.wait_drained()
    assert rx.events == []


def test_policy_names_are_parsed_and_unknown_ones_act_as_observe():
    from ckptwatch import hook
    assert hook.policy({}) == "observe"
    assert hook.policy({"CKPTWATCH_POLICY": " Atomic "}) == "atomic"
    assert hook.policy({"CKPTWATCH_POLICY": "warn+atomic"}) == "atomic,warn"
    assert hook.policy({"CKPTWATCH_POLICY": "atomic,warn"}) == "atomic,warn"
    assert hook.policy({"CKPTWATCH_POLICY": "atomc"}) == "observe"


def test_atomic_policy_reports_the_users_path_around_the_whole_atomic_save(rx, sock, workdir):
    result = run_script(workdir, """
        import json, os, torch, ckptwatch
        from ckptwatch import atomic, hook
        ok = ckptwatch.install()
        torch.save({"w": torch.ones(100)}, "x.pt")
        print(json.dumps({"ok": ok, "policy": hook.policy(), "atomic": atomic.stats()["atomic"],
                          "files": sorted(os.listdir(".")), "size": os.path.getsize("x.pt")}))
        """, sock, CKPTWATCH_POLICY="atomic")
    assert result["ok"] is True and result["policy"] == "atomic" and result["atomic"] == 1
    assert result["files"] == ["child.py", "x.pt"]
    (end,) = rx.wait_count("end", 1)
    rx.wait_drained()
    path = os.path.join(workdir, "x.pt")
    assert {e["path"] for e in rx.events} == {path}
    assert end["outcome"] == "ok" and end["bytes"] == result["size"]


@pytest.mark.parametrize("chosen, asks", [("warn", True), ("atomic,warn", True),
                                           ("observe", False)])
def test_only_the_warn_policy_asks_the_agent_for_notices(rx, sock, workdir, chosen, asks):
    run_script(workdir, """
        import json, torch, ckptwatch
        ckptwatch.install()
        torch.save(1, "x.pt")
        print(json.dumps({}))
        """, sock, CKPTWATCH_POLICY=chosen)
    (end,) = rx.wait_count("end", 1)
    assert end.get("notices", False) is asks        # a short save's only event
    assert [hello.get("notices", False) for hello in rx.hellos] == [asks]


def test_from_torch_import_save_before_install_keeps_the_original(rx, sock, workdir):
    # The documented limit: a name bound before the patch is not reported.
    result = run_script(workdir, """
        import json, torch, ckptwatch
        from torch import save as early_save
        ckptwatch.install()
        early_save(1, "unseen.pt")
        torch.save(1, "seen.pt")
        print(json.dumps({}))
        """, sock)
    assert result == {}
    rx.wait_count("end", 1)
    rx.wait_drained()
    assert {os.path.basename(e["path"]) for e in rx.events} == {"seen.pt"}


def test_save_path_never_imports_extra_modules(rx, sock, workdir):
    result = run_script(workdir, """
        import json, sys, torch, ckptwatch
        ckptwatch.install()
        torch.save(1, "x.pt")
        print(json.dumps({m: m in sys.modules
                          for m in ("psutil", "watchdog", "prometheus_client")}))
        """, sock)
    assert result == {"psutil": False, "watchdog": False, "prometheus_client": False}
    rx.wait_count("end", 1)


def test_torch_distributed_checkpoint_shard_is_one_write(rx, sock, workdir):
    # DCP saves every tensor with torch.save into one open shard file (wrapped per tensor).
    # The shard is reported by DCP's own writer (ckptwatch/writers/dcp.py, tests in
    # test_writers.py), around all of it: the torch.saves inside pass through unreported.
    result = run_script(workdir, """
        import json, os, warnings, torch, ckptwatch
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp
        from ckptwatch import hook
        ckptwatch.install()
        dcp.save({f"w{i}": torch.randn(8) for i in range(50)},
                 checkpoint_id=os.path.abspath("dcp"))
        print(json.dumps({**hook.stats(),
                          "shards": sorted(n for n in os.listdir("dcp") if n.endswith(".distcp"))}))
        """, sock)
    assert result["reported"] == 0 and result["coalesced"] == 0, result
    rx.wait_count("end", 2)
    rx.wait_drained()
    shard = os.path.join(workdir, "dcp", result["shards"][0])
    metadata = os.path.join(workdir, "dcp", ".metadata")
    assert sorted(e["path"] for e in rx.of_type("end")) == [metadata, shard]
    assert {e["path"] for e in rx.events} == {shard, metadata}
    assert {e["writer"] for e in rx.of_type("end")} == {"dcp"}
    assert rx.of_type("end")[0]["site"].startswith(os.path.join(workdir, "child.py") + ":")


def test_threads_saving_concurrently_are_each_reported(rx, sock, workdir):
    result = run_script(workdir, """
        import json, threading, torch, ckptwatch
        from ckptwatch import hook
        ckptwatch.install()
        def work(n):
            for i in range(10):
                torch.save(i, f"t{n}.pt")
        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(json.dumps(hook.stats()))
        """, sock)
    assert result["reported"] == 40 and result["errors"] == 0
    ends = rx.wait_count("end", 40)
    assert sorted(e["seq"] for e in ends) == list(range(1, 41))
    paths = {e["seq"]: e["path"] for e in ends}
    assert all(paths[e["seq"]] == e["path"] for e in rx.of_type("start"))
    assert all(e["func"] == "work" for e in ends)


def test_event_frames_decode_to_the_documented_fields():
    # The hook splices each frame's JSON from pre-encoded parts (identity, call site)
    # instead of json-encoding a dict: the frame must decode to exactly the event the wire
    # contract describes, whatever characters the identity and path hold.
    from ckptwatch import events, hook
    ident = {"node": 'n\\"ode\u00e9', "pid": 4242, "rank": 3, "local_rank": None,
             "world_size": 8, "local_world_size": None, "node_rank": 0, "restart": 1,
             "job": 'job "x"\n\u2603', "master": None}
    code = test_event_frames_decode_to_the_documented_fields.__code__
    cases = [("/ckpt/\u00fcber \"q\"\\x\n.pt", code, 17), ("/ckpt/bad-\udcff.pt", None, None)]
    for seq, (path, code_, line) in enumerate(cases, 1):
        site = (code_, line, events.json_members(
            {"site": f"{code_.co_filename}:{line}" if code_ else None,
             "func": code_.co_name if code_ else None}), {})
        heads = hook._heads(site, path, ident)
        # Times go as integer clocks with a decimal exponent; they must read as the floats
        # the fixed-point text they replace read as, and as job scope's copies of them.
        wall_us, mono_ns = 1700000000123456, 12345000001000
        start = events.decode(hook._start_frame(heads, seq, wall_us, mono_ns)[4:])
        site_text = f"{code_.co_filename}:{line}" if code_ else None
        func = code_.co_name if code_ else None
        expected = dict(ident, v=1, type="start", seq=seq, path=path, site=site_text,
                        func=func, wall=1700000000.123456, mono=12345.000001)
        assert start == expected
        pending = hook._pending(ident, seq, path, site, wall_us, mono_ns)
        assert pending == (ident, seq, path, code_, line, 1700000000.123456, 12345.000001)
        for size, outcome in ((4096, "ok"), (None, "OSError"), (None, "ok"), (7, 'K"\u2603')):
            frame = hook._end_frame(heads, seq, 1700000001500000, 12346250000000, wall_us,
                                    mono_ns, size, outcome)
            end = events.decode(frame[4:])
            assert end == dict(expected, type="end", wall=1700000001.5, mono=12346.25,
                               start_wall=1700000000.123456, start_mono=12345.000001,
                               bytes=size, outcome=outcome)
            assert len(frame) - 4 == events.HEADER.unpack(frame[:4])[0]


@pytest.mark.parametrize("seed", range(3))
def test_time_texts_read_as_the_correctly_rounded_floats(seed):
    # The frames' "Ne-6" / "Ne-9" texts and job scope's N / 10**k must be one float.
    import json
    import random
    from ckptwatch import hook
    rng = random.Random(seed)
    for _ in range(2000):
        wall_us, mono_ns = rng.randrange(10 ** 15, 10 ** 16), rng.randrange(1, 10 ** 18)
        pending = hook._pending({}, 1, "/p", hook._NO_SITE, wall_us, mono_ns)
        fixed_point = f"{wall_us // 10 ** 6}.{wall_us % 10 ** 6:06d}"     # the old text
        assert json.loads(f"{wall_us}e-6") == pending[5] == json.loads(fixed_point)
        assert json.loads(f"{mono_ns}e-9") == pending[6]


def test_an_instrumented_save_loads_only_stdlib_and_ckptwatch_modules(rx, sock, workdir):
    # Issue 7's bound, checked exactly: the modules an instrumented save loads, beyond those the
    # same save loads without ckptwatch, are standard library or ckptwatch's own.
    result = run_script(workdir, """
        import json, sys, torch
        torch.save(1, "warm.pt")                  # whatever torch loads lazily on a first save
        plain_before = set(sys.modules)
        torch.save(1, "plain.pt")
        plain = set(sys.modules) - plain_before
        before = set(sys.modules)
        import ckptwatch
        ckptwatch.install()
        torch.save(1, "x.pt")
        from ckptwatch import emitter
        emitter.get_emitter().flush(5)
        added = sorted(set(sys.modules) - before - plain)
        foreign = [m for m in added if m.split(".")[0] not in sys.stdlib_module_names
                   and m.split(".")[0] != "ckptwatch"]
        print(json.dumps({"foreign": foreign, "ours": [m for m in added
                                                        if m.startswith("ckptwatch")]}))
        """, sock)
    assert result["foreign"] == []
    assert "ckptwatch.hook" in result["ours"] and "ckptwatch.emitter" in result["ours"]
    rx.wait_count("end", 1)


def _in_process_hook(monkeypatch):
    """The hook active in this process around a no-op save, its frames kept in a list."""
    from ckptwatch import events, hook

    class Frames:
        def __init__(self):
            self.sent, self.raw = [], []

        def record(self, frame):
            self.raw.append(frame)
            self.sent.append(events.decode(frame[4:]))

    frames = Frames()
    monkeypatch.setattr(hook, "_active", True)
    monkeypatch.setattr(hook, "_emitter", frames)
    monkeypatch.setattr(hook, "_jobscope", None)
    monkeypatch.setattr(hook, "_torch_dir", "/nonexistent-torch/")
    calls = []
    return hook._make_wrapper(lambda obj, f, *a, **k: calls.append(f)), frames, calls


def test_a_path_too_long_for_its_end_frame_is_reported_by_neither_frame(monkeypatch, workdir):
    # The frames' size is checked once per (site, path) head, for the longer "ok" end: a
    # path whose start would fit one frame but whose end would not sends neither (a start
    # without its end would hold the write open at the agent), and the save itself runs.
    from ckptwatch import events, hook
    save, frames, calls = _in_process_hook(monkeypatch)
    probe = "/" + "p" * 100
    save({}, probe)
    start_len, end_len = (len(frame) - 4 for frame in frames.raw)
    assert end_len - start_len > 60
    # a path of this length makes a start frame of MAX_FRAME_BYTES - 20 and a longer end
    long_path = "/" + "p" * (100 + events.MAX_FRAME_BYTES - 20 - start_len)
    frames.sent.clear()
    errors = hook.stats()["errors"]
    save({}, long_path)
    assert calls[-1] == long_path
    assert frames.sent == []
    assert hook.stats()["errors"] == errors + 1
    save({}, probe)                                  # the next save is reported as before
    assert [e["type"] for e in frames.sent] == ["start", "end"]


def test_every_spelling_of_a_path_is_reported_as_its_absolute_path(monkeypatch, workdir):
    # The save path finds a (site, path)'s cached heads by the argument itself: whatever
    # spelling came first, each save's frames carry the absolute, normalised path.
    save, frames, calls = _in_process_hook(monkeypatch)
    monkeypatch.chdir(workdir)
    absolute = os.path.join(workdir, "x.pt")
    with open(absolute, "wb") as f:
        f.write(b"1234")
    spellings = ["x.pt", absolute, os.path.join(workdir, ".", "x.pt"), "./x.pt",
                 absolute.encode(), absolute]
    for spelling in spellings:
        save({}, spelling)                           # one call site for all of them
    with open(absolute, "ab") as f:
        save({}, f)
    save({}, absolute)
    ends = [e for e in frames.sent if e["type"] == "end"]
    assert len(ends) == len(spellings) + 2
    assert {e["path"] for e in frames.sent} == {absolute}
    assert len({e["site"] for e in ends[:len(spellings)]}) == 1
    assert {e["bytes"] for e in ends} == {4}
