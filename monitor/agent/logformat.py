"""Agent log lines on stderr: logfmt (`level=info msg="..."`, as Prometheus exporters log) or
JSON, one line per record, so log shippers can parse them without multi-line rules.

What a line is about goes in fields of its own, not inside msg: a call site passes them as
`log.warning("concurrent write collision", extra={"fields": {"path": p, "training_job": j}})`
and both formats put them after msg (`... msg="concurrent write collision" path=/ckpt/a.pt
training_job=j1`), so `path=...` or `training_job=...` is one query in Loki or Elasticsearch.
msg stays a short, fixed text per kind of event. Values come from training processes and file
names: every control character is escaped, so nothing in a value can forge a line.
"""
from __future__ import annotations

import json
import logging
import sys
import time

from exporters.logline import clean

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
          "warning": logging.WARNING, "error": logging.ERROR}
# Keys the formatter writes itself: a field of the same name is prefixed so it cannot replace
# them.
_OWN_KEYS = ("ts", "level", "logger", "msg", "exc")


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + \
        f".{int(record.msecs):03d}Z"


def _value(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return "" if value is None else str(value)


def _fields(record: logging.LogRecord) -> dict[str, str]:
    out = {"ts": _timestamp(record), "level": record.levelname.lower(),
           "logger": record.name, "msg": record.getMessage()}
    extra = getattr(record, "fields", None)
    if isinstance(extra, dict):
        for key, value in extra.items():
            key = "".join(c if c.isascii() and (c.isalnum() or c in "_.") else "_"
                          for c in str(key)) or "_"
            out[f"field_{key}" if key in _OWN_KEYS else key] = _value(value)
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


def _logfmt_value(value: str) -> str:
    if value and value.isprintable() and not any(c in value for c in ' "=\\'):
        return value
    # \n and \t as logfmt parsers read them; any other control character as \xNN / \uNNNN
    # (exporters.logline.clean), so a value can neither end the line nor move the cursor.
    return '"' + clean(value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
                       .replace("\t", "\\t")) + '"'


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
