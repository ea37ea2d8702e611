"""`ckptwatch check [options] -- CMD [ARGS...]`: a CI gate for checkpointing.

It starts a private agent (monitor.cli.launcher: its own socket, port and journal; watching the
--watch.path directories), runs CMD with the hook in every Python process it starts (the
`ckptwatch run` environment pointed at that socket), streams CMD's output through untouched,
waits until the agent has judged everything CMD did, stops the agent (SIGTERM: pending
collisions are finalised and the journal flushed) and reports. Exit status: 1 if any collision
(concurrent or redundant), hazard or corrupt checkpoint was seen, or if the agent could not
judge everything; otherwise CMD's own (128 + N when a signal N killed it); 2 on usage errors.

Signals: SIGINT, SIGTERM and SIGHUP sent to check go to CMD. Without a terminal (CI), CMD runs
in a process group of its own and the whole group gets the signal, as a Ctrl-C would. At a
terminal CMD stays in the foreground group: a Ctrl-C reaches it from the terminal already, so
only SIGTERM and SIGHUP are passed on. The agent is stopped whatever happens, and dies with
check even when check is SIGKILLed (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from exporters.journal import read_records
from monitor.cli import report
from monitor.cli.journalview import summarize
from monitor.cli.style import (NORMAL, VERBOSE, Painter, non_negative_float, verbosity)
from monitor.cli.textfmt import keep_head, keep_tail, wrapped
from monitor.cli.run import build_env
from monitor.cli.launcher import AgentProcess

EXIT_UNSAFE = 1
EXIT_USAGE = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

MAX_LISTED = 1000            # of each kind in the report; the counts stay exact
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

USAGE = "ckptwatch check [options] -- CMD [ARGS...]"
EPILOG = """\
example (a CI step: two steps on two CPU ranks, the build fails if checkpointing is unsafe):

  ckptwatch check --watch.path out/ -- \\
      torchrun --standalone --nproc-per-node 2 train.py --steps 2 --out out/

