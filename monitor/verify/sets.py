"""Whole-checkpoint verification: a checkpoint that is a directory of shards, checked as one.

Two kinds of set, each named by one file in its directory:
- "dcp": a torch.distributed.checkpoint directory. `.metadata` (a pickle of Metadata, read by
  monitor.verify.dcpmeta without torch) names, per tensor chunk, a shard file and the byte range
  it occupies. Every shard it names must be there, whole (integrity.verify), and laid out
  exactly as it says: the ranges tile the file from 0 to its end, one torch.save archive each.
- "hf-sharded": a Hugging Face sharded checkpoint. `*.safetensors.index.json` or
  `*.bin.index.json` ({"metadata": {"total_size": N}, "weight_map": {tensor: shard}}) names
  the shards. Every shard must be there and whole; a safetensors shard must hold exactly the
  tensors the index places in it, and their bytes must add up to total_size. A .bin shard is
  checked for presence and structure only.

Verdicts reuse integrity.Verdict: status ok | corrupt | unverifiable; format "dcp" or
"hf-sharded"; details["cause"] when corrupt, one of integrity.CAUSES: `missing_shard` (a
member, or the .metadata, is not there), `mixed` (the members are whole but do not belong
together: a shard from another save, or, when the agent saw the writes, shards written by
different job runs), a member's own cause (truncated, torn...), or `inconsistent` (the index
itself is damaged, or names a file outside the directory).

Pure apart from reading the files: no threads, no clocks. Bounded: the index is read up to
MAX_INDEX_BYTES, never past; a member name is one plain file name in the set's directory (no
"/", no ".."), so nothing outside the directory is ever opened; with follow_symlinks=False
(the agent, root) a member that is a symbolic link is not read either.
"""
from __future__ import annotations

import functools
import json
import os
import stat
from array import array
from dataclasses import dataclass

from . import dcpmeta, integrity
from .integrity import CORRUPT, OK, UNVERIFIABLE, Verdict
from .picklescan import BeyondBudget, OutOfBounds

KIND_DCP = "dcp"
KIND_HF = "hf-sharded"
DCP_METADATA = ".metadata"
DCP_SUFFIX = ".distcp"
HF_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")

MAX_METADATA_BYTES = 16 << 20    # a .metadata pickle read into memory (picklescan's budgets)
# JSON turns one input byte into up to ~14 bytes of objects once containers are capped (a
# valid index has 3): 4 MiB stays within the verifier's ~64 MiB bound.
MAX_INDEX_BYTES = 4 << 20
MAX_INDEX_CONTAINERS = 4096      # `[` and `{` bytes in an index (counted inside strings too)
MAX_LISTING = 100_000            # directory entries looked at to find a set
MAX_SHOWN = 3                    # names quoted in a reason

_HASH_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class CheckpointSet:
    """A set found in `directory`; `index` is the file naming its members."""

    directory: str
    kind: str
    index: str


def find_sets(directory: str, names) -> list[CheckpointSet]:
    """The sets a directory holding `names` contains (pure: from its listing)."""
    names = list(names)
    found = []
    if DCP_METADATA in names or any(n.endswith(DCP_SUFFIX) for n in names):
        found.append(CheckpointSet(directory, KIND_DCP, DCP_METADATA))
    for n in sorted(names):
        if n.endswith(HF_INDEX_SUFFIXES):
            found.append(CheckpointSet(directory, KIND_HF, n))
    return found


def set_of(path: str) -> str | None:
    """The directory of the set a finished file may belong to, or None (the agent's
    question after verifying a file). A DCP shard belongs once `.metadata` exists: before
    that its save is still running (rank 0 writes .metadata last)."""
    directory, name = os.path.split(path)
    if name.endswith(DCP_SUFFIX) or name == DCP_METADATA:
        return directory if os.path.lexists(os.path.join(directory, DCP_METADATA)) else None
    try:
        with os.scandir(directory or ".") as it:
            for i, entry in enumerate(it):
                if i >= MAX_LISTING:
                    break
                if entry.name.endswith(HF_INDEX_SUFFIXES):
                    return directory
    except OSError:
        pass
    return None


def unfinished_dcp(path: str) -> str | None:
    """The directory of a DCP shard whose `.metadata` is not there (yet): its save has not
    finished, or never will (it crashed). None for any other file."""
    directory, name = os.path.split(path)
    if not name.endswith(DCP_SUFFIX):
        return None
    return None if os.path.lexists(os.path.join(directory, DCP_METADATA)) else directory


