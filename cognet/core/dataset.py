"""The dataset contract (DESIGN.md §2): Parquet schemas, reading, validation and writing.

Torch-free (pyarrow and numpy only): training reads whole datasets with `read_dataset`, the
runtime checks the columns of streamed input with `check_visits_columns`.

A dataset is a directory holding `visits.parquet` (one row per visit) and `ddi.parquet`
(interacting medication pairs). Every problem found in them raises `InputError` with one line
``FILE: column C, row R: problem``; rows are 0-based row indices in the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cognet.core.errors import InputError, one_line, where, writing
from cognet.core.files import atomic_path

VISITS_FILE = "visits.parquet"
DDI_FILE = "ddi.parquet"
SPLITS = ("train", "val", "test")
CODE_COLUMNS = ("diagnoses", "procedures", "medications")

_CODES = pa.list_(pa.string())
VISITS_SCHEMA = pa.schema(
    [
        pa.field("patient_id", pa.string(), nullable=False),
        pa.field("visit_id", pa.string(), nullable=False),
        pa.field("visit_seq", pa.int32(), nullable=False),
        pa.field("diagnoses", _CODES, nullable=False),
        pa.field("procedures", _CODES, nullable=False),
        pa.field("medications", _CODES),  # null = unknown, to be recommended
        pa.field("split", pa.string(), nullable=False),  # optional column
    ]
)
DDI_SCHEMA = pa.schema(
    [
        pa.field("drug_a", pa.string(), nullable=False),
        pa.field("drug_b", pa.string(), nullable=False),
    ]
)
# One recommendation per visit: what `cognet-batch score` writes (before its optional
# columns) and `cognet evaluate --predictions` too.
PREDICTIONS_SCHEMA = pa.schema(
    [
        ("patient_id", pa.string()),
        ("visit_id", pa.string()),
        # beam: generation order; set: decreasing P(in set) (docs/DESIGN.md §3)
        ("medications", pa.list_(pa.string())),
        # beam: sum of log-probabilities of the hypothesis, END included; set: mean P(in set)
        ("score", pa.float32()),
        ("probabilities", pa.list_(pa.float32())),  # beam: at its step; set: P(in set)
    ]
)


@dataclass(frozen=True, eq=False)
class Dataset:
    """A validated dataset directory.

    `visits` follows VISITS_SCHEMA with `split` always present; rows are grouped by patient
    (patients in order of first appearance in the file) and sorted by visit_seq inside.
    `ddi_pairs` are unordered pairs, each once as (smaller, larger) code, sorted.
    """

    path: Path
    visits: pa.Table
    ddi_pairs: list[tuple[str, str]]

    def split(self, name: str) -> pa.Table:
        """The visits of one split, in the same patient-grouped order."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {SPLITS}")
        return split_rows(self.visits, name)


def split_rows(visits: pa.Table, split: str) -> pa.Table:
    """The rows of `visits` (a table with a `split` column) in one split, in their order."""
    return visits.filter(pc.equal(visits["split"], split))


