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
"""
from __future__ import annotations

import io
import json
import os
import pickletools
import re
import stat
import struct
import time
from dataclasses import dataclass, field

from .crc import crc32
from .picklescan import BeyondBudget, OutOfBounds, persistent_storages

OK = "ok"
CORRUPT = "corrupt"
UNVERIFIABLE = "unverifiable"

FMT_TORCH_ZIP = "torch-zip"
FMT_TORCH_LEGACY = "torch-legacy"
FMT_SAFETENSORS = "safetensors"
FMT_LFS = "lfs-pointer"
FMT_HTML = "html"
FMT_EMPTY = "empty"
FMT_UNKNOWN = "unknown"

CHUNK = 1 << 20                      # deep reads stream in 1 MiB chunks
# Memory bounds: no input makes a verification hold much more than ~64 MiB (picklescan's
# budgets plus the bytes read here); docs/integrity.md "Memory bounds".
MAX_PICKLE_BYTES = 16 << 20          # data.pkl larger than this is not parsed (sizes unjudged)
MAX_SAFETENSORS_HEADER = 100 << 20   # the safetensors library's own limit (format sniffing)
MAX_SAFETENSORS_PARSE = 2 << 20      # JSON makes up to ~25 B of objects per byte: parse less
MAX_DIRECTORY_BYTES = 16 << 20       # central directory read into memory
MAX_ENTRIES = 200_000                # records per archive (torch: one per storage + 3)
TAIL_SEARCH = 65536 + 22             # a zip comment is at most 64 KiB

# Element sizes of the storage types torch pickles ('storage', <type>, key, location, numel).
# Typed names come from torch.storage._dtype_to_storage_type_map (torch 2.13); newer dtypes
# (float8_*, uint16/32/64, complex32, ...) are pickled as UntypedStorage whose numel is bytes.
STORAGE_ELEMENT_SIZE = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2,
    "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1,
    "BoolStorage": 1, "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16,
    "QInt8Storage": 1, "QInt32Storage": 4, "QUInt8Storage": 1, "QUInt4x2Storage": 1,
    "QUInt2x4Storage": 1, "UntypedStorage": 1,
}

# safetensors dtype -> bytes per element; sub-byte types (F4, F6_*) are not size-checked.
SAFETENSORS_DTYPE_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
    "C64": 8, "C128": 16,
}

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_MAGIC_BYTES = LEGACY_MAGIC.to_bytes(10, "little")
LFS_PREFIX = b"version https://git-lfs.github.com/spec/v1"

_EOCD = struct.Struct("<4sHHHHIIH")                    # end of central directory, 22 bytes
_Z64_LOCATOR = struct.Struct("<4sIQI")                 # zip64 EOCD locator, 20 bytes
_Z64_EOCD = struct.Struct("<4sQHHIIQQQQ")              # zip64 EOCD record, 56 bytes
_CDIR = struct.Struct("<4sHHHHHHIIIHHHHHII")           # central directory entry, 46 bytes
_LOCAL = struct.Struct("<4sHHHHHIIIHH")                # local file header, 30 bytes


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one file.

    status: "ok" | "corrupt" | "unverifiable"; format: "torch-zip" | "torch-legacy" |
    "safetensors" | "lfs-pointer" | "html" | "empty" | "unknown"; reason: one human sentence
    (empty when ok); details: figures behind the verdict (entries, tensors, bytes checked...).
    """

    status: str
    format: str
    reason: str = ""
    details: dict = field(default_factory=dict)


class _Corrupt(Exception):
    """A proven inconsistency; the message is the user-facing reason."""


class _Unverifiable(Exception):
    """The file cannot be judged (unknown storage layout, oversized metadata...)."""


