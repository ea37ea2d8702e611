"""The `ckptwatch` command: one entry point, one module per subcommand.

A subcommand's module is imported only when that subcommand runs (for its options and its
run()), so `ckptwatch --help`, `--version` and `ckptwatch run` (which only builds an
environment and execs) load none of the others: importing check, report, scan and lint costs
~0.3 s, most of `ckptwatch --help`'s time when they were imported for every command.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys

from ckptwatch.version import __version__
from monitor.cli import style

DESCRIPTION = """\
ckptwatch: catch concurrent torch.save writes to one checkpoint path, and say who did it.

  ckptwatch demo                      see it work: a private agent and a 4-rank CPU job
  ckptwatch agent [flags]             the per-node agent (same as `python agent.py`)
  ckptwatch run -- torchrun ...       run a job with every torch.save instrumented
  ckptwatch check -- CMD ...          CI gate: run CMD watched, exit 1 if its saves are unsafe
  ckptwatch report [--journal PATH]   who wrote what, when, and the fix
  ckptwatch scan PATH... [--deep]     find corrupt checkpoints on disk (exit 1 if any)
  ckptwatch lint PATH...              find checkpoint saves that several ranks can run
  ckptwatch diagnose LOG [--journal]  from a failed resume's traceback to the writes behind it
"""


def agent_main(argv: list[str]) -> int:
    """`ckptwatch agent` and `python agent.py`. The daemon needs the agent's dependencies
    (psutil, watchdog, prometheus-client, ...): without them --version still answers and
    anything else is one line saying what to install, not an ImportError's traceback."""
    try:
        from monitor.agent import daemon
    except ModuleNotFoundError as exc:
        if "--version" in argv:
            print(f"ckptwatch {__version__}")
            return 0
        print(f"ckptwatch agent: the Python package {exc.name!r} is not installed in "
              f"{sys.executable}; install ckptwatch with its dependencies (`pip install .` "
              "in the checkout)", file=sys.stderr)
        return style.EXIT_USAGE
    return daemon.main(argv)


class _Parser(argparse.ArgumentParser):
    """A usage error is one line: what is wrong and where the help is (argparse's default is
    the whole usage and then the message), exit 2. An unknown flag close to a known one names
    it."""

    def error(self, message: str):
        self.exit(style.EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def unknown(self, extras: list[str]):
        message = "unrecognized arguments: " + " ".join(extras)
        flags = [s for s in self._option_string_actions if s.startswith("--")]
        for extra in extras:
            close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1)
            if extra.startswith("--") and close:
                message += f"; did you mean {close[0]}?"
                break
        self.error(message)


