"""cognet.data.mimic4 on a tiny MIMIC-IV-shaped hosp/ folder written here (.csv.gz, lower
case), with the mapping files of the MIMIC-III tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from mimic_tables import (
    ALL_PAIRS,
    DDI,
    DRUG_ATC,
    N1,
    N2,
    N3,
    N5,
    N7,
    N8,
    NDC_RXNORM,
    RXNORM_ATC,
    write_gz,
)
from mimic_tables import write_csv as write_plain_csv

from cognet.cli import main
from cognet.core.dataset import read_dataset
from cognet.core.errors import InputError
from cognet.data.mimic3 import SafeDrugFiles
from cognet.data.mimic4 import build_mimic4, icd_token
from cognet.data.tables import Report

ADMISSIONS = (
    ["subject_id", "hadm_id", "admittime", "dischtime", "deathtime", "admission_type"],
    [
        [10001, 2001, "2150-03-01 09:00:00", "2150-03-04 09:00:00", "", "URGENT"],
        [10001, 2002, "2150-01-05 08:00:00", "2150-01-07 08:00:00", "", "EW EMER."],  # first
        [10002, 3001, "2160-05-01 00:00:00", "2160-05-02 00:00:00", "", "ELECTIVE"],
        [10002, 3002, "2160-06-01 00:00:00", "2160-06-03 00:00:00", "", "ELECTIVE"],
        [10003, 4001, "2170-01-01 00:00:00", "2170-01-02 00:00:00", "", "URGENT"],
    ],
)
DIAGNOSES = (
    ["subject_id", "hadm_id", "seq_num", "icd_code", "icd_version"],
    [
        [10001, 2001, 1, "I10", 10],
        [10001, 2001, 2, "E119", 10],
        [10001, 2002, 1, "4019", 9],
        [10001, 2002, 2, "E8798", 9],
        [10001, 2002, 3, "V4581", 9],
        [10001, 2002, 4, "4019", 9],  # repeated
        [10002, 3001, 1, "25000", 9],
        [10002, 3002, 1, "I10", 10],
        [10002, 3002, 2, "", 10],  # no code
        [10003, 4001, 1, "I10", 10],
    ],
)
PROCEDURES = (
    ["subject_id", "hadm_id", "seq_num", "chartdate", "icd_code", "icd_version"],
    [
        [10001, 2001, 1, "2150-03-02", "02703ZZ", 10],
        [10001, 2002, 2, "2150-01-05", "3606", 9],
        [10001, 2002, 1, "2150-01-05", "9604", 9],  # seq_num 1: first
        [10002, 3002, 1, "2160-06-01", "0DTJ4ZZ", 10],
        [10003, 4001, 1, "2170-01-01", "0DTJ4ZZ", 10],
    ],
)
PRESCRIPTIONS = (
    ["subject_id", "hadm_id", "pharmacy_id", "starttime", "stoptime", "drug_type", "drug", "ndc"],
    [
        [10001, 2001, 1, "2150-03-01 10:00:00", "", "MAIN", "a", N1],  # A02B
        [10001, 2001, 2, "2150-03-01 12:00:00", "", "MAIN", "b", N2],  # B01A
        [10001, 2001, 3, "2150-03-01 18:00:00", "", "MAIN", "c", N3],  # A02B again that day
        [10001, 2002, 4, "2150-01-05 09:00:00", "", "MAIN", "e", N5],  # N02B
        [10001, 2002, 5, "2150-01-05 09:00:00", "", "MAIN", "g", N7],  # C03C
        [10001, 2002, 6, "2150-01-05 09:00:00", "", "MAIN", "zero", "0"],
        [10001, 2002, 7, "2150-01-05 09:00:00", "", "MAIN", "empty", ""],
        [10002, 3001, 8, "2160-05-01 00:00:00", "", "MAIN", "a", N1],  # 3001 has no procedure
        [10002, 3002, 9, "", "", "MAIN", "a", N1],  # no starttime: kept
        [10002, 3002, 10, "2160-06-01 00:00:00", "", "MAIN", "x", N8],  # NDC not mapped
        [10002, "", 11, "2160-06-01 00:00:00", "", "MAIN", "a", N1],  # no hadm_id
        [10003, 4001, 12, "2170-01-01 00:00:00", "", "MAIN", "a", N1],  # one admission
    ],
)
VISITS = [
    {
        "patient_id": "10001",
        "visit_id": "2002",
        "visit_seq": 0,
        "diagnoses": ["ICD9CM/401.9", "ICD9CM/E879.8", "ICD9CM/V45.81"],
        "procedures": ["ICD9Proc/96.04", "ICD9Proc/36.06"],
        "medications": ["N02B", "C03C"],
    },
    {
        "patient_id": "10001",
        "visit_id": "2001",
        "visit_seq": 1,
        "diagnoses": ["ICD10CM/I10", "ICD10CM/E11.9"],
        "procedures": ["ICD10PCS/02703ZZ"],
        "medications": ["A02B", "B01A"],
    },
    {
        "patient_id": "10002",
        "visit_id": "3002",
        "visit_seq": 0,
        "diagnoses": ["ICD10CM/I10"],
        "procedures": ["ICD10PCS/0DTJ4ZZ"],
        "medications": ["A02B"],
    },
]
TABLES = {
    "admissions": ADMISSIONS,
    "diagnoses_icd": DIAGNOSES,
    "procedures_icd": PROCEDURES,
    "prescriptions": PRESCRIPTIONS,
}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    hosp = tmp_path / "mimiciv" / "hosp"
    hosp.mkdir(parents=True)
    for name, table in TABLES.items():
        write_gz(hosp / f"{name}.csv.gz", table)
    (tmp_path / "ndc2rxnorm_mapping.txt").write_text(NDC_RXNORM)
    (tmp_path / "drug-atc.csv").write_text(DRUG_ATC)
    return {
        "mimic_dir": tmp_path / "mimiciv",
        "ndc_rxnorm": tmp_path / "ndc2rxnorm_mapping.txt",
        "rxnorm_atc": write_plain_csv(tmp_path / "RXCUI2atc4.csv", RXNORM_ATC),
        "drug_atc": tmp_path / "drug-atc.csv",
        "ddi": write_plain_csv(tmp_path / "drug-DDI.csv", DDI),
        "out": tmp_path / "out",
    }


def build(files: dict[str, Path], **options) -> Report:
    """`build_mimic4` on the fixture's files (the dict the CLI tests turn into options)."""
    mappings = SafeDrugFiles(*(files[k] for k in ("ndc_rxnorm", "rxnorm_atc", "drug_atc", "ddi")))
    return build_mimic4(files["mimic_dir"], mappings, files["out"], **options)


