"""monitor.verify.loadable and the verifier's `pickle` verdict (issue 17 item 7): does an "ok"
checkpoint load with torch.load(weights_only=True)? Checked against torch itself: for each
real file, the verdict says "weights_only" exactly when torch.load(weights_only=True) loads
it. torch.load is only ever called with weights_only=True here (never running the pickle)."""
from __future__ import annotations

import argparse
import collections
import io
import os
import pickle

import pytest

from monitor.verify import integrity, loadable, picklescan

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


class Evil:
    """A pickle that calls os.system on a full unpickle (never done here)."""

    def __reduce__(self):
        return (os.system, ("exit 0",))


def _files(tmp_path) -> dict:
    files = {}

    def save(name, obj, **kw):
        path = tmp_path / name
        torch.save(obj, path, **kw)
        files[name] = str(path)

    save("state_dict.pt", {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)})
    save("module.pt", torch.nn.Linear(2, 2).state_dict())
    save("param.pt", {"p": torch.nn.Parameter(torch.ones(2))})
    save("ordered.pt", collections.OrderedDict(a=torch.ones(1), n=3, s="x", l=[1.5, None]))
    save("dtypes.pt", {"d": torch.float16, "size": torch.Size([2, 3]), "set": {1, 2},
                       "bytes": b"\x00\x01", "dev": torch.device("cpu")})
    save("legacy.pt", {"w": torch.ones(3)}, _use_new_zipfile_serialization=False)
    save("evil.pt", {"w": torch.ones(3), "x": Evil()})
    save("evil_legacy.pt", {"x": Evil()}, _use_new_zipfile_serialization=False)
    save("namespace.pt", {"hparams": argparse.Namespace(lr=0.1), "w": torch.ones(1)})
    save("eval.pt", {"f": eval})
    return files


def _loads_weights_only(path: str) -> bool:
    try:
        torch.load(path, weights_only=True)
        return True
    except pickle.UnpicklingError:
        return False


def test_the_allowlist_is_torchs_own():
    from torch._weights_only_unpickler import _get_allowed_globals
    assert loadable.WEIGHTS_ONLY_GLOBALS == frozenset(_get_allowed_globals()), \
        "torch's weights_only allowlist changed: regenerate monitor/verify/loadable.py"


def test_the_pickle_verdict_agrees_with_torch_load_weights_only(tmp_path):
    for name, path in _files(tmp_path).items():
        v = integrity.verify(path)
        assert v.status == integrity.OK, (name, v)
        truth = _loads_weights_only(path)
        assert (v.details["pickle"] == "weights_only") == truth, (name, v.details, truth)
        if not truth:
            assert v.details["pickle"] == "full_unpickle" and v.details["refused_globals"]
            assert "weights_only=True" in v.reason
        else:
            assert v.reason == ""


def test_an_os_system_pickle_is_named_in_the_verdict(tmp_path):
    v = integrity.verify(_files(tmp_path)["evil.pt"])
    assert v.details["refused_globals"] == ["posix.system"]
    assert "posix.system" in v.reason and "weights_only=False would call them" in v.reason


def test_python2_names_are_read_as_python_3_unpickles_them():
    assert loadable.canonical("__builtin__", "set") == "builtins.set"
    assert loadable.canonical("copy_reg", "_reconstructor") == "copyreg._reconstructor"
    assert loadable.refused({"builtins.set", "posix.system"}) == ["posix.system"]


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_both_readers_name_the_same_globals(protocol):
    data = pickle.dumps({"a": collections.OrderedDict(), "f": os.system, "i": io.BytesIO},
                        protocol=protocol)
    fast = picklescan.pickle_names(data)[1]
    names: set = set()
    picklescan.scan_pickle(data, names=names)
    careful = picklescan._names(names)
    assert fast == careful
    assert {"collections.OrderedDict", "posix.system", "_io.BytesIO"} <= fast


def test_the_names_kept_are_bounded():
    many = b"\x80\x02" + b"".join(b"c" + f"m{i}\nn{i}\n".encode() + b"0" for i in range(5000))
    names = picklescan.pickle_names(many + b"N.")[1]
    assert len(names) <= picklescan.MAX_GLOBALS + 1 and picklescan.MORE in names
    long = b"\x80\x02c" + b"m" * 100_000 + b"\n" + b"n" * 100_000 + b"\n0N."
    (name,) = picklescan.pickle_names(long)[1]
    assert len(name) <= 2 * picklescan.MAX_GLOBAL_TEXT + 1
