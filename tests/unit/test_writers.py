"""ckptwatch.writers: safetensors, torch.distributed.checkpoint and fsspec writes reported like
torch.save's -- each import/install/uninstall order in a fresh Python process, the events read
by a real Unix socket receiver (or by the child itself, as its own agent, to see what is in
the socket at the moment the library starts writing).
"""
import json
import os
import subprocess
import sys
import textwrap

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
    script = os.path.join(workdir, "child.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(body))
    out = subprocess.run([PY, script], env=subprocess_env(CKPTWATCH_SOCKET=sock, **env),
                         cwd=workdir, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def site_of(workdir: str, marker: str) -> str:
    path = os.path.join(workdir, "child.py")
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if marker in line:
                return f"{path}:{number}"
    raise AssertionError(marker)


def writes(rx) -> list:
    """(writer, path, seq) of every end, and the check that each start has its end."""
    ends = rx.of_type("end")
    assert sorted(e["seq"] for e in rx.of_type("start")) == sorted(e["seq"] for e in ends)
    return ends


# ---- safetensors ----------------------------------------------------------------------------

def test_safetensors_save_file_and_save_model_are_reported_with_their_site(rx, sock, workdir):
    pytest.importorskip("safetensors")
    result = run_script(workdir, """
        import json, os, ckptwatch
        ckptwatch.install()                      # before the import: patched when it comes
        import torch
        from safetensors.torch import save_file, save_model   # bound after the patch
        save_file({"w": torch.zeros(16)}, "a.safetensors")     # SAVE-FILE
        save_model(torch.nn.Linear(4, 4), "b.safetensors")     # SAVE-MODEL
        torch.save(1, "c.pt")
        from ckptwatch import writers
        print(json.dumps({"installed": writers.installed(),
                          "sizes": {n: os.path.getsize(n) for n in
                                    ("a.safetensors", "b.safetensors", "c.pt")}}))
        """, sock)
    assert result["installed"] == ["safetensors"]
    ends = {os.path.basename(e["path"]): e for e in rx.wait_count("end", 3)}
    assert {n: e.get("writer") for n, e in ends.items()} == {
        "a.safetensors": "safetensors", "b.safetensors": "safetensors", "c.pt": None}
    assert ends["a.safetensors"]["site"] == site_of(workdir, "SAVE-FILE")
    assert ends["b.safetensors"]["site"] == site_of(workdir, "SAVE-MODEL")
    assert all(e["bytes"] == result["sizes"][n] and e["outcome"] == "ok"
               for n, e in ends.items())
    # One sequence for the process, whichever library wrote.
    assert sorted(e["seq"] for e in writes(rx)) == [1, 2, 3]


def test_safetensors_start_is_in_the_socket_before_the_library_writes(workdir, sockdir):
    # The child is its own agent: when safetensors' own writer (serialize_file, which the
    # original save_file calls) begins, the start must already be readable on the socket.
    pytest.importorskip("safetensors")
    result = run_script(workdir, """
        import json, os, socket, ckptwatch
        from ckptwatch import events
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.environ["CKPTWATCH_SOCKET"])
        listener.listen(1)
        listener.setblocking(False)
        ckptwatch.install()
        import torch, safetensors.torch as st
        reader, conns, seen = events.FrameReader(), [], {}

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

        real = st.serialize_file
        def probe(*args, **kwargs):
            seen["inside"] = in_the_socket()
            seen["exists_inside"] = os.path.exists("m.safetensors")
            return real(*args, **kwargs)
        st.serialize_file = probe
        st.save_file({"w": torch.zeros(4)}, "m.safetensors")
        seen["after"] = in_the_socket()
        print(json.dumps(seen))
        """, os.path.join(sockdir, "own.sock"))
    assert result == {"inside": ["hello", "start"], "exists_inside": False, "after": ["end"]}


def test_safetensors_failure_is_the_same_exception_and_an_end(rx, sock, workdir):
    pytest.importorskip("safetensors")
    result = run_script(workdir, """
        import json, os, torch, ckptwatch
        import safetensors.torch as st
        ckptwatch.install()                      # after the import: patched now
        os.mkdir("ro")
        try:
            st.save_file({"w": torch.zeros(4)}, "missing-dir/x.safetensors")
        except Exception as exc:
            caught = type(exc).__name__
        print(json.dumps({"caught": caught}))
        """, sock)
    (end,) = rx.wait_count("end", 1)
    assert end["outcome"] == result["caught"] and end["writer"] == "safetensors"
    assert end["bytes"] is None


def test_install_twice_uninstall_restores_and_leaves_a_foreign_wrapper(rx, sock, workdir):
    pytest.importorskip("safetensors")
    pytest.importorskip("fsspec")
    result = run_script(workdir, """
        import json, torch, ckptwatch
        import safetensors.torch as st, torch.distributed.checkpoint.filesystem as fs
        import fsspec.implementations.local as local
        originals = (st.save_file, fs.FileSystem.create_stream, local.LocalFileOpener.__init__)
        first, second = ckptwatch.install(), ckptwatch.install()
        wrapped = (st.save_file, fs.FileSystem.create_stream, local.LocalFileOpener.__init__)
        ckptwatch.uninstall()
        restored = (st.save_file, fs.FileSystem.create_stream,
                    local.LocalFileOpener.__init__) == originals
        ckptwatch.install()
        again = st.save_file is wrapped[0]         # the same wrapper, not a second layer
        def foreign(*a, **k):
            return again_wrapper(*a, **k)
        again_wrapper = st.save_file
        st.save_file = foreign
        ckptwatch.uninstall()
        st.save_file({"w": torch.zeros(2)}, "quiet.safetensors")   # ours inside: quiet
        print(json.dumps({"first": first, "second": second, "restored": restored,
                          "changed": all(w is not o for w, o in zip(wrapped, originals)),
                          "again": again, "foreign_kept": st.save_file is foreign}))
        """, sock)
    assert result == {"first": True, "second": False, "restored": True, "changed": True,
                      "again": True, "foreign_kept": True}
    rx.wait_drained()
    assert rx.of_type("start") == []


def test_disabled_patches_nothing(rx, sock, workdir):
    pytest.importorskip("safetensors")
    result = run_script(workdir, """
        import json, ckptwatch, torch
        import safetensors.torch as st
        original = st.save_file
        ckptwatch.install()
        st.save_file({"w": torch.zeros(2)}, "x.safetensors")
        from ckptwatch import writers
        print(json.dumps({"same": st.save_file is original, "installed": writers.installed()}))
        """, sock, CKPTWATCH_DISABLE="1")
    assert result == {"same": True, "installed": []}
    rx.wait_drained()
    assert rx.events == []


def test_a_process_that_imports_none_of_the_writers_loads_none_of_our_machinery(rx, sock,
                                                                               workdir):
    result = run_script(workdir, """
        import json, sys, ckptwatch
        ckptwatch.install()
        import json as _again
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("ckptwatch"))))
        """, sock)
    assert "ckptwatch.hook" not in result and "ckptwatch.emitter" not in result, result
    assert not [m for m in result if m.startswith("ckptwatch.writers.")], result


# ---- torch.distributed.checkpoint -----------------------------------------------------------

DCP_SAVE = """
    import json, os, warnings, ckptwatch
    warnings.simplefilter("ignore")
    ckptwatch.install()
    import torch
    import torch.distributed.checkpoint as dcp
    from ckptwatch import hook
    state = {f"w{i}": torch.randn(8) for i in range(20)}
    def save():
        {call}  # DCP-SAVE
    save()
    names = sorted(os.listdir("dcp"))
    print(json.dumps({"hook": hook.stats(), "names": names,
                      "sizes": {n: os.path.getsize(os.path.join("dcp", n)) for n in names}}))
    """


def test_dcp_every_shard_and_the_metadata_are_one_write_each(rx, sock, workdir):
    call = ('dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.abspath("dcp"), '
            'thread_count=2), no_dist=True)')
    result = run_script(workdir, DCP_SAVE.replace("{call}", call), sock)
    shards = [n for n in result["names"] if n.endswith(".distcp")]
    assert len(shards) == 2 and result["names"] == [".metadata"] + shards, result
    ends = rx.wait_count("end", 3)
    rx.wait_drained()
    paths = {e["path"]: e for e in writes(rx)}
    assert sorted(paths) == sorted(os.path.join(workdir, "dcp", n) for n in result["names"])
    assert {e["writer"] for e in ends} == {"dcp"}
    # Both shards, the one written on DCP's worker thread too, name the user's call.
    assert {e["site"] for e in ends} == {site_of(workdir, "DCP-SAVE")}
    assert all(e["bytes"] == result["sizes"][os.path.basename(p)] for p, e in paths.items())
    # The per-tensor torch.saves into the open shards are inside the shard's write.
    assert result["hook"]["reported"] == 0 and result["hook"]["coalesced"] == 0


def test_dcp_async_save_is_reported_from_its_thread_with_the_callers_site(rx, sock, workdir):
    call = ('dcp.async_save(state, checkpoint_id=os.path.abspath("dcp"), no_dist=True)'
            '.result()')
    result = run_script(workdir, DCP_SAVE.replace("{call}", call), sock)
    assert result["names"] == [".metadata", "__0_0.distcp"]
    ends = rx.wait_count("end", 2)
    assert sorted(os.path.basename(e["path"]) for e in ends) == [".metadata", "__0_0.distcp"]
    assert {e["writer"] for e in ends} == {"dcp"}
    assert {e["site"] for e in ends} == {site_of(workdir, "DCP-SAVE")}


def test_dcp_metadata_start_is_on_record_before_the_temporary_file(workdir, sockdir):
    result = run_script(workdir, """
        import json, os, socket, pathlib, warnings, ckptwatch
        warnings.simplefilter("ignore")
        from ckptwatch import events
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.environ["CKPTWATCH_SOCKET"])
        listener.listen(1)
        listener.setblocking(False)
        ckptwatch.install()
        import torch, torch.distributed.checkpoint as dcp
        reader, conns, seen = events.FrameReader(), [], []

        def in_the_socket():
            try:
                if not conns:
                    conns.append(listener.accept()[0])
                    conns[0].setblocking(False)
                got = []
                while True:
                    got += [(e["type"], os.path.basename(e["path"])) for e in
                            map(json.loads, reader.feed(conns[0].recv(65536)))
                            if e["type"] != "hello"]
            except BlockingIOError:
                return got

        real_open = pathlib.Path.open
        def probe(self, mode="r", *a, **k):
            if "w" in mode:
                seen.append([self.name, in_the_socket()])
            return real_open(self, mode, *a, **k)
        pathlib.Path.open = probe
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=os.path.abspath("dcp"), no_dist=True)
        pathlib.Path.open = real_open
        print(json.dumps(seen))
        """, os.path.join(sockdir, "own.sock"))
    assert result == [["__0_0.distcp", [["start", "__0_0.distcp"]]],
                      [".metadata.tmp", [["end", "__0_0.distcp"], ["start", ".metadata"]]]]


# ---- fsspec ---------------------------------------------------------------------------------

def test_fsspec_transaction_and_autocommit_checkpoint_writes(rx, sock, workdir):
    pytest.importorskip("fsspec")
    result = run_script(workdir, """
        import json, os, ckptwatch
        ckptwatch.install()
        import fsspec
        fs = fsspec.filesystem("file")
        with fs.transaction:
            with fs.open(os.path.abspath("t.ckpt"), "wb") as f:   # TXN
                f.write(b"x" * 100)
        with fs.open(os.path.abspath("a.pt"), "wb") as f:          # AUTO
            f.write(b"y" * 10)
        f = fs.open(os.path.abspath("c.pth"), "wb")                 # CLOSE
        f.write(b"z" * 5)
        f.close()
        with fs.open(os.path.abspath("metrics.csv"), "w") as f:    # not a checkpoint
            f.write("step,loss")
        with fs.open(os.path.abspath("t.ckpt"), "rb") as f:        # a read
            f.read()
        try:
            with fs.transaction:
                with fs.open(os.path.abspath("gone.ckpt"), "wb") as f:   # DISCARD
                    f.write(b"q")
                raise KeyError("abort")
        except KeyError:
            pass
        print(json.dumps({"exists": sorted(n for n in os.listdir(".") if "." in n)}))
        """, sock)
    assert "gone.ckpt" not in result["exists"]
    ends = rx.wait_count("end", 4)
    rx.wait_drained()
    got = {os.path.basename(e["path"]): e for e in writes(rx)}
    assert sorted(got) == ["a.pt", "c.pth", "gone.ckpt", "t.ckpt"]
    assert {e["writer"] for e in ends} == {"fsspec"}
    assert {n: (e["outcome"], e["bytes"]) for n, e in got.items()} == {
        "t.ckpt": ("ok", 100), "a.pt": ("ok", 10), "c.pth": ("ok", 5),
        "gone.ckpt": ("discarded", None)}
    assert got["t.ckpt"]["site"] == site_of(workdir, "# TXN")
    assert got["c.pth"]["site"] == site_of(workdir, "# CLOSE")


def test_fsspec_transaction_start_is_before_the_rename_onto_the_target(workdir, sockdir):
    pytest.importorskip("fsspec")
    result = run_script(workdir, """
        import json, os, shutil, socket, ckptwatch
        from ckptwatch import events
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.environ["CKPTWATCH_SOCKET"])
        listener.listen(1)
        listener.setblocking(False)
        ckptwatch.install()
        import fsspec
        reader, conns, seen = events.FrameReader(), [], {}

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

        real_move = shutil.move
        def probe(src, dst, *a, **k):
            seen["at_move"] = in_the_socket()
            return real_move(src, dst, *a, **k)
        shutil.move = probe
        fs = fsspec.filesystem("file")
        with fs.transaction:
            with fs.open(os.path.abspath("t.ckpt"), "wb") as f:
                f.write(b"x" * 10)
            seen["before_commit"] = in_the_socket()
        seen["after"] = in_the_socket()
        print(json.dumps(seen))
        """, os.path.join(sockdir, "own.sock"))
    assert result == {"before_commit": ["hello", "start"], "at_move": [], "after": ["end"]}


# ---- warn: the warning points at the user's call site ----------------------------------------

class NoticingAgent:
    """One connection: reads the hook's frames and, for the first start by writer `kind`,
    sends back the notice an agent sends for a collision involving that write."""

    def __init__(self, path: str, kind: str):
        import socket
        import threading
        self.kind, self.start_event = kind, None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        from ckptwatch import events
        conn, _ = self.listener.accept()
        reader = events.FrameReader()
        with conn:
            while self.start_event is None:
                data = conn.recv(65536)
                if not data:
                    return
                for payload in reader.feed(data):
                    event = json.loads(payload)
                    if event.get("type") == "start" and event.get("writer") == self.kind:
                        self.start_event = event
            notice = {"v": 1, "type": "notice", "kind": "concurrent",
                      "path": self.start_event["path"], "site": self.start_event["site"],
                      "id": "abc", "others": [{"rank": 1, "pid": 11, "node": "n1",
                                               "site": self.start_event["site"]}]}
            body = json.dumps(notice).encode()
            conn.sendall(events.HEADER.pack(len(body)) + body)
            while conn.recv(65536):
                pass

    def close(self):
        self.listener.close()


_WARN_CHILD = """
    import json, time, warnings, ckptwatch
    ckptwatch.install()
    import torch
    {imports}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        {save}                                  # THE-SAVE
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not [
                w for w in caught if w.category is ckptwatch.CheckpointCollisionWarning]:
            time.sleep(0.01)
    (warning,) = [w for w in caught if w.category is ckptwatch.CheckpointCollisionWarning]
    print(json.dumps({{"file": warning.filename, "line": warning.lineno,
                       "text": str(warning.message)}}))
    """


@pytest.mark.parametrize("kind", ["safetensors", "dcp"])
def test_warn_attributes_a_writers_warning_to_the_users_call_site(kind, workdir, sockdir):
    pytest.importorskip("safetensors")
    imports, save = {
        "safetensors": ("from safetensors.torch import save_file",
                        'save_file({"w": torch.zeros(4)}, "a.safetensors")'),
        "dcp": ("import torch.distributed.checkpoint as dcp",
                'dcp.save({"w": torch.zeros(4)}, checkpoint_id="step-1", no_dist=True)'),
    }[kind]
    sock = os.path.join(sockdir, "agent.sock")
    agent = NoticingAgent(sock, kind)
    try:
        result = run_script(workdir, _WARN_CHILD.format(imports=imports, save=save), sock,
                            CKPTWATCH_POLICY="warn")
    finally:
        agent.close()
    file, _, line = site_of(workdir, "THE-SAVE").rpartition(":")
    assert agent.start_event["site"] == f"{file}:{line}"
    # the user's file and line, so `python -W error::...` and IDEs point at the save
    assert (result["file"], result["line"]) == (file, int(line)), result
    assert f"{file}:{line}" in result["text"]
