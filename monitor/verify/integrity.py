"""Checkpoint verification: is a finished file a whole, self-consistent checkpoint?

One entry point, `verify(path, deep=False, max_bytes_per_second=None) -> Verdict`. Pure: no
threads, no state between calls; standard library only, plus an optional CRC32 accelerator
(monitor.verify.crc). The agent and `ckptwatch scan` run without torch, and verifying never imports
or calls anything a stranger's pickle names (monitor.verify.picklescan).

What is checked, per format (the content decides the format, never the file name):

- torch zip (torch.save since 1.6). Structural, O(entries) small reads: the end-of-central-
  directory record (zip64 too) is where it says it is; every central directory entry's local
  header agrees (name, method = stored, sizes, CRC in the data descriptor torch writes after each
  record); records lie inside the file and overlap neither each other nor the directory; one
  archive prefix; `data.pkl` parses (monitor.verify.picklescan) and every storage it names
  ('storage', type, key, location, numel) has a `data/<key>` record of exactly numel * element
  size bytes; `version` (and `byteorder` when present) hold what torch writes. Deep: CRC32 of
  every record against the directory (reads the whole file, optionally rate-capped).
  `.distcp` shards (torch.distributed.checkpoint) are several such archives back to back; each
  is checked.
- safetensors: header length, JSON header, every tensor's offsets inside the data section,
  contiguous without holes or overlap, shape x dtype size == offset span, and the data section
  ends exactly at the end of the file. The format has no checksums: --deep adds nothing.
- legacy torch (non-zip pickle stream with torch's magic number): the pickles parse and the
  storages that follow them add up to exactly the file size. No checksums either.
- git-lfs pointer files, HTML pages (failed downloads) and unknown content are "unverifiable"
  with a reason saying what the file is; an empty file, or a known format cut short, is corrupt.

The formats live in their own modules (monitor/verify/torchzip.py, safetensorsfile.py,
torchlegacy.py), the verdict's vocabulary in verdict.py and the file I/O (positioned reads,
read-ahead hints, the rate cap) in fileio.py; this module sniffs the format and hands the open
file to its checker. The verdict's names are importable from here, as they always were.
"""
from __future__ import annotations

import errno
import os
import re
import struct

from .fileio import ChangedFile, NotRegularFile, Throttle, open_file, pread, will_need
from .safetensorsfile import MAX_SAFETENSORS_HEADER, safetensors_header, verify_safetensors
from .torchlegacy import LEGACY_MAGIC_BYTES, verify_legacy
from .torchzip import TAIL_SEARCH, verify_torch_zip
from .verdict import (CAUSES, CORRUPT, FMT_EMPTY, FMT_HTML, FMT_LFS, FMT_SAFETENSORS,
                      FMT_TORCH_LEGACY, FMT_TORCH_ZIP, FMT_UNKNOWN, OK, UNVERIFIABLE, Corrupt,
                      Unverifiable, Verdict, corrupt_cause)

__all__ = ["verify", "Verdict", "OK", "CORRUPT", "UNVERIFIABLE", "FMT_TORCH_ZIP",
           "FMT_TORCH_LEGACY", "FMT_SAFETENSORS", "FMT_LFS", "FMT_HTML", "FMT_EMPTY",
           "FMT_UNKNOWN", "CAUSES", "corrupt_cause", "safetensors_header"]

LFS_PREFIX = b"version https://git-lfs.github.com/spec/v1"
_LFS_FIELDS = {"oid": re.compile(r"sha256:[0-9a-f]{64}"), "size": re.compile(r"\d{1,20}")}


