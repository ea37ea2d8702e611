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
