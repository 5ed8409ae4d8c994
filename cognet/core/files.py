"""Where and how every cognet command writes (torch-free): the one atomic-write helper and
the checks made before any work.

Writing. Every output goes through `atomic_path`: the writer fills a temporary file (or
folder) beside the target, named `.NAME.PID-RANDOM.tmp` (`temp_path`, the one naming scheme),
which is fsync'ed and renamed over the target with `os.replace`; on any failure it is
removed, so a target is complete or untouched. A failure to write (a full disk, a permission
denied) is an OutputError naming the target. `commit_dir` moves a folder written whole in
place of an older one.

Folders. A folder output whose files are known (a dataset, a checkpoint, a model: `guarded`'s
`folders` with names) is written whole in a temporary sibling (`Stage`) and moved into place
by `commit_dir` when the run succeeds: a reader sees the old folder or the new one, never a
mix, and a failed, interrupted or killed run leaves the old folder (or none) as it was. An
existing folder is replaced only when it holds nothing but such files (the output of an
earlier run); one holding anything else is refused before any work, never removed.

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
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cognet.core.errors import InputError, OutputError, writing
from cognet.core.interrupt import kill_point
from cognet.core.lock import claimed
from cognet.core.sinks import check_name, check_output, is_null_device, special_kind

DATASET_FILES = ("visits.parquet", "ddi.parquet", "summary.json")


def temp_path(path: str | Path) -> Path:
    """The temporary name of `path` while it is written: `.NAME.PID-RANDOM.tmp` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def is_temp(name: str) -> bool:
    """Whether a file name is one of `temp_path`'s."""
    return name.startswith(".") and name.endswith(".tmp")


def target_of(path: str | Path) -> Path:
    """The output a temporary name stands for (`.NAME.PID-RANDOM.tmp` -> NAME), else `path`:
    what a file written inside a staged folder records as its folder."""
    path = Path(path)
    match = re.fullmatch(r"\.(.+)\.\d+-[0-9a-f]{8}\.tmp", path.name)
    return path.with_name(match.group(1)) if match else path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield the temporary path for `path`; when the block ends without error, the file (or
    folder) written there is fsync'ed and renamed to `path`, replacing any file there.
    On an error it is removed. An OSError (a full disk) becomes an OutputError naming
    `path`. The null device is written in place (no rename would keep its node); any other
    device, FIFO or socket is refused (`cognet.core.sinks`)."""
    path = Path(path)
    if is_null_device(path):
        with writing(path):
            yield path
        return
    kind = special_kind(path)
    if kind:  # checked before work too; never renamed over
        raise InputError(f"{path}: is a {kind}; an output is never written over one")
    tmp = temp_path(path)
    try:
        with writing(path):
            yield tmp
            fsync(tmp)
            kill_point("replace")
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
    """Move the folder `tmp`, written whole, to `path`. An older `path` is swapped with it in
    one step (`renameat2(RENAME_EXCHANGE)`) and removed after, so `path` is at every moment
    the old folder or the new one; where the file system cannot swap, the old folder is
    moved aside first (put back when the move in fails), so `path` may be absent for an
    instant. What is moved aside carries a temporary name, removed by the next run that
    holds the output's lock if this one is killed before removing it."""
    tmp, path = Path(tmp), Path(path)
    fsync(tmp)
    with writing(path):
        if not path.is_dir() or path.is_symlink():
            os.replace(tmp, path)
            _fsync_folder(path.parent)
            return
        if _exchange(tmp, path):
            old = tmp
        else:
            old = temp_path(path)
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)  # the old folder back where it was
                raise
        _fsync_folder(path.parent)
    try:
        kill_point("aside")
    finally:
        remove(old)  # the old folder, under its temporary name


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the C
    library or the file system cannot."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100  # AT_FDCWD: paths relative to the working folder
    exchange = 2  # RENAME_EXCHANGE
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


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
    if not isinstance(name, str) or not name or name in (".", "..") or "\x00" in name:
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
    for option, path in outputs.items():
        if path is not None:  # '' names no file: refused, not taken for "not given"
            check_name(path, option)
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