def listing(directory: str) -> list[str]:
    """Up to MAX_LISTING names in a directory (empty if it cannot be read)."""
    names = []
    try:
        with os.scandir(directory or ".") as it:
            for entry in it:
                if len(names) >= MAX_LISTING:
                    break
                names.append(entry.name)
    except OSError:
        pass
    return names


def signature(directory: str) -> tuple:
    """(name, size, mtime, inode) of the set-relevant files: the same bytes are not verified
    and reported twice by the agent."""
    out = []
    for name in sorted(listing(directory)):
        if name == DCP_METADATA or name.endswith(DCP_SUFFIX) or \
                name.endswith(HF_INDEX_SUFFIXES) or name.endswith((".safetensors", ".bin")):
            try:
                st = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def verify_directory(directory: str, **kwargs) -> list[Verdict]:
    """Verify every set in one directory (see verify_set for kwargs)."""
    return [verify_set(s, **kwargs) for s in find_sets(directory, listing(directory))]


def verify_set(s: CheckpointSet, verify_file=None, runs: dict | None = None,
               follow_symlinks: bool = True) -> Verdict:
    """Verify one set. Never raises.

    verify_file(path) -> integrity.Verdict for one member (default integrity.verify; scan
    passes the verdicts it already has). runs: {member path: run key of its last writer}
    (the agent's knowledge; DCP shards from different runs make the set `mixed`).
    follow_symlinks: False in the agent: a member that is a symbolic link is not read.
    """
    check = _Check(s, verify_file or functools.partial(integrity.verify,
                                                       follow_symlinks=follow_symlinks),
                   runs or {}, follow_symlinks)
    try:
        if s.kind == KIND_DCP:
            check.dcp()
        else:
            check.hf()
    except Exception as e:   # a verifier bug must not take the agent or a scan down
        return Verdict(UNVERIFIABLE, s.kind, f"verifier error: {type(e).__name__}: {e}",
                       {"index": s.index})
    return check.verdict()


# ---------------------------------------------------------------------------- checking

class _NotRead(Exception):
    """A member that was not read: the message says why (symlink, not a regular file)."""


