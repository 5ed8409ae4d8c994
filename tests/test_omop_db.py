"""`cognet data omop --cdm` from a database: a DuckDB file and a real PostgreSQL server (started
here, `pg_server`), each holding test_omop's extract, give the files' output byte for byte;
bad databases exit 2 naming the table and column, and a password never shows."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from cdm_forms import typed, write_duckdb
from click.testing import CliRunner
from omop_tables import CONCEPT, CONCEPT_ANCESTOR, TABLES, write_extract
from pg_server import PASSWORD, PgServer

from cognet.cli import main
from cognet.core.errors import InputError
from cognet.data.omop import ATC_CLASSES, CLINICAL, VOCABULARY, build_omop
from cognet.data.omop_db import DUCKDB_MEMORY, DbOptions, masked, open_cdm, open_database

OPTIONS = [{}, {"source_codes": True}, {"visit_concepts": [9201, 262]}]


def extract() -> dict[str, pa.Table]:
    tables = {**TABLES, "concept": CONCEPT, "concept_ancestor": CONCEPT_ANCESTOR}
    return {name: typed(table) for name, table in tables.items()}


@pytest.fixture
def duck(tmp_path: Path) -> Path:
    return write_duckdb(tmp_path / "cdm.duckdb", extract())


def from_files(tmp_path: Path, ddi: Path, **options) -> Path:
    out = tmp_path / "from_files"
    build_omop(write_extract(tmp_path / "cdm_files"), out, ddi, **options)
    return out


def assert_same_output(expected: Path, got: Path) -> None:
    for name in ("visits.parquet", "ddi.parquet"):
        assert (got / name).read_bytes() == (expected / name).read_bytes(), name
    steps = [json.loads((d / "summary.json").read_text())["steps"] for d in (expected, got)]
    assert steps[0] == steps[1]  # every row counted as the files count it


def invoke(*args: object):
    return CliRunner().invoke(main, ["data", "omop", *map(str, args)])


# ---------------------------------------------------------------- DuckDB


@pytest.mark.parametrize("options", OPTIONS, ids=["standard", "source-codes", "visit-types"])
def test_duckdb_gives_the_files_output_byte_for_byte(duck, ddi_file, tmp_path, options):
    out = tmp_path / "from_duckdb"
    build_omop(duck, out, ddi_file, **options)
    assert_same_output(from_files(tmp_path, ddi_file, **options), out)


def test_cli_duckdb_url_and_separate_vocabulary_schema(ddi_file, tmp_path):
    tables = extract()
    db = write_duckdb(tmp_path / "cdm.ddb", tables, schema="clinical", vocab_schema="athena")
    out = tmp_path / "out"
    result = invoke(
        "--cdm",
        f"duckdb:///{db}",
        "--cdm-schema",
        "clinical",
        "--vocab-schema",
        "athena",
        "--out",
        out,
        "--ddi",
        ddi_file,
    )
    assert result.exit_code == 0, result.output
    assert "drug_exposure: 11 rows -> 7 mapped to ATC-3" in result.output
    assert_same_output(from_files(tmp_path, ddi_file), out)


def test_filters_are_pushed_down_and_the_counts_stay_whole(tmp_path, ddi_file):
    tables = extract()
    many = 5000  # concepts no visit uses, and their ancestor rows: never leave the database
    tables["concept"] = pa.concat_tables(
        [
            tables["concept"],
            typed(
                (
                    CONCEPT[0],
                    [
                        [
                            9_000_000 + i,
                            "x",
                            "Drug",
                            "RxNorm",
                            "Clinical Drug",
                            "S",
                            str(i),
                            "19700101",
                            "20991231",
                            "",
                        ]
                        for i in range(many)
                    ],
                )
            ),
        ]
    )
    tables["concept_ancestor"] = pa.concat_tables(
        [
            tables["concept_ancestor"],
            typed(
                (
                    CONCEPT_ANCESTOR[0],
                    [[9_000_000 + i, 9_000_000 + i, 0, 0] for i in range(many)],
                )
            ),
        ]
    )
    db = write_duckdb(tmp_path / "cdm.duckdb", tables)
    schemas = dict.fromkeys(CLINICAL + VOCABULARY, "cdm")
    events = {
        "condition_occurrence": "condition_concept_id",
        "procedure_occurrence": "procedure_concept_id",
    }
    with open_cdm(db, CLINICAL + VOCABULARY, schemas, events, ATC_CLASSES) as cdm:
        for name in VOCABULARY:
            table = cdm.tables[name]
            streamed = sum(
                len(c)
                for _, cols in table.batches([table.names[0]])
                for c in [next(iter(cols.values()))]
            )
            assert streamed < 30 and table.rows_read(streamed) == tables[name].num_rows
    out = tmp_path / "out"
    report = build_omop(db, out, ddi_file)
    concept = next(s for s in report.steps if s.name == "concept")
    assert concept.rows == len(CONCEPT[1]) + many


def test_duckdb_memory_limit_is_set(duck):
    db = open_database(duck)
    try:
        limit = db.rows("SELECT current_setting('memory_limit')", "settings")[0][0]
    finally:
        db.close()
    default = duckdb.connect().execute("SELECT current_setting('memory_limit')").fetchone()[0]
    with duckdb.connect(config={"memory_limit": DUCKDB_MEMORY}) as con:
        assert limit == con.execute("SELECT current_setting('memory_limit')").fetchone()[0]
    assert limit != default


def test_missing_table_exits_2_naming_it_and_the_schemas(tmp_path):
    tables = extract()
    del tables["drug_exposure"]
    db = write_duckdb(tmp_path / "cdm.duckdb", tables)
    result = invoke("--cdm", db, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert result.output.strip().endswith(
        f"{db}: table cdm.drug_exposure not found (schemas with tables: cdm; see --cdm-schema "
        "and --vocab-schema)"
    )
    result = invoke("--cdm", db, "--cdm-schema", "main", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "table main.person not found" in result.output


def test_missing_column_exits_2_naming_table_and_column(tmp_path):
    db = write_duckdb(tmp_path / "cdm.duckdb", extract())
    con = duckdb.connect(str(db))
    con.execute("ALTER TABLE cdm.cdm.drug_exposure DROP COLUMN drug_concept_id")
    con.close()
    result = invoke("--cdm", db, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert f"{db}: table cdm.drug_exposure: column 'drug_concept_id': missing column" in (
        result.output
    )
    assert not (tmp_path / "out" / "visits.parquet").exists()


@pytest.mark.parametrize("make", ["absent", "not-duckdb"])
def test_unreadable_duckdb_exits_2(tmp_path, make):
    db = tmp_path / "cdm.duckdb"
    if make == "not-duckdb":
        db.write_text("person_id\n1\n")
    result = invoke("--cdm", db, "--out", tmp_path / "out")
    assert result.exit_code == 2 and str(db) in result.output
    assert "Traceback" not in result.output


def test_out_onto_the_database_is_refused(duck, tmp_path):
    before = duck.read_bytes()
    result = invoke("--cdm", f"duckdb:///{duck}", "--out", duck)
    assert result.exit_code == 2  # click: --out is a file
    with pytest.raises(InputError, match=f"the output would overwrite the input {duck}"):
        build_omop(duck, duck)
    assert duck.read_bytes() == before


def test_no_medication_mapping_is_refused_unless_allowed(tmp_path):
    tables = extract()  # a vocabulary without ATC: no drug can map
    concept = tables["concept"]
    keep = [not k.startswith("ATC") for k in concept["concept_class_id"].to_pylist()]
    tables["concept"] = concept.filter(pa.array(keep))
    db = write_duckdb(tmp_path / "cdm.duckdb", tables)
    out = tmp_path / "out"
    result = invoke("--cdm", db, "--out", out)
    assert result.exit_code == 2
    assert "no drug_exposure row maps to an ATC 3rd class" in result.output
    assert "Athena" in result.output and "CONCEPT_ANCESTOR" in result.output
    assert "--allow-no-medications" in result.output and not out.exists()
    result = invoke("--cdm", db, "--out", out, "--allow-no-medications")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "summary.json").read_text())["dataset"]["medications"] == 0


def test_other_urls_are_refused_with_the_password_masked(tmp_path):
    result = invoke("--cdm", "mssql://sa:Hunter2pw@db/cdm", "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert "mssql://sa:***@db/cdm: unsupported database" in result.output
    assert "Hunter2pw" not in result.output
    assert masked("postgresql://u:p%40ss@h:5/db") == (
        "postgresql://u:***@h:5/db",
        ["p%40ss", "p@ss"],
    )
    assert masked("postgresql://u@/db?host=/run&password=Xy") == (
        "postgresql://u@/db?host=/run&password=***",
        ["Xy"],
    )
    assert masked("postgresql://u@h/db") == ("postgresql://u@h/db", [])


# ---------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="module")
def pg():
    server = PgServer.start()
    if server is None:
        pytest.skip("PostgreSQL binaries not installed (apt-get install postgresql; .ci/run does)")
    tables = extract()
    server.load("cdm", {k: v for k, v in tables.items() if k not in VOCABULARY})
    server.load("vocab", {k: v for k, v in tables.items() if k in VOCABULARY})
    yield server
    server.stop()


@pytest.mark.parametrize("options", OPTIONS, ids=["standard", "source-codes", "visit-types"])
def test_postgres_gives_the_files_output_byte_for_byte(pg, ddi_file, tmp_path, options):
    out = tmp_path / "from_pg"
    build_omop(pg.url(), out, ddi_file, database=DbOptions(vocab_schema="vocab"), **options)
    assert_same_output(from_files(tmp_path, ddi_file, **options), out)


def test_cli_postgres_password_from_the_environment(pg, ddi_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    out = tmp_path / "out"
    result = invoke(
        "--cdm", pg.url(password=False), "--vocab-schema", "vocab", "--out", out, "--ddi", ddi_file
    )
    assert result.exit_code == 0, result.output
    assert PASSWORD not in result.output + (out / "summary.json").read_text()
    assert_same_output(from_files(tmp_path, ddi_file), out)


@pytest.mark.parametrize("where", ["user part", "parameter"])
def test_postgres_wrong_password_never_shows_it(pg, tmp_path, monkeypatch, where):
    monkeypatch.delenv("PGPASSWORD", raising=False)
    url = pg.url().replace(PASSWORD, "Wr0ng-Pa55word")
    if where == "parameter":
        url = pg.url(password=False) + "&password=Wr0ng-Pa55word"
    result = invoke("--cdm", url, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert "cannot connect" in result.output
    assert "password authentication failed" in result.output
    assert "Wr0ng-Pa55word" not in result.output and "***" in result.output


def test_unreachable_postgres_exits_2_without_the_password(tmp_path):
    url = f"postgresql://cognet:{PASSWORD}@/cdm?host={tmp_path / 'no-server'}&port=5999"
    result = invoke("--cdm", url, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "cannot connect" in result.output and PASSWORD not in result.output
    assert "Traceback" not in result.output


def test_postgres_missing_table_names_schema_and_table(pg, tmp_path):
    result = invoke("--cdm", pg.url(), "--out", tmp_path / "out")  # vocabulary is not in cdm
    assert result.exit_code == 2
    assert "table cdm.concept not found (schemas with tables: cdm, vocab;" in result.output
    assert PASSWORD not in result.output