exit status: 1 if a collision, hazard or corrupt checkpoint was seen (or the agent could not
judge everything CMD did within --timeout); otherwise CMD's own status (128+N if signal N
killed it); 2 on usage errors; 126/127 if CMD cannot be run or is not found.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `ckptwatch check` options to an argparse parser."""
    parser.add_argument("--watch.path", dest="watch_paths", metavar="DIR", action="append",
                        default=[], help="also watch this directory for checkpoint writes by "
                        "any process, and verify what lands there (repeatable)")
    parser.add_argument("--watch.patterns", dest="watch_patterns", metavar="GLOBS",
                        help="file name patterns that count as checkpoints, comma-separated "
                        "(the agent's default: *.pt, *.pth, *.ckpt, *.safetensors, ...)")
    parser.add_argument("--collision.settle", dest="settle", type=non_negative_float,
                        default=0.5, metavar="SECONDS", help="agent flag: quiet time "
                        "before a collision is final (default 0.5 here: a CI job's saves are "
                        "short)")
    parser.add_argument("--collision.window", dest="window", type=non_negative_float,
                        default=None, metavar="SECONDS", help="agent flag: sequential "
                        "writes of one path by one job run within this count as redundant "
                        "(agent default 60)")
    parser.add_argument("--verify.quiet", dest="verify_quiet", type=non_negative_float,
                        default=0.5, metavar="SECONDS", help="agent flag: quiet time "
                        "before a finished checkpoint is verified (default 0.5 here)")
    parser.add_argument("--agent.flag", dest="agent_flags", action="append", default=[],
                        metavar="FLAG", help="any other agent flag, passed as is, e.g. "
                        "--agent.flag=--watch.mode=polling (repeatable)")
    parser.add_argument("--format", choices=("table", "json"), default="table",
                        help="table: the report on standard error, after CMD's output; "
                        "json: one JSON document on standard output (or --output)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="write the report to FILE instead")
    parser.add_argument("--journal", metavar="PATH", default=None,
                        help="write the agent's journal here and keep it (a new file: the "
                        "records of an old one would count)")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="keep the agent's journal (unless --journal) and log in DIR")
    parser.add_argument("--timeout", type=non_negative_float, default=120.0, metavar="SECONDS",
                        help="how long, after CMD exits, to wait for the agent to judge "
                        "everything (default 120); if it passes, the check fails")
    parser.add_argument("--idle", type=non_negative_float, default=1.0, metavar="SECONDS",
                        help="how long the agent must hold nothing (no hook connected, no "
                        "write in flight, no verification to come) before its verdict is "
                        "taken (default 1.0: covers the file watcher's delivery delay)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to run, after --")


# ---------------------------------------------------------------------------- the verdict

@dataclass
class Findings:
    """What the journal of one check holds (lists capped at MAX_LISTED, counts exact)."""

    collisions: list = field(default_factory=list)      # Collision
    hazards: list = field(default_factory=list)         # journal records
    corrupt: list = field(default_factory=list)         # verification records
    counts: dict = field(default_factory=lambda: {"collisions": 0, "hazards": 0,
                                                  "corrupt": 0, "writes": 0,
                                                  "unverifiable": 0, "malformed": 0})

    @property
    def unsafe(self) -> bool:
        return any(self.counts[k] for k in ("collisions", "hazards", "corrupt"))


def read_findings(journal: str) -> Findings:
    """Collisions (as `ckptwatch report` rebuilds them), hazard records of any kind, corrupt
    verdicts. A journal that does not exist holds nothing."""
    found = Findings()
    if not os.path.exists(journal):
        return found
    summary = summarize(journal, details=False)
    found.collisions = summary.collisions[:MAX_LISTED]
    found.counts.update(collisions=len(summary.collisions), writes=summary.writes,
                        malformed=summary.malformed)
    for record in read_records(journal):
        kind = record.get("type")
        if kind == "hazard":
            found.counts["hazards"] += 1
            if len(found.hazards) < MAX_LISTED:
                found.hazards.append(record)
        elif kind == "verification":
            result = record.get("result")
            if result == "corrupt":
                found.counts["corrupt"] += 1
                if len(found.corrupt) < MAX_LISTED:
                    found.corrupt.append(record)
            elif result == "unverifiable":
                found.counts["unverifiable"] += 1
    return found


@dataclass
class Outcome:
    """Everything the report says: CMD's status, whether the agent judged it all, findings."""

    command: list
    command_status: int | None          # exit status as a shell gives it; None: never ran
    findings: Findings
    judged: bool = True
    incomplete: str = ""                # why not everything was judged
    journal: str | None = None          # kept journal, if any
    log: str | None = None              # kept agent log, if any

    @property
    def verdict(self) -> str:
        if self.findings.unsafe:
            return "unsafe"
        if self.command_status:
            return "command_failed"
        if not self.judged:
            return "incomplete"
        return "safe"

    @property
    def exit_code(self) -> int:
        verdict = self.verdict
        if verdict in ("unsafe", "incomplete"):
            return EXIT_UNSAFE
        return self.command_status or 0


