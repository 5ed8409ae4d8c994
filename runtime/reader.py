"""Streaming input: Parquet record batches -> checked, cast tables -> chunks of whole patients.

Memory stays bounded by the record-batch and chunk sizes, not by the file: rows are read
batch by batch, and a chunk holds complete patients only (a patient whose rows span record
batches is carried over to the next chunk). The rows of a patient must be contiguous and
ordered by strictly increasing visit_seq; the first row that breaks this raises
`InputError` naming it (`sort=True` sorts the whole file in memory instead).

Every table this module yields has the columns of `INPUT_SCHEMA` (nullable: a row with a
null key is rejected later, not here) plus `ROW`, the row's 0-based index in the file.

INPUT of several files (`--engine ray`): `list_files` finds them (a file, a directory or a
glob) and `plan_input` reads their footers into `InputFiles`, the row numbering across them.
"""

from __future__ import annotations

import bisect
import glob
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cognet.core.dataset import check_text, check_visits_columns, parquet_file
from cognet.core.errors import InputError, one_line, where

log = logging.getLogger(__name__)

ROW = "_row"
# `score --split`: a bool column added to the tables; a row False there is not scored but
# skipped (history only), as a row with known medications is without --all.
ASKED = "_asked"
SPLITS = ("train", "val", "test")
CODES = pa.list_(pa.string())
INPUT_SCHEMA = pa.schema(
    [
        ("patient_id", pa.string()),
        ("visit_id", pa.string()),
        ("visit_seq", pa.int64()),  # int64: any integer input casts without overflow
        ("diagnoses", CODES),
        ("procedures", CODES),
        ("medications", CODES),
    ]
)
KEYS = ("patient_id", "visit_id", "visit_seq")
# --keep-columns: KEEP_ALL keeps every input column the output lacks (RESERVED: the
# columns of `outputs.output_schema(explain=True)`). A kept column travels with the rows
# as KEEP_PREFIX + its name, apart from the columns the engines read.
KEEP_ALL = "*"
KEEP_PREFIX = "_keep:"
RESERVED = ("patient_id", "visit_id", "medications", "score", "probabilities", "explanations")


def kept_columns(schema: pa.Schema, keep: Iterable[str], path: object) -> tuple[str, ...]:
    """The input columns that `keep` names (`KEEP_ALL`: every one not in RESERVED), checked:
    InputError for a column the file lacks, one the output has already, or one named twice."""
    keep = tuple(keep)
    twice = sorted({n for n in keep if keep.count(n) > 1})
    if twice:
        raise InputError(f"--keep-columns: {', '.join(twice)} named twice (one output column each)")
    if keep == (KEEP_ALL,):
        return tuple(n for n in schema.names if n not in RESERVED)
    for name in keep:
        if name in RESERVED:
            raise InputError(f"--keep-columns {name}: the output has a column {name!r} already")
        if name not in schema.names:
            raise InputError(f"{where(path, name)}: no such column to keep (--keep-columns)")
    return keep


def check_columns(schema: pa.Schema, path: object) -> None:
    """InputError for a missing or mistyped contract column (extra columns are ignored)."""
    check_visits_columns(schema, path)


