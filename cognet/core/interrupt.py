"""SIGTERM and SIGINT as exceptions, so that a stopped run unwinds like a failed one and
removes what it created (torch-free).

    with terminating():
        ...  # SIGTERM raises Terminated here, SIGINT KeyboardInterrupt

The writers clean up in `finally` blocks and `except BaseException` handlers (the temporary
file of `cognet.core.files.atomic_path`, a staged folder of `cognet.core.files.guarded`);
Python's default SIGTERM ends the process without running them. kill -9 cannot be caught:
what it leaves (temporary names only, never a half output) is removed by the next run that
holds the output's lock (`cognet.core.lock.claim`).

`kill_point(name)` lets the tests stop a writer at a named point of its write, without
timing: with COGNET_KILL_AT=NAME (or NAME:KILL for kill -9) in the environment, the process
signals itself when it reaches that point. The points: `staged` (a folder output is
complete in its temporary sibling), `aside` (the new folder is in place, the older one it
replaced not yet removed from its temporary name), `replace` (a file is complete under its
temporary name), `merged` (cognet-batch score: OUT is in place, its rejects file not yet).
NAME:INT sends SIGINT (Ctrl-C) instead; NAME:STOP stops the process (SIGSTOP) there, for a
test to act while the run holds its locks, then continue it (SIGCONT).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

KILL_AT = "COGNET_KILL_AT"
EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a run ended by SIGTERM


class Terminated(BaseException):
    """The process received SIGTERM (a BaseException, like KeyboardInterrupt: no handler of
    errors may swallow it)."""


def _raise(signum, frame) -> None:
    raise Terminated(f"terminated by signal {signum}")


@contextlib.contextmanager
def terminating() -> Iterator[None]:
    """SIGTERM raises Terminated and SIGINT KeyboardInterrupt inside the block (main thread
    only; elsewhere the block runs unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise)
    before_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)


def kill_point(name: str) -> None:
    """Signal this process (SIGTERM; NAME:KILL, NAME:STOP, NAME:INT for SIGKILL, SIGSTOP,
    SIGINT) the first time it reaches the point COGNET_KILL_AT names; a no-op otherwise."""
    point, _, how = os.environ.get(KILL_AT, "").partition(":")
    if point == name and name not in _reached:
        _reached.add(name)
        signals = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "INT": signal.SIGINT}
        signum = signals.get(how, signal.SIGTERM)
        os.kill(os.getpid(), signum)


_reached: set[str] = set()  # the points met (a stopped run, continued, goes on)
