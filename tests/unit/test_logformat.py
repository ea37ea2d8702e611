"""monitor.agent.logformat: one parseable line per record, logfmt quoting, JSON, levels."""
import io
import json
import logging

import pytest

from monitor.agent import logformat


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_logfmt_quotes_values_with_spaces_quotes_and_newlines(restore_root_logger):
    out = io.StringIO()
    logformat.configure("info", "logfmt", stream=out)
    logging.getLogger("ckptwatch.test").warning('collision on "/a b.pt"\nsecond line')
    logging.getLogger("ckptwatch.test").debug("hidden at info level")
    line = out.getvalue()
    assert line.count("\n") == 1
    assert line.startswith("ts=") and " level=warning logger=ckptwatch.test " in line
    assert line.rstrip("\n").endswith('msg="collision on \\"/a b.pt\\"\\nsecond line"')


def test_json_format_carries_exception(restore_root_logger):
    out = io.StringIO()
    logformat.configure("debug", "json", stream=out)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("x").exception("failed")
    record = json.loads(out.getvalue())
    assert record["level"] == "error" and record["msg"] == "failed"
    assert "ValueError: boom" in record["exc"]


def test_fields_follow_msg_in_logfmt_and_json(restore_root_logger):
    """What a line is about is a field (path=, training_job=), not words inside msg."""
    out = io.StringIO()
    logformat.configure("info", "logfmt", stream=out)
    log = logging.getLogger("ckptwatch.test")
    log.warning("corrupt checkpoint", extra={"fields": {
        "path": "/ckpt/a b.pt", "training_job": "j1", "ranks": ["0", "2"], "level": "x",
        "bad key=": 1, "none": None}})
    line = out.getvalue()
    assert line.endswith(' msg="corrupt checkpoint" path="/ckpt/a b.pt" training_job=j1 '
                         'ranks=0,2 field_level=x bad_key_=1 none=""\n')
    out.truncate(0)
    out.seek(0)
    logformat.configure("info", "json", stream=out)
    log.warning("corrupt checkpoint", extra={"fields": {"path": "/ckpt/a\nb.pt"}})
    record = json.loads(out.getvalue())
    assert record["msg"] == "corrupt checkpoint" and record["path"] == "/ckpt/a\nb.pt"
    assert out.getvalue().count("\n") == 1


def test_logfmt_escapes_every_control_character(restore_root_logger):
    out = io.StringIO()
    logformat.configure("info", "logfmt", stream=out)
    logging.getLogger("x").warning("a\rb\x1b[2J", extra={"fields": {"path": "/p\x00q\u2028"}})
    line = out.getvalue()
    assert line.count("\n") == 1 and "\r" not in line and "\x1b" not in line
    assert 'msg="a\\rb\\x1b[2J"' in line and 'path="/p\\x00q\\u2028"' in line


@pytest.mark.parametrize("level", ["warn", "warning"])
def test_warn_level_hides_info(restore_root_logger, level):
    out = io.StringIO()
    logformat.configure(level, "logfmt", stream=out)
    logging.getLogger("x").info("hidden")
    logging.getLogger("x").warning("shown")
    assert "hidden" not in out.getvalue() and "shown" in out.getvalue()
