"""Agent configuration: one dataclass, defaults and validation in one place.

Flags follow the Prometheus exporter style (`--web.listen-address`, `--log.level`). Every flag
can also be set in a config file (`--config.file PATH`, TOML or YAML by extension), either
nested (`web: {listen-address: ...}`) or flat (`"web.listen-address": ...`). Precedence:
defaults < config file < flags. Every problem found is collected and reported at once
(ConfigError.errors), so a user fixes a broken config in one round trip, not one per error.
"""
from __future__ import annotations

import argparse
import grp
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from exporters.journal import default_journal_path
from exporters.labels import MIN_VALUE_LENGTH, LabelLimits
from exporters.metrics.listen import RESERVED_PATHS, parse_listen_address
from exporters.webconfig import WebConfig, WebConfigError
from exporters import webconfig
from ckptwatch.version import __version__
from ckptwatch import paths
from monitor.fs.options import ATTRIBUTIONS as WATCH_ATTRIBUTIONS
from monitor.fs.options import CHECKPOINT_PATTERNS as WATCH_PATTERNS
from monitor.fs.options import WATCH_MODES

LOG_LEVELS = ("debug", "info", "warn", "error")
# Other spellings people type (Python's "warning", go-kit's "warn"; any case): one level each.
LOG_LEVEL_ALIASES = {"warning": "warn"}
LOG_FORMATS = ("logfmt", "json")


class ConfigError(Exception):
    """Invalid configuration; .errors lists every problem, one human-readable line each."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = list(errors)


@dataclass
class Config:
    """Everything the agent needs to run. Build it with load(argv); defaults live here."""

    listen_address: str = paths.DEFAULT_METRICS_ADDRESS
    telemetry_path: str = "/metrics"
    web_config_file: str | None = None       # exporter-toolkit YAML: TLS, basic auth
    web_config: WebConfig | None = None      # parsed from web_config_file by load()
    socket: str = field(default_factory=paths.default_socket_path)
    socket_mode: int = 0o660
    socket_group: int | None = None         # gid, resolved from a name or number
    journal_path: str = field(default_factory=default_journal_path)
    journal_max_bytes: int = 64 * 1024 * 1024
    journal_backups: int = 5
    collision_window: float = 60.0
    collision_settle: float = 1.0
    collision_job_settle: float = 3.0
    collision_stale_after: float = 3600.0
    collision_max_paths: int = 10000
    collision_max_hold: float = 3.0
    job_scope_store_reads: bool = True        # read a job's store for gone processes' writes
    log_level: str = "info"
    log_format: str = "logfmt"
    size_tolerance: float = 0.01              # relative size difference that counts
    verify_enabled: bool = True
    verify_quiet: float = 2.0
    verify_incomplete_after: float = 60.0    # a DCP directory without .metadata: incomplete
    verify_deep_max_bytes: int = 256 * 1024 * 1024
    verify_max_rate: float = 200e6            # bytes/s for deep checks; 0 = no cap
    verify_store_verdict: bool = True         # tag verified files (user.ckptwatch.verdict)
    node: str = field(default_factory=lambda: os.environ.get("CKPTWATCH_NODE")
                      or socket.gethostname())
    watch_paths: list = field(default_factory=list)
    watch_mode: str = "auto"
    watch_poll_interval: float = 1.0
    watch_attribution: str = "auto"
    watch_patterns: list = field(default_factory=lambda: list(WATCH_PATTERNS))
    metrics_max_jobs: int = LabelLimits.max_jobs
    metrics_max_ranks: int = LabelLimits.max_ranks
    metrics_max_label_length: int = LabelLimits.max_value_length
    metrics_job_idle_expiry: float = LabelLimits.job_idle_expiry

    def label_limits(self) -> LabelLimits:
        """The exporter's label value caps (exporters.labels)."""
        return LabelLimits(max_jobs=self.metrics_max_jobs, max_ranks=self.metrics_max_ranks,
                           max_value_length=self.metrics_max_label_length,
                           job_idle_expiry=self.metrics_job_idle_expiry)


