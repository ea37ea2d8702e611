"""The timeline page (`ckptwatch report --format html`) rendered from a journal, read back with
the standard library's HTML parser, and where a bar for a wall time must sit: for the timeline
tests of both tiers."""
import argparse
import io
from html.parser import HTMLParser

from monitor.cli.report import add_arguments, run
from monitor.cli.timeline import AXIS_PAD, LABEL_W, PLOT_W


class Page(HTMLParser):
    """Every element's tag and attributes, the text, and each element's text (for <title>)."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.elements, self.text, self._stack = [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "text": ""}
        self.elements.append(el)
        if tag not in ("meta", "br", "line", "input", "link"):
            self._stack.append(el)

    def handle_startendtag(self, tag, attrs):
        self.elements.append({"tag": tag, "attrs": dict(attrs), "text": ""})

    def handle_endtag(self, tag):
        while self._stack:
            if self._stack.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        self.text.append(data)
        for el in self._stack:
            el["text"] += data

    def find(self, tag, cls=None):
        return [e for e in self.elements if e["tag"] == tag and
                (cls is None or cls in e["attrs"].get("class", "").split())]


def report_html(journal, *extra):
    """`ckptwatch report --journal JOURNAL --format html` in this process: (exit code, page,
    stderr)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--journal", str(journal), "--format", "html", *extra])
    out, err = io.StringIO(), io.StringIO()
    code = run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def expected_x(t, starts, ends):
    """Where the page must put wall time t: the episode's span padded by AXIS_PAD each side,
    mapped onto PLOT_W pixels after the LABEL_W label column."""
    lo, hi = min(starts), max(ends)
    pad = (hi - lo) * AXIS_PAD
    return LABEL_W + (t - (lo - pad)) / ((hi + pad) - (lo - pad)) * PLOT_W
