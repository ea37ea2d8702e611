"""`ckptwatch diagnose` in process: the answer from a log and real journal files (written by the
agent's own Journal), exit codes, and the log as hostile input (FIFOs, devices, size, control
characters). Real races and real tracebacks: tests/e2e/test_diagnose.py."""
from __future__ import annotations

import io
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from exporters.journal import Journal
from monitor.cli import diagnose
from monitor.cli.main import main
from monitor.detect.model import Collision, Finding, Write, Writer

TRACEBACK = """Restoring states from the checkpoint path at {path}
Traceback (most recent call last):
  File "/src/train.py", line 88, in <module>
    state = torch.load(args.resume)
RuntimeError: record size (800000 bytes) does not match expected size (400000 bytes = 400000 elements * 1 bytes/element) for dtype Byte
"""


def write(pid, rank, start, path, node="node-a"):
    return Write(writer=Writer(node=node, pid=pid, rank=rank, job="j1", local_rank=rank),
                 path=path, seq=1, start_wall=1_700_000_000.0 + start, start_mono=start,
                 end_wall=1_700_000_000.5 + start, end_mono=start + 0.5, bytes=4096,
                 outcome="ok", site="train.py:42", func="save_checkpoint")


def journal_with(path, records) -> str:
    j = Journal(path)
    for r in records:
        j.write(r)
    j.close()
    return path


def run(*argv, stdin=None):
    out, err = io.StringIO(), io.StringIO()
    parser_args = SimpleNamespace(log=None, journal=None, path=None, format="table")
    for key, value in argv:
        setattr(parser_args, key, value)
    code = diagnose.run(parser_args, out=out, err=err, stdin=stdin)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def scene(tmp_path):
    ckpt = str(tmp_path / "ckpt" / "last.pt")
    log = tmp_path / "train.log"
    log.write_text("step 10\n" + TRACEBACK.format(path=ckpt))
    writes = (write(11, 0, 10.0, ckpt), write(12, 1, 10.1, ckpt), write(13, 2, 10.2, ckpt))
    collision = Collision(path=ckpt, kind="concurrent", writes=writes, id="c0ffee",
                          detected_wall=1_700_000_012.0)
    other = Collision(path=str(tmp_path / "other.pt"), kind="concurrent",
                      writes=(write(21, 0, 1.0, "/x"), write(22, 1, 1.1, "/x")), id="other")
    verdict = Finding("verification", ckpt, "j1", wall=1_700_000_013.0,
                      details={"result": "corrupt", "cause": "torn", "reason": "CRC differs",
                               "collision_id": "c0ffee"})
    a = journal_with(str(tmp_path / "a.jsonl"), [*writes, collision, verdict])
    b = journal_with(str(tmp_path / "b.jsonl"), [other, collision])     # another node's copy
    return SimpleNamespace(ckpt=ckpt, log=str(log), a=a, b=b, dir=str(tmp_path))


def test_a_collision_behind_the_error_exits_1_and_names_writers_first_last_and_fix(scene):
    code, out, err = run(("log", scene.log), ("journal", [scene.a, scene.b]))
    assert code == 1, err
    assert "two saves interleaved in one file [record_size_mismatch]" in out
    assert f"  file       {scene.ckpt}" in out                # whole, copyable
    assert "written by a concurrent write collision:" in out      # once, though in both
    assert "first to start: rank0@node-a (pid 11)" in out
    assert "last to finish: rank2@node-a (pid 13)" in out
    assert "verdict    corrupt (torn): CRC differs" in out
    assert "fix: guard this call site with a global-rank-0 check" in out
    # Lines fit 80 columns, but for a path longer than that (one word after the label): a
    # path is never cut.
    assert all(len(line) <= 80 or len(line[13:].rstrip(",").split()) == 1
               for line in out.splitlines())


def test_json_answer(scene):
    code, out, _ = run(("log", scene.log), ("journal", [scene.dir]), ("format", "json"))
    answer = json.loads(out)
    assert code == 1 and answer["collision_behind_error"] is True
    assert answer["failure"]["class"] == "record_size_mismatch"
    assert answer["file"] == scene.ckpt and answer["file_named_at"]["line"] == 2
    assert answer["collision"]["id"] == "c0ffee" and len(answer["collisions"]) == 1
    assert [w["rank"] for w in answer["collision"]["writers"]] == [0, 1, 2]
    assert answer["verification"]["result"] == "corrupt"
    assert len(answer["journals"]) == 2


def test_no_collision_on_record_exits_0(scene, tmp_path):
    log = tmp_path / "other.log"
    log.write_text(TRACEBACK.format(path="/never/written.pt"))
    code, out, _ = run(("log", str(log)), ("journal", [scene.a]))
    assert code == 0
    assert "the journals hold no write of this file" in out
    assert "fix        no collision on record for this file" in out


