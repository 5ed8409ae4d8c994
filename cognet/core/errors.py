"""Exceptions shared by every cognet command (torch-free)."""


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
