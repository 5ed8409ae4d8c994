"""Where and how every cognet command writes (torch-free): the one atomic-write helper and
the checks made before any work.

Writing. Every output goes through `atomic_path`: the writer fills a temporary file (or
folder) beside the target, named `.NAME.PID-RANDOM.tmp` (`temp_path`, the one naming scheme),
which is fsync'ed and renamed over the target with `os.replace`; on any failure it is
removed, so a target is complete or untouched. A failure to write (a full disk, a permission
denied) is an OutputError naming the target. `commit_dir` moves a folder written whole in
place of an older one.

Guarding. `check_outputs` refuses (InputError, exit 2) before any work an output that lands
on what the run reads: a file it reads, a dataset, checkpoint or model directory it reads or
one of their files (`Reads`), or a path inside a folder it reads by listing (a CDM folder, a
scoring input directory). Symlinks are resolved. A new file beside a dataset's files stays
allowed (`--json data/report.json`). It also refuses an output that cannot be written
there (`writable_file`, `writable_folder`). `guarded` runs both checks, then holds each
output's lock (`cognet.core.lock.claim`) for the run: one writer per output.
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


# ---------------------------------------------------------------- file references


def confined(folder: str | Path, name: object, where: str) -> Path:
    """`folder/name` for a file name read from a manifest or checkpoint, refused (InputError
    naming `where`, the file and field that hold it) before anything opens it unless `name`
    is a plain name (no folder part, not absolute) that stays inside `folder` once symlinks
    are resolved."""
    if not isinstance(name, str) or not name or name in (".", ".."):
        raise InputError(f"{where}: {name!r} is not a file name")
    if Path(name).is_absolute() or Path(name).name != name or "\\" in name:
        raise InputError(f"{where}: {name!r} is not a plain file name inside {folder}")
    path = Path(folder) / name
    real, home = _real(path), _real(folder)
    if home not in real.parents:
        raise InputError(f"{where}: {name!r} leads outside {folder} (to {real})")
    return path


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
            files.append((Path(d), "the dataset directory"))
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
    folders: Mapping[str, Iterable[str]] | Iterable[str] = (),
) -> None:
    """InputError (exit 2) naming the output when it lands on what the run reads (see the
    module docstring) or cannot be written. outputs: {option: path}, None for an option
    not given; folders: the options whose output is a folder, or {option: the names of the
    files the run writes in that folder} (each checked as an output too)."""
    folders = _contents(folders)
    given = {k: Path(v) for k, v in outputs.items() if v}
    check_not_read(given, reads, folders)
    for option, path in given.items():
        if option in folders:
            writable_folder(path, f"{path}: {option}")
        else:
            writable_file(path, option)


def check_not_read(
    outputs: Mapping[str, str | Path | None],
    reads: Reads,
    contents: Mapping[str, Iterable[str]] | None = None,
) -> None:
    """The first half of `check_outputs`: InputError when an output (or a file written in
    a folder output: `contents`) is something the run reads, lies inside a folder it lists,
    or two outputs are one path."""
    files, listed = reads.protected()
    given = {k: Path(v) for k, v in outputs.items() if v}
    for option, folder_or_file in given.items():
        written = [folder_or_file, *(folder_or_file / n for n in (contents or {}).get(option, ()))]
        for path in written:
            real = _real(path)
            for file, what in files:
                if real == file or _same_file(real, file):
                    raise InputError(
                        f"{path}: {option} would overwrite {what} {file}; choose another"
                    )
            for folder, what in listed:
                if real == folder or folder in real.parents:
                    raise InputError(f"{path}: {option} is inside {what} {folder}; choose another")
        path, real = folder_or_file, _real(folder_or_file)
        for other, other_path in given.items():
            if other < option and _real(other_path) == real:
                raise InputError(f"{path}: {option} and {other} name the same path")


@contextlib.contextmanager
def guarded(
    command: str,
    outputs: Mapping[str, str | Path | None],
    reads: Reads,
    folders: Mapping[str, Iterable[str]] | Iterable[str] = (),
    clean: bool = True,
) -> Iterator[None]:
    """`check_outputs`, then every output locked (`claim`) for the block: a second run on
    one of them is refused (exit 2) naming the run that holds it. When the block fails (an
    exit with a code other than 0 included), what it added to a folder output goes (the
    folder too when the block made it), so a failed run leaves no half dataset, unless not
    `clean` (the command cleans up itself); a folder made for a lock goes when left empty."""
    from cognet.core.lock import claim

    folders = _contents(folders)
    check_outputs(outputs, reads, folders)
    given = {k: Path(v) for k, v in outputs.items() if v}
    made = [p.parent for p in given.values() if not p.parent.exists()]
    before = {k: _entries(p) for k, p in given.items() if k in folders}
    try:
        with contextlib.ExitStack() as stack:
            for path in given.values():
                stack.enter_context(claim(path, command))
            try:
                yield
            except BaseException as exc:
                if clean and _failed(exc):
                    for option, entries in before.items():
                        _remove_new(given[option], entries)
                raise
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _contents(folders: Mapping[str, Iterable[str]] | Iterable[str]) -> dict[str, tuple]:
    """{option: names written in it} of the folder outputs (no names: only the folder)."""
    if isinstance(folders, Mapping):
        return {k: tuple(v) for k, v in folders.items()}
    return dict.fromkeys(folders, ())


def _failed(exc: BaseException) -> bool:
    """Whether an exception ends a run in failure: not an exit with code 0 (sys.exit(0), or
    click's Exit(0) that ends every successful command)."""
    code = exc.code if isinstance(exc, SystemExit) else getattr(exc, "exit_code", 1)
    return code not in (0, None)


def _entries(folder: Path) -> set[str] | None:
    """The names in `folder`, None when it does not exist yet."""
    return set(os.listdir(folder)) if folder.is_dir() else None


def _remove_new(folder: Path, before: set[str] | None) -> None:
    """Remove what was added to `folder` since `before` (the folder itself when it was not
    there)."""
    if before is None:
        remove(folder)
    elif folder.is_dir():
        for name in set(os.listdir(folder)) - before:
            remove(folder / name)


def writable_file(path: str | Path, what: object) -> None:
    """InputError naming `what` unless a file can be written at `path`: not a directory,
    in a folder that exists and is writable."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: {what} is a directory; it names a file to write")
    folder = Path(os.path.abspath(path)).parent
    if not folder.is_dir():
        raise InputError(f"{path}: {what}: the folder {folder} does not exist")
    writable_folder(folder, f"{path}: {what}")


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
