"""monitor/verify/integrity.py against files torn by real 4-rank torchrun races: the test
corpus's race worker and the product's demo job (the clean corpus, hand-made damage and
lookalikes are tests/unit/test_integrity.py)."""
from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -r requirements-test.txt)")

import corpus  # noqa: E402  (after the torch skip)
from monitor.verify import integrity  # noqa: E402
from monitor.verify.integrity import CORRUPT, OK, verify  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def races(tmp_path_factory):
    """One real torchrun job, 4 ranks saving to the same path 20 times (~15 s)."""
    directory = str(tmp_path_factory.mktemp("race"))
    paths = corpus.race_checkpoints(directory, rounds=20, width=2048)
    yield directory, paths
    shutil.rmtree(directory, ignore_errors=True)   # ~700 MB


def test_real_races_are_flagged(races):
    directory, paths = races
    torn, rejected, singles = [], [], []
    for path in paths:
        try:
            torch.load(path, weights_only=True)
            loads = True
        except Exception:
            loads = False
        if not loads:
            rejected.append(path)
        if corpus.single_rank_output(path, directory) is None:
            torn.append(path)
        else:
            singles.append(path)
    # Enough real, actually mixed files for the result to mean something.
    assert len(torn) >= 10, f"only {len(torn)} of {len(paths)} races tore the file"
    missed_structural = [p for p in rejected if verify(p).status != CORRUPT]
    assert not missed_structural, "torch.load rejects these, structural check passed them"
    missed_deep = [p for p in torn if verify(p, deep=True).status != CORRUPT]
    assert not missed_deep, "torn (not one rank's save), but --deep passed them"
    # Their metric label: a bounded cause, and for races mostly "torn".
    causes = [verify(p, deep=True).details["cause"] for p in torn]
    assert set(causes) <= set(integrity.CAUSES)
    assert causes.count("torn") + causes.count("crc_mismatch") >= len(torn) // 2, causes
    # The rank references saved alone are clean.
    for rank in range(4):
        assert verify(os.path.join(directory, f"ref-rank{rank}.pt"), deep=True).status == OK


def test_race_verdicts_name_a_record_and_the_cause(races):
    _, paths = races
    reasons = [verify(p).reason for p in paths if verify(p).status == CORRUPT]
    assert reasons
    for reason in reasons:
        assert "record" in reason or "truncated" in reason or "zip" in reason, reason


def test_demo_job_race(tmp_path):
    """The product's own demo job (every rank saves last.pt) under real torchrun: if the file
    is torn, the structural check (torch.load fails) or the deep check (not one rank's save,
    per demo_job.consistency) says so."""
    import subprocess
    import sys

    from helpers import subprocess_env
    from monitor.cli.demo_job import consistency
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", "-m", "monitor.cli.demo_job", "--out", str(out), "--save", "every-rank",
         "--width", "2048"], env=subprocess_env(OMP_NUM_THREADS=1), capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = str(out / "last.pt")
    try:
        state = torch.load(path, weights_only=True)
    except Exception:
        assert verify(path).status == CORRUPT
        return
    if consistency(state) is None:
        pytest.skip("this run's race left one rank's whole save (nothing torn to find)")
    assert verify(path, deep=True).status == CORRUPT
