"""Where and how every cognet command writes (torch-free): the one atomic-write helper and
the checks made before any work.

Writing. Every output goes through `atomic_path`: the writer fills a temporary file (or
folder) beside the target, named `.NAME.PID-RANDOM.tmp` (`temp_path`, the one naming scheme),
which is fsync'ed and renamed over the target with `os.replace`; on any failure it is
removed, so a target is complete or untouched. A failure to write (a full disk, a permission
denied) is an OutputError naming the target. `commit_dir` moves a folder written whole in
place of an older one.

Guarding. `check_outputs` refuses (InputError, exit 2) before any work an output that lands
on what the run reads: a file it reads, a file of a dataset, checkpoint or model directory
it reads (`Reads`), a path inside a folder it reads by listing, or (for a folder output)
a folder that holds any of these. Symlinks are resolved. It also refuses an output that
cannot be written there (`writable_file`, `writable_folder`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cognet.core.errors import InputError, writing

DATASET_FILES = ("visits.parquet", "ddi.parquet", "summary.json")


def temp_path(path: str | Path) -> Path:
    """The temporary name of `path` while it is written: `.NAME.PID-RANDOM.tmp` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def is_temp(name: str) -> bool:
    """Whether a file name is one of `temp_path`'s."""
    return name.startswith(".") and name.endswith(".tmp")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield the temporary path for `path`; when the block ends without error, the file (or
    folder) written there is fsync'ed and renamed to `path`, replacing any file there.
    On an error it is removed. An OSError (a full disk) becomes an OutputError naming
    `path`."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with writing(path):
            yield tmp
            fsync(tmp)
            os.replace(tmp, path)
            _fsync_folder(path.parent)
    finally:
        remove(tmp)


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def commit_dir(tmp: str | Path, path: str | Path) -> None:
    """Move the folder `tmp`, written whole, to `path`; an older `path` is moved aside first
    and removed after, so `path` is at every moment the old folder or the new one (or, for
    an instant, absent)."""
    tmp, path = Path(tmp), Path(path)
    fsync(tmp)
    old = None
    with writing(path):
        if path.is_dir() and not path.is_symlink():
            old = temp_path(path)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    if old is not None:
        remove(old)


def fsync(path: Path) -> None:
    """fsync a file, or a folder and every file in it."""
    if path.is_dir():
        for child in path.iterdir():
            if child.is_file():
                fsync(child)
        _fsync_folder(path)
        return
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot sync a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    """Remove a file or a folder if there; never fails."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------- checks before work


@dataclass
class Reads:
    """What a run reads, for `check_outputs`.

    files: files it reads; folders: folders it reads by listing (every file under them
    is an input: a CDM folder, a scoring input directory); datasets, checkpoints, models:
    such directories (a dataset's files are DATASET_FILES; every file of a checkpoint or
    model directory counts)."""

    files: list = field(default_factory=list)
    folders: list = field(default_factory=list)
    datasets: list = field(default_factory=list)
    checkpoints: list = field(default_factory=list)
    models: list = field(default_factory=list)

    def protected(self) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
        """([(file, what)], [(folder, what)]): the files no output may be, and the folders
        no output may be in (resolved)."""
        files = [(p, "the input file") for p in self.files if p]
        for d in filter(None, self.datasets):
            files += [(Path(d) / n, f"a file of the dataset {d}") for n in DATASET_FILES]
        for kind, dirs in (("checkpoint", self.checkpoints), ("model", self.models)):
            for d in filter(None, dirs):
                d = Path(d)
                files.append((d, f"the {kind} directory"))
                if d.is_dir():
                    files += [(p, f"a file of the {kind} {d}") for p in sorted(d.iterdir())]
        folders = [(Path(d), "the input folder") for d in self.folders if d]
        return [(_real(p), w) for p, w in files], [(_real(d), w) for d, w in folders]


def check_outputs(
    outputs: Mapping[str, str | Path | None],
    reads: Reads,
    folders: Iterable[str] = (),
) -> None:
    """InputError (exit 2) naming the output when it lands on what the run reads (see the
    module docstring) or cannot be written. outputs: {option: path}, None for an option
    not given; folders: the options whose output is a folder (written whole)."""
    files, listed = reads.protected()
    given = {k: Path(v) for k, v in outputs.items() if v}
    for option, path in given.items():
        real = _real(path)
        for file, what in files:
            if real == file or _same_file(real, file):
                raise InputError(f"{path}: {option} would overwrite {what} {file}")
            if option in folders and real in file.parents:
                raise InputError(f"{path}: {option} holds {what} {file}; choose another folder")
        for folder, what in listed:
            if real == folder or folder in real.parents:
                raise InputError(f"{path}: {option} is inside {what} {folder}")
            if option in folders and real in folder.parents:
                raise InputError(f"{path}: {option} holds {what} {folder}")
        for other, other_path in given.items():
            if other < option and _real(other_path) == real:
                raise InputError(f"{path}: {option} and {other} name the same path")
        if option in folders:
            writable_folder(path, option)
        else:
            writable_file(path, option)


def writable_file(path: str | Path, what: object) -> None:
    """InputError naming `what` unless a file can be written at `path`: not a directory,
    in a folder that exists (or can be made) and is writable."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: {what} is a directory; it names a file to write")
    writable_folder(path.parent, f"{path}: {what}")


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


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
