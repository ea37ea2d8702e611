"""`ckptwatch lint PATH... [--format text|json] [--assume-distributed]`

Finds checkpoint writes that more than one rank can reach (monitor/lint/) in Python files and
prints them the way ruff and flake8 do, `path:line:col: CODE message`, or as a JSON list of
{path, line, col, code, message}. Directories are searched recursively for *.py (hidden
directories, __pycache__, site-packages and node_modules skipped); files named on the command
line are always read.

Exit codes: 0 clean; 1 at least one finding (a file that cannot be parsed or read is a CKW999
finding: it was not checked, so it must not pass as clean); 2 a usage error, such as a PATH
that does not exist (reported on stderr; the other paths are still linted and printed).

The CLI wires it in with add_arguments(parser) and run(args).
"""
from __future__ import annotations

import json
import os
import sys

from monitor.lint import CODES, LintFinding, lint_source
from monitor.lint.checker import UNREADABLE

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
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="output format (default text: path:line:col: CODE message)")
    parser.add_argument("--assume-distributed", action="store_true",
                        help="lint every module, also those that show no sign of running as "
                             "several processes (helper modules imported by a training script)")


def find_sources(paths):
    """(files, missing): Python files under paths in a stable order, and paths that do not
    exist."""
    files, missing, seen = [], [], set()

    def add(path):
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            files.append(path)

    for top in paths:
        if not os.path.lexists(top):
            missing.append(top)
        elif os.path.isdir(top):
            for root, dirs, names in os.walk(top):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
                for name in sorted(names):
                    if name.endswith(".py"):
                        add(os.path.join(root, name))
        else:
            add(top)
    return files, missing


def lint_file(path: str, assume_distributed: bool = False) -> list[LintFinding]:
    try:
        with open(path, "rb") as f:
            data = f.read()
        source = data.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        return [LintFinding(path, 1, 1, UNREADABLE, f"cannot read: {reason}")]
    return lint_source(source, path, assume_distributed=assume_distributed)


def lint_paths(paths, assume_distributed: bool = False):
    """(findings, missing paths) for every Python file under paths."""
    files, missing = find_sources(paths)
    findings = []
    for path in files:
        findings.extend(lint_file(path, assume_distributed))
    return findings, missing


def run(args, out=None, err=None) -> int:
    """Run `ckptwatch lint` with parsed args; returns the exit code."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        findings, missing = lint_paths(args.paths, args.assume_distributed)
        for path in missing:
            err.write(f"ckptwatch lint: {path}: no such file or directory\n")
        if args.format == "json":
            json.dump([f.to_json() for f in findings], out, indent=2)
            out.write("\n")
        else:
            for finding in findings:
                out.write(f"{finding}\n")
        out.flush()
    except BrokenPipeError:
        # `ckptwatch lint . | head`: the reader left; stop quietly like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    if missing:
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