# --- value converters: take a flag string or a config-file value, return the typed value or
# --- raise ValueError with a message that completes "<flag>: ..."

def _address(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected [host]:port, e.g. :19400 or 127.0.0.1:19400")
    try:
        parse_listen_address(value)
    except Exception as exc:  # its own error type is its business; report the message
        raise ValueError(f"invalid listen address {value!r}: {exc}") from None
    return value


def _telemetry_path(value: Any) -> str:
    if (not isinstance(value, str) or not value.startswith("/") or value in RESERVED_PATHS
            or len(value) > 256 or any(c.isspace() or c in "?#" for c in value)):
        raise ValueError(f"expected a URL path such as /metrics (none of "
                         f"{', '.join(RESERVED_PATHS)}; no spaces, ? or #), got {value!r}")
    return value


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty path")
    return os.path.abspath(os.path.expanduser(value))


def _mode(value: Any) -> int:
    # A config file may give an int (YAML 0660 and TOML 0o660 are already octal-decoded);
    # a string is always read as octal, as chmod does.
    if isinstance(value, bool):
        raise ValueError("expected an octal mode such as 0660")
    if isinstance(value, int):
        mode = value
    elif isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        try:
            mode = int(text, 8)
        except ValueError:
            raise ValueError(f"invalid mode {value!r}: expected octal such as 0660") from None
    else:
        raise ValueError("expected an octal mode such as 0660")
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"mode {oct(mode)} out of range 0-07777")
    return mode


