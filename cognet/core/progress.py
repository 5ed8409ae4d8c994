"""Progress bars on stderr (tqdm), silent where nobody watches."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def progress(
    iterable: Iterable[T] | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    quiet: bool = False,
):
    """A tqdm bar on stderr, silent when stderr is not a terminal or when quiet."""
    from tqdm.auto import tqdm

    disable = quiet or not sys.stderr.isatty()
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        disable=disable,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
    )