# -- column checks (shared with the streaming runtime) ----------------------------------------


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _is_text(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_code_list(t: pa.DataType) -> bool:
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    # list<null>: what pyarrow infers for lists that are all empty
    item = t.value_type if any(is_list(t) for is_list in lists) else None
    return item is not None and (_is_text(item) or pa.types.is_null(item))


def _castable(name: str, t: pa.DataType) -> bool:
    """Whether a column of type `t` converts to the contract type without losing meaning."""
    if name in ("patient_id", "visit_id"):
        return _is_text(t) or pa.types.is_integer(t)  # integer keys become decimal strings
    if name == "split":
        return _is_text(t)
    if name == "visit_seq":
        return pa.types.is_integer(t)
    if name == "medications" and pa.types.is_null(t):
        return True  # every visit unknown
    return _is_code_list(t)


def check_text(table: pa.Table | pa.RecordBatch, path: object, first_row: int = 0) -> None:
    """InputError naming the column and row (counted from `first_row`) of the first value
    that is not UTF-8 text, in every string or list-of-string column: Parquet does not
    check what a writer stored, and Python would fail on it later with a UnicodeDecodeError."""
    for name in table.column_names:
        column = table[name]
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        row = first_row
        for chunk in chunks:
            if _holds_text(chunk.type):
                try:
                    chunk.validate(full=True)
                except pa.ArrowInvalid:
                    bad, value = _first_not_utf8(chunk)
                    if bad is not None:
                        raise InputError(
                            f"{where(path, name, row + bad)}: {value!r} is not UTF-8 text"
                        ) from None
            row += len(chunk)


def _holds_text(t: pa.DataType) -> bool:
    return (
        _is_text(t) or (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_text(t.value_type)
    )


def _first_not_utf8(chunk: pa.Array) -> tuple[int | None, bytes | None]:
    """The first row of a string (or list of strings) array holding bytes that are not
    UTF-8, and those bytes (cut); (None, None) when there is none."""
    if pa.types.is_dictionary(chunk.type):
        chunk = chunk.dictionary_decode()
    if pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
        values = pc.list_flatten(chunk).cast(pa.binary()).to_pylist()
        parents = pc.list_parent_indices(chunk).to_numpy()
    else:
        values = chunk.cast(pa.binary()).to_pylist()
        parents = np.arange(len(values))
    for k, value in enumerate(values):
        try:
            (value or b"").decode("utf-8")
        except UnicodeDecodeError:
            return int(parents[k]), value[:40]
    return None, None


def parquet_file(path: Path) -> pq.ParquetFile:
    """`pq.ParquetFile(path)`; InputError (exit 2) for a file Parquet cannot read, or whose
    column names are not UTF-8 (pyarrow decodes them on opening)."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path}: the column name {exc.object[:40]!r} is not UTF-8 text (byte {exc.start})"
        ) from None


def _type_name(t: pa.DataType) -> str:
    return "list<string>" if t == _CODES else str(t)


def check_visits_columns(schema: pa.Schema, path: object, require_split: bool = False) -> pa.Schema:
    """Check that a visits schema holds the contract columns with usable types.

    Returns the schema to cast the contract columns to (in contract order; `split` only when
    present). Large strings/lists, dictionary strings, integer ids and any integer visit_seq
    are accepted and cast; anything else raises `InputError`. Extra columns are ignored.
    """
    fields = []
    for field in VISITS_SCHEMA:
        found = schema.get_all_field_indices(field.name)
        if not found:
            if field.name == "split" and not require_split:
                continue
            raise InputError(
                f"{where(path, field.name)}: missing column "
                f"(found: {', '.join(schema.names) or 'none'})"
            )
        if len(found) > 1:
            raise InputError(f"{where(path, field.name)}: column appears {len(found)} times")
        actual = schema.field(found[0]).type
        if not _castable(field.name, actual):
            raise InputError(
                f"{where(path, field.name)}: wrong type {actual}, expected {_type_name(field.type)}"
            )
        fields.append(field)
    return pa.schema(fields)


# code lists where null means "no codes" (medications: null = unknown, to be recommended)
NO_CODES_IF_NULL = ("diagnoses", "procedures")


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def cast_visits(table: pa.Table | pa.RecordBatch, target: pa.Schema, path: object) -> pa.Table:
    """Select and cast the contract columns of `table` to `target` (from check_visits_columns).

    Raises `InputError` for a visit_seq outside int32 and for a null in a non-nullable column.
    A null diagnoses or procedures list is an empty one (no codes), the rule of every command
    (`cognet-batch score` reads it so too).
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    table = table.select(target.names)
    seq = table["visit_seq"]
    if seq.type != pa.int32():
        values = seq.to_numpy(zero_copy_only=False)
        limit = np.iinfo(np.int32)
        bad = _first((values < limit.min) | (values > limit.max))  # NaN (null) compares False
        if bad is not None:
            raise InputError(
                f"{where(path, 'visit_seq', bad)}: value {values[bad]} out of the int32 range"
            )
    for name in NO_CODES_IF_NULL:
        if name in target.names and table[name].null_count:
            column = table[name]
            i = table.schema.get_field_index(name)
            table = table.set_column(i, name, pc.fill_null(column, pa.scalar([], column.type)))
    for field in target:
        if not field.nullable:
            row = _first(table[field.name].is_null().to_numpy(zero_copy_only=False))
            if row is not None:
                raise InputError(f"{where(path, field.name, row)}: null value")
    relaxed = pa.schema([f.with_nullable(True) for f in target])
    return pa.Table.from_arrays(table.cast(relaxed).columns, schema=target)


# -- row checks -------------------------------------------------------------------------------


def _codes_of(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """Flattened codes of a list column and the row each came from."""
    lists = column.combine_chunks()
    return pc.list_flatten(lists), pc.list_parent_indices(lists).to_numpy()


def _check_codes(table: pa.Table, path: object) -> None:
    for name in CODE_COLUMNS:
        codes, parents = _codes_of(table[name])
        bad = pc.or_kleene(codes.is_null(), pc.equal(pc.utf8_length(codes), 0))
        i = _first(bad.fill_null(True).to_numpy(zero_copy_only=False))
        if i is not None:
            raise InputError(f"{where(path, name, int(parents[i]))}: empty or null code")


def _keys(column: pa.ChunkedArray) -> np.ndarray:
    """Integer key per row: equal values get equal keys, numbered in order of first appearance."""
    return pc.dictionary_encode(column.combine_chunks()).indices.to_numpy().astype(np.int64)


def _check_rows(table: pa.Table, path: object) -> None:
    visit_keys = _keys(table["visit_id"])
    first_rows = np.unique(visit_keys, return_index=True)[1]
    repeated = np.ones(len(visit_keys), dtype=bool)
    repeated[first_rows] = False
    row = _first(repeated)
    if row is not None:
        first = int(first_rows[visit_keys[row]])
        raise InputError(
            f"{where(path, 'visit_id', row)}: duplicate visit_id "
            f"{table['visit_id'][row].as_py()!r} (first at row {first})"
        )

    n_diag = pc.list_value_length(table["diagnoses"]).to_numpy(zero_copy_only=False)
    n_proc = pc.list_value_length(table["procedures"]).to_numpy(zero_copy_only=False)
    row = _first((n_diag == 0) & (n_proc == 0))
    if row is not None:
        raise InputError(
            f"{where(path, 'diagnoses', row)}: diagnoses and procedures are both empty"
        )

    if "split" in table.column_names:
        known = pc.is_in(table["split"], value_set=pa.array(SPLITS))
        row = _first(~known.to_numpy(zero_copy_only=False))
        if row is not None:
            raise InputError(
                f"{where(path, 'split', row)}: unknown split "
                f"{table['split'][row].as_py()!r}, expected one of "
                f"{', '.join(SPLITS)}"
            )


def _patient_order(table: pa.Table, path: object) -> np.ndarray:
    """Row order grouping patients (first-appearance order) with visit_seq increasing inside.

    Raises `InputError` when a patient has the same visit_seq twice or spans several splits.
    """
    patient = _keys(table["patient_id"])
    seq = table["visit_seq"].to_numpy()
    order = np.lexsort((seq, patient))  # stable: equal (patient, seq) keep file order
    same = patient[order][1:] == patient[order][:-1]
    clash = same & (seq[order][1:] == seq[order][:-1])
    if clash.any():
        later = order[1:][clash]
        k = int(np.argmin(later))
        row, earlier = int(later[k]), int(order[:-1][clash][k])
        raise InputError(
            f"{where(path, 'visit_seq', row)}: patient {table['patient_id'][row].as_py()!r} "
            f"has visit_seq {int(seq[row])} twice (also row {earlier}); visit_seq must be "
            "strictly increasing within a patient"
        )
    if "split" in table.column_names:
        split = _keys(table["split"])
        differs = same & (split[order][1:] != split[order][:-1])
        if differs.any():
            row = int(np.min(order[1:][differs]))
            raise InputError(
                f"{where(path, 'split', row)}: patient {table['patient_id'][row].as_py()!r} "
                "has visits in more than one split"
            )
    return order


# -- splits -----------------------------------------------------------------------------------


def split_patients(n_patients: int, seed: int = 0) -> np.ndarray:
    """Split index (into SPLITS) of each of `n_patients` patients, shuffled with `seed`.

    Proportions of the COGNet reference code: the first 2/3 of a shuffled patient list train,
    then half of the rest (rounded down) test, the remainder val.
    """
    n_train = int(n_patients * 2 / 3)
    n_test = (n_patients - n_train) // 2
    by_position = np.full(n_patients, SPLITS.index("val"), dtype=np.int8)
    by_position[:n_train] = SPLITS.index("train")
    by_position[n_train : n_train + n_test] = SPLITS.index("test")
    out = np.empty(n_patients, dtype=np.int8)
    out[np.random.default_rng(seed).permutation(n_patients)] = by_position
    return out


def _with_split(table: pa.Table, seed: int) -> pa.Table:
    patient = _keys(table["patient_id"])
    split = split_patients(int(patient.max()) + 1, seed)[patient]
    names = pa.array(np.asarray(SPLITS, dtype=object)[split], pa.string())
    return table.append_column(VISITS_SCHEMA.field("split"), names)


# -- reading ----------------------------------------------------------------------------------


def _open(path: Path) -> pq.ParquetFile:
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    return parquet_file(path)


def _read(file: pq.ParquetFile, path: Path, columns: list[str]) -> pa.Table:
    try:
        table = file.read(columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
    check_text(table, path)
    return table


def read_visits(path: str | os.PathLike, split_seed: int = 0) -> pa.Table:
    """Read and validate one visits Parquet file (see `Dataset.visits` for the result)."""
    path = Path(path)
    file = _open(path)
    target = check_visits_columns(file.schema_arrow, path)
    table = cast_visits(_read(file, path, target.names), target, path)
    if table.num_rows == 0:
        raise InputError(f"{path}: no visits")
    _check_codes(table, path)
    _check_rows(table, path)
    order = _patient_order(table, path)
    if "split" not in table.column_names:
        table = _with_split(table, split_seed)
    return table.take(pa.array(order)).combine_chunks()


def read_ddi(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Read interacting pairs: unordered, deduplicated, self-pairs dropped, sorted."""
    path = Path(path)
    file = _open(path)
    schema = file.schema_arrow
    for field in DDI_SCHEMA:
        if field.name not in schema.names:
            raise InputError(
                f"{where(path, field.name)}: missing column "
                f"(found: {', '.join(schema.names) or 'none'})"
            )
        if not _is_text(schema.field(field.name).type):
            raise InputError(
                f"{where(path, field.name)}: wrong type "
                f"{schema.field(field.name).type}, expected string"
            )
    table = _read(file, path, DDI_SCHEMA.names)
    pairs = set()
    for name in DDI_SCHEMA.names:
        row = _first(table[name].is_null().to_numpy(zero_copy_only=False))
        if row is not None:
            raise InputError(f"{where(path, name, row)}: null value")
    drug_a = table["drug_a"].cast(pa.string()).to_pylist()
    drug_b = table["drug_b"].cast(pa.string()).to_pylist()
    for a, b in zip(drug_a, drug_b, strict=True):
        if a != b:
            pairs.add((a, b) if a < b else (b, a))
    return sorted(pairs)


def read_dataset(path: str | os.PathLike, split_seed: int = 0) -> Dataset:
    """Read and validate a dataset directory (`visits.parquet` + `ddi.parquet`).

    When visits.parquet has no `split` column, patients are split with `split_patients`
    (seeded by `split_seed`) in order of first appearance.
    """
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: dataset directory not found")
    visits = read_visits(path / VISITS_FILE, split_seed)
    return Dataset(path=path, visits=visits, ddi_pairs=read_ddi(path / DDI_FILE))


# -- writing ----------------------------------------------------------------------------------


def _write_atomic(
    path: str | os.PathLike,
    schema: pa.Schema,
    tables: Iterable[pa.Table],
    row_group_size: int | None,
) -> Path:
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for table in tables:
            writer.write_table(table, row_group_size=row_group_size)
    return path


def write_visits(
    path: str | os.PathLike,
    data: pa.Table | pa.RecordBatch | Iterable[pa.Table | pa.RecordBatch],
    row_group_size: int | None = None,
) -> Path:
    """Write visits atomically (temp file + rename), cast to VISITS_SCHEMA.

    `data` is a table, a batch, or an iterable of them (streamed: each is written as it
    comes, split into row groups of at most `row_group_size` rows). The `split` column is
    written when the first piece has one.
    """
    pieces = iter([data] if isinstance(data, (pa.Table, pa.RecordBatch)) else data)
    first = next(pieces, None)
    if first is None:
        raise ValueError("write_visits needs at least one table or batch")
    target = check_visits_columns(first.schema, path)

    def tables():
        yield cast_visits(first, target, path)
        for piece in pieces:
            yield cast_visits(piece, target, path)

    return _write_atomic(path, target, tables(), row_group_size)


def write_ddi(path: str | os.PathLike, pairs: Iterable[Sequence[str]]) -> Path:
    """Write interacting pairs (drug_a, drug_b) atomically."""
    pairs = list(pairs)
    table = pa.table(
        {"drug_a": [a for a, _ in pairs], "drug_b": [b for _, b in pairs]}, schema=DDI_SCHEMA
    )
    return _write_atomic(path, DDI_SCHEMA, [table], None)
