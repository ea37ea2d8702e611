"""The safetensors format: what integrity.verify() checks of one (see its docstring), and the
header that checks across a set's files read (monitor/verify/sets.py). The format has no
checksums: a deep check adds nothing. Raises verdict.Corrupt or verdict.Unverifiable.
"""
from __future__ import annotations

import json
import os
import struct

from .fileio import open_file, pread
from .verdict import FMT_SAFETENSORS, OK, Corrupt, Unverifiable, Verdict

MAX_SAFETENSORS_HEADER = 100 << 20   # the safetensors library's own limit (format sniffing)
MAX_SAFETENSORS_PARSE = 2 << 20      # JSON makes up to ~25 B of objects per byte: parse less

# safetensors dtype -> bytes per element; sub-byte types (F4, F6_*) are not size-checked.
SAFETENSORS_DTYPE_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
    "C64": 8, "C128": 16,
}


def safetensors_header(path: str, follow_symlinks: bool = True) -> dict:
    """The JSON header of a safetensors file (bounded: MAX_SAFETENSORS_PARSE), for checks
    across files (monitor.verify.sets). Raises ValueError with the reason, OSError (a FIFO or
    a device: fileio.NotRegularFile, never opened blocking)."""
    with open_file(path, follow_symlinks) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError("truncated: shorter than the 8-byte header length")
        try:
            header, _ = _safetensors_header(f, size)
        except (Corrupt, Unverifiable) as e:
            raise ValueError(str(e)) from None
    return header


def _safetensors_header(f, size):
    """(header dict, header length), or _Corrupt / _Unverifiable."""
    n = struct.unpack("<Q", pread(f, 0, 8))[0]
    if 8 + n > size:
        raise Corrupt(f"truncated: the header says {n} bytes, the file holds {size - 8} "
                      "after the length")
    if n > MAX_SAFETENSORS_PARSE:
        raise Unverifiable(f"header of {n} bytes is larger than the verifier parses "
                           f"({MAX_SAFETENSORS_PARSE >> 20} MiB)")
    try:
        header = json.loads(pread(f, 8, n))
    except (ValueError, UnicodeDecodeError) as e:
        raise Corrupt(f"header is not valid JSON ({e})") from None
    except RecursionError:
        raise Corrupt("header is not valid JSON (nested deeper than Python parses)") from None
    if not isinstance(header, dict):
        raise Corrupt("header is not a JSON object")
    return header, n


def verify_safetensors(f, size, path, deep, throttle) -> Verdict:
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
            raise Corrupt(f"tensor {name!r}: malformed entry in the header") from None
        if not begin <= end:
            raise Corrupt(f"tensor {name!r}: offsets {begin}..{end} run backwards")
        if end > data_len:
            raise Corrupt(f"truncated: tensor {name!r} ends at {end}, the data section holds "
                          f"{data_len} bytes")
        elem = SAFETENSORS_DTYPE_SIZE.get(dtype)
        if elem is None:
            unsized += 1
        else:
            numel = 1
            for d in shape:
                numel *= d
            if numel * elem != end - begin:
                raise Corrupt(f"tensor {name!r}: shape {shape} x {dtype} is {numel * elem} "
                              f"bytes, its offsets span {end - begin}")
        spans.append((begin, end, name))
    spans.sort()
    expected = 0
    for begin, end, name in spans:
        if begin != expected:
            what = "overlaps the previous tensor" if begin < expected else "leaves a hole"
            raise Corrupt(f"tensor {name!r} at {begin} {what} (expected {expected})")
        expected = end
    if expected != data_len:
        raise Corrupt(f"{data_len - expected} bytes after the last tensor (data section "
                      f"{data_len}, tensors {expected})")
    return Verdict(OK, FMT_SAFETENSORS, "", {"tensors": len(spans), "unsized_tensors": unsized,
                                              "header_bytes": n, "deep": deep})

