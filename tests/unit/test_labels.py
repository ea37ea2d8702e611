"""exporters/labels.py: cleaning, admission and expiry of label values (pure, no clock)."""
from __future__ import annotations

from exporters.labels import MIN_VALUE_LENGTH, LabelValues, clean


def test_short_values_are_kept_as_they_are():
    assert clean("job-7", 128) == "job-7"
    assert clean("", 128) == ""


def test_long_values_are_cut_to_the_limit_and_stay_apart():
    a, b = clean("x" * 1000 + "a", 32), clean("x" * 1000 + "b", 32)
    assert len(a) == len(b) == 32
    assert a != b and a.startswith("x" * 23 + "~")
    assert clean("x" * 1000 + "a", 32) == a          # stable across calls and processes


def test_unencodable_values_become_encodable():
    value = clean("job-\ud800", 128)
    value.encode("utf-8")
    assert value == "job-\\ud800"


def test_minimum_length_leaves_room_for_the_hash():
    assert len(clean("y" * 100, MIN_VALUE_LENGTH)) == MIN_VALUE_LENGTH


def test_admission_is_first_come_up_to_the_limit():
    values = LabelValues(limit=2, idle_expiry=10)
    assert values.admit("a", 0) and values.admit("b", 0)
    assert not values.admit("c", 0)
    assert values.admit("a", 5)                        # held values are always admitted
    assert len(values) == 2 and "c" not in values


def test_expiry_forgets_only_idle_values_oldest_first():
    values = LabelValues(limit=3, idle_expiry=10)
    values.admit("a", 0)
    values.admit("b", 2)
    values.admit("a", 5)                               # used again: no longer the oldest
    assert values.expire(11) == []
    assert values.expire(12) == ["b"]
    assert values.expire(15) == ["a"]
    assert len(values) == 0


def test_zero_expiry_keeps_everything():
    values = LabelValues(limit=1, idle_expiry=0)
    values.admit("a", 0)
    assert values.expire(1e12) == [] and "a" in values
