"""monitor.fs.source: which files the watcher hands to the verifier (FileNotices), with a real
inotify watcher on a temporary directory. A file read here in a version no watcher here saw
written (on a network filesystem: another node's write) is verified once per version."""
import os
import threading

import pytest

from helpers import wait_for
from monitor.fs.source import FILE_CLOSED, FileNotice, FsSource


@pytest.fixture
def source(tmp_path):
    """(source, notices): a started FsSource on tmp_path, the FILE_CLOSED paths it delivered."""
    notices, lock = [], threading.Lock()

    def deliver(batch):
        with lock:
            notices.extend(i.path for i in batch
                           if isinstance(i, FileNotice) and i.kind == FILE_CLOSED)
    src = FsSource([str(tmp_path)], ["*.pt"], "inotify", 1.0, "n1", deliver,
                   attribution="proc")
    src.start()
    yield src, notices
    src.stop()


def read(path) -> None:
    with open(path, "rb") as f:
        f.read()


def write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_reading_a_file_written_here_adds_nothing(source, tmp_path):
    src, notices = source
    path, first, second = (str(tmp_path / n) for n in ("mine.pt", "m1.pt", "m2.pt"))
    write(path, b"x" * 100)
    write(first, b"m")                  # its notice comes after every notice of the write
    wait_for(lambda: first in notices, message="the first marker's notice")
    due = notices.count(path)
    assert due >= 1                     # the finished write
    read(path)
    write(second, b"m")
    wait_for(lambda: second in notices, message="the second marker's notice")
    assert notices.count(path) == due


def test_a_file_nobody_here_wrote_is_due_when_read_once_per_version(tmp_path):
    path = tmp_path / "theirs.pt"
    path.write_bytes(b"y" * 100)                  # written before anyone here watched
    notices = []
    src = FsSource([str(tmp_path)], ["*.pt"], "inotify", 1.0, "n1",
                   lambda batch: notices.extend(i.path for i in batch
                                                if isinstance(i, FileNotice)),
                   attribution="proc")
    src.start()
    try:
        read(path)
        wait_for(lambda: notices.count(str(path)) == 1, message="the read's notice")
        read(path)                                # the same version: nothing new
        os.utime(path, ns=(1, 1))                 # another version (no write seen here)
        read(path)
        wait_for(lambda: notices.count(str(path)) == 2, message="the new version's notice")
        read(path)
        marker = tmp_path / "marker.pt"
        marker.write_bytes(b"m")
        wait_for(lambda: str(marker) in notices, message="the marker's notice")
        # (A written file may be handed on more than once: the verifier's schedule merges
        # them. A read is handed on once per version.)
        assert notices.count(str(path)) == 2
    finally:
        src.stop()