def exit_status(returncode: int) -> int:
    """Popen's returncode as a shell reports it: -N (killed by signal N) -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


# ---------------------------------------------------------------------------- rendering

def _status_text(status: int | None) -> str:
    if status is None:
        return "did not run"
    if status > 128 and status - 128 in signal.Signals._value2member_map_:
        return f"killed by {signal.Signals(status - 128).name} (exit {status})"
    return f"exit {status}"


def render_json(outcome: Outcome) -> str:
    f = outcome.findings
    return json.dumps({
        "verdict": outcome.verdict,
        "exit_code": outcome.exit_code,
        "command": outcome.command,
        "command_exit_code": outcome.command_status,
        "judged": outcome.judged,
        "incomplete": outcome.incomplete or None,
        "counts": f.counts,
        "collisions": [c.to_record() for c in f.collisions],
        "hazards": f.hazards,
        "corrupt": f.corrupt,
        "journal": outcome.journal,
        "agent_log": outcome.log,
    }, indent=2, default=str) + "\n"


def _field(record: dict, name: str, width: int = 200) -> str:
    value = record.get(name)
    return keep_head(str(value), width) if value not in (None, "") else ""


VERDICT_COLOUR = {"unsafe": "bad", "incomplete": "bad", "command_failed": "warn", "safe": "good"}


def render_table(outcome: Outcome, width: int = 80, paint=None, quiet: bool = False) -> str:
    """The report for people; paint (style.Painter) colours the verdict line; quiet (-q):
    only the verdict line when checkpointing was safe."""
    f = outcome.findings
    lines = []
    if f.collisions:
        lines += [report.render_table(f.collisions, width), ""]
    for h in f.hazards:
        lines.append(keep_tail(_field(h, "path") or "?", width))
        text = " ".join(x for x in (_field(h, "hazard"), _field(h, "detail")) if x)
        lines += wrapped("hazard: ", text or "(no detail)", width)
        lines.append("")
    for v in f.corrupt:
        lines.append(keep_tail(_field(v, "path") or "?", width))
        why = ", ".join(x for x in (_field(v, "cause"), _field(v, "reason")) if x)
        link = _field(v, "collision_id")
        lines += wrapped("corrupt: ", why + (f" (written by collision {link})"
                                             if link else ""), width)
        lines.append("")
    n = f.counts
    lines.append(f"ckptwatch check: {n['collisions']} collision(s), {n['hazards']} hazard(s), "
                 f"{n['corrupt']} corrupt checkpoint(s) in {n['writes']} write(s), "
                 f"{n.get('verified', 0)} checkpoint(s) verified")
    lines.append(f"ckptwatch check: command {_status_text(outcome.command_status)}")
    if not outcome.judged:
        lines.append(f"ckptwatch check: NOT everything was judged: {outcome.incomplete}")
    if outcome.journal:
        lines.append(f"ckptwatch check: journal kept at {outcome.journal}")
    if outcome.log:
        lines.append(f"ckptwatch check: agent log kept at {outcome.log}")
    verdict = {"unsafe": "FAIL: checkpointing is unsafe (see above)",
               "command_failed": "the command failed; checkpointing looked safe",
               "incomplete": "FAIL: the agent could not judge everything",
               "safe": "OK: no collision, hazard or corrupt checkpoint"}[outcome.verdict]
    verdict = f"ckptwatch check: {verdict} -> exit {outcome.exit_code}"
    if paint is not None:
        verdict = paint(verdict, VERDICT_COLOUR[outcome.verdict])
    if quiet and outcome.verdict == "safe":
        lines = []
    lines.append(verdict)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- signals

class SignalForwarder:
    """Passes SIGINT/SIGTERM/SIGHUP on to CMD while it runs; after it exits, a signal only
    cuts the wait for the verdict short. own_group: CMD leads its own process group (no
    terminal): the whole group gets every signal."""

    def __init__(self, own_group: bool):
        self.own_group = own_group
        self.proc: subprocess.Popen | None = None
        self.received: list[int] = []
        self.command_done = False
        self._previous: dict = {}

    def install(self) -> None:
        for sig in FORWARDED:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        proc = self.proc
        if proc is None or self.command_done:
            return
        if signum == signal.SIGINT and not self.own_group:
            return          # the terminal sent it to CMD's (our) process group already
        try:
            if self.own_group:
                os.killpg(proc.pid, signum)
            else:
                os.kill(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _in_terminal_foreground() -> bool:
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


# ---------------------------------------------------------------------------- command

def _usage_error(message: str, err) -> int:
    print(f"ckptwatch check: {message} (usage: {USAGE}; see ckptwatch check --help)",
          file=err)
    return EXIT_USAGE


def _agent_flags(args) -> list[str]:
    flags = ["--collision.settle", str(args.settle), "--verify.quiet", str(args.verify_quiet)]
    if args.window is not None:
        flags += ["--collision.window", str(args.window)]
    for path in args.watch_paths:
        flags += ["--watch.path", os.path.abspath(path)]
    if args.watch_patterns:
        flags += ["--watch.patterns", args.watch_patterns]
    return flags + list(args.agent_flags)


def _validate(args, cmd: list, err) -> int | None:
    if not cmd:
        return _usage_error("no command given", err)
    for name in ("settle", "verify_quiet", "timeout", "idle"):
        if getattr(args, name) < 0:
            return _usage_error(f"--{name.replace('_', '.')} must be >= 0", err)
    for path in args.watch_paths:
        if not os.path.isdir(path):
            return _usage_error(f"--watch.path {path}: not a directory", err)
    if args.journal and not os.path.isdir(os.path.dirname(os.path.abspath(args.journal))):
        return _usage_error(f"--journal {args.journal}: its directory does not exist; create "
                            "it first (a typo must not become a directory tree)", err)
    journal = args.journal or (os.path.join(args.keep, "journal.jsonl") if args.keep else None)
    if journal and os.path.exists(journal) and os.path.getsize(journal) > 0:
        return _usage_error(f"the journal {journal} exists already; its records would count: "
                            "give a new path", err)
    if args.keep and os.path.exists(args.keep) and not os.path.isdir(args.keep):
        return _usage_error(f"--keep {args.keep}: not a directory", err)
    return None


def _verifications(agent: AgentProcess) -> dict:
    """{result: n} of the agent's verifications (the journal only holds the bad ones)."""
    try:
        return {s.labels.get("result", ""): int(s.value) for s in agent.samples()
                if s.name == "ckptwatch_checkpoint_verifications_total" and s.value}
    except (OSError, RuntimeError, ValueError):
        return {}


