"""ckptwatch: see every torch.save, catch concurrent writes to one checkpoint path.

In-process API (stdlib only; torch is imported lazily, never by this package itself):

    import monitor
    monitor.install()     # patch torch.save now, or as soon as torch is imported
    monitor.uninstall()   # restore the original torch.save (only if still ours)
"""
from monitor.version import __version__

__all__ = ["__version__", "install", "uninstall"]


def install() -> bool:
    """Patch torch.save (and torch.serialization.save). Idempotent. See monitor.hook."""
    from monitor import hook
    return hook.install()


def uninstall() -> bool:
    """Restore the original torch.save if the current one is ours. Idempotent."""
    from monitor import hook
    return hook.uninstall()
