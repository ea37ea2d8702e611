"""What a verification says about a file: the Verdict, its status, format and cause, and the two
exceptions the format checkers raise (monitor/verify/integrity.py turns them into Verdicts).

Pure: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


class Corrupt(Exception):
    """A proven inconsistency; the message is the user-facing reason."""


class Unverifiable(Exception):
    """The file cannot be judged (unknown storage layout, oversized metadata...)."""


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

