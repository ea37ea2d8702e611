"""monitor/cli/tracebacks.py: every failure class on the message the real library raises (each
failure is made to happen here: torch.load, safetensors, pickle, zipfile, os.rename, open),
the file found in the log around it, and input no log should be able to slow or fool it."""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import time
import traceback
import zipfile

import pytest

from helpers import subprocess_env
from monitor.cli import tracebacks


def traceback_of(fn) -> str:
    """The traceback Python prints for fn(), as a log holds it."""
    try:
        fn()
    except BaseException as exc:        # noqa: BLE001 (every failure is wanted here)
        return "".join(traceback.format_exception(exc))
    raise AssertionError("did not fail")


def log_around(path: str, tb: str) -> str:
    return (f"epoch 3 step 1200 loss 0.412\nresuming from {path}\n"
            f"INFO building model\n{tb}")


@pytest.fixture(scope="module")
def torch_files(tmp_path_factory):
    torch = pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("tb")
    small, big = io.BytesIO(), io.BytesIO()
    torch.save({"w": torch.arange(10_000)}, small)
    torch.save({"w": torch.arange(20_000)}, big)
    small, big = small.getvalue(), big.getvalue()
    files = {"truncated.pt": small[:len(small) // 2], "cut_end.pt": small[:-10],
             "mixed.pt": big[:len(small) // 2] + small[len(small) // 2:],
             "empty.pt": b"", "garbage.pt": b"\x00garbage" * 50}
    record = bytearray(small)
    (info,) = [i for i in zipfile.ZipFile(io.BytesIO(small)).infolist() if "/data/" in i.filename]
    record[info.header_offset:info.header_offset + 4] = b"XXXX"     # a local header overwritten
    files["record.pt"] = bytes(record)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return torch, d


@pytest.mark.torch
@pytest.mark.parametrize("name, weights_only, expected", [
    ("cut_end.pt", True, "zip_truncated"),            # failed finding central directory
    ("truncated.pt", True, "zip_unreadable"),         # OSError from PyTorchFileReader
    ("record.pt", True, "zip_record_corrupt"),
    ("mixed.pt", True, "record_size_mismatch"),
    ("empty.pt", False, "pickle_truncated"),          # EOFError: Ran out of input
    ("empty.pt", True, "pickle_truncated"),           # a bare EOFError
    ("garbage.pt", False, "pickle_garbage"),          # invalid load key
    ("garbage.pt", True, "pickle_garbage"),           # Unsupported operand
])
def test_torch_load_failures(torch_files, name, weights_only, expected):
    torch, d = torch_files
    path = str(d / name)
    tb = traceback_of(lambda: torch.load(path, weights_only=weights_only))
    found = tracebacks.diagnose_text(log_around(path, tb))
    assert found.failure.cls.name == expected, tb[-600:]
    assert found.file.path == path and found.file.how == "log"


def test_safetensors_failures(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    whole = st.save({"w": torch.arange(10_000, dtype=torch.float32)})
    for name, data, expected in (("cut.safetensors", whole[:len(whole) // 2],
                                  "safetensors_truncated"),
                                 ("tiny.safetensors", whole[:4], "safetensors_truncated"),
                                 ("junk.safetensors", b"\xff" * 64,
                                  "safetensors_header_corrupt")):
        path = tmp_path / name
        path.write_bytes(data)
        tb = traceback_of(lambda: st.load_file(str(path)))
        found = tracebacks.diagnose_text(log_around(str(path), tb))
        assert found.failure.cls.name == expected, tb[-400:]
        assert found.file.path == str(path)


def test_older_safetensors_spelling():
    line = ("safetensors_rust.SafetensorError: Error while deserializing header: "
            "MetadataIncompleteBuffer")
    assert tracebacks.diagnose_text(line).failure.cls.name == "safetensors_truncated"


def test_pickle_and_zip_failures(tmp_path):
    empty = tmp_path / "state.pkl"
    empty.write_bytes(b"")
    tb = traceback_of(lambda: pickle.load(open(empty, "rb")))
    assert tracebacks.diagnose_text(tb).failure.cls.name == "pickle_truncated"
    junk = tmp_path / "optimizer.bin"
    junk.write_bytes(b"\x00" * 100)
    tb = traceback_of(lambda: zipfile.ZipFile(junk))
    found = tracebacks.diagnose_text(log_around(str(junk), tb))
    assert found.failure.cls.name == "not_a_zip" and found.file.path == str(junk)


def test_a_staging_directory_renamed_by_another_process(tmp_path):
    """transformers' Trainer saves into tmp-checkpoint-N and renames it; a second process
    saving the same step finds it gone."""
    staging, final = tmp_path / "tmp-checkpoint-500", tmp_path / "checkpoint-500"
    tb = traceback_of(lambda: os.rename(staging, final))
    found = tracebacks.diagnose_text("Saving model checkpoint to " + str(final) + "\n" + tb)
    assert found.failure.cls.name == "staging_dir_missing"
    assert found.file.path == str(staging) and found.file.how == "error message"
    assert str(final) in [c.path for c in found.candidates]


@pytest.mark.skipif(os.geteuid() != 0, reason="makes another user's file: needs root")
def test_a_checkpoint_of_another_user(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"x")
    os.chmod(path, 0o600)
    os.chmod(tmp_path, 0o755)
    code = ("import os, sys; os.setgid(65534); os.setuid(65534); open(sys.argv[1], 'rb')")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                            text=True, env=subprocess_env())
    assert "PermissionError: [Errno 13]" in result.stderr
    found = tracebacks.diagnose_text(result.stderr)
    assert found.failure.cls.name == "permission_denied"
    assert found.file.path == str(path) and not found.failure.cls.collision_signature


def test_permission_denied_on_a_non_checkpoint_is_not_ours():
    text = "PermissionError: [Errno 13] Permission denied: '/etc/shadow'"
    assert tracebacks.diagnose_text(text).failure is None


def test_the_last_failure_is_the_one_and_earlier_ones_are_counted():
    text = ("EOFError: Ran out of input\nretrying\n"
            "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
            "central directory\n")
    failure = tracebacks.diagnose_text(text).failure
    assert failure.cls.name == "zip_truncated" and failure.line == 3 and failure.earlier == 1


def test_the_file_nearest_the_failure_wins_and_source_files_never_do():
    text = ("loading /old/run/epoch1.pt\nLoading checkpoint shards from "
            "--resume=/ckpt/run-2/last.pth\nTraceback (most recent call last):\n"
            '  File "/src/train.py", line 10, in <module>\n'
            "    state = torch.load(args.resume)\n"
            "RuntimeError: record size (8 bytes) does not match expected size (4 bytes)\n")
    found = tracebacks.diagnose_text(text)
    assert [c.path for c in found.candidates] == ["/ckpt/run-2/last.pth", "/old/run/epoch1.pt"]
    assert found.file.line == 2


def test_a_literal_in_the_traceback_names_the_file():
    text = ('Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
            '    torch.load("runs/exp 1/model.pt")\nEOFError: Ran out of input\n')
    found = tracebacks.diagnose_text(text)
    assert found.file.path == "runs/exp 1/model.pt" and found.file.how == "traceback"


def test_colour_codes_are_dropped():
    text = ("\x1b[31mRuntimeError\x1b[0m: \x1b[1mPytorchStreamReader failed reading zip "
            "archive: failed finding central directory\x1b[0m  /ckpt/a.pt")
    found = tracebacks.diagnose_text(text)
    assert found.failure.cls.name == "zip_truncated" and found.file.path == "/ckpt/a.pt"


def test_nothing_recognised():
    found = tracebacks.diagnose_text("ValueError: bad learning rate\n" * 3)
    assert found.failure is None
    # An EINVAL elsewhere is not a checkpoint's.
    assert tracebacks.diagnose_text("OSError: [Errno 22] Invalid argument\n").failure is None


@pytest.mark.parametrize("hostile", [
    "/" * 200_000 + "a" * 200_000,
    ("'" + "/a" * 3000 + "'") * 100,
    "\x1b[" * 200_000,
    "a.pt " * 400_000,
    "EOFError: Ran out of input\n" * 50_000,
    ("x" * 100 + "/checkpoint") * 10_000,
])
def test_hostile_lines_cost_little(hostile):
    started = time.process_time()
    tracebacks.diagnose_text(hostile)
    assert time.process_time() - started < 5
    assert all(len(line) <= tracebacks.MAX_LINE for line in tracebacks.clean_lines(hostile))
