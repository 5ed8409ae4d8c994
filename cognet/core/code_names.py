"""Names beside codes, for people reading explanations (torch-free).

    names = CodeNames.load()                      # the shipped names
    names = CodeNames.load("atc_names.csv")       # a user's names first, then the shipped
    names.name("diagnosis", "592.0")              # 'Calculus of kidney'

Shipped (`SHIPPED`, derived once by tools/make_code_names.py): the ICD-9-CM diagnoses and
procedures of the CMS version 32 master descriptions (public domain), keyed by the undotted
code. A code is looked up undotted and upper-cased, so `5920`, `592.0` and the OMOP tokens of
`cognet data mimic4` (`ICD9CM/592.0`, `ICD9Proc/38.93`) find the same name; a token of another
vocabulary (`ICD10CM/...`) finds none. No ATC names ship: no public source was found (the WHO
index is not free to copy); a user's file can give them.

A user's file (`--names FILE`): CSV or TSV (by its extension; `.gz` too) with a header holding
`code` and `name`, and optionally `kind` (diagnosis, procedure or medication; empty or absent:
any kind). Its names come before the shipped ones.
"""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

from cognet.core.errors import InputError

KINDS = ("diagnosis", "procedure", "medication")
SHIPPED = Path(__file__).with_name("code_names.tsv.gz")
# OMOP vocabulary prefixes of the shipped kinds (upper-cased, as `key` leaves them)
ICD9_PREFIX = {"diagnosis": "ICD9CM/", "procedure": "ICD9PROC/"}


def key(code: str) -> str:
    """The form codes are compared in: no dots nor surrounding spaces, upper case."""
    return code.strip().replace(".", "").upper()


class CodeNames:
    """Names of codes by kind: a user's first, then the shipped ones (see the module)."""

    def __init__(self, shipped: dict, user: dict | None = None):
        self._shipped = shipped  # {(kind, key): name}
        self._user = user or {}  # {(kind or None, key): name}

    @classmethod
    def load(cls, user_file: str | Path | None = None) -> CodeNames:
        """The shipped names, under a user's file when given (InputError for a bad file)."""
        shipped = {(kind, code): name for kind, code, name in _rows(SHIPPED, "\t")}
        user = None
        if user_file is not None:
            path = Path(user_file)
            delimiter = "\t" if ".tsv" in path.suffixes else ","
            user = {
                (kind or None, key(code)): name
                for kind, code, name in _rows(path, delimiter, check=True)
            }
        return cls(shipped, user)

    def name(self, kind: str, code: str | None) -> str | None:
        """The name of a code of `kind` (one of KINDS), or None when none is known."""
        if code is None:
            return None
        k = key(code)
        for found in (self._user.get((kind, k)), self._user.get((None, k))):
            if found:
                return found
        prefix = ICD9_PREFIX.get(kind)
        if prefix and k.startswith(prefix):
            k = k[len(prefix) :]
        if "/" in k:  # a token of a vocabulary without shipped names
            return None
        return self._shipped.get((kind, k))

    def named(self, kind: str, code: str) -> str:
        """`code (name)`, or the bare code when it has no name."""
        found = self.name(kind, code)
        return f"{code} ({found})" if found else code


def _rows(path: Path, delimiter: str, check: bool = False) -> list[tuple[str, str, str]]:
    """(kind, code, name) of each row of a names file; `check`: a user's file, whose
    problems are InputErrors naming the file, the column or the row."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        text = raw.decode("utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"{path}: file not found (--names)") from None
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as exc:
        raise InputError(f"{path}: not a readable names file ({exc})") from None
    reader = csv.DictReader(io.StringIO(text), delimiter=delimiter)
    missing = [c for c in ("code", "name") if c not in (reader.fieldnames or [])]
    if missing:
        raise InputError(
            f"{path}: column {missing[0]!r}: no such column (a names file has code, name and "
            "optionally kind)"
        )
    rows = []
    for line, row in enumerate(reader, start=2):
        kind = (row.get("kind") or "").strip()
        code, name = (row.get("code") or "").strip(), (row.get("name") or "").strip()
        if check and kind and kind not in KINDS:
            raise InputError(
                f"{path}: line {line}: column 'kind': {kind!r} is none of {', '.join(KINDS)}"
            )
        if code and name:
            rows.append((kind, code, name))
    return rows
