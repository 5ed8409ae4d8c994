"""One writer per output: an exclusive lock on an output, held for a whole run (torch-free,
so that every command takes it: training, export, the data converters, scoring,
evaluation's files, the benchmark).

    with claim(out, "cognet train"):
        ...  # the only run writing OUT (a file, a folder or a parts folder: lock `.OUT.lock`)

Every command locks an output the same way, whatever it writes there: `claim` takes the
lock file `.NAME.lock` beside the output, so `cognet train --out R` and `cognet-batch score
--out R` (or `cognet evaluate --predictions P` and `cognet-batch score --out P`) exclude each
other. `OutputLock.acquire` takes `flock(LOCK_EX | LOCK_NB)` on the lock file (created with
its folder when missing) and writes `PID HOST COMMAND` in it; a second run gets
`OutputBusy`, an InputError naming the holder's command and pid, at once (it never waits).
Both scoring engines take the same locks, so a local and a Ray run on one OUT exclude each
other too, and `--resume` takes them like any run.

The kernel drops the lock when its holder's process ends, however it ends (kill -9 and a
crash included): there is no stale lock to clean up, at most a lock file that the next run
reuses, and no pid is trusted to decide anything (pids are reused; Ray workers live on other
hosts). What a killed run may leave are temporary names (`cognet.core.files.temp_path`:
`.NAME.PID-RANDOM.tmp`); `claim` removes those of its output once it holds the lock, when
no other run can be writing them. `release` removes the lock file before it unlocks. A run
that finds the file gone or replaced right after locking it (its holder was removing it)
locks the new one instead, so two runs never hold different files.

What a network file system promises: Linux runs flock over NFS as an NFS byte-range lock
(NFSv4, or NLM for v3), which other clients see while the server keeps the lock. It does not
hold on a mount with `nolock` or `local_lock` (each client then locks only for itself), nor
on file systems without locking (some FUSE and object-store mounts). A client cut from the
server may lose its lock when its lease expires (about 90 s on NFSv4) without being told,
and a second run may then start. On such storage, give each run its own OUT.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

from cognet.core.errors import InputError, OutputError, one_line, os_reason
from cognet.core.interrupt import terminating
from cognet.core.sinks import is_null_device

ATTEMPTS = 20  # retries when the file is removed or replaced while we lock it


class OutputBusy(InputError):
    """Another run holds the lock."""


class OutputLock:
    """An exclusive, non-blocking lock on `path`; a context manager (`acquire`/`release`).

    what: how the error names the locked output (default: the lock file's folder);
    command: this run's command, written in the lock file for a refused run to name;
    keep_folder: never remove the lock's folder; sweep: the output whose leftover temporary
    names to remove once locked; sink: lock nothing (the null device, which any number of
    runs may write)."""

    def __init__(
        self,
        path: str | Path,
        what: str | None = None,
        command: str = "cognet-batch score",
        keep_folder: bool = False,
        sweep: str | Path | None = None,
        sink: bool = False,
    ):
        self.sink = sink
        self.path = Path(path)
        self.what = what or str(self.path.parent)
        self.command = command
        self.keep_folder = keep_folder
        self.sweep = sweep
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Lock, or raise OutputBusy (held elsewhere) or InputError (cannot create the file)."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already locked by this object")
        if self.sink:
            return
        for _ in range(ATTEMPTS):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise InputError(f"{self.path}: cannot lock ({one_line(exc)})") from None
                raise OutputBusy(
                    f"{self.what}: is being written by {holder(self.path)}; wait for it to "
                    "end or choose another output"
                ) from None
            if _same_file(fd, self.path):
                self._fd = fd
                self._sign()
                if self.sweep is not None:
                    sweep_temps(self.sweep)
                return
            os.close(fd)  # removed or replaced by its last holder: lock the new one
        raise InputError(f"{self.path}: the lock file keeps changing; is another run looping?")

    def _sign(self) -> None:
        """Write `PID HOST COMMAND` in the held lock file; on a full disk, let the lock go
        (its file removed) and raise OutputError naming the output (exit 1)."""
        try:
            os.ftruncate(self._fd, 0)
            os.write(self._fd, f"{os.getpid()} {socket.gethostname()} {self.command}\n".encode())
        except OSError as exc:
            self.release()
            raise OutputError(f"{self.what}: {os_reason(exc)}") from None

    def _open(self) -> int:
        folder = self.path.parent
        try:
            if not folder.is_dir():
                folder.mkdir(parents=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileExistsError:  # made by another run in the meantime
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if os_reason(exc) == "no space left on device":  # a full disk: exit 1, as writes
                raise OutputError(f"{self.what}: no space left on device") from None
            raise InputError(f"{self.path}: cannot create ({os_reason(exc)})") from None

    def release(self) -> None:
        """Remove the lock file (and its folder when left empty), then unlock."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink()
            if not self.keep_folder:
                try:
                    self.path.parent.rmdir()
                except OSError:  # not empty: the parts --resume needs
                    pass
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)


def lock_file(out: str | Path) -> Path:
    """The lock file of an output that is one file or folder: `.NAME.lock` beside it."""
    out = Path(out)
    return out.with_name(f".{out.name}.lock")


def claim(out: str | Path, command: str) -> OutputLock:
    """The lock that makes `command` the only run writing `out` (a file, a folder or a parts
    folder); use it as a context manager around the whole run. A second run gets OutputBusy
    (exit 2) naming the holder. Once locked, the temporary names a killed run left for `out`
    are removed (`sweep_temps`)."""
    sink = is_null_device(out)  # nothing to lock, and no lock file in /dev
    return OutputLock(
        lock_file(out), what=str(out), command=command, keep_folder=True, sweep=out, sink=sink
    )


@contextlib.contextmanager
def claimed(outputs: Iterable[str | Path | None], command: str) -> Iterator[None]:
    """Every output (None: not given) claimed for the block, SIGTERM and SIGINT raised as
    exceptions inside it (`cognet.core.interrupt.terminating`) so that a stopped run cleans
    up like a failed one."""
    with contextlib.ExitStack() as stack:
        for out in outputs:
            if out:
                stack.enter_context(claim(out, command))
        stack.enter_context(terminating())
        yield


def sweep_temps(out: str | Path) -> list[Path]:
    """Remove the temporary names that a killed run left for `out`: `.NAME.PID-RANDOM.tmp`
    beside it (files or folders), and, when `out` is a folder written file by file (a parts
    folder, the benchmark's), such names inside it. Call it only holding `out`'s lock: no
    other run writes there then. Returns what went."""
    out = Path(out)
    found = _temps(out.parent, re.escape(out.name))
    if out.is_dir() and not out.is_symlink():
        found += _temps(out, ".+")
    for path in found:  # files.remove's rule, here: files imports this module
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return found


def _temps(folder: Path, name: str) -> list[Path]:
    pattern = re.compile(rf"\.{name}\.\d+-[0-9a-f]{{8}}\.tmp")
    try:
        return [folder / n for n in os.listdir(folder) if pattern.fullmatch(n)]
    except OSError:
        return []


def holder(path: str | Path) -> str:
    """`COMMAND (pid N)` (`... (pid N on HOST)` from another machine) of the lock file's last
    holder."""
    try:
        pid, host, *command = Path(path).read_text().split() + ["?", "?"]
    except OSError:
        return "another run (pid unknown)"
    name = " ".join(c for c in command if c != "?") or "another cognet run"
    where = f"pid {pid}" if host in ("?", socket.gethostname()) else f"pid {pid} on {host}"
    return f"{name} ({where})"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