def verify(path: str, deep: bool = False, max_bytes_per_second: float | None = None,
           name: str | None = None) -> Verdict:
    """Verify one checkpoint file. Never raises.

    name: the file's real name when `path` is a /proc/self/fd link (the format rules use it).

    deep: also CRC32 every zip record against the central directory (reads the whole file).
    max_bytes_per_second: cap the deep read rate (sleeps between 1 MiB chunks), so a verifying
    agent does not starve the training job's own I/O.
    """
    try:
        # Opening a FIFO or a device would block or read forever: regular files only.
        if not stat.S_ISREG(os.stat(path).st_mode):
            return Verdict(UNVERIFIABLE, FMT_UNKNOWN, "not a regular file")
        with _open(path) as f:
            size = os.fstat(f.fileno()).st_size
            return _verify_open(f, size, name or path, deep,
                                _Throttle(max_bytes_per_second))
    except OSError as e:
        return Verdict(UNVERIFIABLE, FMT_UNKNOWN, f"cannot read: {e.strerror or e}",
                       {"errno": e.errno})
    except Exception as e:  # a verifier bug must not take the agent or a scan down
        return Verdict(UNVERIFIABLE, FMT_UNKNOWN, f"verifier error: {type(e).__name__}: {e}")


def _verify_open(f, size: int, path: str, deep: bool, throttle: "_Throttle") -> Verdict:
    if size == 0:
        return Verdict(CORRUPT, FMT_EMPTY, "empty file (0 bytes)", {"cause": "empty"})
    if _fadvise is not None and size > TAIL_SEARCH:
        # The zip directory is at the end: on a cold file, fetch it while the head is read.
        _fadvise(f.fileno(), size - TAIL_SEARCH, TAIL_SEARCH, _WILLNEED)
    head = _pread(f, 0, min(size, 4096))
    fmt = _sniff(f, head, size)
    checker = {FMT_TORCH_ZIP: _verify_torch_zip, FMT_SAFETENSORS: _verify_safetensors,
               FMT_TORCH_LEGACY: _verify_legacy}.get(fmt)
    if checker is None:
        return _describe_other(fmt, head, size)
    try:
        return checker(f, size, path, deep, throttle)
    except _Corrupt as e:
        return Verdict(CORRUPT, fmt, str(e), {"cause": corrupt_cause(str(e))})
    except _Unverifiable as e:
        return Verdict(UNVERIFIABLE, fmt, str(e))


CAUSES = ("empty", "truncated", "torn", "crc_mismatch", "inconsistent", "out_of_bounds",
          # checkpoint sets (monitor.verify.sets): a member the set names is not there; the
          # members are whole but come from different saves
          "missing_shard", "mixed")


def corrupt_cause(reason: str) -> str:
    """A bounded category for a corrupt verdict's reason (one of CAUSES), fit for a metric
    label such as ckptwatch_corrupt_checkpoints_total{reason}; the reason itself is free
    text."""
    if reason.startswith("empty file"):
        return "empty"
    if reason.startswith("truncated"):
        return "truncated"
    if reason.startswith("CRC32 mismatch"):
        return "crc_mismatch"
    if reason.startswith("out of bounds"):
        return "out_of_bounds"
    if "torn" in reason or "overwritten" in reason or "overlap" in reason:
        return "torn"
    return "inconsistent"


def _sniff(f, head: bytes, size: int) -> str:
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return FMT_TORCH_ZIP
    # A legacy file opens with pickle.dumps(LEGACY_MAGIC); a cut one with a prefix of it.
    if head.startswith(b"\x80") and head[2:4] == b"\x8a\x0a" and \
            _LEGACY_MAGIC_BYTES.startswith(head[4:14]):
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
    if size >= 22 and _pread(f, size - 22, 4) == b"PK\x05\x06":
        return FMT_TORCH_ZIP
    return FMT_UNKNOWN


def _describe_other(fmt: str, head: bytes, size: int) -> Verdict:
    if fmt == FMT_LFS:
        details = {}
        for line in head.decode("utf-8", "replace").splitlines():
            key, _, value = line.partition(" ")
            if key in ("oid", "size"):
                details[key] = value
        real = f" of {details['size']} bytes" if "size" in details else ""
        return Verdict(UNVERIFIABLE, FMT_LFS,
                       f"git-lfs pointer file ({size} bytes), not the checkpoint{real}: "
                       "run `git lfs pull`", details)
    if fmt == FMT_HTML:
        m = re.search(rb"<title[^>]*>(.*?)</title>", head, re.I | re.S)
        title = m.group(1).decode("utf-8", "replace").strip()[:80] if m else ""
        return Verdict(UNVERIFIABLE, FMT_HTML,
                       f"HTML page ({size} bytes), not a checkpoint: a failed download "
                       "(error or login page?)" + (f" titled {title!r}" if title else ""),
                       {"title": title} if title else {})
    return Verdict(UNVERIFIABLE, FMT_UNKNOWN,
                   f"not a known checkpoint format (starts with {head[:8].hex(' ')})")


