"""`ckptwatch scan PATH... [--deep] [--format table|json] [--include GLOB...]`

Verifies every checkpoint under the given paths with monitor/verify/integrity.py and prints one line
per file (status, format, size, path; the reason below it), then one line per checkpoint set
found in the directories walked (a torch.distributed.checkpoint directory, a Hugging Face
sharded checkpoint: monitor/verify/sets.py), then a summary. Readable in 80 columns; a progress
bar goes to stderr, only when stderr is a terminal.

Exit codes: 0 nothing corrupt; 1 at least one corrupt file or set; 2 a usage error or an
incomplete scan, which must not pass as clean: a PATH that does not exist, no checkpoint
file found at all, a file named on the command line that could not be verified (unreadable,
a symbolic link loop, a device or FIFO, not in a checkpoint format scan knows), or a file or
directory in a walked tree that could not be read (permission denied, an I/O error). Each is one line on stderr saying what to do;
the other paths are still scanned and reported. In a walked tree, what scan does not read by
design (a FIFO, a device, a link out of the tree) or cannot judge (a file matching --include
in no known format) is listed as "unverifiable" and leaves the exit code alone. 2 wins over 1.

What scan reads (it is often run as root over shared storage others can write): only regular
files, opened without blocking and checked on the open descriptor (a FIFO, a device or a
socket, even one swapped in after the directory was listed, is "unverifiable: not read");
in the directories it walks, never a symbolic link that leads out of the tree given on the
command line (an in-tree link is verified as its target, once), and every file it opens is
the one the walk saw (same device and inode). A PATH named on the command line is the user's
own choice and is followed. No verdict quotes a file's bytes, and names are printed with
their control characters escaped.

What the agent found when the file was written (the verdict it stored with the file,
ckptwatch/verdicts.py, when it is about this very version of the file): its verdict (often
from a deeper check than scan's structural one), the collision that wrote it, its writers
and the last checkpoint of the directory verified ok are told in one more line under the
file's ("agent: ..."), in the words the resume guard prints when the file is loaded and
`ckptwatch report` uses (ckptwatch.verdicts.describe). The status column is scan's own check.

"ok" means the file is structurally whole (see docs/integrity.md); it says nothing about
whether loading it is safe. A torch pickle that names callables outside what
torch.load(weights_only=True) accepts is listed with a line saying so (details["pickle"]).

The CLI wires it in with add_arguments(parser) and run(args).
"""
from __future__ import annotations

import errno
import fnmatch
import json
import os
import stat
import sys
import textwrap
import time
from dataclasses import dataclass

from ckptwatch import verdicts as file_verdicts
from monitor.verify import crc
from monitor.verify import integrity
from monitor.verify import sets as checkpoint_sets
from monitor.cli.style import NORMAL, VERBOSE, Painter, positive_float, verbosity
from monitor.cli.textfmt import human_bytes
from monitor.verify.fileio import kind_of
from exporters.logline import clean
from monitor.fs.options import CHECKPOINT_PATTERNS as DEFAULT_PATTERNS

EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_USAGE = 2

WIDTH = 80


@dataclass
class Result:
    """One scanned file, or one checkpoint set (is_set: path is its directory): where, how
    big, and the verdict."""

    path: str
    size: int | None
    verdict: integrity.Verdict
    seconds: float = 0.0
    is_set: bool = False
    named: bool = False         # named on the command line (not found in a walk)
    story: str = ""               # the agent's record of the file, told as the guard tells it

    @property
    def unread(self) -> str:
        """Why this result leaves the scan incomplete (exit 2), or "": a file named on the
        command line that was not verified, or anything whose read failed with an OS error
        (a file gone since the walk, ENOENT, is not: there is nothing left to verify)."""
        v = self.verdict
        if v.status != integrity.UNVERIFIABLE or self.is_set:
            return ""
        code = v.details.get("errno") if isinstance(v.details, dict) else None
        if code == errno.EACCES or code == errno.EPERM:
            return "run scan as a user who can read it"
        if code == errno.ELOOP and self.named:
            return "a symbolic link loop: name the file it should lead to"
        if code is not None and code != errno.ENOENT:
            return "the scan could not read it"
        if self.named:
            return ("name a checkpoint file (torch.save, safetensors) or a directory "
                    "holding checkpoints")
        return ""

    def to_json(self) -> dict:
        v = self.verdict
        out = {"path": self.path, "size": self.size, "status": v.status, "format": v.format,
               "reason": v.reason, "details": v.details, "seconds": round(self.seconds, 6)}
        if self.story:
            out["story"] = self.story
        if self.is_set:
            out["cause"] = v.details.get("cause", "")
        return out