def cli_args(files: dict[str, Path]) -> list[str]:
    return [a for key, path in files.items() for a in ("--" + key.replace("_", "-"), str(path))]


@pytest.mark.parametrize(
    ("code", "version", "kind", "token"),
    [
        ("4019", 9, "diagnoses", "ICD9CM/401.9"),
        ("486", 9, "diagnoses", "ICD9CM/486"),
        ("V4581", 9, "diagnoses", "ICD9CM/V45.81"),
        ("E8798", 9, "diagnoses", "ICD9CM/E879.8"),
        ("E879", 9, "diagnoses", "ICD9CM/E879"),
        ("I10", 10, "diagnoses", "ICD10CM/I10"),
        ("S72001A", 10, "diagnoses", "ICD10CM/S72.001A"),
        ("3606", 9, "procedures", "ICD9Proc/36.06"),
        ("02703ZZ", 10, "procedures", "ICD10PCS/02703ZZ"),
        ("401.9", 9, "diagnoses", "ICD9CM/401.9"),
    ],
)
def test_icd_tokens_follow_omop(code, version, kind, token):
    assert icd_token(code, version, kind) == token


def test_builds_the_visits(files):
    report = build(files)
    assert pq.read_table(files["out"] / "visits.parquet").to_pylist() == VISITS
    ddi = pq.read_table(files["out"] / "ddi.parquet").to_pylist()
    assert [(p["drug_a"], p["drug_b"]) for p in ddi] == ALL_PAIRS
    assert report.dataset == {
        "patients": 2,
        "visits": 3,
        "medications_null": 0,
        "diagnoses": 5,
        "procedures": 4,
        "medications": 4,
        "ddi_pairs": 4,
    }
    dataset = read_dataset(files["out"])
    assert dataset.visits.drop_columns("split").to_pylist() == VISITS


def test_counts_every_dropped_row(files):
    steps = {s.name: s for s in build(files).steps}
    assert steps["prescriptions"].dropped == {
        "without hadm_id": 1,
        'with NDC "0" or empty': 2,
        "with an NDC not mapped to ATC-3": 1,
        "repeating an (admission, day, ATC-3)": 1,
    }
    assert steps["prescriptions"].kept == 7
    assert steps["patients with 2+ admissions"].dropped == {"of a patient with one admission": 1}
    assert steps["diagnoses_icd"].dropped == {
        "without hadm_id or icd_code": 1,
        "repeating an (admission, code)": 1,
    }
    assert steps["admissions with medications"].dropped == {
        "without a diagnosis": 0,
        "without a procedure": 1,
    }
    for step in steps.values():
        assert step.rows == step.kept + sum(step.dropped.values()), step


