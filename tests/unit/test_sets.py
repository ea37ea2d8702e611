"""Whole-checkpoint verification (monitor/verify/sets.py, dcpmeta.py): real DCP directories
written by torch.distributed.checkpoint.save and real Hugging Face sharded checkpoints written
by transformers' save_pretrained (tests/support/ckptsets.py), whole and broken; through the pure
function and through `python -m monitor.cli.scan`; and hostile indexes. Through the agent:
tests/e2e/test_sets.py. The tests that write checkpoints are marked torch."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

import corpus
from ckptsets import shards
from helpers import REPO_ROOT, subprocess_env
from monitor.verify import dcpmeta, integrity, picklescan, sets
from monitor.verify.worker import VerifySchedule

CORRUPT, OK, UNVERIFIABLE = integrity.CORRUPT, integrity.OK, integrity.UNVERIFIABLE


def copy(saves, name, tmp_path) -> str:
    dst = tmp_path / name
    shutil.copytree(saves[name], dst)
    return str(dst)


def only(directory, **kwargs) -> integrity.Verdict:
    verdicts = sets.verify_directory(directory, **kwargs)
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


def cause(v):
    return (v.status, v.details.get("cause"))


# ---------------------------------------------------------------------------- DCP

@pytest.mark.torch
def test_whole_dcp_directory_is_ok(saves):
    v = only(saves["dcp"])
    assert v.status == OK and v.format == "dcp", v
    assert v.details["members"] == shards(saves["dcp"], ".distcp")
    assert len(v.details["members"]) == 2 and v.details["ranges"] == 4


@pytest.mark.torch
def test_both_metadata_readers_agree_on_a_real_metadata(saves):
    data = open(os.path.join(saves["dcp"], ".metadata"), "rb").read()
    fast, careful = dcpmeta._fast(data), dcpmeta._careful(data, picklescan.BUDGET)
    assert fast.is_dcp and careful.is_dcp
    assert fast.files == careful.files and sum(len(a) for a in fast.files.values()) == 8


@pytest.mark.torch
def test_dcp_shard_missing(saves, tmp_path):
    d = copy(saves, "dcp", tmp_path)
    os.unlink(os.path.join(d, shards(d, ".distcp")[1]))
    v = only(d)
    assert cause(v) == (CORRUPT, "missing_shard"), v
    assert "is missing" in v.reason


@pytest.mark.torch
def test_dcp_metadata_missing(saves, tmp_path):
    d = copy(saves, "dcp", tmp_path)
    os.unlink(os.path.join(d, ".metadata"))
    assert cause(only(d)) == (CORRUPT, "missing_shard")


@pytest.mark.torch
def test_dcp_shard_truncated(saves, tmp_path):
    d = copy(saves, "dcp", tmp_path)
    path = os.path.join(d, shards(d, ".distcp")[0])
    os.truncate(path, os.path.getsize(path) - 100)
    v = only(d)
    assert cause(v) == (CORRUPT, "truncated"), v


@pytest.mark.torch
def test_dcp_shard_from_another_save_is_mixed(saves, tmp_path):
    d = copy(saves, "dcp", tmp_path)
    name = shards(d, ".distcp")[0]
    shutil.copyfile(os.path.join(saves["dcp_big"], name), os.path.join(d, name))
    v = only(d)
    assert cause(v) == (CORRUPT, "mixed"), v
    assert "different save" in v.reason
    # Each file alone is a whole torch archive: only the set check sees it.
    assert integrity.verify(os.path.join(d, name)).status == OK


@pytest.mark.torch
def test_dcp_shards_written_by_different_runs_are_mixed(saves):
    """The agent's knowledge: same bytes, but the last writers of two shards were two runs."""
    names = shards(saves["dcp"], ".distcp")
    paths = [os.path.join(saves["dcp"], n) for n in names]
    same = {p: ("job-a", None, 0) for p in paths}
    assert only(saves["dcp"], runs=same).status == OK
    different = {paths[0]: ("job-a", None, 0), paths[1]: ("job-a", None, 1)}
    v = only(saves["dcp"], runs=different)
    assert cause(v) == (CORRUPT, "mixed") and "different job runs" in v.reason, v