def add_arguments(parser) -> None:
    """Add scan's arguments to an argparse (sub)parser."""
    parser.description = ("Verify checkpoint files on disk: structure (zip directory, headers, "
                          "tensor sizes vs the pickled metadata) and, with --deep, every "
                          "record's CRC32. Exit 1 if anything is corrupt. \"ok\" means whole, "
                          "not safe to load: a torch pickle naming callables that "
                          "torch.load(weights_only=True) refuses (os.system, ...) is listed "
                          "with a line saying so. Only regular files are read; symbolic links "
                          "out of a scanned directory are not followed.")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="files or directories (searched recursively)")
    parser.add_argument("--deep", action="store_true",
                        help="also check every record's CRC32 (reads every byte)")
    parser.add_argument("--format", choices=("table", "json"), default="table",
                        help="output format (default table)")
    parser.add_argument("--include", action="append", metavar="GLOB", default=None,
                        help="file name pattern to verify in directories, repeatable "
                             f"(default: {' '.join(DEFAULT_PATTERNS)}); files named on the "
                             "command line are always verified")
    parser.add_argument("--max-rate", type=positive_float, metavar="MiB/s", default=None,
                        help="cap the --deep read rate, a number > 0 (default: no cap)")


@dataclass(frozen=True)
class Target:
    """A file to verify: `path` as shown, `source` as opened (an in-tree link's target),
    `identity` the (st_dev, st_ino) the walk saw there, `follow` whether a symbolic link may be
    followed (a PATH named on the command line), `skip` why it is not opened at all."""

    path: str
    source: str
    identity: tuple | None = None
    follow: bool = False
    skip: str = ""


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip(os.sep) + os.sep)


def find_files(paths, patterns=DEFAULT_PATTERNS, errors=None, found_sets=None):
    """(targets, missing): checkpoint files under paths as Targets, in a stable order, and the
    paths that do not exist. Unreadable directories are appended to `errors` as (path,
    OSError); checkpoint sets in the directories walked to `found_sets`
    (monitor.verify.sets.CheckpointSet). See the module doc for what is followed."""
    targets, missing, seen = [], [], set()

    def add(target):
        key = target.identity or _identity(target.source) or os.path.realpath(target.source)
        if target.skip or key not in seen:
            seen.add(key)
            targets.append(target)

    def onerror(err):
        if errors is not None:
            errors.append((err.filename, err))

    for top in paths:
        if not os.path.lexists(top):
            missing.append(top)
        elif os.path.isdir(top):
            tree = os.path.realpath(top)
            for root, dirs, names in os.walk(top, onerror=onerror):
                dirs.sort()
                if found_sets is not None:
                    found_sets.extend(checkpoint_sets.find_sets(root, names))
                for name in sorted(names):
                    if any(fnmatch.fnmatch(name, p) for p in patterns):
                        add(_walked(os.path.join(root, name), tree))
        else:
            add(Target(top, top, follow=True))
    return targets, missing


