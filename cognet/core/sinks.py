"""Outputs that name no regular file (torch-free): the null device, other special files and
paths that name nothing, checked by every command before any work.

A file output is written beside its target and renamed over it (`cognet.core.files`): run
as root, that rename would replace a device node, a FIFO or a socket with a plain file (the
machine's /dev/null included). So an output naming a device, FIFO or socket is refused
(`check_output`), except the null device: written to in place (`atomic_path`), with no
rename and no lock file beside it (`cognet.core.lock.claim`), its node untouched. An output
path that names no file (`.`, `./`, `''`, `/`, `..`) is refused too: every output has a name,
and the lock and temporary names are made from it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cognet.core.errors import InputError

KINDS = {
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
}


def is_null_device(path: str | Path) -> bool:
    """Whether `path` (links followed) is the null device node."""
    try:
        st, null = os.stat(path), os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev


def special_kind(path: str | Path) -> str | None:
    """The kind of special file `path` names (links followed): "FIFO", "socket",
    "character device" or "block device"; None for a regular file, a folder, nothing."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return KINDS.get(stat.S_IFMT(mode))


def check_name(path: str | Path, option: object) -> None:
    """InputError (exit 2) when `path` names no file or folder."""
    if Path(path).name in ("", ".", ".."):
        raise InputError(
            f"{option} {str(path)!r}: names no file or folder; give the output's name "
            f"(e.g. {option} out)"
        )


def check_output(path: str | Path, option: object) -> bool:
    """InputError (exit 2) when `path` names no file, or a device, FIFO or socket other than
    the null device; True when it is the null device (written in place), else False."""
    check_name(path, option)
    if is_null_device(path):
        return True
    kind = special_kind(path)
    if kind:
        raise InputError(
            f"{path}: {option} is a {kind}; an output is written as a new file renamed over "
            "its path, which would replace it: name a regular file (or /dev/null)"
        )
    return False
