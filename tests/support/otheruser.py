"""Playing another local user: tests that run as root chown files to uid 65534 (nobody), or
start a child that drops to it with setuid; elsewhere they skip."""
from __future__ import annotations

import os

import pytest

from helpers import remove_tree, short_tmpdir

NOBODY, NOGROUP = 65534, 65533

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root")


@pytest.fixture
def public_dir():
    """A short temporary directory that every user may enter (0755, root's)."""
    path = short_tmpdir("cwt")
    os.chmod(path, 0o755)
    yield path
    remove_tree(path)
