"""`ckptwatch lint PATH... [--format table|json] [--assume-distributed]`

Finds checkpoint writes that more than one rank can reach (monitor/lint/) in Python files and
prints them the way ruff and flake8 do, `path:line:col: CODE message` (--format table, the
human format's name in every command; `text`, its old name here, is still accepted), or as a
JSON list of {path, line, col, code, message}. Like flake8 it prints nothing when clean; -v
adds how many files it read (stderr). Directories are searched recursively for *.py (hidden
directories, __pycache__, site-packages and node_modules skipped); files named on the command
line are always read.

Exit codes: 0 clean; 1 at least one finding (a file that cannot be parsed or read is a CKW999
finding: it was not checked, so it must not pass as clean); 2 a usage error or an incomplete
lint: a PATH that does not exist, a directory that cannot be listed (anywhere in the walk),
or no Python file found at all (each one line on stderr; the other paths are still linted and
printed). 2 wins over 1.

What is read: regular files only, opened without blocking and judged on the descriptor (a
`*.py` that is a FIFO, a device or a link to one is a CKW999 "not read" line, never a hang
or an endless read), at most MAX_SOURCE_BYTES of each (a larger file is a CKW999 "not
checked": the parse takes ~60x the file's size in memory), decoded as Python itself would:
the PEP 263 coding line or a UTF-8 BOM, else UTF-8. Paths are printed with their control
characters escaped.

The CLI wires it in with add_arguments(parser) and run(args).
"""
from __future__ import annotations

import io
import json
import os
import stat
import sys
import tokenize

from exporters.logline import clean
from monitor.cli.style import VERBOSE, Painter, positive_float, verbosity
from monitor.cli.textfmt import human_bytes
from monitor.lint import CODES, LintFinding, lint_source
from monitor.lint.checker import UNREADABLE
from monitor.verify.fileio import kind_of

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2

SKIP_DIRS = {"__pycache__", "site-packages", "node_modules"}


def add_arguments(parser) -> None:
    """Add lint's arguments to an argparse (sub)parser."""
    parser.description = (
        "Find checkpoint writes (torch.save, save_pretrained, safetensors, np.save, "
        "pickle/json dumps, accelerate) that more than one rank can run, and collective saves "
        "run under a rank guard. Codes: " + "; ".join(f"{c} {m}" for c, m in CODES.items())
        + ". Suppress one line with `# ckptwatch: ignore[CODE]`. Exit 1 on findings.")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="Python files or directories (searched recursively for *.py)")
    parser.add_argument("--format", choices=("table", "json", "text"), default="table",
                        help="output format (default table: path:line:col: CODE message; "
                             "text is the same as table)")
    parser.add_argument("--max-file-size", type=_mib, default=MAX_SOURCE_BYTES, metavar="MiB",
                        help="skip (as a CKW999 line) Python files larger than this "
                             f"(default {MAX_SOURCE_BYTES >> 20}; parsing takes 100-400x a "
                             "file's size in memory)")
    parser.add_argument("--assume-distributed", action="store_true",
                        help="lint every module, also those that show no sign of running as "
                             "several processes (helper modules imported by a training script)")


def find_sources(paths, errors=None):
    """(files, missing): Python files under paths in a stable order, and paths that do not
    exist. Directories that cannot be listed are appended to `errors` as (path, OSError)."""
    files, missing, seen = [], [], set()

    def onerror(err):
        if errors is not None:
            errors.append((err.filename, err))

    def add(path):
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            files.append(path)

    for top in paths:
        if not os.path.lexists(top):
            missing.append(top)
        elif os.path.isdir(top):
            for root, dirs, names in os.walk(top, onerror=onerror):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
                for name in sorted(names):
                    if name.endswith(".py"):
                        add(os.path.join(root, name))
        else:
            add(top)
    return files, missing


# The largest file read by default (--max-file-size). Python's own parse takes 100-400 bytes
# of memory per byte of source (1 MiB of short statements: ~420 MiB), and the old unbounded
# read parsed a 200 MB file into 12 GB; the largest hand-written modules are well below this.
MAX_SOURCE_BYTES = 2 << 20