def verify(path: str, deep: bool = False, max_bytes_per_second: float | None = None,
           name: str | None = None, follow_symlinks: bool = True,
           identity: tuple | None = None) -> Verdict:
    """Verify one checkpoint file. Never raises. Only a regular file is read (a FIFO or a
    device, even one swapped in after the caller's look, is "unverifiable", never opened
    blocking: fileio.open_file).

    name: the file's real name when `path` is a /proc/self/fd link (the format rules use it).
    follow_symlinks=False: a symbolic link is not followed ("unverifiable"). identity: the
    (st_dev, st_ino) the caller saw; another file found there is not read.

    deep: also CRC32 every zip record against the central directory (reads the whole file).
    max_bytes_per_second: cap the deep read rate (sleeps between 1 MiB chunks), so a verifying
    agent does not starve the training job's own I/O.
    """
    try:
        with open_file(path, follow_symlinks, identity) as f:
            size = os.fstat(f.fileno()).st_size
            return _verify_open(f, size, name or path, deep,
                                Throttle(max_bytes_per_second))
    except (NotRegularFile, ChangedFile) as e:
        return Verdict(UNVERIFIABLE, FMT_UNKNOWN, f"not read: {e.strerror}")
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            return Verdict(UNVERIFIABLE, FMT_UNKNOWN, "not read: a symbolic link, not followed")
        return Verdict(UNVERIFIABLE, FMT_UNKNOWN, f"cannot read: {e.strerror or e}",
                       {"errno": e.errno})
    except Exception as e:  # a verifier bug must not take the agent or a scan down
        return Verdict(UNVERIFIABLE, FMT_UNKNOWN, f"verifier error: {type(e).__name__}: {e}")


def _verify_open(f, size: int, path: str, deep: bool, throttle: Throttle) -> Verdict:
    if size == 0:
        return Verdict(CORRUPT, FMT_EMPTY, "empty file (0 bytes)", {"cause": "empty"})
    if size > TAIL_SEARCH:
        # The zip directory is at the end: on a cold file, fetch it while the head is read.
        will_need(f, size - TAIL_SEARCH, TAIL_SEARCH)
    head = pread(f, 0, min(size, 4096))
    fmt = _sniff(f, head, size)
    checker = {FMT_TORCH_ZIP: verify_torch_zip, FMT_SAFETENSORS: verify_safetensors,
               FMT_TORCH_LEGACY: verify_legacy}.get(fmt)
    if checker is None:
        return _describe_other(fmt, head, size)
    try:
        return checker(f, size, path, deep, throttle)
    except Corrupt as e:
        return Verdict(CORRUPT, fmt, str(e), {"cause": corrupt_cause(str(e))})
    except Unverifiable as e:
        return Verdict(UNVERIFIABLE, fmt, str(e))



def _sniff(f, head: bytes, size: int) -> str:
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return FMT_TORCH_ZIP
    # A legacy file opens with pickle.dumps(LEGACY_MAGIC); a cut one with a prefix of it.
    if head.startswith(b"\x80") and head[2:4] == b"\x8a\x0a" and \
            LEGACY_MAGIC_BYTES.startswith(head[4:14]):
        return FMT_TORCH_LEGACY
    if len(head) >= 9 and head[8:9] == b"{" and \
            struct.unpack_from("<Q", head)[0] <= MAX_SAFETENSORS_HEADER:
        return FMT_SAFETENSORS
    if head.startswith(LFS_PREFIX):
        return FMT_LFS
    lowered = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if lowered.startswith((b"<!doctype html", b"<html", b"<head", b"<body")):
        return FMT_HTML
    # A torn torch save can start with a hole (zeros) or another writer's bytes, but its tail
    # is still some writer's end-of-directory record: check it as a zip, which will say why.
    # Torch writes no zip comment, so the record is the last 22 bytes.
    if size >= 22 and pread(f, size - 22, 4) == b"PK\x05\x06":
        return FMT_TORCH_ZIP
    return FMT_UNKNOWN


def _describe_other(fmt: str, head: bytes, size: int) -> Verdict:
    if fmt == FMT_LFS:
        details = {}
        for line in head.decode("utf-8", "replace").splitlines():
            key, _, value = line.partition(" ")
            # Only values of the pointer format's own shape are kept (they are printed).
            if key in _LFS_FIELDS and _LFS_FIELDS[key].fullmatch(value):
                details[key] = value
        real = f" of {details['size']} bytes" if "size" in details else ""
        return Verdict(UNVERIFIABLE, FMT_LFS,
                       f"git-lfs pointer file ({size} bytes), not the checkpoint{real}: "
                       "run `git lfs pull`", details)
    # No bytes of the file in a verdict (an HTML title, the first bytes of an unknown file):
    # `ckptwatch scan` run by root over a tree others can write would print them, and a
    # symbolic link to /etc/shadow made its first bytes a line of output.
    if fmt == FMT_HTML:
        return Verdict(UNVERIFIABLE, FMT_HTML,
                       f"HTML page ({size} bytes), not a checkpoint: a failed download "
                       "(error or login page?)")
    return Verdict(UNVERIFIABLE, FMT_UNKNOWN, "not a known checkpoint format")