def cast_input(table: pa.Table | pa.RecordBatch, path: object, first_row: int = 0) -> pa.Table:
    """The contract columns of `table` cast to INPUT_SCHEMA (nulls kept)."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    columns = [cast_column(table, f.name, f.type, path, first_row) for f in INPUT_SCHEMA]
    return pa.Table.from_arrays(columns, schema=INPUT_SCHEMA)


def cast_column(
    table: pa.Table, name: str, target: pa.DataType, path: object, first_row: int = 0
) -> pa.ChunkedArray:
    """Column `name` of `table` cast to `target`; InputError naming the column, and the row
    (counted from `first_row`) of an integer that does not fit (a uint64 >= 2^63)."""
    column = table.column(name)
    if column.type == target:
        return column
    try:
        return column.cast(target)
    except (pa.ArrowException, ValueError) as exc:
        detail = f"cannot read as {target} ({one_line(exc)})"
        row = None
        if pa.types.is_integer(column.type) and pa.types.is_integer(target):
            info = np.iinfo(target.to_pandas_dtype())
            values = column.to_pylist()  # only on this failure: the batch's rows
            row = next(
                (
                    i
                    for i, v in enumerate(values)
                    if v is not None and not info.min <= v <= info.max
                ),
                None,
            )
            if row is not None:
                detail = f"value {values[row]} out of the {target} range"
        at = where(path, name, None if row is None else first_row + row)
        raise InputError(f"{at}: {detail}") from None


def split_rows(path: str | Path, split: str) -> np.ndarray:
    """bool [rows of the file]: the rows whose `split` column (the dataset's, user guide
    "Data") is `split`. InputError when the file has no such column or no row of `split`."""
    try:
        file = pq.ParquetFile(path)
        if "split" not in file.schema_arrow.names:
            raise InputError(
                f"{where(path, 'split')}: no such column; --split needs the dataset's split "
                "column (train / val / test)"
            )
        column = file.read(columns=["split"]).column("split").cast(pa.string())
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
    rows = pc.fill_null(pc.equal(column, split), False).to_numpy(zero_copy_only=False)
    if not rows.any():
        raise InputError(f"{where(path, 'split')}: no row of split {split!r} (--split)")
    return rows


def asked(batches: Iterable[pa.Table], rows: np.ndarray) -> Iterator[pa.Table]:
    """`batches` with the ASKED column: rows[ROW] (`split_rows`)."""
    for table in batches:
        yield table.append_column(ASKED, pa.array(rows[table[ROW].to_numpy()]))


class VisitFile:
    """A visits Parquet file to score, checked on opening (readable, contract columns, the
    columns to keep: `kept_columns`)."""

    def __init__(self, path: str | Path, batch_rows: int = 65536, keep: Iterable[str] = ()):
        self.path = Path(path)
        if self.path.is_dir():
            raise InputError(f"{self.path}: is a directory, not a Parquet file")
        if not self.path.is_file():
            raise InputError(f"{self.path}: file not found")
        self._file = parquet_file(self.path)
        check_columns(self._file.schema_arrow, self.path)
        self.keep = kept_columns(self._file.schema_arrow, keep, self.path)
        self.kept_fields = [self._file.schema_arrow.field(name) for name in self.keep]
        self.num_rows = self._file.metadata.num_rows
        self.batch_rows = batch_rows

    def batches(self, columns: Iterable[str] | None = None) -> Iterator[pa.Table]:
        """Record batches in file order, cast, with the ROW column, then the kept columns
        (`columns`: only these, cast)."""
        kept = () if columns else self.keep
        columns = list(columns or INPUT_SCHEMA.names)
        reading = list(dict.fromkeys([*columns, *kept]))
        start = 0
        try:
            for batch in self._file.iter_batches(batch_size=self.batch_rows, columns=reading):
                check_text(batch, self.path, start)  # before any value reaches Python
                table = self._cast(batch, columns, start)
                table = table.append_column(ROW, pa.array(np.arange(start, start + len(table))))
                yield keep(table, batch, kept)
                start += len(table)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(
                f"{self.path}: not a readable Parquet file ({one_line(exc)})"
            ) from None

    def _cast(self, batch: pa.RecordBatch, columns: list[str], start: int) -> pa.Table:
        if columns == INPUT_SCHEMA.names:
            return cast_input(batch, self.path, start)
        table = pa.Table.from_batches([batch])
        types = {c: INPUT_SCHEMA.field(c).type for c in columns}
        return pa.table({c: cast_column(table, c, t, self.path, start) for c, t in types.items()})

    def sorted_batches(self) -> Iterator[pa.Table]:
        """The whole file in memory, rows grouped by patient (first appearance order) and
        ordered by visit_seq; rows with a null key go last (they are rejected)."""
        table = pa.concat_tables(self.batches())
        patient = pc.dictionary_encode(table["patient_id"].combine_chunks()).indices
        key = patient.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        seq = table["visit_seq"].fill_null(0).to_numpy().astype(np.int64)
        null = ~_valid_keys(table)
        key[null] = np.iinfo(np.int64).max
        order = np.lexsort((table[ROW].to_numpy(), seq, key))  # ties keep file order
        table = table.take(pa.array(order)).combine_chunks()
        for start in range(0, len(table), self.batch_rows):
            yield table.slice(start, self.batch_rows)


def keep(table: pa.Table, source: pa.Table | pa.RecordBatch, names: Iterable[str]) -> pa.Table:
    """`table` with the columns `names` of `source` (as they are) appended, each as
    KEEP_PREFIX + its name."""
    for name in names:
        field = source.schema.field(name)
        table = table.append_column(field.with_name(KEEP_PREFIX + name), source.column(name))
    return table


def _valid_keys(table: pa.Table) -> np.ndarray:
    """bool [rows]: patient_id and visit_seq both present (the order check needs them)."""
    ok = pc.and_(table["patient_id"].is_valid(), table["visit_seq"].is_valid())
    return ok.to_numpy(zero_copy_only=False)


class HashSet:
    """Membership of 64-bit hashes with ~8 bytes per entry (a sorted numpy array plus a
    small Python set of recent entries). Python's string hash: a false match has odds of
    about n^2 / 2^64 over n entries (5e-8 for a million)."""

    def __init__(self, recent_cap: int = 1 << 16):
        self._sorted = np.empty(0, np.int64)
        self._recent: set[int] = set()
        self._cap = recent_cap

    def __len__(self) -> int:
        return self._sorted.size + len(self._recent)

    def add(self, hashes: list[int]) -> np.ndarray:
        """Add hashes in order; bool [len(hashes)]: the hash was already present (in the set
        or earlier in `hashes`)."""
        arr = np.asarray(hashes, np.int64)
        if self._sorted.size:
            at = np.searchsorted(self._sorted, arr).clip(max=self._sorted.size - 1)
            seen = self._sorted[at] == arr
        else:
            seen = np.zeros(arr.size, bool)
        recent = self._recent
        for i, h in enumerate(hashes):
            if h in recent:
                seen[i] = True
            else:
                recent.add(h)
        if len(recent) > max(self._cap, self._sorted.size // 4):
            merged = np.fromiter(recent, np.int64, len(recent))
            self._sorted = np.union1d(self._sorted, merged)
            recent.clear()
        return seen


def string_hashes(values: pa.Array | pa.ChunkedArray) -> list[int]:
    return [hash(v) for v in values.to_pylist()]


def continues(
    pid: pa.Array, seq: np.ndarray, last: tuple[str, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The ordering rule's facts about each row of rows in stream order, keys all present:
    bool [rows] the row continues the patient of the row before it, and int64 [rows] that
    row's visit_seq (`last`: (patient_id, visit_seq) of the row before the first; None: no
    row). A patient's rows are in order when seq > previous wherever they continue; an equal
    visit_seq is a repeat (`repeated_seq`), which no sorting fixes. The local reader
    (`OrderCheck`) and the Ray engine (`ray_tasks`, on rows sorted by key) both use it."""
    same = np.empty(len(pid), bool)
    same[1:] = pc.equal(pid[1:], pid[:-1]).to_numpy(zero_copy_only=False)
    prev_seq = np.empty_like(seq)
    prev_seq[1:] = seq[:-1]
    if len(pid) and last is None:
        same[0] = False
    elif len(pid):
        same[0] = pid[0].as_py() == last[0]
        prev_seq[0] = last[1]
    return same, prev_seq