def _group(value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError("expected a group name or gid")
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        gid = int(value)
        try:
            grp.getgrgid(gid)
        except KeyError:
            raise ValueError(f"unknown group id {gid}") from None
        return gid
    if isinstance(value, str):
        try:
            return grp.getgrnam(value).gr_gid
        except KeyError:
            raise ValueError(f"unknown group {value!r}") from None
    raise ValueError("expected a group name or gid")


def _number(kind: type, minimum: float, strict: bool = False) -> Callable[[Any], Any]:
    word = "an integer" if kind is int else "a number"

    def convert(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected {word}")
        try:
            if isinstance(value, str):
                number = kind(value.strip())
            elif isinstance(value, int) or (kind is float and isinstance(value, float)):
                number = kind(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"expected {word}, got {value!r}") from None
        if number < minimum or (strict and number == minimum):
            bound = "greater than" if strict else "at least"
            raise ValueError(f"must be {bound} {minimum}, got {value!r}")
        return number
    return convert


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _path_list(value: Any) -> list:
    items = value if isinstance(value, list) else [value]
    return [_path(item) for item in items]


def _patterns(value: Any) -> list:
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"expected file name patterns such as '*.pt', got {item!r}")
        out += [p for p in item.replace(",", " ").split() if p]
    if not out:
        raise ValueError("expected at least one pattern such as '*.pt'")
    return out


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a non-empty name")
    return value.strip()


def _choice(choices: tuple[str, ...],
            aliases: dict[str, str] | None = None) -> Callable[[Any], str]:
    aliases = aliases or {}

    def convert(value: Any) -> str:
        word = value.strip().lower() if isinstance(value, str) else None
        word = aliases.get(word, word)
        if word not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
        return word
    return convert


@dataclass(frozen=True)
class Option:
    flag: str                      # without the leading "--"; also the config-file key
    attr: str                      # Config field
    convert: Callable[[Any], Any]
    help: str
    show_default: Callable[[], str] | None = None
    repeatable: bool = False       # a flag given several times; a list in the config file


OPTIONS = (
    Option("web.listen-address", "listen_address", _address,
           "address for /metrics and /healthz, [host]:port"),
    Option("web.telemetry-path", "telemetry_path", _telemetry_path,
           "URL path of the metrics"),
    Option("web.config.file", "web_config_file", _path,
           "TLS and basic-auth configuration in the Prometheus exporter-toolkit format "
           "(tls_server_config, basic_auth_users with bcrypt hashes), as node_exporter's",
           lambda: "none: plain HTTP, no authentication"),
    Option("ingest.socket", "socket", _path,
           "Unix socket that instrumented processes send events to "
           "(they read it from CKPTWATCH_SOCKET)"),
    Option("ingest.socket-mode", "socket_mode", _mode,
           "permissions of the socket file, octal; senders need write access",
           lambda: "0660"),
    Option("ingest.socket-group", "socket_group", _group,
           "group (name or gid) that owns the socket file, so trainers of that group can "
           "connect", lambda: "none: the agent's group"),
    Option("journal.path", "journal_path", _path,
           "JSONL journal of finished writes and collisions (appended across restarts)"),
    Option("journal.max-bytes", "journal_max_bytes", _number(int, 1),
           "rotate the journal when it exceeds this many bytes"),
    Option("journal.backups", "journal_backups", _number(int, 0),
           "rotated journal files to keep"),
    Option("collision.window", "collision_window", _number(float, 0),
           "seconds during which sequential writes of one path by one job run count as "
           "a redundant write"),
    Option("collision.settle", "collision_settle", _number(float, 0),
           "seconds without a new overlapping write before a collision is final and reported"),
    Option("collision.job-settle", "collision_job_settle", _number(float, 0),
           "settle for writers of a distributed job: their other nodes' writes arrive "
           "through job scope, later than local ones"),
    Option("collision.stale-after", "collision_stale_after", _number(float, 0, strict=True),
           "seconds after which a write that never ended is given up as lost"),
    Option("collision.max-paths", "collision_max_paths", _number(int, 1),
           "paths tracked at once; the oldest are evicted beyond this (bounds memory)"),
    Option("metrics.max-jobs", "metrics_max_jobs", _number(int, 1),
           "distinct training_job label values exported at once; further jobs are exported "
           "as training_job=\"__overflow__\" and counted in "
           "ckptwatch_label_values_overflowed_total (bounds /metrics and memory)"),
    Option("metrics.max-ranks", "metrics_max_ranks", _number(int, 1),
           "distinct (training_job, rank) pairs exported at once; further ranks are "
           "exported as rank=\"__overflow__\""),
    Option("metrics.max-label-length", "metrics_max_label_length",
           _number(int, MIN_VALUE_LENGTH),
           "characters kept of a training_job or rank label value; longer values are cut "
           "and end in ~ and a hash"),
    Option("metrics.job-idle-expiry", "metrics_job_idle_expiry", _number(float, 0),
           "seconds without an update after which a training job's series are dropped and "
           "its place freed (0: never)"),
    Option("collision.max-hold", "collision_max_hold", _number(float, 0),
           "seconds, after settle, a write still in flight may hold back the report of a "
           "concurrent collision it is part of; then the collision is reported naming it as "
           "in flight (a live but silent writer cannot hide a collision)"),
    Option("job-scope.store-reads", "job_scope_store_reads", _bool,
           "read a distributed job's store (the TCPStore a local process's job scope named) "
           "for that process's recent writes once it is gone without having read them "
           "(os._exit, SIGKILL right after a save), so this node hears of the other nodes' "
           "writes of the same paths; connects only where a local process said its store is "
           "(true/false)", lambda: "true"),
    Option("log.level", "log_level", _choice(LOG_LEVELS, LOG_LEVEL_ALIASES),
           f"log level: {', '.join(LOG_LEVELS)} (any case; warning = warn)"),
    Option("log.format", "log_format", _choice(LOG_FORMATS),
           f"log line format: {', '.join(LOG_FORMATS)}"),
    Option("node.name", "node", _name,
           "this node's name: the node of every write the agent sees, from the hook or the "
           "filesystem watcher (what a hook claims in its events is not trusted)",
           lambda: "$CKPTWATCH_NODE or the host name"),
    Option("watch.path", "watch_paths", _path_list,
           "directory to watch for checkpoint writes by any process, recursively; repeat "
           "for several (none: only the hook's events)", lambda: "none", repeatable=True),
    Option("watch.mode", "watch_mode", _choice(WATCH_MODES),
           "auto (inotify, polling where inotify fails), inotify, or polling (network "
           "filesystems: inotify cannot see other nodes' writes)"),
    Option("watch.poll-interval", "watch_poll_interval", _number(float, 0, strict=True),
           "seconds between polls in polling mode"),
    Option("watch.attribution", "watch_attribution", _choice(WATCH_ATTRIBUTIONS),
           "how writers of watched files are named: fanotify (the kernel names every "
           "writer, even of a short save; needs CAP_SYS_ADMIN), proc (a /proc scan after "
           "each event; misses writes shorter than the scan), or auto (fanotify where it "
           "works, else proc)"),
    Option("watch.patterns", "watch_patterns", _patterns,
           "file name patterns that count as checkpoints, comma-separated",
           lambda: ",".join(WATCH_PATTERNS)),
    Option("size.tolerance", "size_tolerance", _number(float, 0),
           "relative difference between finished sizes of one path (by different processes, "
           "within the collision window) reported as a size fluctuation; 0.01 = 1%%"),
    Option("verify.enabled", "verify_enabled", _bool,
           "verify each checkpoint once its writers are done (true/false)",
           lambda: "true"),
    Option("verify.quiet", "verify_quiet", _number(float, 0),
           "seconds a path must see no new write before it is verified"),
    Option("verify.incomplete-after", "verify_incomplete_after", _number(float, 0),
           "seconds without a write in a watched DCP checkpoint directory whose .metadata has "
           "not come before it is judged incomplete (its save crashed)"),
    Option("verify.deep-max-bytes", "verify_deep_max_bytes", _number(int, 0),
           "files up to this size also get the deep check (CRC32 of every record)"),
    Option("verify.max-rate", "verify_max_rate", _number(float, 0),
           "bytes/s the deep check may read (0: no cap)", lambda: "200000000"),
    Option("verify.store-verdict", "verify_store_verdict", _bool,
           "store each file's verdict with it as the extended attribute "
           "user.ckptwatch.verdict, which the resume guard reads when the file is loaded, "
           "on any node (true/false)", lambda: "true"),
)
_BY_FLAG = {o.flag: o for o in OPTIONS}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so flag errors join the other errors."""

    def error(self, message: str):
        raise ConfigError([message])


def build_parser(prog: str = "ckptwatch agent") -> argparse.ArgumentParser:
    """The agent's flags. Defaults are None so load() can tell given flags from absent ones."""
    parser = _Parser(
        prog=prog, allow_abbrev=False,
        description="ckptwatch agent: receives torch.save write events from instrumented "
                    "processes on this node, detects concurrent writes to one checkpoint "
                    "path, and exports them to Prometheus, a JSONL journal and the log.",
        epilog="Every flag can also be set in --config.file (TOML or YAML), nested "
               "(web: {listen-address: ...}) or flat (\"web.listen-address\": ...). "
               "Flags override the file. Invalid configuration exits with code 2. "
               "The agent checks each event's pid against the sending process, so it must "
               "see the training processes (hostPID on Kubernetes; the trainers' own pid "
               "namespaces are fine).")
    parser.add_argument("--version", action="version", version=f"ckptwatch {__version__}")
    # -q/-v as on every ckptwatch command: fewer or more log lines (--log.level wins).
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", dest="verbosity_level", action="store_const",
                           const="error", default=None, help="log errors only (--log.level "
                           "error)")
    verbosity.add_argument("-v", "--verbose", dest="verbosity_level", action="store_const",
                           const="debug", default=None, help="log everything (--log.level "
                           "debug)")
    parser.add_argument("--config.file", dest="config_file", metavar="PATH", default=None,
                        help="TOML (.toml) or YAML (.yaml/.yml) file with any of the settings "
                             "below (default: none)")
    defaults = Config()
    for opt in OPTIONS:
        shown = opt.show_default() if opt.show_default else getattr(defaults, opt.attr)
        parser.add_argument(f"--{opt.flag}", dest=opt.attr, default=None,
                            action="append" if opt.repeatable else "store",
                            metavar=opt.flag.split(".")[-1].upper().replace("-", "_"),
                            help=f"{opt.help} (default: {shown})")
    return parser


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def read_file(path: str) -> tuple[dict[str, Any], list[str]]:
    """Settings from a TOML/YAML config file as {flag: value}, and the errors found."""
    ext = os.path.splitext(path)[1].lower()
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        return {}, [f"--config.file: cannot read {path}: {exc.strerror or exc}"]
    try:
        if ext == ".toml":
            import tomllib
            data = tomllib.loads(raw.decode("utf-8"))
        elif ext in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(raw) or {}
        else:
            return {}, [f"--config.file: {path}: unknown extension {ext!r}, "
                        "expected .toml, .yaml or .yml"]
    except Exception as exc:  # tomllib/yaml/unicode errors: report, never traceback
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return {}, [f"--config.file: {path}: cannot parse: {detail}"]
    if not isinstance(data, dict):
        return {}, [f"--config.file: {path}: expected a mapping of settings at the top level"]
    settings, errors = {}, []
    for key, value in _flatten(data).items():
        if key in _BY_FLAG:
            settings[key] = value
        else:
            errors.append(f"{path}: unknown setting {key!r}")
    return settings, errors