def test_path_given_when_the_log_names_none(scene, tmp_path):
    log = tmp_path / "bare.log"
    log.write_text("EOFError: Ran out of input\n")
    code, out, _ = run(("log", str(log)), ("journal", [scene.a]))
    assert code == 0 and "pass it with --path FILE" in out
    code, out, _ = run(("log", str(log)), ("journal", [scene.a]), ("path", scene.ckpt))
    assert code == 1 and "(--path)" in out


def test_a_relative_path_in_the_log_matches_the_journals_absolute_one(scene, tmp_path):
    log = tmp_path / "rel.log"
    log.write_text(TRACEBACK.format(path="ckpt/last.pt"))
    code, out, _ = run(("log", str(log)), ("journal", [scene.a]), ("format", "json"))
    assert code == 1 and json.loads(out)["journal_paths"] == [scene.ckpt]


def test_standard_input(scene):
    with open(scene.log, "rb") as f:
        code, out, _ = run(("log", "-"), ("journal", [scene.a]), stdin=f)
    assert code == 1 and "ckptwatch diagnose: standard input" in out


def test_no_failure_recognised_exits_0(tmp_path):
    log = tmp_path / "ok.log"
    log.write_text("all good\n")
    code, out, _ = run(("log", str(log)))
    assert code == 0 and "no checkpoint load failure recognised" in out


# --- usage and hostile input -----------------------------------------------------------------

def test_missing_log_and_journal_exit_2_with_one_line(tmp_path, scene):
    code, out, err = run(("log", str(tmp_path / "nope.log")))
    assert code == 2 and out == "" and err.count("\n") == 1 and "cannot read" in err
    code, _, err = run(("log", scene.log), ("journal", [str(tmp_path / "nope.jsonl")]))
    assert code == 2 and "no journal at" in err


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=run(("log", str(fifo)))),
                              daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "diagnose waited on a FIFO"
    code, _, err = result["r"]
    assert code == 2 and "not a regular file" in err


@pytest.mark.parametrize("name", ["/dev/null", "/dev/zero", "/proc/self"])
def test_devices_and_directories_are_not_logs(name):
    code, _, err = run(("log", name))
    assert code == 2 and ("not a regular file" in err or "cannot read" in err)


def test_a_fifo_journal_is_refused(scene, tmp_path):
    fifo = tmp_path / "j.jsonl"
    os.mkfifo(fifo)
    code, _, err = run(("log", scene.log), ("journal", [str(fifo)]))
    assert code == 2 and "not a regular file" in err


def test_a_huge_log_is_read_from_its_end_only(tmp_path, scene):
    log = tmp_path / "huge.log"
    with open(log, "wb") as f:
        f.write(b"x" * 100 + b"\n")
        f.write((b"noise " * 200 + b"\n") * 3000)               # ~3.6 MB
        f.write(TRACEBACK.format(path=scene.ckpt).encode())
    text, read, total = diagnose.read_log(str(log), limit=1 << 20)
    assert read <= 1 << 20 and total == os.path.getsize(log)
    assert text.startswith("noise") and "record size" in text     # a cut first line dropped
    started = time.process_time()
    code, out, _ = run(("log", str(log)), ("journal", [scene.a]))
    assert code == 1 and time.process_time() - started < 20


def test_stdin_is_bounded_too():
    data = io.BytesIO(b"y" * (3 << 20) + b"\nEOFError: Ran out of input\n")
    text, read, total = diagnose.read_log("-", stdin=data, limit=1 << 20)
    assert read == 1 << 20 and total == (3 << 20) + 28 and text.endswith("Ran out of input\n")


def test_what_it_prints_is_escaped(tmp_path):
    path = "/ckpt/\x1b[2J\x1b[31mevil\rname.pt"
    log = tmp_path / "evil.log"
    log.write_bytes(("Restoring states from the checkpoint path at '" + path + "'\n"
                     "EOFError: Ran out of input \x07\x1b]0;title\x07\n").encode()
                    + b"\xff\xfe not utf-8\n")
    code, out, _ = run(("log", str(log)))
    assert code == 0
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    # A \r inside a line does not end it (colour codes are dropped before matching).
    assert "/ckpt/evil\\rname.pt" in out and "\\x07" in out


def test_the_command_line(scene, capsys):
    assert main(["diagnose", scene.log, "--journal", scene.a]) == 1
    assert "record_size_mismatch" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["diagnose", scene.log, "--jurnal", scene.a])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["diagnose", "--help"])
    assert info.value.code == 0
    assert "--journal" in capsys.readouterr().out
