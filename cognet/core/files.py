"""Checks on where a command will write, made before it works (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path

from cognet.core.errors import InputError


def writable_folder(folder: str | Path, what: object) -> None:
    """InputError naming `what` unless `folder` is, or can be made as, a writable directory:
    it is a directory, or its nearest existing ancestor is a writable one."""
    folder = Path(os.path.abspath(folder))
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{what}: cannot write there ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{what}: cannot write there ({existing} is not writable)")