class _Subparser(_Parser):
    """Every subcommand: exact flag names only, --version, -q/-v, and its own usage errors
    (argparse hands a subcommand's unknown flags up to `ckptwatch`, whose error showed the
    top-level usage for `ckptwatch report --jurnal x`)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        if kwargs.get("add_help", True):        # not `agent`: it forwards its arguments
            self.add_argument("--version", action="version",
                              version=f"ckptwatch {__version__}")
            style.add_verbosity(self)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.unknown(extras)
        return namespace, extras


def _check_module():
    from monitor.cli import check
    return check


def _report_module():
    from monitor.cli import report
    return report


def _scan_module():
    from monitor.cli import scan
    return scan


def _lint_module():
    from monitor.cli import lint
    return lint


def _diagnose_module():
    from monitor.cli import diagnose
    return diagnose


# Ranks `ckptwatch demo` starts at most: each is a Python process with torch (~300 MB).
MAX_DEMO_RANKS = 16

# The subcommands whose options live in their own module (add_arguments(parser)).
_OPTIONS_FROM = {"check": _check_module, "report": _report_module, "scan": _scan_module,
                 "lint": _lint_module, "diagnose": _diagnose_module}


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv: the first word that is not an option (the top level
    takes no option with a value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(detailed=tuple(_OPTIONS_FROM)) -> argparse.ArgumentParser:
    """The whole command line. detailed: the subcommands whose options are added (importing
    their modules); main() passes only the one it runs, so the others stay unimported."""
    # allow_abbrev=False everywhere: an abbreviated flag (--jour for --journal) must be an
    # error, not a silent guess that breaks when a longer flag is added.
    parser = _Parser(
        prog="ckptwatch", description=DESCRIPTION, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ckptwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=_Subparser)

    # `agent` forwards its arguments untouched: the agent owns its flags and --help.
    sub.add_parser("agent", help="run the per-node agent (see `ckptwatch agent --help`)",
                   add_help=False)

    run = sub.add_parser(
        "run", help="run a command with torch.save instrumented in every Python process",
        description="Run CMD with the ckptwatch hook active in every Python process it starts "
                    "(torchrun workers included). Events go to the agent at --socket, else "
                    "$CKPTWATCH_SOCKET, else the default socket. The job never waits on the "
                    "agent: if none is running, the job runs exactly as without ckptwatch.",
        usage="ckptwatch run [--socket PATH] -- CMD [ARGS...]")
    run.add_argument("--socket", metavar="PATH", help="agent socket (default: $CKPTWATCH_SOCKET "
                     "or the agent's default socket)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to run, after --")

    check = sub.add_parser(
        "check", help="CI gate: run a command under a private agent, report, exit 1 on any "
        "collision, hazard or corrupt checkpoint (else the command's status)",
        description="Run CMD with every torch.save instrumented and watched by a private "
                    "agent; when CMD has exited and the agent has judged everything, print "
                    "the report and exit 1 if any collision, hazard or corrupt checkpoint "
                    "was seen, otherwise with CMD's own exit status.",
        usage="ckptwatch check [options] -- CMD [ARGS...]",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    report = sub.add_parser("report", help="show what the agent's journal holds: collisions "
                            "(who wrote what, when, the fix), hazards, verification verdicts, "
                            "size fluctuations, torn reads (exit 1 if it shows a collision, a "
                            "hazard or a corrupt or incomplete checkpoint)")
    scan = sub.add_parser("scan", help="verify checkpoint files on disk: ok, corrupt or "
                          "unverifiable, with the reason (exit 1 if any is corrupt)")
    lint = sub.add_parser("lint", help="find checkpoint writes that more than one rank can "
                          "run, in Python sources (exit 1 if any)")
    diagnose = sub.add_parser(
        "diagnose", help="read a failed resume's traceback: the failure, the file, who wrote "
        "it and the fix (exit 1 if a write collision is behind it)",
        description="Read a training log or traceback (a file, or - for standard input): name "
                    "the checkpoint load failure (torch.load, safetensors, zip, pickle, "
                    "staging-directory and permission errors), the file it names and, from the "
                    "agent's journals, who wrote that file, which rank started first and "
                    "finished last, what the agent found in it and the fix. Offline: reads the "
                    "log and the journals only. Exit 1 when a write collision on that file is "
                    "on record, 0 otherwise, 2 on a usage error or unreadable input.")
    for name, subparser in (("check", check), ("report", report), ("scan", scan),
                            ("lint", lint), ("diagnose", diagnose)):
        if name in detailed:
            module = _OPTIONS_FROM[name]()
            if name == "check":
                subparser.epilog = module.EPILOG
            module.add_arguments(subparser)

    demo = sub.add_parser("demo", help="start a private agent, run a colliding 4-rank CPU job "
                          "and its fixed version, print what ckptwatch saw")
    demo.add_argument("--nproc", type=style.int_range(2, MAX_DEMO_RANKS), default=4,
                      help=f"ranks in the demo job, 2 to {MAX_DEMO_RANKS} (default 4; one "
                      "rank cannot collide with itself, and each rank is a Python process "
                      "with torch loaded)")
    demo.add_argument("--keep", action="store_true",
                      help="keep the demo's working directory (journal, checkpoints)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user's mistake (style.UsageError) is one line and exit 2; Ctrl-C is
    one line and exit 130; a reader that leaves (`| head`) ends the output quietly."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "agent":
        return agent_main(argv[1:])
    command = _command(argv)
    prog = f"ckptwatch {command}" if command in _COMMANDS else "ckptwatch"
    try:
        return _run(argv, command)
    except style.UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return style.EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return style.EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader left: stop quietly like other Unix tools (no second error at exit).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:      # a bug, not the user's mistake: one line, -v shows it all
        if "-v" in argv or "--verbose" in argv:
            raise
        detail = str(exc).splitlines()[0][:200] if str(exc) else ""
        print(f"{prog}: internal error: {type(exc).__name__}"
              + (f": {detail}" if detail else "")
              + f" (a bug in ckptwatch; run it again with -v for the traceback)",
              file=sys.stderr)
        return style.EXIT_INTERNAL


_COMMANDS = ("run", "check", "report", "scan", "lint", "diagnose", "demo")


def _run(argv: list[str], command: str | None) -> int:
    parser = build_parser(detailed=[command] if command in _OPTIONS_FROM else [])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return style.EXIT_USAGE
    if args.command == "run":
        from monitor.cli import run as runner
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return runner.run(cmd, socket=args.socket, verbosity=style.verbosity(args))
    if args.command in _OPTIONS_FROM:
        return _OPTIONS_FROM[args.command]().run(args)
    if args.command == "demo":
        from monitor.cli import demo
        return demo.run(nproc=args.nproc, keep=args.keep, verbosity=style.verbosity(args))
    parser.error(f"unknown command {args.command}")
    return style.EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
