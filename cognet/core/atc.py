"""ATC codes checked by their form, not their length (torch-free).

An ATC code of level 3 is a letter, two digits and a letter (A10B); level 4 adds a letter
(A10BA) and level 5 two digits (A10BA02). cognet's medications are level-3 classes, the first
four characters of a code of level 3 or below. "ZZZZZZZZ" and "hello world" have lengths
that pass a length check and are not ATC codes.
"""

from __future__ import annotations

import re

ATC = re.compile(r"[A-Z][0-9]{2}[A-Z](?:[A-Z](?:[0-9]{2})?)?")


def is_atc(code: object) -> bool:
    """Whether `code` is an ATC code of level 3, 4 or 5."""
    return isinstance(code, str) and ATC.fullmatch(code) is not None


def atc3(code: object) -> str | None:
    """The level-3 class of an ATC code of level 3 or below, else None."""
    return code[:4] if is_atc(code) else None
