"""Agent log lines on stderr: logfmt (`level=info msg="..."`, as Prometheus exporters log) or
JSON, one line per record, so log shippers can parse them without multi-line rules."""
from __future__ import annotations

import json
import logging
import sys
import time

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + \
        f".{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, str]:
    out = {"ts": _timestamp(record), "level": record.levelname.lower(),
           "logger": record.name, "msg": record.getMessage()}
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


def _logfmt_value(value: str) -> str:
    if value and not any(c in value for c in ' "=\n\t\\'):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") \
        .replace("\t", "\\t") + '"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _fields(record).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), ensure_ascii=False)


def configure(level: str = "info", fmt: str = "logfmt", stream=None) -> logging.Handler:
    """Send the root logger's records to stderr in the chosen format; returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS.get(level, logging.INFO))
    # watchdog logs every inotify event at debug: thousands of lines per checkpoint would
    # bury the agent's own debug output.
    logging.getLogger("watchdog").setLevel(max(root.level, logging.INFO))
    return handler
