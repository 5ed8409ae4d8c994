"""The OMOP CDM tables of a test extract as typed Arrow tables, and written into a DuckDB
file, as a CDM database holds them (ids BIGINT, dates DATE, date-times TIMESTAMP)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import duckdb
import pyarrow as pa

VOCABULARY = ("concept", "concept_ancestor")
TEXT_IDS = ("domain_id", "vocabulary_id", "concept_class_id")  # varchar in the CDM


def _date(text: str) -> dt.date:
    return dt.datetime.strptime(text, "%Y%m%d" if "-" not in text else "%Y-%m-%d").date()


def _type(column: str) -> tuple[pa.DataType, object]:
    """The column's type by its OMOP name, and the parser of its text."""
    if column.endswith("_datetime"):
        return pa.timestamp("us"), dt.datetime.fromisoformat
    if column.endswith("_date"):
        return pa.date32(), _date
    if column in TEXT_IDS:
        return pa.string(), str
    if column.endswith(("_id", "_separation", "year_of_birth")):
        return pa.int64(), int
    return pa.string(), str


def typed(table: tuple[list, list]) -> pa.Table:
    """(header, rows) as written to CSV -> a typed Arrow table; "" is null."""
    header, rows = table
    columns = {}
    for i, column in enumerate(header):
        kind, parse = _type(column)
        values = [None if row[i] == "" else parse(row[i]) for row in rows]
        columns[column] = pa.array(values, kind)
    return pa.table(columns)


def write_duckdb(
    path: Path, tables: dict[str, pa.Table], schema: str = "cdm", vocab_schema: str | None = None
) -> Path:
    """A DuckDB file with the clinical tables in ``schema`` and the vocabulary in
    ``vocab_schema`` (default the same)."""
    con = duckdb.connect(str(path))
    catalog = con.execute("SELECT current_database()").fetchone()[0]
    for name, table in tables.items():
        where = (vocab_schema or schema) if name in VOCABULARY else schema
        con.execute(f'CREATE SCHEMA IF NOT EXISTS "{catalog}"."{where}"')
        con.register("source", table)
        con.execute(f'CREATE TABLE "{catalog}"."{where}"."{name}" AS SELECT * FROM source')
        con.unregister("source")
    con.close()
    return path
