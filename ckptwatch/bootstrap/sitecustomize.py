"""ckptwatch bootstrap, imported by Python at start-up when this directory is on PYTHONPATH.

Kept trivial on purpose: make our package importable, call ckptwatch.bootstrap.initialize(),
then run the next `sitecustomize` on sys.path (the user's or the distribution's), which ours
would otherwise hide. Nothing here may ever break interpreter start-up.
CKPTWATCH_DISABLE=1 skips our part entirely; the chained sitecustomize still runs.
"""
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))   # the directory that contains `ckptwatch/`


def _disabled() -> bool:
    # Same rule as ckptwatch.paths.disabled(), inlined so the kill switch imports nothing of ours.
    return os.environ.get("CKPTWATCH_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


def _initialize() -> None:
    try:
        # Appended, not prepended: an installed ckptwatch or the user's modules keep priority.
        if _ROOT not in sys.path:
            sys.path.append(_ROOT)
        from ckptwatch import bootstrap
        bootstrap.initialize()
    except Exception:
        pass


def _chain() -> None:
    """Execute the next sitecustomize.py found on sys.path after our own directory."""
    try:
        entries = [os.path.abspath(p or os.curdir) for p in sys.path]
        start = entries.index(_HERE) + 1 if _HERE in entries else 0
        for entry in entries[start:]:
            if entry == _HERE:
                continue
            candidate = os.path.join(entry, "sitecustomize.py")
            if not os.path.isfile(candidate):
                continue
            spec = importlib.util.spec_from_file_location("sitecustomize", candidate)
            if spec is None or spec.loader is None:
                return
            module = importlib.util.module_from_spec(spec)
            # The user's module becomes `sitecustomize`, as it would have without us.
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            return
    except Exception:
        # A broken user sitecustomize is reported the way Python reports it, minus the crash.
        import traceback
        traceback.print_exc()


if not _disabled():
    _initialize()
_chain()