def _identity(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _walked(path: str, tree: str) -> Target:
    """The Target for a name found in a walk of `tree` (its real path)."""
    path_to_open = path
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            path_to_open = os.path.realpath(path)
            if not _inside(path_to_open, tree):
                return Target(path, path, skip="not read: a symbolic link out of the scanned "
                                               "tree, not followed")
            st = os.stat(path_to_open)
    except OSError:
        return Target(path, path_to_open)   # gone, or a dangling link: verify() says why
    if not stat.S_ISREG(st.st_mode):
        return Target(path, path, skip=f"not read: {kind_of(st.st_mode)}, not a regular file")
    return Target(path, path_to_open, (st.st_dev, st.st_ino))


def scan(paths, deep=False, patterns=DEFAULT_PATTERNS, max_bytes_per_second=None,
         on_result=None, progress=None):
    """Verify every checkpoint under paths. Returns (results, missing paths).

    on_result(Result) is called as each file finishes; progress(done_files, total_files,
    done_bytes, total_bytes) before each file and at the end. Checkpoint sets found in the
    directories walked come after the files, as Results with is_set (their members are
    verified once: a file verdict already made is reused).
    """
    errors, found_sets = [], []
    files, missing = find_files(paths, patterns, errors, found_sets)
    sizes = []
    for target in files:
        try:
            sizes.append(None if target.skip else os.stat(target.source).st_size)
        except OSError:
            sizes.append(None)
    total_bytes = sum(s or 0 for s in sizes)
    results, done_bytes = [], 0
    verdicts = {}
    for (path, err) in errors:
        result = Result(path, None, integrity.Verdict(
            integrity.UNVERIFIABLE, integrity.FMT_UNKNOWN,
            f"cannot read directory: {err.strerror or err}", {"errno": err.errno}))
        results.append(result)
        if on_result:
            on_result(result)
    for i, (target, size) in enumerate(zip(files, sizes)):
        if progress:
            progress(i, len(files), done_bytes, total_bytes)
        started = time.monotonic()
        if target.skip:
            verdict = integrity.Verdict(integrity.UNVERIFIABLE, integrity.FMT_UNKNOWN,
                                        target.skip)
        else:
            verdict = integrity.verify(target.source, deep=deep,
                                       max_bytes_per_second=max_bytes_per_second,
                                       name=target.path, follow_symlinks=target.follow,
                                       identity=target.identity)
        result = Result(target.path, size, verdict, time.monotonic() - started,
                        named=target.follow, story=_story(target, verdict))
        results.append(result)
        verdicts[os.path.realpath(target.path)] = verdict
        done_bytes += size or 0
        if on_result:
            on_result(result)

    def verify_member(path):
        key = os.path.realpath(path)
        if key not in verdicts:
            verdicts[key] = integrity.verify(path, deep=deep,
                                             max_bytes_per_second=max_bytes_per_second,
                                             follow_symlinks=False)
        return verdicts[key]

    for s in found_sets:
        started = time.monotonic()
        # A set's members are plain names in its directory; a member that is a symbolic link
        # is not followed (it could lead anywhere).
        verdict = checkpoint_sets.verify_set(s, verify_file=verify_member,
                                             follow_symlinks=False)
        result = Result(s.directory, verdict.details.get("bytes"), verdict,
                        time.monotonic() - started, is_set=True)
        results.append(result)
        if on_result:
            on_result(result)
    if progress:
        progress(len(files), len(files), done_bytes, total_bytes)
    return results, missing


def _story(target: Target, verdict: integrity.Verdict) -> str:
    """The agent's stored verdict on the file, if it is about this version of it, joined with
    scan's own finding and told in the guard's words; "" without one."""
    if target.skip:
        return ""
    try:
        st = os.stat(target.source, follow_symlinks=target.follow)
        data = os.getxattr(target.source, file_verdicts.XATTR, follow_symlinks=target.follow)
    except OSError:
        return ""
    stored = file_verdicts.decode(data)
    if stored is None or not file_verdicts.same_file(stored, st):
        return ""
    if verdict.status == integrity.CORRUPT and stored.state != integrity.CORRUPT:
        # Damaged since the agent judged it (or scan looked deeper): scan's finding wins.
        stored = file_verdicts.FileVerdict(
            integrity.CORRUPT, verdict.details.get("cause")
            or integrity.corrupt_cause(verdict.reason), verdict.reason, stored.collision,
            stored.writers, stored.last_ok, stored.identity)
    if not stored.collision and not stored.refused:
        return ""                 # nothing the status line does not say
    return file_verdicts.describe(target.path, stored)


def exit_code(results, missing) -> int:
    if missing or not results or any(r.unread for r in results):
        return EXIT_USAGE
    if any(r.verdict.status == integrity.CORRUPT for r in results):
        return EXIT_CORRUPT
    return EXIT_OK


def run(args, out=None, err=None) -> int:
    """Run `ckptwatch scan` with parsed args; returns the exit code."""
    try:
        return _run(args, out or sys.stdout, err or sys.stderr)
    except BrokenPipeError:
        # `ckptwatch scan DIR | head`: the reader left; stop quietly like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _run(args, out, err) -> int:
    patterns = tuple(args.include) if args.include else DEFAULT_PATTERNS
    rate = args.max_rate * (1 << 20) if getattr(args, "max_rate", None) else None
    level = verbosity(args)
    table = args.format == "table"
    bar = ProgressBar(err) if table and level >= NORMAL and _isatty(err) else None
    paint = Painter(out)
    started = time.monotonic()

    def show(result):
        if not table or (level < NORMAL and result.verdict.status == integrity.OK):
            return
        if bar:
            bar.clear()
        out.write(format_line(result, paint))
        out.flush()

    results, missing = scan(args.paths, deep=args.deep, patterns=patterns,
                            max_bytes_per_second=rate, on_result=show,
                            progress=bar.update if bar else None)
    if bar:
        bar.clear()
    elapsed = time.monotonic() - started
    for path in missing:
        err.write(f"ckptwatch scan: {clean(path)}: no such file or directory\n")
    for r in results:
        if r.unread:
            err.write(f"ckptwatch scan: {clean(r.path)}: {clean(r.verdict.reason)}; "
                      f"{r.unread}\n")
    if not results and not missing:
        err.write(f"ckptwatch scan: no checkpoint files under {clean(' '.join(args.paths))} "
                  f"(patterns: {' '.join(patterns)}); name the files, or add --include GLOB\n")
    if level >= VERBOSE:
        s = summary(results, elapsed, args.deep)
        err.write(f"ckptwatch scan: read {s['files']} file(s), {human_bytes(s['bytes'])}, "
                  f"in {elapsed:.2f}s (patterns: {' '.join(patterns)})\n")
    if args.format == "json":
        json.dump({"files": [r.to_json() for r in results if not r.is_set],
                   "sets": [r.to_json() for r in results if r.is_set],
                   "summary": summary(results, elapsed, args.deep),
                   "missing": missing, "unread": [r.path for r in results if r.unread],
                   "exit_code": exit_code(results, missing)},
                  out, indent=2)
        out.write("\n")
    elif level >= NORMAL:
        out.write(summary_line(results, elapsed, args.deep, missing))
    return exit_code(results, missing)


# ---------------------------------------------------------------------------- formatting



STATUS_COLOUR = {integrity.OK: "good", integrity.CORRUPT: "bad", integrity.UNVERIFIABLE: "warn"}


def format_line(result: Result, paint=None) -> str:
    """`corrupt       torch-zip      32.1MiB  path` and the reason wrapped below, in 80 cols;
    paint (style.Painter) colours the status."""
    v = result.verdict
    path = clean(result.path) + ("/ (set)" if result.is_set else "")
    status = f"{v.status:<12}"
    if paint is not None:
        status = paint(v.status, STATUS_COLOUR.get(v.status, "")) + status[len(v.status):]
    line = f"{status} {v.format:<12} {human_bytes(result.size):>9}  {path}\n"
    if v.reason:
        line += textwrap.fill(clean(v.reason), WIDTH, initial_indent="    ",
                              subsequent_indent="    ", break_on_hyphens=False) + "\n"
    if result.story:
        line += textwrap.fill("agent: " + result.story, WIDTH, initial_indent="    ",
                              subsequent_indent="    ", break_on_hyphens=False,
                              break_long_words=True) + "\n"
    return line


def summary(results, elapsed: float, deep: bool) -> dict:
    """Counts of files by status; sets are counted apart (`sets`, `sets_<status>`)."""
    counts = {integrity.OK: 0, integrity.CORRUPT: 0, integrity.UNVERIFIABLE: 0}
    set_counts = {f"sets_{s}": 0 for s in counts}
    files = [r for r in results if not r.is_set]
    for r in files:
        counts[r.verdict.status] = counts.get(r.verdict.status, 0) + 1
    for r in results:
        if r.is_set:
            set_counts[f"sets_{r.verdict.status}"] += 1
    out = {"files": len(files), "bytes": sum(r.size or 0 for r in files),
           "seconds": round(elapsed, 3), "deep": deep, **counts,
           "sets": len(results) - len(files), **set_counts}
    if deep:
        out["crc32"] = crc.BACKEND          # explains a slow deep scan (stdlib zlib)
    return out


def summary_line(results, elapsed: float, deep: bool, missing=()) -> str:
    s = summary(results, elapsed, deep)
    line = (f"{s['files']} files, {human_bytes(s['bytes'])} in {elapsed:.1f}s "
            f"({'deep' if deep else 'structural'}): {s['ok']} ok, {s['corrupt']} corrupt, "
            f"{s['unverifiable']} unverifiable")
    if s["sets"]:
        line += (f"; {s['sets']} checkpoint set{'s' if s['sets'] > 1 else ''}: "
                 f"{s['sets_ok']} ok, {s['sets_corrupt']} corrupt, "
                 f"{s['sets_unverifiable']} unverifiable")
    if missing:
        line += f"; {len(missing)} path(s) not found"
    return textwrap.fill(line, WIDTH) + "\n"


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class ProgressBar:
    """One self-erasing line on a terminal: files and bytes done. Drawn at most 10 times a
    second, and only once a scan has run for half a second (short scans stay quiet)."""

    def __init__(self, stream, clock=None, delay: float = 0.5):
        self.stream, self.clock = stream, clock or time.monotonic
        self.start = self.clock()
        self.delay = delay
        self.last = 0.0
        self.shown = False

    def update(self, done, total, done_bytes, total_bytes) -> None:
        now = self.clock()
        if now - self.start < self.delay or now - self.last < 0.1:
            return
        self.last = now
        frac = done_bytes / total_bytes if total_bytes else (done / total if total else 1)
        width = 30
        filled = int(frac * width)
        text = (f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} files "
                f"{human_bytes(done_bytes)}/{human_bytes(total_bytes)}")
        self.stream.write(text[:WIDTH])
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def main(argv=None) -> int:
    """`python -m monitor.cli.scan ...`: the same command without the ckptwatch entry point."""
    import argparse
    parser = argparse.ArgumentParser(prog="ckptwatch scan", allow_abbrev=False)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
