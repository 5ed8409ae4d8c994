"""A small schema language for the JSON files cognet reads back (torch-free): each field's
type and range declared once, checked by one walk that names the first field out of place.

A schema is a tree of specs: `Int`, `Number`, `Bool`, `Str`, `OneOf` (an enumeration,
matched by membership of the exact value, never as a substring), `Nullable`, `ListOf`,
`MapOf` (an object of any keys), `Obj` (an object of named fields: required or optional,
unknown fields refused or ignored) and `Record` (an object whose keys are a dataclass's
fields, values left to the dataclass's own checks). `check(value, spec)` raises
`FieldError(field, why)`, field a dotted path such as `dims.heads` or
`member_graphs.1.graphs.encoder.file`; `checked(obj, spec, file)` turns it into the
`InputError` line `FILE: field 'F': WHY`. The schemas themselves are in
`cognet.core.file_schemas`.

Values in messages are shown by `show`: a bounded repr (control characters escaped, cut to
a few dozen characters), since the file being refused is not trusted.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cognet.core.errors import InputError

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_repr.maxlist = _repr.maxdict = 4
_repr.maxlevel = 2


def show(value: object) -> str:
    """A short, safe repr of a value read from a file."""
    return _repr.repr(value)


class FieldError(ValueError):
    """A field out of its type or range: `field` (a dotted path) and `why`."""

    def __init__(self, field_name: str, why: str):
        super().__init__(f"field {field_name!r}: {why}")
        self.field = field_name
        self.why = why


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int | None = None

    def check(self, value: Any, path: str) -> None:
        hi = self.hi
        if not _integer(value) or value < self.lo or (hi is not None and value > hi):
            span = f"[{self.lo}, {hi}]" if hi is not None else f"[{self.lo}, ...)"
            raise FieldError(path, f"{show(value)} is not an integer in {span}")


@dataclass(frozen=True)
class Number:
    """A finite int or float (a boolean is no number) in [lo, hi] (or (lo, ...) when
    `lo_open`, (..., hi) when `hi_open`)."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def check(self, value: Any, path: str) -> None:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise FieldError(path, f"{show(value)} is not a finite number")
        below = value <= self.lo if self.lo_open else value < self.lo
        above = value >= self.hi if self.hi_open else value > self.hi
        if below or above:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            span = f"{left}{self.lo:g}, {self.hi:g}{right}"
            raise FieldError(path, f"{show(value)} is not in {span}")


@dataclass(frozen=True)
class Bool:
    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, bool):
            raise FieldError(path, f"{show(value)} is not true or false")


@dataclass(frozen=True)
class Str:
    """A string; `empty` whether "" is one; `suffix` a required ending; `length` an exact
    length (a sha256: 64); no NUL byte."""

    empty: bool = False
    suffix: str = ""
    length: int | None = None

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, str):
            raise FieldError(path, f"{show(value)} is not a string")
        if (not value and not self.empty) or "\0" in value:
            raise FieldError(path, f"{show(value)} is not a name")
        if self.suffix and (not value.endswith(self.suffix) or value == self.suffix):
            raise FieldError(path, f"{show(value)} does not end with {self.suffix}")
        if self.length is not None and len(value) != self.length:
            raise FieldError(path, f"{show(value)} is not {self.length} characters long")


SHA256 = Str(length=64)


@dataclass(frozen=True)
class OneOf:
    """One of `values`, compared by equality of type and value (1 is not True, "beam" is
    not "bea")."""

    values: tuple

    def check(self, value: Any, path: str) -> None:
        if not any(type(value) is type(v) and value == v for v in self.values):
            choices = ", ".join(map(str, self.values))
            raise FieldError(path, f"{show(value)} is not one of {choices}")


@dataclass(frozen=True)
class Nullable:
    spec: Any

    def check(self, value: Any, path: str) -> None:
        if value is not None:
            self.spec.check(value, path)


@dataclass(frozen=True)
class AnyOf:
    """A value that one of `specs` takes; `what` names them for the message."""

    specs: tuple
    what: str

    def check(self, value: Any, path: str) -> None:
        for spec in self.specs:
            try:
                spec.check(value, path)
                return
            except FieldError:
                pass
        raise FieldError(path, f"{show(value)} is not {self.what}")


@dataclass(frozen=True)
class ListOf:
    """A JSON list of `item`s; `length` an exact length, `unique` no repeated item; items are
    named by their index from `first` (1: `member_graphs.1` is member 1)."""

    item: Any
    length: int | None = None
    unique: bool = False
    first: int = 0

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, list):
            raise FieldError(path, f"{show(value)} is not a list")
        if self.length is not None and len(value) != self.length:
            raise FieldError(path, f"{len(value)} items, not {self.length}")
        for i, item in enumerate(value, self.first):
            self.item.check(item, _join(path, i))
        if self.unique and len(set(value)) != len(value):
            seen: set = set()
            twice = next(v for v in value if v in seen or seen.add(v))
            raise FieldError(path, f"{show(twice)} appears twice")


@dataclass(frozen=True)
class MapOf:
    """A JSON object of any keys (or only `keys`, when given) whose values are `value`s."""

    value: Any
    keys: tuple | None = None

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise FieldError(path, f"{show(value)} is not an object")
        for key, item in value.items():
            if self.keys is not None and key not in self.keys:
                known = ", ".join(self.keys)
                raise FieldError(_join(path, key), f"unknown name (expected one of {known})")
            self.value.check(item, _join(path, key))


@dataclass(frozen=True)
class Any_:
    """Any JSON value: a record kept as written, never read."""

    def check(self, value: Any, path: str) -> None:
        pass


ANY = Any_()


@dataclass(frozen=True)
class Obj:
    """A JSON object of named fields: `fields` {name: spec}, those in `required` present;
    an unknown field is refused unless `extra` (a free record, whose other fields are never
    read)."""

    fields: Mapping[str, Any]
    required: tuple[str, ...] = ()
    extra: bool = False

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise FieldError(path, f"{show(value)} is not an object")
        for name in self.required:
            if name not in value:
                objects = isinstance(self.fields.get(name), (Obj, MapOf, Record))
                raise FieldError(
                    _join(path, name), "missing or not an object" if objects else "missing"
                )
        for name, item in value.items():
            spec = self.fields.get(name)
            if spec is not None:
                spec.check(item, _join(path, name))
            elif not self.extra:
                raise FieldError(_join(path, name), "unknown field (not one this version reads)")


@dataclass(frozen=True)
class Record:
    """An object whose keys are fields of the dataclass `cls` (some may be left to their
    defaults); `nested` {field: spec} checks an object-valued field's own keys. The values are
    the dataclass's to check (its `__post_init__`), where they are declared."""

    cls: type
    nested: Mapping[str, Any] = field(default_factory=dict)

    def check(self, value: Any, path: str) -> None:
        names = [f.name for f in dataclasses.fields(self.cls)]
        Obj({n: self.nested.get(n, ANY) for n in names}).check(value, path)


def check(value: Any, spec: Any, path: str = "") -> None:
    """FieldError naming the first field of `value` that `spec` does not take."""
    spec.check(value, path)


def checked(obj: Any, spec: Any, file: object, hint: str = "") -> Any:
    """`obj` when `spec` takes it; otherwise InputError `FILE: field 'F': WHY` (`hint`
    appended: what to do about it)."""
    if not isinstance(obj, dict):
        raise InputError(f"{file}: not a JSON object")
    try:
        spec.check(obj, "")
    except FieldError as exc:
        raise InputError(f"{file}: field {exc.field!r}: {exc.why}{hint}") from None
    return obj
