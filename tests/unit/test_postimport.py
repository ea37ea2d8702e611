"""ckptwatch/postimport.py: the post-import watch several parts of ckptwatch share (the
writers patch a library's saves, the resume guard its loads), with real imports of modules
written for the test."""
import sys

import pytest

from ckptwatch import postimport as imports


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh importable package `cwtestpkg_<n>` with a submodule `mod`."""
    name = f"cwtestpkg_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def test_every_callback_for_a_name_runs_once_in_order(package):
    calls = []

    def first():
        calls.append(("first", sys.modules[f"{package}.mod"].VALUE))

    def second():
        calls.append(("second", sys.modules[f"{package}.mod"].VALUE))

    def failing():
        raise RuntimeError("a callback's failure is not the import's")

    target = f"{package}.mod"
    imports.watch({target: first})
    imports.watch({target: failing})
    imports.watch({target: second, f"{package}.never": first})
    imports.watch({target: first})                  # the same callback again: runs once
    __import__(target)
    assert calls == [("first", 42), ("second", 42)]
    imports.unwatch([first])
    assert imports._current() is None               # nothing left to watch: finder gone


def test_unwatch_removes_only_the_given_callbacks(package):
    calls = []
    mine, theirs = (lambda: calls.append("mine")), (lambda: calls.append("theirs"))
    target = f"{package}.mod"
    imports.watch({target: mine})
    imports.watch({target: theirs})
    imports.unwatch([mine])
    __import__(target)
    assert calls == ["theirs"]


def test_a_module_already_imported_is_not_watched(package):
    __import__(f"{package}.mod")
    imports.watch({f"{package}.mod": lambda: pytest.fail("called for a module imported")})
    assert imports._current() is None or f"{package}.mod" not in imports._current().callbacks