class Stage:
    """Where a `guarded` run writes each output: `stage[option]` is the path itself for a
    file, or a temporary sibling (`temp_path`) for a folder built whole, moved into place by
    `commit` (the guard commits at the end of a successful block; a caller may commit
    earlier, e.g. to keep a failed export's report)."""

    def __init__(self, outputs: Mapping[str, Path], staged: Iterable[str]):
        self.outputs = dict(outputs)
        self.temps = {k: temp_path(self.outputs[k]) for k in staged}

    def __getitem__(self, option: str) -> Path:
        return self.temps.get(option, self.outputs[option])

    def commit(self) -> None:
        """Move every staged folder that was written into place (`commit_dir`)."""
        for option, tmp in list(self.temps.items()):
            if tmp.is_dir():
                kill_point("staged")
                commit_dir(tmp, self.outputs[option])
            del self.temps[option]

    def named(self, exc: BaseException) -> BaseException:
        """An InputError or OutputError that names a staged path, naming the output instead
        (`PATH: no space left on device` names the checkpoint, not its temporary sibling);
        any other exception as it is."""
        if not isinstance(exc, (InputError, OutputError)):
            return exc
        text = str(exc)
        for option, tmp in self.temps.items():
            text = text.replace(str(tmp), str(self.outputs[option]))
        return exc if text == str(exc) else type(exc)(text)

    def discard(self) -> None:
        """Remove what was staged and not committed."""
        for tmp in self.temps.values():
            remove(tmp)
        self.temps.clear()


@contextlib.contextmanager
def guarded(
    command: str,
    outputs: Mapping[str, str | Path | None],
    reads: Reads,
    folders: Mapping[str, Iterable[str]] | Iterable[str] = (),
) -> Iterator[Stage]:
    """`check_outputs`, then every output locked (`claim`) for the block: a second run on
    one of them is refused (exit 2) naming the run that holds it. Yields the `Stage`: a
    folder output whose file names are given is written in a temporary sibling and moved
    into place when the block succeeds; when it fails (an exit with a code other than 0, an
    interrupt and SIGTERM included) the staged folder goes and nothing else: a run never
    removes what it did not create. A folder made for a lock goes when left empty."""
    folders = _contents(folders)
    check_outputs(outputs, reads, folders)
    given = {k: Path(v) for k, v in outputs.items() if v}
    staged = [k for k in given if folders.get(k)]
    made = [p.parent for p in given.values() if not p.parent.exists()]
    stage = Stage(given, staged)
    try:
        with claimed(given.values(), command):
            for option in staged:  # checked holding the lock: no other run changes it now
                replaceable(given[option], folders[option], option)
            try:
                yield stage
            except BaseException as exc:
                if not _failed(exc):
                    stage.commit()
                    raise
                named = stage.named(exc)
                stage.discard()
                if named is not exc:
                    raise named from None
                raise
            stage.commit()
    finally:
        stage.discard()
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def replaceable(folder: Path, names: Iterable[str], option: str) -> None:
    """InputError unless `folder` is absent, or a folder holding only `names` (what an
    earlier run of the command wrote, which the new output replaces whole) and temporary
    names: a folder holding anything else is never replaced."""
    if not folder.is_dir():
        return
    names = set(names)
    other = sorted(n for n in os.listdir(folder) if n not in names and not is_temp(n))
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise InputError(
            f"{folder}: {option} holds files this command does not write ({shown}); it "
            "would replace the folder whole: choose a new or empty folder"
        )


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


def writable_file(path: str | Path, what: object) -> None:
    """InputError naming `what` unless a file can be written at `path`: not a directory,
    in a folder that exists and is writable."""
    path = Path(path)
    if check_output(path, what):
        return  # the null device: written in place, nothing made beside it
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
