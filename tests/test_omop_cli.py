"""`cognet data omop` on the command line, and bad input: a missing table or column, an
unreadable value, an output that would overwrite an input (exit 2, one line, no traceback).
The extract is test_omop's."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from omop_tables import VISIT, rewrite_tables, write_table

from cognet.cli import main
from cognet.core.errors import InputError
from cognet.data.omop import build_omop, parse_concept_ids


def invoke(*args: str):
    return CliRunner().invoke(main, ["data", "omop", *map(str, args)])


def test_cli_prints_each_step_and_writes_a_summary(cdm, ddi_file, tmp_path):
    out = tmp_path / "out"
    result = invoke("--cdm", cdm, "--out", out, "--ddi", ddi_file)
    assert result.exit_code == 0, result.output
    assert (
        "drug_exposure: 11 rows -> 7 mapped to ATC-3; dropped 1 without visit_occurrence_id, "
        "1 of a visit not in visit_occurrence, 1 with concept_id 0, 1 with no ATC 3rd ancestor"
    ) in result.stdout
    assert "visits: 8 rows -> 7 written; dropped 1 without a condition or procedure" in (
        result.stdout
    )
    assert f"wrote {out}: patients 3, visits 7, medications null 3" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"]["visits"] == 7
    assert [s["name"] for s in summary["steps"]][-2:] == ["visits", "ddi"]
    visits = summary["steps"][-2]
    assert (visits["rows"], visits["kept"]) == (8, 7)
    assert visits["dropped"] == {"without a condition or procedure": 1}
    assert result.stderr == ""


def test_cli_without_ddi_warns_and_writes_no_pairs(cdm, tmp_path):
    result = invoke("--cdm", cdm, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "Warning: no --ddi file: ddi.parquet is empty, so the DDI graph and the DDI metrics "
        "will be empty\n"
    )
    assert pq.read_table(tmp_path / "out" / "ddi.parquet").num_rows == 0


def test_cli_help_has_an_example():
    result = CliRunner().invoke(main, ["data", "omop", "--help"])
    assert result.exit_code == 0 and "Example:" in result.output
    assert "cognet data omop --cdm" in result.output


@pytest.mark.parametrize("table", ["person", "drug_exposure", "CONCEPT", "CONCEPT_ANCESTOR"])
def test_cli_missing_table_exits_2(cdm, tmp_path, table):
    (cdm / f"{table}.csv").unlink()
    result = invoke("--cdm", cdm, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {cdm / (table.lower() + '.csv')}: table {table.lower()} not found "
        "(looked for .csv, .csv.gz, .parquet in any case)\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("file", "column", "args"),
    [
        ("drug_exposure.csv", "drug_concept_id", []),
        ("visit_occurrence.csv", "visit_start_date", []),
        ("visit_occurrence.csv", "visit_concept_id", ["--visit-concepts", "9201"]),
        ("condition_occurrence.csv", "condition_source_concept_id", ["--source-codes"]),
        ("CONCEPT_ANCESTOR.csv", "descendant_concept_id", []),
        ("CONCEPT.csv", "concept_code", []),
    ],
)
def test_cli_missing_column_exits_2(cdm, tmp_path, file, column, args):
    path = cdm / file
    delimiter = "\t" if file.isupper() or file.startswith("CONCEPT") else ","
    with path.open(newline="") as handle:
        table = list(csv.reader(handle, delimiter=delimiter, quoting=csv.QUOTE_NONE))
    keep = [i for i, name in enumerate(table[0]) if name != column]
    write_table(
        path, ([table[0][i] for i in keep], [[r[i] for i in keep] for r in table[1:]]), delimiter
    )
    result = invoke("--cdm", cdm, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2
    assert result.stderr == f"Error: {path}: column {column!r}: missing column\n"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "12,1,9201,2020-01-15",
            "12,1,9201,2020-15-01",
            "column 'visit_start_date', line 6: '2020-15-01' is not a date "
            "(YYYY-MM-DD or YYYYMMDD)",
        ),
        ("12,1,9201,2020-01-15", "12,,9201,2020-01-15", "column 'person_id', line 6: empty"),
        (
            "12,1,9201,2020-01-15",
            "1x2,1,9201,2020-01-15",
            "column 'visit_occurrence_id', line 6: '1x2' is not an integer id",
        ),
        (
            "12,1,9201,2020-01-15",
            "10,1,9201,2020-01-15",
            "column 'visit_occurrence_id', line 6: visit_occurrence_id 10 repeated "
            "(first at line 2)",
        ),
    ],
)
def test_cli_bad_value_names_the_line(cdm, tmp_path, old, new, message):
    path = cdm / "visit_occurrence.csv"
    path.write_text(path.read_text().replace(old, new))
    result = invoke("--cdm", cdm, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr == f"Error: {path}: {message}\n"


def test_parquet_errors_name_the_row(cdm, tmp_path):
    rewrite_tables(cdm, ".parquet")
    path = cdm / "DRUG_EXPOSURE.parquet"
    table = pq.read_table(path)
    ids = table["drug_concept_id"].to_pylist()
    ids[3] = 1.5
    pq.write_table(table.set_column(2, "drug_concept_id", pa.array(ids, pa.float64())), path)
    with pytest.raises(
        InputError,
        match=r"DRUG_EXPOSURE.parquet: column 'drug_concept_id', "
        r"row 3: 1.5 is not an integer id",
    ):
        build_omop(cdm, tmp_path / "out")


def test_refuses_to_overwrite_its_input(cdm, tmp_path):
    result = invoke("--cdm", cdm, "--out", cdm)
    assert result.exit_code == 2
    assert (
        result.stderr == f"Error: {cdm}: --out is inside the input folder {cdm}; choose another\n"
    )
    ddi = tmp_path / "ddi.parquet"
    pq.write_table(pa.table({"drug_a": ["C08C"], "drug_b": ["C09A"]}), ddi)
    before = ddi.read_bytes()
    result = invoke("--cdm", cdm, "--out", tmp_path, "--ddi", ddi)
    assert result.exit_code == 2
    message = f"Error: {ddi}: --out would overwrite the input file {ddi}; choose another\n"
    assert result.stderr == message
    assert ddi.read_bytes() == before


def test_bad_visit_concepts_exit_2(cdm, tmp_path):
    result = invoke("--cdm", cdm, "--out", tmp_path / "out", "--visit-concepts", "9201,inp")
    assert result.exit_code == 2
    assert result.stderr == "Error: --visit-concepts: 'inp' is not a concept id (e.g. 9201,262)\n"
    assert parse_concept_ids(" 262, 9201,262 ") == [262, 9201]


def test_no_visit_left_is_an_input_error(cdm, tmp_path):
    with pytest.raises(InputError, match="no visit has a condition or procedure code"):
        build_omop(cdm, tmp_path / "out", visit_concepts=[581478])
    write_table(cdm / "visit_occurrence.csv", (VISIT[0], []))  # a header only
    with pytest.raises(InputError, match="visit_occurrence: 0 rows -> 0 visits"):
        build_omop(cdm, tmp_path / "out")


@pytest.mark.parametrize(
    ("name", "old", "new", "line", "fields"),
    [
        ("condition_occurrence.csv", ",I21,", ",I21,X,", 5, 8),  # an unquoted comma
        ("CONCEPT.csv", "Myocardial", "Myocardial\t", 4, 10),  # Athena: a stray tab
    ],
)
def test_ragged_line_is_named(cdm, tmp_path, name, old, new, line, fields):
    path = cdm / name
    path.write_text(path.read_text().replace(old, new))
    result = invoke("--cdm", cdm, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {path}: line {line}: {fields + 1} fields, the header has {fields}\n"
    )