# ---------------------------------------------------------------------------- torch zip

@dataclass(slots=True)
class _Entry:
    name: str
    flags: int
    method: int
    crc: int
    csize: int
    usize: int
    offset: int                    # local header offset, absolute in the file
    data_start: int = 0
    end: int = 0                   # end of data and data descriptor


def _verify_torch_zip(f, size, path, deep, throttle) -> Verdict:
    # A .distcp shard is one torch.save archive per tensor, back to back: walk them from the
    # end. Any other file must be exactly one archive starting at offset 0.
    chained = path.endswith(".distcp")
    end, archives, totals = size, 0, {"entries": 0, "storages": 0, "unsized_storages": 0,
                                      "bytes_checked": 0}
    while True:
        start, info = _check_archive(f, end, deep, throttle, allow_prefix=chained)
        archives += 1
        for key in totals:
            totals[key] += info.get(key, 0)
        if start == 0:
            break
        end = start
    details = dict(totals, archives=archives, deep=deep)
    if not deep:
        del details["bytes_checked"]
    return Verdict(OK, FMT_TORCH_ZIP, "", details)


def _check_archive(f, end: int, deep: bool, throttle, allow_prefix: bool):
    """Check the zip archive that ends at `end`. Returns (archive start, details)."""
    cd_offset, cd_size, count, dir_end = _find_directory(f, end)
    # Offsets in an archive are relative to its start; the directory is right before its
    # end records, which places the start (zipfile computes the same "concat" offset).
    start = dir_end - cd_size - cd_offset
    if start < 0:
        raise _Corrupt(f"central directory claims {cd_size} bytes at offset {cd_offset}, "
                       f"past its own end record at {dir_end} (torn or truncated)")
    if start > 0 and not allow_prefix:
        raise _Corrupt(f"{start} unexplained bytes before the zip archive (torn write: "
                       "the directory at the end belongs to a different layout)")
    entries = _read_directory(f, start + cd_offset, cd_size, count, start)
    if not entries:
        raise _Corrupt("zip archive with no entries")
    cd_start = start + cd_offset
    entries.sort(key=lambda e: e.offset)       # file order: header reads share pages
    cold = _prefetch_headers(f, entries)
    for e in entries:
        _check_local(f, e, cd_start)
    if entries[0].offset != start:
        raise _Corrupt(f"first record starts at {entries[0].offset}, not at the archive start "
                       f"{start}")
    for a, b in zip(entries, entries[1:]):
        if a.end > b.offset:
            raise _Corrupt(f"records {a.name} and {b.name} overlap ({a.name} ends at {a.end}, "
                           f"{b.name} starts at {b.offset})")
    if entries[-1].end > cd_start:
        raise _Corrupt(f"record {entries[-1].name} runs into the central directory")
    info = _check_torch_layout(f, entries)
    info["entries"] = len(entries)
    if deep:
        if cold:
            _forget_headers(f, entries)
        info["bytes_checked"] = _check_crcs(f, entries, throttle)
    return start, info


