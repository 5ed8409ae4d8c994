"""Reading source extracts and reporting conversions, shared by the dataset builders.

`SourceTable` reads one table file (CSV, CSV.gz or Parquet) in record batches, columns
matched without regard to case, and converts ids and dates with errors that name the file,
column and row. `Step` / `Report` count what each conversion step read, kept and dropped:
every converter returns a `Report`, and `write_dataset` writes its dataset with the report
in ``OUT/summary.json``.

CSV files are comma- or tab-separated (told by the header line). Tab-separated files are read
as Athena writes them, without quoting (a concept name may hold a lone ``"``); a field wholly
in quotes is unquoted. Dates are ``YYYY-MM-DD`` (a time after it is allowed) or Athena's
``YYYYMMDD``; in Parquet also date or timestamp columns. Ids may be written ``123.0`` (what a
float column gives). Empty, ``NULL``, ``NA`` and ``NaN`` are missing ids and dates.
"""

from __future__ import annotations

import csv
import gzip
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from cognet.core import strict_json
from cognet.core.dataset import DDI_FILE, VISITS_FILE, write_ddi, write_visits
from cognet.core.errors import InputError, one_line, where
from cognet.core.files import target_of, write_text

log = logging.getLogger(__name__)

SUFFIXES = (".csv.gz", ".tsv.gz", ".csv", ".tsv", ".parquet")  # longest first
SUMMARY_FILE = "summary.json"
NULL_TEXT = ["", "NULL", "null", "NA", "NaN", "nan", "None"]  # empty in id and date columns
DATE_FORMATS = ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d", "%Y%m%d")
CSV_BLOCK = 1 << 23  # bytes per CSV record batch
PARQUET_BATCH = 1 << 18  # rows per Parquet record batch


# ---------------------------------------------------------------- report


@dataclass
class Step:
    """Rows read by one step and what became of them: rows = kept + sum(dropped)."""

    name: str
    rows: int
    kept: int
    what: str
    dropped: dict[str, int] = field(default_factory=dict)

    @classmethod
    def counting(cls, name: str, what: str, reasons: Iterable[str]) -> Step:
        """A step whose rows and drops are added up batch by batch; `close` sets kept."""
        return cls(name, 0, 0, what, dict.fromkeys(reasons, 0))

    def close(self) -> Step:
        """Kept = rows less every drop; the step has ended (`ended`)."""
        self.kept = self.rows - sum(self.dropped.values())
        return self.ended()

    def ended(self) -> Step:
        """Log the step's line (`--verbose` shows each step as it ends); returns the step."""
        log.info("%s", self.line())
        return self

    def line(self) -> str:
        text = f"{self.name}: {self.rows:,} rows -> {self.kept:,} {self.what}"
        gone = [f"{n:,} {reason}" for reason, n in self.dropped.items() if n]
        return text + ("; dropped " + ", ".join(gone) if gone else "")


@dataclass
class Report:
    """What a conversion read, kept and dropped, and the counts of the dataset it wrote."""

    source: str
    out: Path
    steps: list[Step]
    dataset: dict[str, int]
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        counts = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in self.dataset.items())
        out = target_of(self.out)  # the folder, not the temporary sibling it is built in
        written = f"wrote {out}: {counts}; summary {out / SUMMARY_FILE}"
        return [s.line() for s in self.steps] + [written]

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "out": str(target_of(self.out)),
            "dataset": self.dataset,
            "steps": [asdict(s) for s in self.steps],
            "warnings": self.warnings,
        }


def write_summary(report: Report) -> Path:
    """``OUT/summary.json``, written atomically."""
    return write_text(
        report.out / SUMMARY_FILE, strict_json.dumps(report.to_json(), indent=2) + "\n"
    )


def write_dataset(
    report: Report, visits: pa.Table, pairs: Sequence[tuple[str, str]], **write_options
) -> Report:
    """The end of every conversion: ``visits.parquet`` (`write_visits` with `write_options`),
    ``ddi.parquet`` and ``summary.json`` into ``report.out``; returns the report."""
    write_visits(report.out / VISITS_FILE, visits, **write_options)
    write_ddi(report.out / DDI_FILE, pairs)
    write_summary(report)
    return report


