"""`ckptwatch scan` (monitor/cli/scan.py): walking, output, exit codes, run as a real process."""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -r requirements-test.txt)")

import corpus  # noqa: E402  (after the torch skip)
from helpers import REPO_ROOT, subprocess_env
from monitor.cli import scan

pytestmark = [pytest.mark.torch]


@pytest.fixture
def tree(tmp_path):
    """ok/ holds clean checkpoints; bad/ adds a flipped-byte and a truncated copy."""
    ok = tmp_path / "ok"
    ok.mkdir()
    torch.save({"w": torch.randn(256, 256)}, ok / "model.pt")
    torch.save({"w": torch.arange(10)}, ok / "sub.pth")
    (ok / "nested").mkdir()
    torch.save([torch.ones(3)], ok / "nested" / "x.ckpt")
    (ok / "notes.txt").write_text("not a checkpoint")
    bad = tmp_path / "bad"
    bad.mkdir()
    corpus.flip_tensor_byte(str(ok / "model.pt"), str(bad / "flipped.pt"))
    data = (ok / "model.pt").read_bytes()
    (bad / "cut.pt").write_bytes(data[:len(data) // 2])
    return tmp_path


def _run(*argv):
    parser = argparse.ArgumentParser(prog="ckptwatch scan")
    scan.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = scan.run(parser.parse_args([str(a) for a in argv]), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_clean_tree_exits_0_one_line_per_file(tree):
    code, out, err = _run(tree / "ok")
    assert code == 0, out
    lines = out.splitlines()
    assert sum(line.startswith("ok ") for line in lines) == 3
    assert "notes.txt" not in out
    assert lines[-1].startswith("3 files") and "3 ok, 0 corrupt" in lines[-1]
    assert err == ""                              # no progress bar when stderr is no TTY


def test_corrupt_files_exit_1_with_reason(tree):
    code, out, _ = _run(tree / "bad")
    assert code == 1
    assert "truncated" in out                      # the cut copy, structural
    assert "flipped.pt" in out
    # Structural scan passes the flipped byte; --deep finds it.
    flipped = next(line for line in out.splitlines() if "flipped.pt" in line)
    assert flipped.startswith("ok ")
    code, out, _ = _run(tree / "bad", "--deep")
    assert code == 1
    assert "CRC32 mismatch" in out
    assert "0 ok, 2 corrupt" in out


def test_output_fits_80_columns(tree):
    _, out, _ = _run(tree / "bad", "--deep")
    for line in out.splitlines():
        shown = line.replace(str(tree), "")        # the path is the user's, not ours
        assert len(shown) <= 80, line


def test_missing_path_is_usage_error_after_scanning_the_rest(tree):
    code, out, err = _run(tree / "nope", tree / "ok")
    assert code == 2
    assert "nope: no such file or directory" in err
    assert "3 ok" in out and "not found" in out


def test_json_format(tree):
    code, out, _ = _run(tree, "--format", "json", "--deep")
    doc = json.loads(out)
    assert code == doc["exit_code"] == 1
    by_name = {os.path.basename(f["path"]): f for f in doc["files"]}
    assert by_name["flipped.pt"]["status"] == "corrupt"
    assert by_name["model.pt"]["status"] == "ok"
    assert by_name["model.pt"]["format"] == "torch-zip"
    assert by_name["model.pt"]["size"] == os.path.getsize(tree / "ok" / "model.pt")
    assert doc["summary"]["files"] == 5 and doc["summary"]["corrupt"] == 2
    assert doc["summary"]["crc32"] in ("zlib-ng", "isal", "zlib")


def test_include_patterns_and_named_files(tree):
    torch.save({"a": torch.ones(1)}, tree / "ok" / "weights.data")
    _, out, _ = _run(tree / "ok")
    assert "weights.data" not in out
    _, out, _ = _run(tree / "ok", "--include", "*.data")
    assert "weights.data" in out and "model.pt" not in out
    # A file named on the command line is verified whatever its name.
    _, out, _ = _run(tree / "ok" / "weights.data")
    assert out.startswith("ok ")


def test_unreadable_and_lookalikes_are_reported_and_counted(tree):
    d = tree / "odd"
    corpus.lookalikes(str(d))
    os.symlink(d / "gone.pt", d / "dangling.pt")
    os.mkfifo(d / "pipe.pt")
    code, out, _ = _run(d)
    assert code == 1                               # the empty file is corrupt
    assert "cannot read" in out and "No such file" in out     # the dangling link
    assert "not a regular file" in out
    assert "git lfs pull" in out and "HTML page" in out and "empty file" in out
    assert "1 corrupt, 4 unverifiable" in out


def test_real_process_json(tree):
    """python -m monitor.cli.scan runs as a process: exit code and stdout are what a CI sees."""
    proc = subprocess.run([sys.executable, "-m", "monitor.cli.scan", "--format", "json",
                           str(tree / "ok")], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["ok"] == 3
    assert "import torch" not in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "monitor.cli.scan"], cwd=REPO_ROOT,
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "PATH" in bad.stderr


def test_scan_does_not_import_torch(tree):
    code = ("import sys, monitor.cli.scan as s; s.scan([sys.argv[1]], deep=True); "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tree)], cwd=REPO_ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_only_after_a_delay():
    now = [0.0]
    stream = _Tty()
    bar = scan.ProgressBar(stream, clock=lambda: now[0], delay=0.5)
    bar.update(1, 10, 100, 1000)
    assert stream.getvalue() == ""                 # short scans stay quiet
    now[0] = 0.6
    bar.update(5, 10, 500, 1000)
    text = stream.getvalue()
    assert text.startswith("\r[") and "5/10 files" in text and len(text) <= 81
    bar.update(6, 10, 600, 1000)                   # within 0.1 s: not redrawn
    assert stream.getvalue() == text
    bar.clear()
    assert stream.getvalue().endswith("\r\033[K")


def test_progress_bar_drawn_on_tty_stderr(tree, monkeypatch):
    err = _Tty()
    clock = iter(range(0, 1000))                   # each reading one second later
    monkeypatch.setattr(scan.time, "monotonic", lambda: float(next(clock)))
    parser = argparse.ArgumentParser()
    scan.add_arguments(parser)
    out = io.StringIO()
    scan.run(parser.parse_args([str(tree / "ok")]), out=out, err=err)
    assert "files" in err.getvalue() and err.getvalue().endswith("\r\033[K")
    assert "\r" not in out.getvalue()              # stdout stays clean for pipes


def test_memo_bomb_is_not_ok_and_scan_stays_small(tmp_path):
    """A 2**27 memo index in an 11-byte data.pkl once made scan grow a 2 GB memo table and
    then call the file "ok". Under a 400 MB address-space cap (the old code dies of
    MemoryError there or falls back to a reader that says ok) the verdict must be a refusal
    and the peak RSS small."""
    bomb = corpus.memo_bomb(str(tmp_path / "bomb.pt"), 2 ** 27)
    code, out, err, peak = corpus.run_measured(
        ["-m", "monitor.cli.scan", "--format", "json", bomb],
        env=subprocess_env(), limit_bytes=400 << 20)
    [result] = json.loads(out)["files"]
    assert result["status"] != "ok", result
    assert result["status"] == "corrupt" and result["details"]["cause"] == "out_of_bounds"
    assert code == scan.EXIT_CORRUPT, err
    assert peak is not None and peak < 80 << 20, f"peak RSS {peak} bytes"


# ---- files that are not files, links out of the tree (issue 17 items 5, 7) ----------------

def test_a_checkpoint_swapped_for_a_fifo_after_each_look_does_not_hang_scan(tree,
                                                                           monkeypatch):
    # Old code: scan stat'ed the file (size), integrity.verify stat'ed it again, then opened
    # it by name: a FIFO renamed over it after the look blocked scan forever.
    from racer import FifoRacer, bounded
    target = tree / "ok" / "model.pt"
    with FifoRacer(target, monkeypatch) as racer:
        finished, result = bounded(lambda: _run(tree / "ok"), timeout=20)
        assert finished, "scan blocked opening a FIFO"
        assert racer.looks >= 1
    code, out, _ = result
    assert "not read: a FIFO, not a regular file" in out
    assert code == 0


def test_a_sharded_set_whose_shard_becomes_a_fifo_does_not_hang_scan(tmp_path):
    # Old code: a Hugging Face shard verified as a file, then renamed to a FIFO before the set
    # check read its header again (safetensors_header opened it blocking): scan hung.
    from racer import bounded
    st = pytest.importorskip("safetensors.torch")
    d = tmp_path / "hf"
    d.mkdir()
    st.save_file({"a": torch.ones(4)}, str(d / "model-00001-of-00001.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 16},
         "weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    shard = d / "model-00001-of-00001.safetensors"

    def swap(result):
        if result.path == str(shard):               # verified as a file: now a FIFO
            os.rename(shard, str(shard) + ".real")
            os.mkfifo(shard)

    finished, got = bounded(lambda: scan.scan([str(d)], on_result=swap), timeout=20)
    try:
        assert finished, "scan blocked opening a FIFO"
    finally:
        try:
            os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    results, _ = got
    (hf,) = [r for r in results if r.is_set]
    assert hf.verdict.status == "unverifiable" and "FIFO" in hf.verdict.reason


def test_scan_never_follows_a_link_out_of_the_tree_nor_prints_file_bytes(tree, tmp_path):
    # Old code: `ckptwatch scan` as root printed "starts with 72 6f 6f 74 3a 24 36 24" for a
    # link to /etc/shadow planted in a scanned tree.
    from openwatch import OpenWatch
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:$6$SECRETSECRET:19000:0:99999:7:::\n")
    (tree / "ok" / "stolen.pt").symlink_to(secret)
    (tree / "ok" / "latest.pt").symlink_to(tree / "ok" / "model.pt")     # in the tree
    (tree / "ok" / "junk.pt").write_bytes(b"\x1b[2J\x1b]0;pwned\x07 plain junk")
    watch = OpenWatch(str(secret))
    try:
        code, out, _ = _run(tree / "ok")
        assert not watch.opened(), "scan opened a file outside the scanned tree"
    finally:
        watch.close()
    assert code == 0
    assert "symbolic link out of the scanned tree, not followed" in out
    assert secret.read_bytes()[:8].hex(" ") not in out and "SECRET" not in out
    assert "not a known checkpoint format\n" in out and "1b 5b" not in out
    assert "\x1b" not in out
    # The in-tree link is its target, verified once.
    assert out.count("model.pt") + out.count("latest.pt") == 1


def test_names_are_printed_with_control_characters_escaped(tree):
    evil = tree / "ok" / "a\x1b]0;pwned\x07.pt"
    evil.write_bytes(b"")
    code, out, _ = _run(tree / "ok")
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned\\x07.pt" in out


class _CallsOsSystem:
    def __reduce__(self):
        return (os.system, ("exit 0",))


def test_ok_says_what_it_means_for_a_pickle_that_calls_os_system(tree):
    # Old code: "ok torch-zip" and nothing else, which reads like "safe to load".
    torch.save({"w": torch.ones(2), "x": _CallsOsSystem()}, tree / "ok" / "evil.pt")
    code, out, _ = _run(tree / "ok")
    assert code == 0                                     # whole: not corrupt
    said = out.split("evil.pt\n", 1)[1].split("\nok ", 1)[0]
    said = " ".join(said.split())                        # the reason, unwrapped
    assert said.startswith("structurally whole, but its pickle names posix.system")
    assert "torch.load(weights_only=True) refuses" in said
    code, out, _ = _run("--format", "json", tree / "ok")
    files = {os.path.basename(f["path"]): f for f in json.loads(out)["files"]}
    assert files["evil.pt"]["details"]["pickle"] == "full_unpickle"
    assert files["evil.pt"]["details"]["refused_globals"] == ["posix.system"]
    assert files["model.pt"]["details"]["pickle"] == "weights_only"


def test_a_file_named_and_found_in_a_directory_is_verified_once(tree):
    code, out, _ = _run(tree / "ok" / "model.pt", tree / "ok")
    assert code == 0 and out.count("model.pt") == 1