def _write(text: str, args, out, err) -> None:
    if args.output and args.output != "-":
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text)
            return
        except OSError as exc:
            print(f"ckptwatch check: cannot write {args.output}: {exc.strerror or exc}; "
                  "the report follows", file=err)
    (out if args.format == "json" else err).write(text)
    (out if args.format == "json" else err).flush()


def run(args, out=None, err=None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    cmd = list(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)
    problem = _validate(args, cmd, err)
    if problem is not None:
        return problem
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    workdir = args.keep or tempfile.mkdtemp(prefix="ckptwatch-check-")
    journal = os.path.abspath(args.journal) if args.journal else None
    agent = AgentProcess(workdir, *_agent_flags(args), log_level="info", journal=journal,
                         die_with_parent=True)
    env = build_env(os.environ, agent.socket)
    if shutil.which(cmd[0], path=env.get("PATH")) is None and not os.path.exists(cmd[0]):
        print(f"ckptwatch check: command not found: {cmd[0]}", file=err)
        agent.close()
        return EXIT_NOT_FOUND
    forwarder = SignalForwarder(own_group=not _in_terminal_foreground())
    forwarder.install()
    status: int | None = None
    judged, incomplete = True, ""
    verified: dict = {}
    try:
        try:
            try:
                agent.start(timeout=30)
            except RuntimeError as exc:
                print(f"ckptwatch check: the agent did not start: {exc}", file=err)
                return EXIT_USAGE
            if forwarder.received:      # asked to stop before CMD ran
                return 128 + forwarder.received[0]
            out.flush()
            err.flush()
            try:
                forwarder.proc = subprocess.Popen(
                    cmd, env=env, process_group=0 if forwarder.own_group else None)
            except FileNotFoundError:
                print(f"ckptwatch check: command not found: {cmd[0]}", file=err)
                return EXIT_NOT_FOUND
            except OSError as exc:
                print(f"ckptwatch check: cannot execute {cmd[0]}: {exc.strerror or exc}",
                      file=err)
                return EXIT_NOT_EXECUTABLE
            status = exit_status(forwarder.proc.wait())
            forwarder.command_done = True
            signals_before = len(forwarder.received)
            if not agent.alive():
                judged, incomplete = False, (f"the agent exited during the run (code "
                                             f"{agent.proc.returncode})")
            elif not agent.wait_settled(
                    quiet=args.idle, timeout=args.timeout,
                    cancelled=lambda: len(forwarder.received) > signals_before):
                judged = False
                if len(forwarder.received) > signals_before:
                    incomplete = "interrupted while waiting for the agent's verdict"
                elif not agent.alive():
                    incomplete = (f"the agent exited during the run (code "
                                  f"{agent.proc.returncode})")
                else:
                    incomplete = (f"the agent still had work after --timeout {args.timeout:g}s "
                                  "(a process of CMD still connected or writing, or "
                                  "verifications pending)")
            verified = _verifications(agent)
        finally:
            code = agent.stop()     # finalises pending collisions, flushes the journal
        if judged and code not in (0, None):
            judged, incomplete = False, f"the agent exited with code {code} when stopped"
        findings = read_findings(agent.journal)
        findings.counts["verified"] = sum(verified.values())
        findings.counts["verified_by_result"] = verified
        outcome = Outcome(cmd, status, findings, judged, incomplete,
                          journal=agent.journal if (args.journal or args.keep) else None,
                          log=agent.log_path if args.keep else None)
        if (not judged or verbosity(args) >= VERBOSE) and not args.keep:
            print("ckptwatch check: agent log (tail):\n" + agent.log[-2000:], file=err)
        if args.format == "json":
            text = render_json(outcome)
        else:
            to_file = args.output and args.output != "-"
            text = render_table(outcome, paint=None if to_file else Painter(err),
                                quiet=verbosity(args) < NORMAL)
        _write(text, args, out, err)
        return outcome.exit_code
    finally:
        forwarder.restore()
        agent.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