def repeated_seq(at: str, patient: str, seq: int, also: str | None = None) -> InputError:
    """The error of a patient with two rows of one visit_seq: `at` names the second row,
    `also` the first when it is worth naming (another file)."""
    first = f" (also at {also})" if also else ""
    return InputError(
        f"{at}: patient {patient!r} has visit_seq {seq} twice{first}; a patient's visit_seq "
        "values must be unique"
    )


class OrderCheck:
    """Streaming check that each patient's rows are contiguous and ordered by visit_seq.

    Feed tables in stream order; raises InputError at the first offending row. Rows with a
    null patient_id or visit_seq are ignored here (they are rejected as rows).
    """

    def __init__(self, path: object):
        self.path = path
        self._last: tuple[str, int] | None = None  # (patient_id, visit_seq) of the last row
        self._patients = HashSet()

    def feed(self, table: pa.Table) -> None:
        valid = _valid_keys(table)
        if not valid.all():
            table = table.filter(pa.array(valid))
        if len(table) == 0:
            return
        pid = table["patient_id"].combine_chunks()
        seq = table["visit_seq"].to_numpy()
        rows = table[ROW].to_numpy()
        same, prev_seq = continues(pid, seq, self._last)
        bad = np.flatnonzero(same & (seq <= prev_seq))
        if bad.size:
            i = int(bad[0])
            at = where(self.path, "visit_seq", int(rows[i]))
            if seq[i] == prev_seq[i]:  # sorting cannot help
                raise repeated_seq(at, pid[i].as_py(), int(seq[i]))
            raise InputError(
                f"{at}: patient {pid[i].as_py()!r} has visit_seq {seq[i]} after visit_seq "
                f"{prev_seq[i]}; the rows of a patient must be ordered by increasing visit_seq "
                "(use --sort to sort in memory)"
            )
        starts = np.flatnonzero(~same)
        again = self._patients.add(string_hashes(pid.take(pa.array(starts))))
        if again.any():
            i = int(starts[np.argmax(again)])
            raise InputError(
                f"{where(self.path, 'patient_id', int(rows[i]))}: patient {pid[i].as_py()!r} "
                "appears again after other patients; the rows of a patient must be contiguous "
                "(use --sort to sort in memory)"
            )
        self._last = (pid[-1].as_py(), int(seq[-1]))