def test_keeps_the_commonest_codes(files):
    build(files, top_medications=2, top_diagnoses=1)
    visits = pq.read_table(files["out"] / "visits.parquet").to_pylist()
    # ATC-3 rows: A02B 3 (2001, 3001, 3002), then B01A, C03C, N02B 1 each: B01A by name.
    # Diagnoses: ICD10CM/I10 (3 admissions) alone; 2002 keeps none, so it goes.
    assert [(v["visit_id"], v["diagnoses"], v["medications"]) for v in visits] == [
        ("2001", ["ICD10CM/I10"], ["A02B", "B01A"]),
        ("3002", ["ICD10CM/I10"], ["A02B"]),
    ]


def test_reads_the_hosp_folder_itself_and_plain_csv(files):
    hosp = files["mimic_dir"] / "hosp"
    for path in list(hosp.iterdir()):
        (hosp / (path.name.split(".")[0].upper() + ".csv")).write_bytes(
            gzip.decompress(path.read_bytes())
        )
        path.unlink()
    build({**files, "mimic_dir": hosp})
    assert pq.read_table(files["out"] / "visits.parquet").to_pylist() == VISITS


def test_cli_prints_steps_and_summary(files):
    result = CliRunner().invoke(main, ["data", "mimic4", *cli_args(files)])
    assert result.exit_code == 0, result.output
    assert (
        'prescriptions: 12 rows -> 7 mapped to ATC-3; dropped 1 without hadm_id, 2 with NDC "0" '
        "or empty, 1 with an NDC not mapped to ATC-3, 1 repeating an (admission, day, ATC-3)"
    ) in result.output
    assert f"wrote {files['out']}: patients 2, visits 3" in result.output
    summary = json.loads((files["out"] / "summary.json").read_text())
    assert summary["source"] == "mimic4" and summary["dataset"]["visits"] == 3
    steps = {s["name"]: s for s in summary["steps"]}
    assert (steps["prescriptions"]["rows"], steps["prescriptions"]["kept"]) == (12, 7)
    assert steps["prescriptions"]["dropped"]["without hadm_id"] == 1
    assert steps["admissions with medications"]["dropped"] == {
        "without a diagnosis": 0,
        "without a procedure": 1,
    }


def test_cli_no_mapped_medication_exits_2_saying_what_to_do(files):
    files["ndc_rxnorm"].write_text("{'99999999999': '1001'}")
    result = CliRunner().invoke(main, ["data", "mimic4", *cli_args(files)])
    assert result.exit_code == 2
    assert "no prescription's NDC maps to ATC-3 through" in result.output
    assert "use SafeDrug's ndc2rxnorm_mapping.txt and ndc2atc_level4.csv" in result.output
    assert not (files["out"] / "visits.parquet").exists()


@pytest.mark.parametrize("table", ["prescriptions", "admissions"])
def test_cli_missing_table_exits_2(files, table):
    (files["mimic_dir"] / "hosp" / f"{table}.csv.gz").unlink()
    result = CliRunner().invoke(main, ["data", "mimic4", *cli_args(files)])
    assert result.exit_code == 2
    hosp = files["mimic_dir"] / "hosp"
    assert result.stderr == (
        f"Error: {hosp / (table.upper() + '.csv')}: file not found (nor {table.upper()}.csv.gz)\n"
    )


@pytest.mark.parametrize(
    ("table", "column"),
    [("diagnoses_icd", "icd_version"), ("prescriptions", "ndc"), ("procedures_icd", "seq_num")],
)
def test_cli_missing_column_exits_2(files, table, column):
    header, rows = TABLES[table]
    at = header.index(column)
    path = files["mimic_dir"] / "hosp" / f"{table}.csv.gz"
    write_gz(
        path,
        (
            [h for i, h in enumerate(header) if i != at],
            [[v for i, v in enumerate(r) if i != at] for r in rows],
        ),
    )
    result = CliRunner().invoke(main, ["data", "mimic4", *cli_args(files)])
    assert result.exit_code == 2
    assert result.stderr == f"Error: {path}: column {column!r}: missing column\n"


def test_bad_icd_version_names_the_line(files):
    header, rows = DIAGNOSES
    path = write_gz(
        files["mimic_dir"] / "hosp" / "diagnoses_icd.csv.gz",
        (header, [*rows[:3], [10001, 2002, 9, "4019", 11], *rows[3:]]),
    )
    with pytest.raises(InputError) as error:
        build(files)
    assert (
        str(error.value)
        == f"{path}: column 'icd_version', line 5: 11 is not an ICD version (9 or 10)"
    )


def test_refuses_to_overwrite_its_input(files):
    with pytest.raises(InputError, match="the output would overwrite the input"):
        build({**files, "out": files["mimic_dir"] / "hosp"})