def check_output(out: Path, inputs: Iterable[Path]) -> None:
    """InputError when OUT is an input folder or an output file would replace an input."""
    out = out.resolve()
    for path in inputs:
        path = Path(path).resolve()
        if path == out or (
            path.parent == out and path.name in (VISITS_FILE, DDI_FILE, SUMMARY_FILE)
        ):
            raise InputError(f"{out}: the output would overwrite the input {path}")


# ---------------------------------------------------------------- reading tables


class SourceTable:
    """One table file (CSV, CSV.gz or Parquet): columns matched without regard to case,
    read in record batches, values converted with errors that name the file, column and row
    (CSV: the line, header = line 1; Parquet: the 0-based row)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{self.path}: file not found")
        self.parquet = self.path.name.lower().endswith(".parquet")
        try:
            if self.parquet:
                self._file = pq.ParquetFile(self.path)
                names = self._file.schema_arrow.names
            else:
                opener = gzip.open if self.path.name.lower().endswith(".gz") else open
                with opener(self.path, "rt", encoding="utf-8-sig", newline="") as handle:
                    header = handle.readline().rstrip("\r\n")
                self.delimiter = "\t" if "\t" in header else ","
                names = [n.strip().strip('"').strip() for n in header.split(self.delimiter)]
        except (pa.ArrowException, OSError, UnicodeDecodeError, EOFError) as exc:
            raise InputError(f"{self.path}: not readable ({one_line(exc)})") from None
        if not any(names):
            raise InputError(f"{self.path}: empty file (no header line)")
        self.names = names
        self.columns: dict[str, str] = {}
        for name in names:
            self.columns.setdefault(name.lower(), name)

    def row_name(self, row: int) -> str:
        """A data row (0 = the first) as the user finds it: CSV line or Parquet row."""
        return f"row {row}" if self.parquet else f"line {row + 2}"

    def where(self, column: str, row: int | None = None) -> str:
        """``FILE: column 'C'`` and, with a row, ``, line N`` (CSV) or ``, row N`` (Parquet)."""
        text = where(self.path, self.columns.get(column, column))  # as the file spells it
        return text if row is None else f"{text}, {self.row_name(row)}"

    def batches(self, required: Sequence[str], optional: Sequence[str] = ()):
        """(first row, {column: array}) per record batch; a missing required column raises."""
        for column in required:
            if column not in self.columns:
                raise InputError(f"{self.where(column)}: missing column")
        wanted = [*required, *(c for c in optional if c in self.columns)]
        actual = [self.columns[c] for c in wanted]
        start = 0
        try:
            for batch in self._read(actual):
                yield start, {c: batch.column(a) for c, a in zip(wanted, actual, strict=True)}
                start += batch.num_rows
        except (pa.ArrowException, OSError, UnicodeDecodeError, EOFError) as exc:
            raise InputError(
                self._ragged_line() or f"{self.path}: not readable ({one_line(exc)})"
            ) from None

    def rows_read(self, read: int) -> int:
        """The table's row count, given the rows its batches gave: the same for a file (a
        database table whose batches were filtered in the database counts them there)."""
        return read

    def _ragged_line(self) -> str | None:
        """The first CSV line whose number of fields is not the header's, told as an error."""
        if self.parquet:
            return None
        opener = gzip.open if self.path.name.lower().endswith(".gz") else open
        with opener(self.path, "rt", encoding="utf-8-sig", newline="", errors="replace") as file:
            if self.delimiter == "\t":  # no quoting: one line, one row
                rows = ((n, line.rstrip("\r\n").split("\t")) for n, line in enumerate(file, 1))
            else:
                reader = csv.reader(file)
                rows = ((reader.line_num, fields) for fields in reader)
            for number, fields in rows:
                if fields and fields != [""] and len(fields) != len(self.names):
                    return (
                        f"{self.path}: line {number}: {len(fields)} fields, the header has "
                        f"{len(self.names)}"
                    )
        return None

    def _read(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        if self.parquet:
            yield from self._file.iter_batches(batch_size=PARQUET_BATCH, columns=columns)
            return
        reader = pacsv.open_csv(
            self.path,
            read_options=pacsv.ReadOptions(
                column_names=self.names, skip_rows=1, block_size=CSV_BLOCK
            ),
            parse_options=pacsv.ParseOptions(
                delimiter=self.delimiter, quote_char='"' if self.delimiter == "," else False
            ),
            convert_options=pacsv.ConvertOptions(
                include_columns=columns, column_types={c: pa.string() for c in columns}
            ),
        )
        yield from reader

    def text(self, values: pa.Array) -> pa.Array:
        """Strings, trimmed (and unquoted in tab files); empty -> null."""
        values = pc.utf8_trim_whitespace(values.cast(pa.string()))
        if not self.parquet and self.delimiter == "\t":
            values = pc.replace_substring_regex(values, r'^"(.*)"$', r"\1")
        return pc.if_else(pc.equal(values, ""), pa.scalar(None, pa.string()), values)

    def _fail(self, column: str, start: int, bad: pa.Array, values: pa.Array, what: str):
        row = int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{self.where(column, start + row)}: {values[row].as_py()!r} is {what}")

    def _missing(self, text: pa.Array) -> pa.Array:
        return pc.if_else(pc.is_in(text, pa.array(NULL_TEXT)), pa.scalar(None, pa.string()), text)

    def require(self, values: pa.Array, column: str, start: int) -> np.ndarray:
        """The valid mask of ``values``; InputError naming the first empty row."""
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        if not valid.all():
            raise InputError(f"{self.where(column, start + int(np.argmin(valid)))}: empty")
        return valid

    def _valid(self, values: pa.Array, column: str, start: int, required: bool):
        if required:
            valid = self.require(values, column, start)
        else:
            valid = values.is_valid().to_numpy(zero_copy_only=False)
        return values.fill_null(0).to_numpy(zero_copy_only=False), valid

    def ints(
        self, values: pa.Array, column: str, start: int, required: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(int64 values, valid mask); a non-integer (or with ``required`` an empty value)
        raises InputError naming its row."""
        kind = values.type
        if pa.types.is_integer(kind):
            ids = values.cast(pa.int64())
        elif pa.types.is_floating(kind) or pa.types.is_decimal(kind):
            floats = values.cast(pa.float64())
            floats = pc.if_else(pc.is_nan(floats), pa.scalar(None, pa.float64()), floats)
            bad = pc.fill_null(pc.not_equal(pc.floor(floats), floats), False)
            if pc.any(bad).as_py():
                self._fail(column, start, bad, values, "not an integer id")
            ids = floats.cast(pa.int64(), safe=False)
        else:
            text = self._missing(pc.replace_substring_regex(self.text(values), r"\.0*$", ""))
            bad = pc.invert(pc.fill_null(pc.match_substring_regex(text, r"^[+-]?\d{1,18}$"), True))
            if pc.any(bad).as_py():
                self._fail(column, start, bad, values, "not an integer id")
            ids = text.cast(pa.int64())
        return self._valid(ids, column, start, required)

    def times(
        self, values: pa.Array, column: str, start: int, required: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(microseconds since 1970 as int64, valid mask) of a date or date-time column."""
        kind = values.type
        if pa.types.is_date(kind) or pa.types.is_timestamp(kind):
            stamps = values.cast(pa.timestamp("us", getattr(kind, "tz", None)))
        else:
            text = self._missing(self.text(values))
            head = pc.utf8_slice_codeunits(pc.replace_substring(text, "T", " "), 0, 19)
            parsed = [pc.strptime(head, f, "us", error_is_null=True) for f in DATE_FORMATS]
            stamps = pc.coalesce(*parsed)
            bad = pc.and_(text.is_valid(), stamps.is_null())
            if pc.any(bad).as_py():
                self._fail(column, start, bad, values, "not a date (YYYY-MM-DD or YYYYMMDD)")
        return self._valid(stamps.cast(pa.int64()), column, start, required)


def find_tables(folder: Path, names: Sequence[str]) -> dict[str, SourceTable]:
    """The file of each table (one folder down if not at the top); InputError naming the
    expected file when one is missing, or both files when a table has two."""
    if not folder.is_dir():
        raise InputError(f"{folder}: folder not found")

    def index(directory: Path) -> dict[str, list[Path]]:
        found: dict[str, list[Path]] = {}
        for path in sorted(directory.iterdir()):
            lower = path.name.lower()
            suffix = next((s for s in SUFFIXES if lower.endswith(s)), None)
            if suffix and path.is_file():
                found.setdefault(lower[: -len(suffix)], []).append(path)
        return found

    top = index(folder)
    below: dict[str, list[Path]] = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        for name, paths in index(sub).items():
            below.setdefault(name, []).extend(paths)
    tables = {}
    for name in names:
        paths = top.get(name) or below.get(name) or []
        if not paths:
            raise InputError(
                f"{folder / (name + '.csv')}: table {name} not found "
                "(looked for .csv, .csv.gz, .parquet in any case)"
            )
        if len(paths) > 1:
            raise InputError(f"{paths[1]}: a second file for table {name} (also {paths[0]})")
        tables[name] = SourceTable(paths[0])
    return tables


# ---------------------------------------------------------------- output


def code_lists(
    keys: np.ndarray, codes: Sequence[str], n_visits: int, nullable: bool = False
) -> tuple[pa.ListArray, np.ndarray]:
    """list<string> per visit from sorted distinct keys ``visit * len(codes) + code index``,
    and the number of codes of each visit; with ``nullable`` an empty list is null."""
    n = max(len(codes), 1)
    counts = np.bincount(keys // n, minlength=n_visits)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    values = pa.array(list(codes), pa.string()).take(pa.array(keys % n))
    mask = pa.array(counts == 0) if nullable else None
    return pa.ListArray.from_arrays(offsets, values, mask=mask), counts


def read_ddi_pairs(path: Path, medications: set[str]) -> tuple[list[tuple[str, str]], Step]:
    """Sorted unordered pairs (a < b) of the dataset's medications from a CSV or Parquet file
    with columns drug_a, drug_b; the other rows are counted."""
    table = SourceTable(path)
    outside = "outside the dataset's medications"
    step = Step.counting("ddi", "interacting pairs", ["self pairs", outside, "repeated"])
    pairs: set[tuple[str, str]] = set()
    for start, cols in table.batches(["drug_a", "drug_b"]):
        a, b = (table.text(cols[c]) for c in ("drug_a", "drug_b"))
        for column, values in (("drug_a", a), ("drug_b", b)):
            table.require(values, column, start)
        for x, y in zip(a.to_pylist(), b.to_pylist(), strict=True):
            pair = (min(x, y), max(x, y))
            step.rows += 1
            if x == y:
                step.dropped["self pairs"] += 1
            elif x not in medications or y not in medications:
                step.dropped[outside] += 1
            elif pair in pairs:
                step.dropped["repeated"] += 1
            pairs.add(pair)
    kept = sorted(p for p in pairs if p[0] != p[1] and {*p} <= medications)
    return kept, step.close()


def no_mapped_medications(prescriptions: object, ndc_rxnorm: object, rxnorm_atc: object) -> str:
    """The refusal of mimic3 / mimic4 when no prescription maps to ATC-3:
    they keep only admissions with mapped medications, so nothing would be left to write."""
    return (
        f"{prescriptions}: no prescription's NDC maps to ATC-3 through {ndc_rxnorm} and "
        f"{rxnorm_atc}, and only admissions with mapped medications are kept: use SafeDrug's "
        "ndc2rxnorm_mapping.txt and ndc2atc_level4.csv (RXCUI, ATC4), whose keys are "
        "MIMIC's 11-digit NDCs"
    )


def dataset_counts(table: pa.Table, ddi_pairs: int) -> dict[str, int]:
    """Patients, visits (and those with medications null), distinct codes, DDI pairs."""
    counts = {"patients": len(pc.unique(table["patient_id"])), "visits": table.num_rows}
    counts["medications_null"] = table["medications"].null_count
    for name in ("diagnoses", "procedures", "medications"):
        counts[name] = len(pc.unique(pc.list_flatten(table[name])))
    return {**counts, "ddi_pairs": ddi_pairs}