def check_order(batches: Iterable[pa.Table], path: object) -> int:
    """Run OrderCheck over a stream (patient_id, visit_seq and ROW suffice); returns rows."""
    check, rows = OrderCheck(path), 0
    for table in batches:
        check.feed(table)
        rows += len(table)
    return rows


@dataclass
class Chunk:
    """Consecutive rows of the stream holding whole patients."""

    index: int  # 0, 1, ... in stream order
    start: int  # stream position of the first row
    table: pa.Table  # INPUT_SCHEMA + ROW

    @property
    def end(self) -> int:
        return self.start + len(self.table)


def patient_starts(table: pa.Table) -> np.ndarray:
    """bool [rows]: row i starts a new patient (its patient_id differs from that of the last
    row before it with a patient_id). A row without a patient_id (rejected) starts nothing,
    so it never splits the patient around it; the first row always starts a group."""
    pid = table["patient_id"].combine_chunks()
    starts = np.zeros(len(table), bool)
    valid = np.flatnonzero(pid.is_valid().to_numpy(zero_copy_only=False))
    if valid.size:
        ids = pid.take(pa.array(valid))
        new = np.ones(valid.size, bool)
        new[1:] = ~pc.equal(ids[1:], ids[:-1]).to_numpy(zero_copy_only=False)
        starts[valid] = new
    if len(table):
        starts[0] = True
    return starts


