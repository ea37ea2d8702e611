"""The journal on a real full disk, a read-only remount and an unwritable directory.

Needs root (mount). Each test mounts its own small tmpfs and unmounts it in teardown.
"""
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from exporters.journal import Journal, read_records, ReadStats

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tmpfs")

RECORD_PAD = "x" * 300          # ~400-byte lines: a 64 KiB tmpfs holds ~160 of them


def record(seq):
    return {"type": "write", "seq": seq, "pad": RECORD_PAD}


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def journal_logs(caplog):
    """The journal's own log records. caplog holds every logger's records from every thread
    of this worker, and a thread an earlier test left behind may log meanwhile (on a loaded
    machine, a slow shutdown's warning): only the journal's are the test's to count."""
    return [r for r in caplog.records if r.name == "exporters.journal"]


def journal_lines(path):
    stats = ReadStats()
    seqs = [r["seq"] for r in read_records(str(path), stats)]
    return seqs, stats


def assert_whole_lines(path):
    data = open(path, "rb").read()
    assert data == b"" or data.endswith(b"\n"), f"torn last line: {data[-80:]!r}"
    for line in data.splitlines():
        json.loads(line)        # every line is a whole record


def test_full_disk_counts_every_lost_record_and_leaves_no_torn_line(small_fs, caplog):
    path = small_fs / "journal.jsonl"
    journal = Journal(str(path), buffered=True)
    caplog.set_level(logging.INFO, logger="exporters.journal")
    sent = 1003
    for seq in range(sent):
        journal.write(record(seq))
        if seq % 7 == 6:        # the agent flushes once per loop tick
            journal.flush()
    journal.flush()

    assert_whole_lines(path)
    seqs, stats = journal_lines(path)
    assert stats.malformed == 0
    assert seqs == list(range(len(seqs))), "records on disk are a prefix of what was sent"
    assert 100 < len(seqs) < sent
    assert journal.records == len(seqs)
    assert journal.records_lost == sent - len(seqs)
    failures = [r for r in journal_logs(caplog) if r.levelno >= logging.WARNING]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert "No space left" in failures[0].getMessage()

    # Space comes back: writing resumes, one line says so with the count lost meanwhile.
    caplog.clear()
    path.unlink()
    journal.write(record(sent))
    journal.flush()
    assert [r["seq"] for r in read_records(str(path))] == [sent]
    recovered = [r.getMessage() for r in journal_logs(caplog)]
    assert len(recovered) == 1 and f"{sent - len(seqs)} records lost" in recovered[0], recovered
    journal.close()


def test_unbuffered_full_disk_mid_line_is_truncated_back(small_fs):
    # One record at a time, as `report` readers expect by default: the write that hits
    # ENOSPC in the middle of its line must not leave that half line behind.
    path = small_fs / "journal.jsonl"
    journal = Journal(str(path))
    results = [journal.write(record(seq)) for seq in range(400)]
    assert_whole_lines(path)
    seqs, stats = journal_lines(path)
    assert stats.malformed == 0
    assert results.count(True) == len(seqs) == journal.records
    assert results.count(False) == journal.records_lost == 400 - len(seqs)


def test_read_only_remount_counts_losses_and_recovers(small_fs, caplog):
    path = small_fs / "journal.jsonl"
    journal = Journal(str(path), buffered=True)
    caplog.set_level(logging.INFO, logger="exporters.journal")
    for seq in range(10):
        journal.write(record(seq))
    # The kernel refuses a remount while a file is open for writing (an error remount by
    # ext4 does not ask); closing makes the next write reopen on the read-only file system,
    # as after a rotation.
    journal.close()
    remount = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)],
                             capture_output=True, text=True)
    assert remount.returncode == 0, remount.stderr      # EBUSY: a file still open for writing
    try:
        for seq in range(10, 60):
            journal.write(record(seq))
            if seq % 5 == 4:
                journal.flush()
        journal.flush()
        assert journal.records_lost == 50
        warnings = [r.getMessage() for r in journal_logs(caplog)
                    if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "Read-only" in warnings[0], warnings
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    journal.write(record(60))
    journal.flush()
    assert_whole_lines(path)
    assert [r["seq"] for r in read_records(str(path))] == list(range(10)) + [60]
    assert journal.records == 11 and journal.records_lost == 50
    journal.close()


_UNPRIVILEGED_WRITER = r'''
import json, logging, os, sys
from exporters.journal import Journal
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
os.setgid(65534); os.setuid(65534)     # after the imports: the interpreter lives under /root
journal = Journal(sys.argv[1], max_bytes=4096, backups=2)
ok = [journal.write({"type": "write", "seq": seq, "pad": "x" * 300}) for seq in range(40)]
print(json.dumps({"ok": ok.count(True), "lost": journal.records_lost,
                  "records": journal.records}))
'''


def test_unwritable_directory_rotation_failure_loses_nothing_silently():
    # Root ignores directory permissions, so the writer drops to nobody. It can append to its
    # journal but not rename it: rotation fails. Records that could not be written are
    # counted, and the file still holds only whole lines.
    top = tempfile.mkdtemp(prefix="cwj")     # pytest's tmp_path is closed to other users
    os.chmod(top, 0o755)
    directory = pathlib.Path(top) / "jdir"
    directory.mkdir()
    path = directory / "journal.jsonl"
    path.write_text("")
    os.chown(path, 65534, 65534)
    os.chmod(directory, 0o555)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        out = subprocess.run([sys.executable, "-c", _UNPRIVILEGED_WRITER, str(path)],
                             capture_output=True, text=True, env=env, cwd=os.getcwd())
        assert out.returncode == 0, out.stderr
    finally:
        os.chmod(directory, 0o755)
    try:
        check_unwritable_result(out, path)
    finally:
        shutil.rmtree(top)


def check_unwritable_result(out, path):
    result = json.loads(out.stdout)
    assert_whole_lines(path)
    seqs, stats = journal_lines(path)
    assert stats.malformed == 0
    assert result["records"] == len(seqs) == result["ok"]
    assert result["lost"] == 40 - len(seqs) > 0
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "Permission denied" in warnings[0], out.stderr