class _Check:
    def __init__(self, s: CheckpointSet, verify_file, runs: dict, follow: bool):
        self.s, self.verify_file, self.runs, self.follow = s, verify_file, runs, follow
        self.problems: list[tuple[str, str]] = []       # (cause, reason), corrupt
        self.doubts: list[str] = []                     # reasons for unverifiable
        self.details: dict = {"index": s.index, "shards": 0, "bytes": 0}
        self.members: list[str] = []

    # -- outcome

    def corrupt(self, cause: str, reason: str) -> None:
        self.problems.append((cause, reason))

    def verdict(self) -> Verdict:
        details = dict(self.details, members=self.members)
        if self.problems:
            # The most telling problem first: missing, then a damaged member, then mixing.
            order = {"missing_shard": 0, "mixed": 2, "inconsistent": 3}
            cause, reason = min(self.problems, key=lambda p: order.get(p[0], 1))
            more = len(self.problems) - 1
            if more:
                reason += f" (and {more} more problem{'s' if more > 1 else ''})"
            details["cause"] = cause
            details["problems"] = len(self.problems)
            return Verdict(CORRUPT, self.s.kind, reason, details)
        if self.doubts:
            return Verdict(UNVERIFIABLE, self.s.kind, self.doubts[0], details)
        return Verdict(OK, self.s.kind, "", details)

    # -- members

    def member(self, name) -> str | None:
        """The path of member `name`, or None (and a problem) if it may not be read."""
        if not isinstance(name, str) or not _plain_name(name):
            self.corrupt("inconsistent", f"{self.s.index} names {str(name)[:80]!r} as a "
                         "shard: not a file name in the checkpoint directory (not read)")
            return None
        return os.path.join(self.s.directory, name)

    def open_index(self, path: str, limit: int) -> bytes:
        """Up to `limit` bytes of the index file; raises _NotRead/OSError/_TooLarge."""
        flags = os.O_RDONLY | (0 if self.follow else getattr(os, "O_NOFOLLOW", 0))
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _NotRead("not a regular file")
            if st.st_size > limit:
                raise _TooLarge(st.st_size)
            chunks, left = [], limit + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
            if len(data) > limit:               # grew while we read: still bounded
                raise _TooLarge(len(data))
            return data
        finally:
            os.close(fd)

    def verify_member(self, name: str, path: str) -> Verdict | None:
        """The member's own verdict; None (and a problem or doubt) if missing or not read."""
        try:
            st = os.stat(path) if self.follow else os.lstat(path)
        except FileNotFoundError:
            self.corrupt("missing_shard", f"shard {name} is missing ({self.s.index} names "
                         "it)")
            return None
        except OSError as e:
            self.doubts.append(f"shard {name}: cannot read: {e.strerror or e}")
            return None
        if stat.S_ISLNK(st.st_mode):
            self.doubts.append(f"shard {name} is a symbolic link: not followed")
            return None
        self.members.append(name)
        self.details["shards"] += 1
        self.details["bytes"] += st.st_size
        v = self.verify_file(path)
        if v.status == CORRUPT:
            cause = v.details.get("cause") or integrity.corrupt_cause(v.reason)
            self.corrupt(cause, f"shard {name}: {v.reason}")
        elif v.status != OK:
            self.doubts.append(f"shard {name}: {v.reason}")
        return v

    # -- torch.distributed.checkpoint

    def read_set_file(self, name: str, limit: int, missing: str) -> bytes | None:
        """The set's describing file (DCP .metadata, HF index) in the set's directory, or None
        after recording why not: missing is a corrupt set, too large or unreadable a doubt."""
        try:
            return self.open_index(os.path.join(self.s.directory, name), limit)
        except FileNotFoundError:
            self.corrupt("missing_shard", missing)
        except _TooLarge as e:
            self.doubts.append(f"{name} of {e.size} bytes is larger than the verifier reads "
                               f"({limit >> 20} MiB)")
        except (_NotRead, OSError) as e:
            self.doubts.append(f"{name}: cannot read: {_why(e)}")
        return None

    def dcp(self) -> None:
        d = self.s.directory
        data = self.read_set_file(DCP_METADATA, MAX_METADATA_BYTES,
                                  f"{DCP_METADATA} is missing: the save did not finish (it is "
                                  "written last) or it was deleted")
        if data is None:
            return
        try:
            shards = dcpmeta.shard_ranges(data)
        except OutOfBounds as e:
            self.corrupt("out_of_bounds", f"out of bounds: {DCP_METADATA}: "
                         f"{str(e).removeprefix('out of bounds: ')}")
            return
        except BeyondBudget as e:
            self.doubts.append(f"{DCP_METADATA} is too large to check within the verifier's "
                               f"memory bound: {e}")
            return
        except (ValueError, IndexError, KeyError, TypeError, OverflowError,
                UnicodeDecodeError) as e:
            self.corrupt("inconsistent", f"{DCP_METADATA} is not a valid pickle ({e})")
            return
        del data
        if not shards.is_dcp:
            self.doubts.append(f"{DCP_METADATA} is not a torch.distributed.checkpoint "
                               "Metadata pickle")
            return
        self.details["ranges"] = shards.ranges
        named = set()
        for name in sorted(shards.files):
            path = self.member(name)
            if path is None:
                continue
            named.add(name)
            v = self.verify_member(name, path)
            if v is not None and v.status == OK:
                self.dcp_layout(name, path, shards.files[name], v,
                                exact=shards.transformed == 0)
        self.dcp_runs(named)
        unreferenced = [n for n in listing(d) if n.endswith(DCP_SUFFIX) and n not in named]
        if unreferenced:
            # Left by an earlier save with more ranks: harmless for loading, worth knowing.
            self.details["unreferenced"] = len(unreferenced)

    def dcp_layout(self, name: str, path: str, pairs: array, v: Verdict, exact: bool) -> None:
        """The ranges .metadata gives tile the (whole) shard exactly, one archive each."""
        try:
            size = os.stat(path).st_size
        except OSError:
            return
        ranges = sorted(zip(pairs[::2], pairs[1::2]))
        expected = 0
        for offset, length in ranges:
            if offset != expected:
                what = "overlap" if offset < expected else "leave a gap"
                self.corrupt("mixed", f"shard {name} is whole but not the one {DCP_METADATA} "
                             f"describes: its ranges {what} at byte {min(offset, expected)} "
                             "(a shard from a different save)")
                return
            expected = offset + length
        if expected != size:
            self.corrupt("mixed", f"shard {name} is whole but not the one {DCP_METADATA} "
                         f"describes: {size} bytes, {DCP_METADATA} says {expected} (a shard "
                         "from a different save)")
            return
        archives = v.details.get("archives")
        if exact and v.format == integrity.FMT_TORCH_ZIP and archives is not None and \
                archives != len(ranges):
            self.corrupt("mixed", f"shard {name} holds {archives} archives, {DCP_METADATA} "
                         f"names {len(ranges)} (a shard from a different save)")

    def dcp_runs(self, named: set) -> None:
        """Shards whose last writers (as the agent saw them) belong to different job runs."""
        by_run: dict = {}
        for name in sorted(named):
            key = self.runs.get(os.path.join(self.s.directory, name))
            if key is not None:
                by_run.setdefault(key, []).append(name)
        if len(by_run) > 1:
            shown = "; ".join(f"{', '.join(names[:MAX_SHOWN])} by run {_run_label(key)}"
                              for key, names in list(by_run.items())[:MAX_SHOWN])
            self.corrupt("mixed", f"shards written by {len(by_run)} different job runs: "
                         f"{shown}")
        if by_run:
            self.details["runs"] = len(by_run)

    # -- Hugging Face sharded

    def hf(self) -> None:
        data = self.read_set_file(self.s.index, MAX_INDEX_BYTES, f"{self.s.index} is missing")
        if data is None:
            return
        if data.count(b"[") + data.count(b"{") > MAX_INDEX_CONTAINERS:
            self.corrupt("inconsistent", f"{self.s.index} is not a shard index (more than "
                         f"{MAX_INDEX_CONTAINERS} JSON objects and arrays)")
            return
        groups, total_size, problem = _parse_index(data)
        del data
        if problem:
            self.corrupt("inconsistent", f"{self.s.index} {problem}")
            return
        self.details["tensors"] = sum(len(h) for h in groups.values())
        data_bytes, checkable = 0, True
        for name in sorted(groups):
            path = self.member(name)
            if path is None:
                checkable = False
                continue
            v = self.verify_member(name, path)
            if v is None or v.status != OK or v.format != integrity.FMT_SAFETENSORS:
                checkable = False       # .bin shards: presence and structure only
                continue
            held = self.hf_tensors(name, path, groups[name])
            if held is None:
                checkable = False
            else:
                data_bytes += held
        if checkable and total_size is not None and total_size != data_bytes:
            self.corrupt("mixed", f"{self.s.index} says total_size {total_size}, its shards "
                         f"hold {data_bytes} bytes of tensors (shards from different saves)")

    def hf_tensors(self, name: str, path: str, hashes: array) -> int | None:
        """Compare a safetensors shard's tensors with the index's; returns its tensor bytes."""
        try:
            header = integrity.safetensors_header(path, follow_symlinks=self.follow)
        except (ValueError, OSError) as e:
            self.doubts.append(f"shard {name}: {_why(e)}")
            return None
        held, extra, size = set(), [], 0
        expected = set(hashes)
        for tensor, t in header.items():
            if tensor == "__metadata__":
                continue
            h = hash(tensor) & _HASH_MASK
            held.add(h)
            if h not in expected:
                extra.append(tensor)
            try:
                size += t["data_offsets"][1] - t["data_offsets"][0]
            except (KeyError, TypeError, IndexError):
                pass                    # integrity.verify judged the header already
        lacking = len(expected - held)
        if extra or lacking:
            parts = []
            if lacking:
                parts.append(f"lacks {lacking} tensor{'s' if lacking > 1 else ''} the index "
                             "places there")
            if extra:
                shown = ", ".join(repr(t[:80]) for t in extra[:MAX_SHOWN])
                parts.append(f"holds {len(extra)} the index does not name ({shown}"
                             f"{', ...' if len(extra) > MAX_SHOWN else ''})")
            self.corrupt("mixed", f"shard {name} is whole but {' and '.join(parts)}: a shard "
                         "from a different save")
        return size


