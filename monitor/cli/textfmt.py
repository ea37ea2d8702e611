"""Text for an 80-column terminal, as `ckptwatch report`, `check` and `scan` print it: sizes,
clock times, values cut to a width (control characters escaped: exporters.logline.clean),
labelled lines wrapped.
"""
from __future__ import annotations

import textwrap
import time

from exporters.logline import clean


def human_bytes(n) -> str:
    """4096 -> 4.0KiB; None -> "-"."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)}B" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"   # unreachable


def clock_time(wall: float) -> str:
    """HH:MM:SS.mmm in local time."""
    ms = int(round((wall % 1) * 1000))
    seconds = int(wall)
    if ms == 1000:
        seconds, ms = seconds + 1, 0
    return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{ms:03d}"


def keep_tail(text: str, width: int) -> str:
    """The text, or "..." + its tail when longer than width (the end of a path says most)."""
    text = clean(text)
    if len(text) <= width:
        return text
    if width <= 3:
        return text[-width:]
    return "..." + text[-(width - 3):]


def keep_head(text: str, width: int) -> str:
    text = clean(text)
    if len(text) <= width:
        return text
    return text[:max(0, width - 3)] + "..."[:width]


def wrapped(label: str, text: str, width: int) -> list:
    """`text` wrapped to width, the first line after the label, the rest indented under it."""
    return textwrap.wrap(text, width=width, initial_indent="  " + label,
                         subsequent_indent="  " + " " * len(label),
                         break_on_hyphens=False) or ["  " + label]