class _NotChecked(Exception):
    """A file that is not read or not parsed: the message says why (a CKW999 line)."""


def read_source(path: str, limit: int = MAX_SOURCE_BYTES) -> str:
    """The text of a Python file as Python would decode it. Raises _NotChecked (a FIFO, a
    device, too large, an undecodable file) or OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotChecked(f"not read: {kind_of(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise _NotChecked(f"not checked: {human_bytes(st.st_size)}, larger than the "
                              f"{human_bytes(limit)} lint reads")
        os.set_blocking(fd, True)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:                       # grew while read: still bounded
        raise _NotChecked(f"not checked: larger than the {human_bytes(limit)} lint reads")
    try:
        # PEP 263: a coding line in the first two lines, or a UTF-8 BOM; else UTF-8.
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError) as err:
        raise _NotChecked(f"cannot read: {err}") from None


def _mib(text: str) -> int:
    """--max-file-size: a finite number of MiB > 0, as bytes."""
    return int(positive_float(text) * (1 << 20))


def lint_file(path: str, assume_distributed: bool = False,
              max_bytes: int = MAX_SOURCE_BYTES) -> list[LintFinding]:
    try:
        source = read_source(path, max_bytes)
    except _NotChecked as why:
        return [LintFinding(path, 1, 1, UNREADABLE, str(why))]
    except OSError as err:
        return [LintFinding(path, 1, 1, UNREADABLE,
                            f"cannot read: {err.strerror or err}")]
    return lint_source(source, path, assume_distributed=assume_distributed)


def lint_paths(paths, assume_distributed: bool = False, max_bytes: int = MAX_SOURCE_BYTES,
               errors=None, files_read=None):
    """(findings, missing paths) for every Python file under paths. Directories that cannot
    be listed go to `errors` (path, OSError); the files linted to `files_read`."""
    files, missing = find_sources(paths, errors)
    if files_read is not None:
        files_read.extend(files)
    findings = []
    for path in files:
        findings.extend(lint_file(path, assume_distributed, max_bytes))
    return findings, missing


def run(args, out=None, err=None) -> int:
    """Run `ckptwatch lint` with parsed args; returns the exit code."""
    out, err = out or sys.stdout, err or sys.stderr
    unlisted, files = [], []
    paint = Painter(out)
    try:
        findings, missing = lint_paths(args.paths, args.assume_distributed,
                                       getattr(args, "max_file_size", MAX_SOURCE_BYTES),
                                       unlisted, files)
        for path in missing:
            err.write(f"ckptwatch lint: {clean(path)}: no such file or directory\n")
        for path, error in unlisted:
            err.write(f"ckptwatch lint: cannot read directory {clean(str(path))}: "
                      f"{error.strerror or error}; its files were not linted (run as a user "
                      "who can read it)\n")
        if not files and not missing and not unlisted:
            err.write(f"ckptwatch lint: no Python files under {clean(' '.join(args.paths))}; "
                      "name .py files or directories holding them\n")
        if verbosity(args) >= VERBOSE:
            err.write(f"ckptwatch lint: read {len(files)} file(s), {len(findings)} "
                      "finding(s)\n")
        if args.format == "json":
            json.dump([f.to_json() for f in findings], out, indent=2)
            out.write("\n")
        else:
            for finding in findings:
                line = clean(str(finding))
                if paint.enabled:
                    line = line.replace(f" {finding.code} ",
                                        f" {paint(finding.code, 'bad')} ", 1)
                out.write(f"{line}\n")
        out.flush()
    except BrokenPipeError:
        # `ckptwatch lint . | head`: the reader left; stop quietly like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    if missing or unlisted or not files:
        return EXIT_USAGE
    return EXIT_FINDINGS if findings else EXIT_OK


def main(argv=None) -> int:
    """`python -m monitor.cli.lint ...`: the same command without the ckptwatch entry point."""
    import argparse
    parser = argparse.ArgumentParser(prog="ckptwatch lint", allow_abbrev=False)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
