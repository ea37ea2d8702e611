"""How every `ckptwatch` command talks to a person: colour, verbosity and usage errors.

One definition for all subcommands, so `-q`, `-v`, colour and a mistake's message mean the
same everywhere:

- Colour only on a terminal (the stream's isatty()), never when NO_COLOR is set to anything
  but the empty string (https://no-color.org). Colour is applied last, to a finished line or
  token, so widths computed for 80 columns stay right.
- Verbosity: QUIET (-q) prints only what is wrong (findings, failures, errors); NORMAL adds
  the progress, notes and summary lines; VERBOSE (-v) also says what was read, on stderr.
  Exit codes never depend on it.
- A user's mistake (a missing, unreadable or non-matching input, a bad number) is a
  UsageError: main() prints it as one line, `ckptwatch <command>: <what is wrong>; <what to
  do>`, and exits 2. Never a traceback.
"""
from __future__ import annotations

import argparse
import math
import os

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130          # 128 + SIGINT, as a shell reports a Ctrl-C'd command
EXIT_INTERNAL = 70              # EX_SOFTWARE (sysexits.h): a bug, not 1 (findings) or 2

QUIET, NORMAL, VERBOSE = 0, 1, 2

_CODES = {"bad": "31;1", "warn": "33", "good": "32", "bold": "1", "dim": "2"}


class UsageError(Exception):
    """A user's mistake: one line for stderr, exit 2 (main() prints it after the command)."""


def verbosity(args) -> int:
    """The verbosity -q/-v asked for (the last given wins; NORMAL when neither)."""
    return getattr(args, "verbosity", NORMAL)


def color_enabled(stream, environ=None) -> bool:
    """Colour for this stream: a terminal, and NO_COLOR unset or empty."""
    environ = os.environ if environ is None else environ
    if environ.get("NO_COLOR", ""):
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):    # no isatty, or a closed stream
        return False


class Painter:
    """paint(text, role) with colour on this stream when color_enabled(), else text as is.
    Roles: bad (red), warn (yellow), good (green), bold, dim."""

    def __init__(self, stream, environ=None):
        self.enabled = color_enabled(stream, environ)

    def __call__(self, text: str, role: str) -> str:
        code = _CODES.get(role)
        if not self.enabled or not code or not text:
            return text
        return f"\033[{code}m{text}\033[0m"


# ---------------------------------------------------------------------------- argparse

def add_verbosity(parser: argparse.ArgumentParser) -> None:
    """-q/--quiet and -v/--verbose, the same on every command."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=QUIET,
                       default=NORMAL, help="print only what is wrong (findings, failures, "
                       "errors); the exit code is the same")
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const",
                       const=VERBOSE, help="also say what was read (on stderr)")


def _number(kind, text: str, minimum, maximum, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if (isinstance(value, float) and not math.isfinite(value)) or value < minimum \
            or (maximum is not None and value > maximum):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def int_range(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum]."""
    what = (f"a whole number from {minimum} to {maximum}" if maximum is not None
            else f"a whole number >= {minimum}")

    def convert(text: str) -> int:
        return _number(int, text, minimum, maximum, what)
    return convert


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _number(float, text, 0.0, None, "a number > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return _number(float, text, 0.0, None, "a number >= 0")