def _find_directory(f, end: int):
    tail_len = min(end, TAIL_SEARCH)
    tail = _pread(f, end - tail_len, tail_len)
    pos = tail.rfind(b"PK\x05\x06")
    # The record must be complete and its comment must end exactly at the archive end.
    while pos >= 0:
        if pos + 22 <= len(tail):
            comment_len = struct.unpack_from("<H", tail, pos + 20)[0]
            if pos + 22 + comment_len == len(tail):
                break
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    if pos < 0:
        raise _Corrupt("truncated: no zip end-of-central-directory record at the end of the "
                       "file (cut short by an interrupted copy or download, or torn by a "
                       "concurrent write)")
    eocd_pos = end - tail_len + pos
    _, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    dir_end = eocd_pos
    if pos >= 20 and tail[pos - 20:pos - 16] == b"PK\x06\x07":
        _, _, z64_pos, _ = _Z64_LOCATOR.unpack_from(tail, pos - 20)
        loc_pos = eocd_pos - 20
        # z64_pos is relative to the archive start, which we do not know yet: the record sits
        # right before the locator (torch writes no extensible data).
        rec_pos = loc_pos - _Z64_EOCD.size
        rec = _pread(f, rec_pos, _Z64_EOCD.size) if rec_pos >= 0 else b""
        if len(rec) < _Z64_EOCD.size or rec[:4] != b"PK\x06\x06":
            raise _Corrupt("zip64 end-of-central-directory record missing or damaged")
        (_, _, _, _, _, _, n_disk64, n_total64, cd_size64, cd_offset64) = _Z64_EOCD.unpack(rec)
        if rec_pos - (z64_pos) < 0:
            raise _Corrupt("zip64 locator points past the end of the file")
        n_total, cd_size, cd_offset = n_total64, cd_size64, cd_offset64
        dir_end = rec_pos
        archive_start = rec_pos - z64_pos
        if archive_start != dir_end - cd_size - cd_offset:
            raise _Corrupt("zip64 end records disagree on where the archive starts "
                           f"({archive_start} vs {dir_end - cd_size - cd_offset})")
    elif disk or cd_disk or n_disk != n_total:
        raise _Corrupt("multi-disk zip archive (not something torch writes)")
    return cd_offset, cd_size, n_total, dir_end


def _read_directory(f, cd_pos: int, cd_size: int, count: int, start: int) -> list:
    if cd_size > MAX_DIRECTORY_BYTES:
        raise _Unverifiable(f"central directory of {cd_size} bytes is larger than the "
                            f"verifier reads ({MAX_DIRECTORY_BYTES >> 20} MiB)")
    if count > MAX_ENTRIES:
        raise _Unverifiable(f"zip archive of {count} records: more than the verifier checks "
                            f"({MAX_ENTRIES})")
    data = _pread(f, cd_pos, cd_size)
    if len(data) != cd_size:
        raise _Corrupt("truncated: central directory extends past the end of the file")
    entries, names, pos = [], set(), 0
    for i in range(count):
        if pos + _CDIR.size > cd_size:
            raise _Corrupt(f"central directory ends after {i} of {count} entries")
        (sig, _, _, flags, method, _, _, crc, csize, usize, nlen, xlen, clen, _, _, _,
         offset) = _CDIR.unpack_from(data, pos)
        if sig != b"PK\x01\x02":
            raise _Corrupt(f"central directory entry {i} has a bad signature")
        name_b = data[pos + 46:pos + 46 + nlen]
        extra = data[pos + 46 + nlen:pos + 46 + nlen + xlen]
        pos += 46 + nlen + xlen + clen
        if pos > cd_size:
            raise _Corrupt(f"central directory entry {i} runs past the directory")
        if 0xFFFFFFFF in (usize, csize, offset):
            usize, csize, offset = _zip64_fields(extra, usize, csize, offset)
        name = name_b.decode("utf-8", "replace")
        if name in names:
            raise _Corrupt(f"duplicate entry {name} in the central directory")
        names.add(name)
        entries.append(_Entry(name, flags, method, crc, csize, usize, start + offset))
    if pos != cd_size:
        raise _Corrupt(f"central directory holds {cd_size - pos} bytes after its {count} "
                       "entries")
    return entries


