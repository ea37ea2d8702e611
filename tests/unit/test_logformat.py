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
