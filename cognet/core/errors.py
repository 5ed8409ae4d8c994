"""Exceptions shared by every cognet command (torch-free)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator


class InputError(ValueError):
    """A user or input mistake: one line naming the file, column and row.

    CLIs print the message and exit with code 2, without a traceback.
    """


class ParityError(RuntimeError):
    """An exported graph or runtime disagrees with the torch model."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (white space folded), or its type's name when it
    has none: the detail of an input error's single line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def escaped(text: str) -> str:
    """`text` with every character that is not printable (control, format and bidi
    characters such as ESC or U+202E, line separators, lone surrogates of undecodable file
    names) written as its Python escape (`\\x1b`, `\\u202e`): an error line shows what a
    file or option holds, and nothing in it can restyle or reorder the terminal."""
    if text.isprintable():
        return text
    return "".join(
        c
        if c.isprintable() or c == " "
        else c.encode("unicode_escape", "backslashreplace").decode()
        for c in text
    )


def where(path: object, column: str | None = None, row: int | None = None) -> str:
    """Format the location prefix of an input error: ``FILE: column C, row R``."""
    parts = [str(path)]
    detail = []
    if column is not None:
        detail.append(f"column {column!r}")
    if row is not None:
        detail.append(f"row {row}")
    if detail:
        parts.append(", ".join(detail))
    return ": ".join(parts)


class OutputError(RuntimeError):
    """An output that could not be written (disk full, no permission): one line naming the
    file. CLIs print it without a traceback and exit with code 1."""


def os_reason(exc: BaseException) -> str:
    """What went wrong in an OSError, in a few lower-case words ("no space left on device").

    A full disk does not always come as an OSError: numpy reports a short write as "2400
    requested and 1008 written", safetensors wraps the OS error in its own; all read as a
    full disk."""
    text = str(exc)
    full = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    short_write = "requested and" in text and "written" in text
    if full or short_write or "no space left on device" in text.lower():
        return "no space left on device"
    strerror = getattr(exc, "strerror", None)
    return strerror.lower() if strerror else one_line(exc)


@contextlib.contextmanager
def writing(path: object) -> Iterator[None]:
    """Turn a failure to write `path` (OSError, or a library's wrapper of one) into an
    OutputError naming it: `PATH: no space left on device`."""
    try:
        yield
    except OutputError:
        raise
    except Exception as exc:
        reason = os_reason(exc)
        if not isinstance(exc, OSError) and reason != "no space left on device":
            raise
        raise OutputError(f"{path}: {reason}") from None