def load(argv: list[str] | None = None) -> Config:
    """Build the Config from flags and the optional config file; raise ConfigError on errors."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    errors = [f"unknown flag {arg!r}" if arg.startswith("-") else f"unexpected argument {arg!r}"
              for arg in unknown]
    values: dict[str, tuple[str, Any]] = {}   # attr -> (where it came from, raw value)
    if args.config_file:
        settings, file_errors = read_file(args.config_file)
        errors += file_errors
        for key, value in settings.items():
            values[_BY_FLAG[key].attr] = (f"{args.config_file}: {key}", value)
    for opt in OPTIONS:
        given = getattr(args, opt.attr)
        if given is not None:
            values[opt.attr] = (f"--{opt.flag}", given)
    if args.verbosity_level and "log_level" not in values:
        values["log_level"] = ("-q/-v", args.verbosity_level)
    converted = {}
    for opt in OPTIONS:
        if opt.attr not in values:
            continue
        where, raw = values[opt.attr]
        try:
            converted[opt.attr] = opt.convert(raw)
        except ValueError as exc:
            errors.append(f"{where}: {exc}")
    if converted.get("web_config_file"):
        try:
            converted["web_config"] = webconfig.load(converted["web_config_file"])
        except WebConfigError as exc:
            errors += [f"--web.config.file: {line}" for line in exc.errors]
    if errors:
        raise ConfigError(errors)
    return Config(**converted)


def path_problems(cfg: Config) -> list[str]:
    """What is wrong, on this machine, with the paths a config names (load() checks only the
    config itself: the deploy tests parse a DaemonSet's flags where /var/lib/ckptwatch is
    not). A journal other than the default whose directory does not exist (the agent creates
    only its default journal's directory: a typo must not become a new directory tree), and a
    watch path that exists but is not a directory. A watch path that does not exist yet is allowed (watched
    from when it appears: monitor.fs.watch); the agent warns at start."""
    errors = []
    parent = os.path.dirname(cfg.journal_path)
    # Only a missing one: a parent that is a file is the journal's own open error (exit 1).
    if cfg.journal_path != default_journal_path() and not os.path.exists(parent):
        errors.append(f"--journal.path: the directory {parent} does not exist; create it "
                      "first or give another path")
    for path in cfg.watch_paths:
        if os.path.exists(path) and not os.path.isdir(path):
            errors.append(f"--watch.path: {path} is not a directory; give the directory the "
                          "checkpoints are written to")
    return errors