class _TooLarge(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


def _parse_index(data: bytes):
    """({shard: sorted array('Q') of tensor-name hashes}, total_size | None, problem | "").
    The parsed JSON is dropped on return: names are kept as 8-byte hashes."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        return {}, None, f"is not valid JSON ({e})"
    except RecursionError:
        return {}, None, "is not valid JSON (nested too deeply)"
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        return {}, None, "has no weight_map object"
    groups: dict = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            return {}, None, f"maps tensor {tensor[:80]!r} to a non-string shard"
        groups.setdefault(shard, array("Q")).append(hash(tensor) & _HASH_MASK)
    meta = doc.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if isinstance(total, float) and total.is_integer():
        total = int(total)
    if not isinstance(total, int) or isinstance(total, bool):
        total = None
    return groups, total, ""


def _plain_name(name: str) -> bool:
    """One file name, inside the set's directory: no separators, no "..", no NUL."""
    return bool(name) and len(name) <= 255 and "/" not in name and "\\" not in name and \
        "\0" not in name and name not in (".", "..")


def _why(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e)


def _run_label(key) -> str:
    if isinstance(key, tuple) and key:
        job, _, restart = (tuple(key) + (None, None))[:3]
        return f"{job}" + (f" (restart {restart})" if restart is not None else "")
    return str(key)
