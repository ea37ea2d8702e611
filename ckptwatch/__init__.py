"""ckptwatch: see every torch.save, catch concurrent writes to one checkpoint path.

In-process API (stdlib only; torch is imported lazily, never by this package itself):

    import ckptwatch
    ckptwatch.install()     # patch torch.save now, or as soon as torch is imported
    ckptwatch.uninstall()   # restore the original torch.save (only if still ours)
    ckptwatch.CheckpointCollisionWarning   # what CKPTWATCH_POLICY=warn issues (ckptwatch.policy)
    ckptwatch.CheckpointRefused    # what a load raises under CKPTWATCH_POLICY=strict
                                   # (ckptwatch.resumeguard)
"""
from ckptwatch.version import __version__

__all__ = ["CheckpointCollisionWarning", "CheckpointRefused", "__version__", "install",
           "is_installed", "uninstall"]


def __getattr__(name):
    # Lazily: ckptwatch.policy and ckptwatch.resumeguard import logging, which every Python process under the
    # bootstrap would otherwise pay for.
    if name == "CheckpointCollisionWarning":
        from ckptwatch.policy import CheckpointCollisionWarning
        return CheckpointCollisionWarning
    if name == "CheckpointRefused":
        from ckptwatch.resumeguard import CheckpointRefused
        return CheckpointRefused
    raise AttributeError(f"module 'ckptwatch' has no attribute {name!r}")


def install() -> bool:
    """Patch torch.save (and torch.serialization.save) now, or as soon as torch is imported.
    Idempotent. See ckptwatch.bootstrap and ckptwatch.hook."""
    from ckptwatch import bootstrap
    return bootstrap.install()


def uninstall() -> bool:
    """Restore the original torch.save and the other writers' functions where the current
    ones are ours. Idempotent."""
    from ckptwatch import hook, writers
    restored = writers.uninstall()
    return hook.uninstall() or restored


def is_installed() -> bool:
    """True if torch is imported and its save is ours."""
    from ckptwatch import hook
    return hook.is_installed()
