"""What a resume-time failure in a training log says: which failure it is, and which checkpoint
file it names. Pure: text in, values out (monitor/cli/diagnose.py reads the log and the
journals).

The signatures are the frameworks' own messages (checked against torch 2.13, safetensors 0.8
and the standard library by tests/unit/test_tracebacks.py, which makes each failure happen):

- torch.load of a zip checkpoint cut short: `PytorchStreamReader failed reading zip archive:
  failed finding central directory`, or (cut well before its end) `OSError: [Errno 22]
  Invalid argument` raised by `torch._C.PyTorchFileReader`;
- a record overwritten: `PytorchStreamReader failed reading file data/N: invalid header or
  archive is corrupted`;
- the index of one save over the records of another (two saves of different sizes
  interleaved): `record size (X bytes) does not match expected size (Y bytes ...)`;
- a legacy/empty file: `EOFError: Ran out of input` (bare `EOFError` from the weights-only
  unpickler), `UnpicklingError: invalid load key`, the weights-only unpickler's `Unsupported
  operand`;
- `zipfile.BadZipFile: File is not a zip file`;
- safetensors: `SafetensorError: Error while deserializing header: MetadataIncompleteBuffer`
  (0.8: `incomplete metadata, file not fully covered`), `HeaderTooSmall`/`header too small`,
  `HeaderTooLarge`/`header too large`, `InvalidHeaderDeserialization`;
- a staging directory another process renamed first: `FileNotFoundError: ... tmp-checkpoint-N`
  (transformers' Trainer saves into tmp-checkpoint-N and renames it);
- `PermissionError: [Errno 13] Permission denied: '<a checkpoint path>'`.

The log is input from anywhere: lines are cut to MAX_LINE characters before any pattern sees
them, ANSI colour codes are dropped, and nothing here prints.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_LINE = 8192             # characters of a line that are looked at
CONTEXT_LINES = 400         # how far before the error a log line may name the file
CONTEXT_FRAMES = 8          # how far before the error a class's context line may be

# Colour and cursor codes (pytest, rich and loguru colour tracebacks).
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


@dataclass(frozen=True)
class FailureClass:
    """One kind of resume-time failure: its name (stable, for --format json), what it means
    and whether overlapping writes of one file produce it."""

    name: str
    title: str
    meaning: str
    pattern: re.Pattern
    collision_signature: bool = True
    # A line that must come shortly before (the traceback's frames): for messages too general
    # to mean a checkpoint on their own.
    context: re.Pattern | None = None


def _c(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.IGNORECASE)


CLASSES = (
    FailureClass(
        "zip_truncated", "checkpoint cut short (zip archive without its end)",
        "torch.load found no central directory: the file ends before the archive does. A "
        "second writer truncated it (every torch.save opens with truncation), the save died, "
        "or the disk filled.",
        _c(r"PytorchStreamReader failed reading zip archive: failed finding central directory")),
    FailureClass(
        "zip_unreadable", "checkpoint cut short (torch cannot open the archive)",
        "torch's zip reader failed on the file itself (torch 2.13 raises this for an archive "
        "cut short well before its end): a second writer truncated it, or the save died.",
        _c(r"^\s*OSError: \[Errno 22\] Invalid argument\s*$"),
        context=re.compile(r"PyTorchFileReader|_open_zipfile_reader")),
    FailureClass(
        "zip_record_corrupt", "checkpoint record overwritten",
        "a record inside the zip archive does not start where the archive says: bytes of "
        "another write landed in the middle of this one.",
        _c(r"PytorchStreamReader failed reading file \S+: invalid header or archive is "
           r"corrupted")),
    FailureClass(
        "record_size_mismatch", "two saves interleaved in one file",
        "the archive's index comes from one save and a tensor's record from another of a "
        "different size: two processes wrote the file at the same time.",
        _c(r"record size \(\d+ bytes\) does not match expected size")),
    FailureClass(
        "pickle_truncated", "checkpoint empty or cut short",
        "the unpickler ran out of bytes: the file is empty or ends early (a writer had just "
        "truncated it, or the save died).",
        _c(r"^\s*EOFError(?::\s*Ran out of input)?\s*$|EOFError: Ran out of input")),
    FailureClass(
        "pickle_garbage", "checkpoint does not start like one",
        "the first bytes are not a pickle: the file was overwritten by something else, or is "
        "not a checkpoint.",
        _c(r"UnpicklingError: invalid load key|Weights only load failed.*Unsupported operand"
           r"|^\s*Unsupported operand \d+")),
    FailureClass(
        "not_a_zip", "checkpoint is not a zip archive",
        "a zip reader found no archive: the file is cut short, overwritten, or not the "
        "format expected.",
        _c(r"BadZipFile: File is not a zip file|zipfile\.BadZipFile")),
    FailureClass(
        "safetensors_truncated", "safetensors file cut short",
        "the header promises more bytes than the file holds: a second writer truncated it, "
        "or the save died.",
        _c(r"SafetensorError: Error while deserializing header: (MetadataIncompleteBuffer|"
           r"incomplete metadata|HeaderTooSmall|header too small)")),
    FailureClass(
        "safetensors_header_corrupt", "safetensors header overwritten",
        "the header length or the header is garbage: another write landed at the start of "
        "the file.",
        _c(r"SafetensorError: Error while deserializing header: (HeaderTooLarge|header too "
           r"large|InvalidHeaderDeserialization|invalid JSON)")),
    FailureClass(
        "staging_dir_missing", "staging directory renamed by another process",
        "the save writes into tmp-checkpoint-N and renames it to checkpoint-N; another "
        "process saving the same step (every rank, or every node with save_on_each_node) "
        "renamed or removed it first.",
        _c(r"FileNotFoundError: \[Errno 2\] No such file or directory: .*tmp-checkpoint")),
    FailureClass(
        "permission_denied", "checkpoint owned by someone else",
        "the process may not open the checkpoint: another user's or another job's process "
        "wrote it (two jobs share an output directory), or it is read-only.",
        _c(r"PermissionError: \[Errno 13\] Permission denied: .*(\.pt|\.pth|\.bin|\.ckpt|"
           r"\.safetensors|\.distcp|checkpoint)"),
        collision_signature=False),
)
BY_NAME = {c.name: c for c in CLASSES}

# A checkpoint-like path: a name with a checkpoint extension, or a path through a directory
# named like one; never a source file (traceback frames name .py files). Found by splitting a
# line into tokens and looking at each: linear in the line, whatever it holds (a regular
# expression with nested repeats over path characters backtracks without end on hostile input).
CHECKPOINT_EXTENSIONS = frozenset(("pt", "pth", "bin", "ckpt", "safetensors", "distcp", "pkl",
                                   "pickle", "tar", "npz", "msgpack", "h5"))
_TOKEN = re.compile(r"""[^\s'"()\[\]{}<>,;`|]+""")
_CHECKPOINT_DIR = re.compile(r"(?:^|/)(?:tmp-)?checkpoint")
_QUOTED = re.compile(r"'((?:[^'\\\n]|\\.){1,4096})'" + r'|"((?:[^"\\\n]|\\.){1,4096})"')
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')


@dataclass(frozen=True)
class Failure:
    """The failure a log ends with: its class, the line (1-based, in what was read) and the
    message as logged (cut, not escaped: the caller escapes what it prints)."""

    cls: FailureClass
    line: int
    message: str
    earlier: int = 0            # failures of a known class before this one


@dataclass(frozen=True)
class FileMention:
    path: str
    line: int                   # where the log names it (1-based)
    text: str                   # that line (cut)
    how: str                    # "error message", "traceback", "log"


@dataclass
class Diagnosis:
    failure: Failure | None
    file: FileMention | None
    candidates: list = field(default_factory=list)      # every FileMention, nearest first


def clean_lines(text: str) -> list[str]:
    """The log's lines (split at \n only: a \r, \x1c or \u2028 inside a line must not move
    what follows to a line of its own), colour codes dropped, each cut to MAX_LINE
    characters."""
    return [_ANSI.sub("", line[:MAX_LINE * 2]).rstrip("\r")[:MAX_LINE]
            for line in text.split("\n")]


def find_failure(lines: list[str]) -> Failure | None:
    """The last line matching a failure class: the failure that ended the run."""
    found: list[tuple[int, FailureClass]] = []
    for index, line in enumerate(lines):
        for cls in CLASSES:
            if cls.pattern.search(line) and (
                    cls.context is None
                    or any(cls.context.search(before)
                           for before in lines[max(0, index - CONTEXT_FRAMES):index])):
                found.append((index, cls))
                break
    if not found:
        return None
    index, cls = found[-1]
    # A bare `EOFError` line is the end of a traceback; a known class earlier on the same
    # traceback (a chained exception) is the same failure, counted once.
    return Failure(cls, index + 1, lines[index].strip(), earlier=len(found) - 1)


def looks_like_checkpoint(token: str) -> bool:
    """A path-like token naming a checkpoint file or a checkpoint directory."""
    if len(token) < 4 or token.endswith(".py"):
        return False
    name = token.rsplit("/", 1)[-1]
    stem, dot, ext = name.rpartition(".")
    if dot and stem and ext.lower() in CHECKPOINT_EXTENSIONS:
        return True
    return "/" in token and _CHECKPOINT_DIR.search(token) is not None


def _paths_in(line: str) -> list[str]:
    if _FRAME.match(line):
        return []            # File "/src/train.py", line 10: the code, not the checkpoint
    out = []
    for match in _QUOTED.finditer(line):             # a quoted path may hold spaces
        text = match.group(1) or match.group(2) or ""
        if looks_like_checkpoint(text):
            out.append(text)
    for match in _TOKEN.finditer(line):
        token = match.group(0).rstrip(".:")
        if "=" in token:
            token = token.rsplit("=", 1)[1]          # --resume=/ckpt/last.pt
        if looks_like_checkpoint(token):
            out.append(token)
    return out


def _error_paths(message: str) -> list[str]:
    """Paths an OSError names: `[Errno N] text: 'a'` or `'a' -> 'b'` (rename)."""
    tail = message.split("]", 1)[1] if "] " in message else message
    return [m.group(1) or m.group(2) for m in _QUOTED.finditer(tail)]


def find_file(lines: list[str], failure: Failure | None) -> list[FileMention]:
    """Checkpoint paths the log names around the failure, best first: the error's own
    message, then the traceback above it, then log lines before it (nearest first)."""
    if failure is None:
        end, start = len(lines), max(0, len(lines) - CONTEXT_LINES)
    else:
        end, start = failure.line, max(0, failure.line - CONTEXT_LINES)
    mentions: list[FileMention] = []
    seen: set[str] = set()

    def add(path: str, index: int, how: str) -> None:
        if path and path not in seen and len(seen) < 100:
            seen.add(path)
            mentions.append(FileMention(path, index + 1, lines[index].strip()[:400], how))

    if failure is not None:
        message = lines[failure.line - 1]
        if failure.cls.name in ("staging_dir_missing", "permission_denied"):
            for path in _error_paths(message):      # an OSError names its file, quoted
                add(path, failure.line - 1, "error message")
        for path in _paths_in(message):
            add(path, failure.line - 1, "error message")
    # The traceback block ends at the error; its code lines (`state = torch.load("x.pt")`)
    # and a chained message may name the file. Then the log before it.
    in_traceback = True
    for index in range(end - 1, start - 1, -1):
        line = lines[index]
        if in_traceback and index < end - 1 and line.startswith("Traceback (most recent"):
            in_traceback = False
            continue
        for path in _paths_in(line):
            add(path, index, "traceback" if in_traceback else "log")
    return mentions


def diagnose_text(text: str) -> Diagnosis:
    lines = clean_lines(text)
    failure = find_failure(lines)
    mentions = find_file(lines, failure)
    return Diagnosis(failure, mentions[0] if mentions else None, mentions)