# ---------------------------------------------------------------------------- Hugging Face

@pytest.mark.torch
def test_whole_hf_sharded_checkpoint_is_ok(saves):
    v = only(saves["hf"])
    assert v.status == OK and v.format == "hf-sharded", v
    assert v.details["members"] == shards(saves["hf"], ".safetensors")
    assert len(v.details["members"]) > 2


@pytest.mark.torch
def test_hf_shard_missing(saves, tmp_path):
    d = copy(saves, "hf", tmp_path)
    os.unlink(os.path.join(d, shards(d, ".safetensors")[2]))
    assert cause(only(d)) == (CORRUPT, "missing_shard")


@pytest.mark.torch
def test_hf_shard_truncated(saves, tmp_path):
    d = copy(saves, "hf", tmp_path)
    path = os.path.join(d, shards(d, ".safetensors")[2])
    os.truncate(path, os.path.getsize(path) // 2)
    assert cause(only(d)) == (CORRUPT, "truncated")


@pytest.mark.torch
def test_hf_shard_of_another_model_is_mixed(saves, tmp_path):
    """Same tensor names, other sizes: only total_size tells."""
    d = copy(saves, "hf", tmp_path)

    def tensors(path):
        return {k: v["data_offsets"][1] - v["data_offsets"][0]
                for k, v in integrity.safetensors_header(path).items() if k != "__metadata__"}

    # The shard holding the embedding: the same names in both saves, other sizes.
    name = next(n for n in shards(d, ".safetensors")
                if "transformer.wte.weight" in tensors(os.path.join(d, n)))
    other = os.path.join(saves["hf_other"], name)
    assert tensors(other).keys() == tensors(os.path.join(d, name)).keys()
    assert tensors(other) != tensors(os.path.join(d, name))
    shutil.copyfile(other, os.path.join(d, name))
    v = only(d)
    assert cause(v) == (CORRUPT, "mixed") and "total_size" in v.reason, v


@pytest.mark.torch
def test_hf_shard_of_another_sharding_is_mixed(saves, tmp_path):
    d = copy(saves, "hf", tmp_path)
    # A shard of a save with a larger max_shard_size, under this save's first shard name.
    theirs = shards(saves["hf_resharded"], ".safetensors")[0]
    shutil.copyfile(os.path.join(saves["hf_resharded"], theirs),
                    os.path.join(d, shards(d, ".safetensors")[0]))
    v = only(d)
    assert cause(v) == (CORRUPT, "mixed") and "the index" in v.reason, v


@pytest.mark.torch
def test_hf_bin_shards_presence_and_structure(tmp_path):
    """pytorch_model.bin.index.json (transformers 5 writes safetensors only: the .bin layout
    is written here as transformers 4 did, one torch.save per shard)."""
    import torch
    weights = {"a": torch.ones(3), "b": torch.zeros(4)}
    torch.save({"a": weights["a"]}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": weights["b"]}, tmp_path / "pytorch_model-00002-of-00002.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({
        "metadata": {"total_size": 28},
        "weight_map": {"a": "pytorch_model-00001-of-00002.bin",
                       "b": "pytorch_model-00002-of-00002.bin"}}))
    assert only(str(tmp_path)).status == OK
    path = tmp_path / "pytorch_model-00002-of-00002.bin"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert cause(only(str(tmp_path))) == (CORRUPT, "truncated")
    path.unlink()
    assert cause(only(str(tmp_path))) == (CORRUPT, "missing_shard")


# ---------------------------------------------------------------------------- scan

def scan_json(*paths):
    proc = subprocess.run([sys.executable, "-m", "monitor.cli.scan", "--format", "json",
                           *map(str, paths)], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.mark.torch
def test_scan_reports_sets_as_units(saves, tmp_path):
    code, doc, err = scan_json(saves["dcp"], saves["hf"])
    assert code == 0, err
    assert [(s["format"], s["status"]) for s in doc["sets"]] == [("dcp", OK),
                                                                 ("hf-sharded", OK)]
    assert doc["summary"]["sets"] == 2 and doc["summary"]["sets_ok"] == 2
    assert {os.path.dirname(f["path"]) for f in doc["files"]} == {saves["dcp"], saves["hf"]}

    d = copy(saves, "dcp", tmp_path)
    name = shards(d, ".distcp")[0]
    shutil.copyfile(os.path.join(saves["dcp_big"], name), os.path.join(d, name))
    h = copy(saves, "hf", tmp_path)
    os.unlink(os.path.join(h, shards(h, ".safetensors")[0]))
    code, doc, err = scan_json(tmp_path)
    assert code == 1, err
    got = {(s["path"], s["format"]): (s["status"], s["cause"]) for s in doc["sets"]}
    assert got == {(d, "dcp"): (CORRUPT, "mixed"), (h, "hf-sharded"): (CORRUPT, "missing_shard")}
    # Every file alone is fine: the set is what fails the scan.
    assert {f["status"] for f in doc["files"]} == {OK}
    assert doc["exit_code"] == 1


@pytest.mark.torch
def test_scan_table_names_the_set(saves):
    proc = subprocess.run([sys.executable, "-m", "monitor.cli.scan", saves["dcp"]],
                          cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{saves['dcp']}/ (set)" in proc.stdout and "1 checkpoint set: 1 ok" in \
        proc.stdout.replace("\n", " ")


# ---------------------------------------------------------------------------- hostile

@pytest.mark.torch
def test_index_naming_a_file_outside_is_never_read(saves, tmp_path):
    d = copy(saves, "hf", tmp_path)
    index = os.path.join(d, "model.safetensors.index.json")
    doc = json.load(open(index))
    outside = shutil.copyfile(os.path.join(d, shards(d, ".safetensors")[0]),
                              tmp_path / "outside.safetensors")
    doc["weight_map"]["x"] = "../outside.safetensors"
    doc["weight_map"]["y"] = "../../../../../../etc/passwd"
    doc["weight_map"]["z"] = "/etc/passwd"
    json.dump(doc, open(index, "w"))
    read = []

    def verify_file(path):
        read.append(os.path.realpath(path))
        return integrity.verify(path)

    v = sets.verify_set(sets.CheckpointSet(d, sets.KIND_HF, "model.safetensors.index.json"),
                        verify_file=verify_file)
    assert cause(v) == (CORRUPT, "inconsistent") and "not a file name" in v.reason, v
    assert read and all(os.path.dirname(p) == os.path.realpath(d) for p in read), read
    assert str(outside) not in read


@pytest.mark.torch
def test_symlinked_member_is_not_followed_by_the_agent(saves, tmp_path):
    d = copy(saves, "hf", tmp_path)
    name = shards(d, ".safetensors")[1]
    os.rename(os.path.join(d, name), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(d, name))
    assert only(d).status == OK                          # scan (the user's own rights)
    v = only(d, follow_symlinks=False)                   # the agent (root)
    assert v.status == UNVERIFIABLE and "symbolic link" in v.reason, v


def test_huge_index_is_not_read(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.write(b'{"weight_map": {')
        f.truncate(100 << 20)                            # 100 MB (sparse)
    v = only(str(tmp_path))
    assert v.status == UNVERIFIABLE and "larger than the verifier reads" in v.reason, v


def test_index_of_many_containers_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_bytes(
        b'{"weight_map": {}, "metadata": [' + b"{}," * 100_000 + b"{}]}")
    assert cause(only(str(tmp_path))) == (CORRUPT, "inconsistent")


def _metadata_dir(tmp_path, pickle_bytes: bytes) -> str:
    d = tmp_path / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle_bytes)
    import torch
    torch.save({"x": torch.ones(2)}, d / "__0_0.distcp")
    return str(d)


@pytest.mark.torch
def test_metadata_memo_bomb_is_out_of_bounds(tmp_path):
    d = _metadata_dir(tmp_path, corpus.memo_bomb_pickle(2 ** 31))
    assert cause(only(d)) == (CORRUPT, "out_of_bounds")


@pytest.mark.torch
def test_metadata_huge_claimed_lengths_are_corrupt(tmp_path):
    for i, data in enumerate([b"\x80\x04\x8d" + struct.pack("<Q", 2 ** 62) + b".",
                              b"\x80\x04\x95" + struct.pack("<Q", 2 ** 40) + b"N.",
                              b"\x80\x04X\xff\xff\xff\x7f."]):
        (tmp_path / str(i)).mkdir()
        v = only(_metadata_dir(tmp_path / str(i), data))
        assert cause(v) == (CORRUPT, "inconsistent"), (data, v)


@pytest.mark.torch
def test_metadata_beyond_the_range_cap_is_unverifiable(saves, tmp_path, monkeypatch):
    monkeypatch.setattr(dcpmeta, "MAX_RANGES", 3)
    v = only(saves["dcp"])
    assert v.status == UNVERIFIABLE and "memory bound" in v.reason, v


_BOMB_SCRIPT = r"""
import os, sys, struct, json, tempfile
sys.path.insert(0, sys.argv[1])
from monitor.verify import sets, picklescan
d = tempfile.mkdtemp()
# the careful reader's worst: a 16 MiB .metadata of empty dicts (one kept object per byte)
with open(os.path.join(d, ".metadata"), "wb") as f:
    f.write(b"\x80\x04" + b"}" * ((16 << 20) - 4) + b".")
open(os.path.join(d, "__0_0.distcp"), "wb").write(b"x")
h = tempfile.mkdtemp()
with open(os.path.join(h, "model.safetensors.index.json"), "wb") as f:   # strings, 4 MiB
    f.write(b'{"weight_map": {' + b",".join(b'"%05d":"ab"' % i for i in range(99999))
            + b'}, "metadata": ["' + b'ab","' * (((4 << 20) - 1_500_000) // 5) + b'"]}')
for v in sets.verify_directory(d) + sets.verify_directory(h):
    print(json.dumps([v.status, v.details.get("cause", ""), v.reason[:100]]))
"""


def test_hostile_set_indexes_stay_under_the_memory_bound():
    here = os.path.dirname(os.path.abspath(corpus.__file__))      # tests/support/
    rc, out, err, peak = corpus.run_measured(["-c", _BOMB_SCRIPT, here],
                                             env=subprocess_env(), limit_bytes=400 << 20,
                                             timeout=240)
    assert rc == 0, err
    verdicts = [json.loads(line) for line in out.splitlines()]
    assert len(verdicts) == 2 and verdicts[0][0] != OK, verdicts
    assert not any(v[2].startswith("verifier error") for v in verdicts), verdicts
    # interpreter ~16 MiB + the verifier's ~64 MiB bound + slack (as tests/unit/test_fuzz.py)
    assert peak is not None and peak < 120 << 20, f"peak RSS {peak >> 20} MiB"


# ---------------------------------------------------------------------------- the agent

def test_schedule_makes_a_set_due_after_its_members_are_quiet():
    s = VerifySchedule(quiet=1.0)
    s.note_run("/c/__0_0.distcp", ("j", None, 0))
    s.member_verified("/c", 10.0)
    assert s.due_sets(10.5) == []
    s.write_started("/c/__1_0.distcp", 10.6, watched=True)      # another shard in flight
    assert s.due_sets(20.0) == []
    s.write_finished("/c/__1_0.distcp", "", 20.0, watched=True)
    assert s.due_sets(20.5) == []
    assert s.due_sets(21.0) == [("/c", {"/c/__0_0.distcp": ("j", None, 0)})]
    assert s.due_sets(30.0) == []                               # reported once