def chunks(
    batches: Iterable[pa.Table], path: object, score_all: bool, max_targets: int, max_rows: int
) -> Iterator[Chunk]:
    """Cut a stream of tables into chunks of whole patients, checking the row order.

    A chunk closes at the first patient boundary where it holds >= max_targets rows to score
    or >= max_rows rows; the cut points depend only on the stream and the limits, so a rerun
    cuts the same chunks (resume relies on it).
    """
    check = OrderCheck(path)
    pending: list[pa.Table] = []
    index = start = 0

    def cut(table: pa.Table, final: bool) -> Iterator[tuple[int, int]]:
        begins = patient_starts(table)
        target = (
            np.ones(len(table), bool)
            if score_all
            else (table["medications"].is_null().to_numpy(zero_copy_only=False))
        )
        cum = np.concatenate([[0], np.cumsum(target)])
        bounds = np.append(np.flatnonzero(begins)[1:], len(table))
        if not final:
            bounds = bounds[:-1]  # the last patient may go on in the next batch
        pos = 0
        for b in bounds:
            if cum[b] - cum[pos] >= max_targets or b - pos >= max_rows:
                yield pos, int(b)
                pos = int(b)
        if final and pos < len(table):
            yield pos, len(table)

    def emit(final: bool) -> Iterator[Chunk]:
        nonlocal pending, index, start
        table = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
        pos = 0
        for a, b in cut(table, final):
            yield Chunk(index, start, table.slice(a, b - a))
            index, start, pos = index + 1, start + (b - a), b
        pending = [table.slice(pos)] if pos < len(table) else []

    for table in batches:
        if len(table) == 0:
            continue
        check.feed(table)
        pending.append(table)
        yield from emit(final=False)
    if pending:
        yield from emit(final=True)


# -- several input files (--engine ray) ------------------------------------------------------
@dataclass(frozen=True)
class InputFiles:
    """The Parquet files of INPUT in name order and where each row group starts."""

    source: str  # INPUT as given
    paths: tuple[str, ...]
    first_rows: tuple[int, ...]  # row number of each file's first row
    units: tuple[tuple[int, int, int], ...]  # (file, row group, row number of its first row)
    num_rows: int
    kept: tuple[pa.Field, ...] = ()  # --keep-columns, as the first file types them

    def where(self, column: str, row: int) -> str:
        """`FILE: column C, row R` of a row number (R: the row in that file)."""
        i = bisect.bisect_right(self.first_rows, row) - 1
        return where(self.paths[i], column, row - self.first_rows[i])


def list_files(source: str) -> list[str]:
    """The Parquet files of a file, a directory (`*.parquet`, recursively, skipping names that
    start with `.` or `_`) or a glob, in name order; InputError when there is none."""
    if any(c in source for c in "*?["):
        paths = [p for p in glob.glob(source, recursive=True) if os.path.isfile(p)]
    elif os.path.isdir(source):
        paths = []
        for root, dirs, names in os.walk(source):
            dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
            paths += [
                os.path.join(root, n)
                for n in names
                if n.endswith(".parquet") and not n.startswith((".", "_"))
            ]
    elif os.path.isfile(source):
        paths = [source]
    else:
        raise InputError(f"{source}: file not found")
    if not paths:
        raise InputError(f"{source}: no Parquet file found")
    return sorted(os.path.abspath(p) for p in paths)


def plan_input(source: str, keep: Iterable[str] = ()) -> InputFiles:
    """List INPUT and read its footers (readable, contract columns, the columns to keep,
    rows per row group). KEEP_ALL keeps the first file's columns: every file must hold them."""
    paths = list_files(source)
    first_rows, units, start, kept = [], [], 0, ()
    for i, path in enumerate(paths):
        try:
            meta = parquet_file(Path(path)).metadata
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
        check_columns(schema, path)
        keep = kept_columns(schema, keep, path)
        if i == 0:
            kept = tuple(schema.field(name) for name in keep)
        first_rows.append(start)
        for g in range(meta.num_row_groups):
            units.append((i, g, start))
            start += meta.row_group(g).num_rows
    return InputFiles(source, tuple(paths), tuple(first_rows), tuple(units), start, kept)
