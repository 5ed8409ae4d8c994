"""Numbers that are numbers: finite-value checks and strict JSON (torch-free).

A NaN slips through every range check (`nan < 0` and `nan > 1` are both False) and an
infinity through every one-sided one, so each float the project takes (an option, a field of
config.json or manifest.json) goes through `finite` first; a JSON boolean is not a number
(`true` is not 1.0). JSON is read with `loads`, which refuses NaN, Infinity and numbers that
overflow a float (1e999), and written with `dumps`, which never writes them (Python's json
module does both by default, and neither is JSON): a float that is not finite is written as
null, the value it stands for being unknown.

`loads` also refuses what JSON parsers disagree on or choke on: a key given twice in one
object (Python keeps the last, other readers the first: a file would say two things) and
nesting deeper than MAX_DEPTH (Python's parser recurses and would end in RecursionError).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64  # objects and arrays in one another; cognet's own files nest 6 deep at most
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string, or a bracket


def is_number(value: object) -> bool:
    """A finite int or float, not a bool (numpy scalars included)."""
    if isinstance(value, bool) or not hasattr(value, "__float__") or isinstance(value, str):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def finite(value: object, what: str) -> float:
    """`value` as a float; ValueError naming `what` unless it is a finite number (a bool, a
    string, NaN or an infinity is not)."""
    if not is_number(value):
        raise ValueError(f"{what} must be a finite number, not {value!r}")
    return float(value)


def _refuse(token: str) -> float:
    raise ValueError(f"{token} is not a number JSON allows")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a float")
    return value


def loads(text: str | bytes) -> Any:
    """json.loads, refusing NaN, Infinity, -Infinity, overflowing numbers, a key given twice
    in one object and nesting deeper than MAX_DEPTH (ValueError)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # UnicodeDecodeError is a ValueError
    _check_depth(text)
    return json.loads(
        text, parse_constant=_refuse, parse_float=_float, object_pairs_hook=_unique_keys
    )


def _check_depth(text: str) -> None:
    """ValueError when brackets outside strings nest deeper than MAX_DEPTH (a linear scan,
    before the recursive parser sees the text)."""
    depth = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ValueError(f"nested deeper than {MAX_DEPTH} (at character {match.start()})")
        elif token in "]}":
            depth -= 1


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {twice!r} is given twice in one object")
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """json.dumps writing strict JSON: a float that is not finite becomes null."""
    return json.dumps(_clean(obj), allow_nan=False, **kwargs)


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "dtype") and hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return _clean(obj.item())  # a numpy scalar
    return obj