def _zip64_fields(extra: bytes, usize: int, csize: int, offset: int):
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4:pos + 4 + length]
        pos += 4 + length
        if tag != 1:
            continue
        values = [v for (v,) in struct.iter_unpack("<Q", body[:len(body) // 8 * 8])]
        if usize == 0xFFFFFFFF and values:
            usize = values.pop(0)
        if csize == 0xFFFFFFFF and values:
            csize = values.pop(0)
        if offset == 0xFFFFFFFF and values:
            offset = values.pop(0)
    return usize, csize, offset


def _check_local(f, e: _Entry, cd_start: int) -> None:
    if e.offset + _LOCAL.size > cd_start:
        raise _Corrupt(f"record {e.name}: local header offset {e.offset} is outside the "
                       "records area")
    raw = _pread(f, e.offset, _LOCAL.size + len(e.name.encode()) + 8)
    (sig, _, flags, method, _, _, crc, csize, usize, nlen, xlen) = _LOCAL.unpack_from(raw)
    if sig != b"PK\x03\x04":
        raise _Corrupt(f"record {e.name}: no local header at offset {e.offset} "
                       "(overwritten by another write)")
    name = raw[_LOCAL.size:_LOCAL.size + nlen].decode("utf-8", "replace")
    if name != e.name:
        raise _Corrupt(f"local header at {e.offset} names {name!r}, the directory says "
                       f"{e.name!r}")
    if method != 0 or e.method != 0:
        raise _Corrupt(f"record {e.name} is compressed (method {method}/{e.method}); torch "
                       "stores records uncompressed")
    if e.csize != e.usize:
        raise _Corrupt(f"record {e.name}: stored sizes differ ({e.csize} vs {e.usize})")
    e.data_start = e.offset + _LOCAL.size + nlen + xlen
    data_end = e.data_start + e.csize
    if data_end > cd_start:
        raise _Corrupt(f"record {e.name} ({e.csize} bytes at {e.data_start}) runs past the "
                       "records area")
    if flags & 0x08:
        # Sizes and CRC follow the data (torch streams records): read that descriptor.
        desc = _pread(f, data_end, 24)
        off = 4 if desc[:4] == b"PK\x07\x08" else 0
        for width, fmt in ((12, "<III"), (20, "<IQQ")):
            if len(desc) >= off + width:
                d_crc, d_csize, d_usize = struct.unpack_from(fmt, desc, off)
                if (d_crc, d_csize, d_usize) == (e.crc, e.csize, e.usize):
                    e.end = data_end + off + width
                    return
        d_crc = struct.unpack_from("<I", desc, off)[0] if len(desc) >= off + 4 else None
        if d_crc is not None and d_crc != e.crc:
            raise _Corrupt(f"record {e.name}: the CRC written after its data differs from the "
                           "central directory: torn, parts come from different saves")
        raise _Corrupt(f"record {e.name}: the sizes written after its data differ from the "
                       "central directory: torn, parts come from different saves")
    if csize not in (e.csize, 0xFFFFFFFF) or usize not in (e.usize, 0xFFFFFFFF) or \
            crc != e.crc:
        raise _Corrupt(f"record {e.name}: local header sizes/CRC disagree with the central "
                       "directory")
    e.end = data_end


def _check_torch_layout(f, entries: list) -> dict:
    """One archive prefix, data.pkl consistent with the data/<key> records, version present."""
    prefixes = {e.name.split("/", 1)[0] for e in entries}
    if len(prefixes) != 1 or any("/" not in e.name for e in entries):
        raise _Corrupt(f"entries from different archives mixed: {sorted(prefixes)[:4]}")
    prefix = prefixes.pop() + "/"
    by_name = {e.name[len(prefix):]: e for e in entries}
    pkl = by_name.get("data.pkl")
    if pkl is None:
        raise _Unverifiable("zip archive without data.pkl: not a torch checkpoint")
    version = by_name.get("version") or by_name.get(".data/version")
    if version is None:
        raise _Corrupt("no version record (torch writes one in every checkpoint)")
    if not re.fullmatch(rb"\d+\n?", _pread(f, version.data_start, min(version.csize, 32))):
        raise _Corrupt("version record does not hold a version number")
    byteorder = by_name.get("byteorder")
    if byteorder is not None and \
            _pread(f, byteorder.data_start, min(byteorder.csize, 16)) not in (b"little", b"big"):
        raise _Corrupt("byteorder record holds neither 'little' nor 'big'")
    if pkl.csize > MAX_PICKLE_BYTES:
        return {"storages": 0, "unsized_storages": 0, "pickle_unparsed": pkl.csize}
    storages = _persistent_storages(_pread(f, pkl.data_start, pkl.csize), "data.pkl")
    unsized = 0
    for key, (type_name, numel) in storages.items():
        record = by_name.get(f"data/{key}")
        if record is None:
            raise _Corrupt(f"data.pkl names storage {key}, but record data/{key} is missing")
        elem = STORAGE_ELEMENT_SIZE.get(type_name)
        if elem is None or not isinstance(numel, int):
            unsized += 1
            continue
        if record.csize != numel * elem:
            raise _Corrupt(f"record data/{key} holds {record.csize} bytes, data.pkl says "
                           f"{numel} x {type_name} = {numel * elem} bytes")
    return {"storages": len(storages), "unsized_storages": unsized}


def _persistent_storages(data: bytes, what: str) -> dict:
    """{key: (storage type name, numel)} of every ('storage', ...) persistent id in a pickle
    (monitor.verify.picklescan: nothing the pickle names is imported or run)."""
    try:
        return persistent_storages(data)
    except OutOfBounds as e:
        raise _Corrupt(f"out of bounds: {what}: {str(e).removeprefix('out of bounds: ')}") \
            from None
    except BeyondBudget as e:
        raise _Unverifiable(f"{what} is too large to check within the verifier's memory "
                            f"bound: {e}") from None
    except (ValueError, IndexError, KeyError, TypeError, OverflowError,
            UnicodeDecodeError) as e:
        raise _Corrupt(f"{what} is not a valid pickle ({e})") from None


_fadvise = getattr(os, "posix_fadvise", None)          # not on macOS
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", 0)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 0)


def _check_crcs(f, entries: list, throttle) -> int:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    checked, bad = 0, []
    # Plain sequential reads, no posix_fadvise(WILLNEED) look-ahead: measured on a cold 320 MiB
    # file, the kernel's own readahead gets 133 ms and a WILLNEED 4 MiB ahead of every 1 MiB
    # read 263 ms (bench/scan_speed.py; docs/integrity.md).
    for e in entries:
        f.seek(e.data_start)
        remaining, crc = e.csize, 0
        while remaining:
            n = f.readinto(view[:min(CHUNK, remaining)])
            if not n:
                raise _Corrupt(f"truncated: record {e.name} ends early")
            crc = crc32(view[:n], crc)
            remaining -= n
            checked += n
            throttle.account(n)
        if crc != e.crc:
            bad.append(e.name)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise _Corrupt(f"CRC32 mismatch in {len(bad)} of {len(entries)} records ({shown}): "
                       "contents overwritten after the directory was written")
    return checked


# ---------------------------------------------------------------------------- safetensors

def safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (bounded: MAX_SAFETENSORS_PARSE), for checks
    across files (monitor.verify.sets). Raises ValueError with the reason, OSError."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError("truncated: shorter than the 8-byte header length")
        try:
            header, _ = _safetensors_header(f, size)
        except (_Corrupt, _Unverifiable) as e:
            raise ValueError(str(e)) from None
    return header


def _safetensors_header(f, size):
    """(header dict, header length), or _Corrupt / _Unverifiable."""
    n = struct.unpack("<Q", _pread(f, 0, 8))[0]
    if 8 + n > size:
        raise _Corrupt(f"truncated: the header says {n} bytes, the file holds {size - 8} "
                       "after the length")
    if n > MAX_SAFETENSORS_PARSE:
        raise _Unverifiable(f"header of {n} bytes is larger than the verifier parses "
                            f"({MAX_SAFETENSORS_PARSE >> 20} MiB)")
    try:
        header = json.loads(_pread(f, 8, n))
    except (ValueError, UnicodeDecodeError) as e:
        raise _Corrupt(f"header is not valid JSON ({e})") from None
    except RecursionError:
        raise _Corrupt("header is not valid JSON (nested deeper than Python parses)") from None
    if not isinstance(header, dict):
        raise _Corrupt("header is not a JSON object")
    return header, n


def _verify_safetensors(f, size, path, deep, throttle) -> Verdict:
    header, n = _safetensors_header(f, size)
    data_len = size - 8 - n
    spans, unsized = [], 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = t["dtype"], t["shape"], t["data_offsets"]
            if not all(isinstance(v, int) and v >= 0 for v in (begin, end, *shape)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise _Corrupt(f"tensor {name!r}: malformed entry in the header") from None
        if not begin <= end:
            raise _Corrupt(f"tensor {name!r}: offsets {begin}..{end} run backwards")
        if end > data_len:
            raise _Corrupt(f"truncated: tensor {name!r} ends at {end}, the data section holds "
                           f"{data_len} bytes")
        elem = SAFETENSORS_DTYPE_SIZE.get(dtype)
        if elem is None:
            unsized += 1
        else:
            numel = 1
            for d in shape:
                numel *= d
            if numel * elem != end - begin:
                raise _Corrupt(f"tensor {name!r}: shape {shape} x {dtype} is {numel * elem} "
                               f"bytes, its offsets span {end - begin}")
        spans.append((begin, end, name))
    spans.sort()
    expected = 0
    for begin, end, name in spans:
        if begin != expected:
            what = "overlaps the previous tensor" if begin < expected else "leaves a hole"
            raise _Corrupt(f"tensor {name!r} at {begin} {what} (expected {expected})")
        expected = end
    if expected != data_len:
        raise _Corrupt(f"{data_len - expected} bytes after the last tensor (data section "
                       f"{data_len}, tensors {expected})")
    return Verdict(OK, FMT_SAFETENSORS, "", {"tensors": len(spans), "unsized_tensors": unsized,
                                              "header_bytes": n, "deep": deep})


# ---------------------------------------------------------------------------- legacy torch

def _verify_legacy(f, size, path, deep, throttle) -> Verdict:
    """magic, protocol version, sys info, the object, the sorted storage keys: five pickles;
    then per key an 8-byte element count and the storage's bytes, to exactly the end."""
    f.seek(0)
    storages = {}
    keys = None
    for i in range(5):
        start = f.tell()
        if start >= size:
            raise _Corrupt(f"truncated: the file ends before pickle {i + 1} of 5")
        data = _read_pickle(f, size, i)
        if i == 3:
            storages = _persistent_storages(data, "the pickled object")
        elif i == 4:
            keys = [arg for op, arg, _ in pickletools.genops(data)
                    if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE")]
    pos = f.tell()
    for key in keys:
        head = _pread(f, pos, 8)
        if len(head) < 8:
            raise _Corrupt(f"truncated: storage {key} is missing (file ends at {size})")
        count = struct.unpack("<q", head)[0]
        type_name, numel = storages.get(key, (None, None))
        elem = STORAGE_ELEMENT_SIZE.get(type_name)
        if elem is None:
            raise _Unverifiable(f"legacy torch file with a storage of unknown layout "
                                f"({type_name}): cannot follow it")
        if count != numel:
            raise _Corrupt(f"storage {key} holds {count} elements, the pickle says {numel}")
        pos += 8 + count * elem
        if pos > size:
            raise _Corrupt(f"truncated: storage {key} runs {pos - size} bytes past the end")
    if pos != size:
        raise _Corrupt(f"{size - pos} unexpected bytes after the last storage")
    return Verdict(OK, FMT_TORCH_LEGACY, "", {
        "storages": len(keys), "deep": deep,
        "note": "legacy format has no checksums: sizes and layout checked only"})


class _Bounded:
    """A file seen only up to `size`: pickletools reads length-prefixed strings with one
    read(n), and a damaged length must not allocate gigabytes."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def read(self, n: int = -1) -> bytes:
        left = max(0, self.size - self.f.tell())
        return self.f.read(left if n is None or n < 0 else min(n, left))

    def readline(self) -> bytes:
        return self.f.readline(max(0, self.size - self.f.tell()))

    def tell(self) -> int:
        return self.f.tell()


def _read_pickle(f, size: int, index: int) -> bytes:
    start = f.tell()
    # genops decodes every argument: never let it see more than MAX_PICKLE_BYTES.
    limit = min(size, start + MAX_PICKLE_BYTES)
    try:
        for _ in pickletools.genops(_Bounded(f, limit)):
            pass
    except (ValueError, struct.error) as e:
        if f.tell() >= size:      # the parse ran into the end of the file
            raise _Corrupt(f"truncated: pickle {index + 1} of 5 is cut short") from None
        if f.tell() >= limit:
            raise _Unverifiable(f"legacy torch file whose pickle {index + 1} of 5 is larger "
                                f"than the verifier reads ({MAX_PICKLE_BYTES >> 20} MiB)") \
                from None
        raise _Corrupt(f"pickle {index + 1} of 5 is not a valid pickle ({e})") from None
    end = f.tell()
    f.seek(start)
    data = f.read(end - start)
    return data


# ---------------------------------------------------------------------------- I/O helpers

PAGE = 4096


class _File(io.BufferedReader):
    """A buffered file plus a one-page window for _pread: a record's data descriptor and the
    next record's local header are adjacent, so one page read serves both (this halves the
    random reads of a structural check on a cold cache)."""

    window = (0, b"")


def _open(path: str) -> _File:
    return _File(io.FileIO(path, "rb"))


def _pread(f, offset: int, n: int) -> bytes:
    """n bytes at offset (fewer at the end of the file), without moving the file position."""
    if n <= 0:
        return b""
    win_off, win = f.window
    if win_off <= offset and offset + n <= win_off + len(win):
        return win[offset - win_off:offset - win_off + n]
    want = max(n, PAGE)
    out = os.pread(f.fileno(), want, offset)
    while len(out) < want:
        more = os.pread(f.fileno(), want - len(out), offset + len(out))
        if not more:
            break
        out += more
    if want == PAGE:
        f.window = (offset, out)
    return out[:n]


def _prefetch_headers(f, entries: list) -> bool:
    """On a cold cache every local header (and the data descriptor just before it) is a
    separate disk read, and the structural check would wait for them one after another. Ask
    the kernel for all of them at once instead: it queues the reads in parallel (cold 320 MiB
    file, 131 records: 7.9 ms -> 2.7 ms). Only when the file is not cached: on cached pages
    this would cost a syscall per record for nothing. Returns whether the file was cold."""
    fd = f.fileno()
    if _fadvise is None or not entries or _is_cached(fd, entries[len(entries) // 2].offset):
        return False
    for e in entries:
        # data.pkl is read whole; every other record only around its header.
        span = e.csize if e.name.endswith("/data.pkl") and e.csize <= MAX_PICKLE_BYTES else 0
        _fadvise(fd, max(0, e.offset - 64), PAGE + 64 + span, _WILLNEED)
    return True


def _forget_headers(f, entries: list) -> None:
    """Drop the header pages the structural check pulled into a cold file's cache before the
    deep pass reads the file front to back. Cached islands every few MiB break the kernel's
    sequential readahead (a plain read after a structural check: 245 ms instead of 135 ms on
    a 320 MiB file); without them the deep pass streams like a plain read."""
    fd = f.fileno()
    for e in entries:
        _fadvise(fd, max(0, (e.offset - 64) & ~(PAGE - 1)), 3 * PAGE, _DONTNEED)


_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def _is_cached(fd: int, offset: int) -> bool:
    """Is the page at offset in the page cache? (preadv2 RWF_NOWAIT fails with EAGAIN if a
    read would have to wait for the disk; unknown, e.g. on NFS, counts as not cached.)"""
    if _NOWAIT is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], offset, _NOWAIT) == 1
    except OSError:
        return False


class _Throttle:
    """Keeps the average read rate at or below max_bytes_per_second by sleeping."""

    def __init__(self, max_bytes_per_second: float | None):
        self.rate = max_bytes_per_second if max_bytes_per_second and \
            max_bytes_per_second > 0 else None
        self.start = time.monotonic()
        self.bytes = 0

    def account(self, n: int) -> None:
        if self.rate is None:
            return
        self.bytes += n
        ahead = self.bytes / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)
