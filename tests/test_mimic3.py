"""cognet.data.mimic3 on tiny MIMIC-shaped CSVs written here (no MIMIC data in the repo)."""

from __future__ import annotations

import csv
import gzip
import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
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
    N4,
    N5,
    N6,
    N7,
    N8,
    NDC_RXNORM,
    RXNORM_ATC,
    write_csv,
)

from cognet.cli.data import mimic3_command
from cognet.core.dataset import read_dataset
from cognet.core.errors import InputError
from cognet.data.mimic3 import SafeDrugFiles, build_mimic3, load_prescriptions, ranked_codes
from cognet.data.tables import Report

PRESCRIPTIONS = (
    ["ROW_ID", "SUBJECT_ID", "HADM_ID", "ICUSTAY_ID", "STARTDATE", "DRUG", "NDC"],
    [
        # a leading row that forward fill cannot complete (no ICUSTAY_ID above): dropped,
        # so patient 5 keeps one admission and is dropped too
        [0, 5, 501, "", "2104-01-01 00:00:00", "a", N1],
        [1, 1, 101, 5001, "2100-03-01 10:00:00", "a", N1],  # A02B
        [2, 1, 101, "", "2100-03-01 10:00:00", "b", N2],  # ICUSTAY_ID filled; B01A
        [3, 1, 101, 5001, "2100-03-02 08:00:00", "zero", "0"],  # NDC "0": dropped first
        [4, 1, 101, 5001, "2100-03-02 08:00:00", "b", ""],  # NDC filled from row 2: B01A
        [5, 1, 101, 5001, "2100-03-02 08:00:00", "c", N3],  # A02B
        [6, 1, 101, 5001, "2100-03-02 08:00:00", "c", N3],  # duplicate
        [7, 1, 102, 5002, "2100-01-05 09:00:00", "e", N5],  # N02B
        [8, 1, 102, 5002, "2100-01-05 09:00:00", "f", N4],  # empty RxCUI: dropped
        [9, 1, 102, 5002, "2100-01-06 09:00:00", "g", N7],  # C03C
        [10, 2, 201, 6001, "2101-05-01 00:00:00", "a", N1],
        [11, 2, 201, 6001, "2101-05-01 00:00:00", "e", N5],
        [12, 2, 202, 6002, "2101-06-01 00:00:00", "a", N1],
        [13, 2, 202, 6002, "2101-06-02 00:00:00", "a", N1],
        [14, 2, 202, 6002, "2101-06-02 00:00:00", "b", N2],
        [15, 3, 301, 7001, "2102-01-01 00:00:00", "h", N6],  # one admission: dropped
        [16, 3, 301, 7001, "2102-01-02 00:00:00", "h", N6],
        [17, 4, 401, 8001, "2103-01-01 00:00:00", "e", N5],
        [18, 4, 402, 8002, "2103-02-01 00:00:00", "b", N2],  # 402 has no procedure
        [19, 4, 401, 8001, "2103-01-01 00:00:00", "x", N8],  # NDC not in the mapping
        [20, 5, 502, 9001, "2104-02-01 00:00:00", "a", N1],
    ],
)
DIAGNOSES = (
    ["ROW_ID", "SUBJECT_ID", "HADM_ID", "SEQ_NUM", "ICD9_CODE"],
    [
        [1, 1, 101, 1, "4019"],
        [2, 1, 101, 2, "0389"],
        [3, 1, 101, 3, "V4581"],
        [4, 1, 102, 1, "0389"],
        [5, 1, 102, 2, "25000"],
        [6, 1, 102, "", ""],
        [7, 2, 201, 1, "4019"],
        [8, 2, 201, 2, "25000"],
        [9, 2, 201, 3, "5849"],
        [10, 2, 202, 1, "4019"],
        [11, 2, 202, 2, "E8798"],
        [12, 2, 202, 3, "4019"],
        [13, 3, 301, 1, "4019"],
        [14, 4, 401, 1, "0389"],
        [15, 4, 401, 2, "4019"],
        [16, 4, 402, 1, "4019"],
        [17, 5, 501, 1, "4019"],
        [18, 5, 502, 1, "4019"],
    ],
)
PROCEDURES = (
    ["ROW_ID", "SUBJECT_ID", "HADM_ID", "SEQ_NUM", "ICD9_CODE"],
    [
        [1, 1, 101, 2, "3893"],
        [2, 1, 101, 10, "8856"],
        [3, 1, 101, 1, "9604"],
        [4, 1, 102, 1, "0040"],
        [5, 2, 201, 1, "3893"],
        [6, 2, 202, 1, "0040"],
        [7, 2, 202, 2, "0040"],
        [8, 3, 301, 1, "3893"],
        [9, 4, 401, 1, "9904"],
        [10, 5, 501, 1, "3893"],
        [11, 5, 502, 1, "3893"],
    ],
)
ADMISSIONS = (
    ["ROW_ID", "SUBJECT_ID", "HADM_ID", "ADMITTIME", "DISCHTIME"],
    [
        # HADM_ID order is not time order: 102 came first
        [1, 1, 101, "2100-03-01 09:00:00", "2100-03-04 09:00:00"],
        [2, 1, 102, "2100-01-05 08:00:00", "2100-01-07 08:00:00"],
        [3, 2, 201, "2101-05-01 00:00:00", ""],
        [4, 2, 202, "2101-06-01 00:00:00", ""],
        [5, 3, 301, "2102-01-01 00:00:00", ""],
        [6, 4, 401, "2103-01-01 00:00:00", ""],
        [7, 4, 402, "2103-02-01 00:00:00", ""],
        [8, 5, 501, "2104-01-01 00:00:00", ""],
        [9, 5, 502, "2104-02-01 00:00:00", ""],
    ],
)

VISITS = [
    # patient 1: admission 102 before 101 (ADMITTIME), though HADM_ID says otherwise
    {
        "patient_id": "1",
        "visit_id": "102",
        "visit_seq": 0,
        "diagnoses": ["0389", "25000"],
        "procedures": ["0040"],
        "medications": ["N02B", "C03C"],
    },
    {
        "patient_id": "1",
        "visit_id": "101",
        "visit_seq": 1,
        "diagnoses": ["4019", "0389", "V4581"],
        "procedures": ["9604", "3893", "8856"],
        "medications": ["A02B", "B01A"],
    },
    {
        "patient_id": "2",
        "visit_id": "201",
        "visit_seq": 0,
        "diagnoses": ["4019", "25000", "5849"],
        "procedures": ["3893"],
        "medications": ["A02B", "N02B"],
    },
    {
        "patient_id": "2",
        "visit_id": "202",
        "visit_seq": 1,
        "diagnoses": ["4019", "E8798"],
        "procedures": ["0040"],
        "medications": ["A02B", "B01A"],
    },
    # patient 4 had 2 admissions with prescriptions; 402 has no procedure, so one visit
    # remains (the reference counts admissions before the joins)
    {
        "patient_id": "4",
        "visit_id": "401",
        "visit_seq": 0,
        "diagnoses": ["0389", "4019"],
        "procedures": ["9904"],
        "medications": ["N02B"],
    },
]


def drop_column(path: Path, column: str) -> None:
    with path.open(newline="") as handle:
        rows = list(csv.reader(handle))
    keep = [i for i, name in enumerate(rows[0]) if name != column]
    write_csv(path, ([rows[0][i] for i in keep], [[row[i] for i in keep] for row in rows[1:]]))


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    mimic = tmp_path / "mimic"
    mimic.mkdir()
    for name, table in (
        ("PRESCRIPTIONS", PRESCRIPTIONS),
        ("DIAGNOSES_ICD", DIAGNOSES),
        ("PROCEDURES_ICD", PROCEDURES),
        ("ADMISSIONS", ADMISSIONS),
    ):
        write_csv(mimic / f"{name}.csv", table)
    (tmp_path / "ndc2rxnorm_mapping.txt").write_text(NDC_RXNORM)
    (tmp_path / "drug-atc.csv").write_text(DRUG_ATC)
    return {
        "mimic_dir": mimic,
        "ndc_rxnorm": tmp_path / "ndc2rxnorm_mapping.txt",
        "rxnorm_atc": write_csv(tmp_path / "RXCUI2atc4.csv", RXNORM_ATC),
        "drug_atc": tmp_path / "drug-atc.csv",
        "ddi": write_csv(tmp_path / "drug-DDI.csv", DDI),
        "out": tmp_path / "out",
    }


def build(files: dict[str, Path], **options) -> Report:
    """`build_mimic3` on the fixture's files (the dict the CLI tests turn into options)."""
    mappings = SafeDrugFiles(*(files[k] for k in ("ndc_rxnorm", "rxnorm_atc", "drug_atc", "ddi")))
    return build_mimic3(files["mimic_dir"], mappings, files["out"], **options)


def cli_args(files: dict[str, Path], *extra: str) -> list[str]:
    args = []
    for key, path in files.items():
        args += ["--" + key.replace("_", "-"), str(path)]
    return args + list(extra)


def read_pairs(out: Path) -> list[tuple[str, str]]:
    table = pq.read_table(out / "ddi.parquet")
    return list(zip(table["drug_a"].to_pylist(), table["drug_b"].to_pylist(), strict=True))


def test_builds_the_reference_visits(files):
    report = build(files)
    assert pq.read_table(files["out"] / "visits.parquet").to_pylist() == VISITS
    assert read_pairs(files["out"]) == ALL_PAIRS  # 40 types: all three of the fixture
    assert report.dataset == {
        "patients": 3,
        "visits": 5,
        "medications_null": 0,
        "diagnoses": 6,
        "procedures": 5,
        "medications": 4,
        "ddi_pairs": 4,
    }


def test_summary_json_counts_what_each_step_kept_and_dropped(files):
    report = build(files)
    summary = json.loads((files["out"] / "summary.json").read_text())
    assert summary == report.to_json() and summary["source"] == "mimic3"
    steps = {s["name"]: s for s in summary["steps"]}
    # the fixture's rows: 0 (nothing above to fill from), 3 (NDC "0") and 6 (a duplicate)
    assert steps["prescriptions"] == {
        "name": "prescriptions",
        "rows": 21,
        "kept": 18,
        "what": "distinct (admission, start date, NDC)",
        "dropped": {
            'with NDC "0"': 1,
            "incomplete after the forward fill": 1,
            "repeating an (admission, start date, NDC)": 1,
        },
    }
    # patients 3 and 5 have one admission left; NDCs N4 (empty RxCUI) and N8 map to nothing
    assert steps["patients with 2+ admissions"]["dropped"] == {"of a patient with one admission": 3}
    assert steps["NDC to ATC-3"]["dropped"]["with an NDC not mapped to ATC-3"] == 2
    assert steps["diagnoses_icd"]["dropped"] == {
        "without an id or icd9_code": 1,
        "repeating an (admission, code)": 1,
    }
    assert steps["admissions with medications"]["kept"] == summary["dataset"]["visits"] == 5
    assert all(s["rows"] == s["kept"] + sum(s["dropped"].values()) for s in summary["steps"])


def test_each_step_is_logged_as_it_ends(files, caplog):
    """What --verbose shows: every step's line, in the report's order."""
    with caplog.at_level(logging.INFO, logger="cognet.data.tables"):
        report = build(files)
    assert [r.getMessage() for r in caplog.records] == [s.line() for s in report.steps]


def test_files_follow_the_dataset_contract(files):
    build(files)
    visits = pq.read_schema(files["out"] / "visits.parquet")
    assert visits.names == [
        "patient_id",
        "visit_id",
        "visit_seq",
        "diagnoses",
        "procedures",
        "medications",
    ]  # no split column: split by patient later
    assert visits.field("patient_id").type == pa.string()
    assert visits.field("visit_id").type == pa.string()
    assert visits.field("visit_seq").type == pa.int32()
    for name in ("diagnoses", "procedures", "medications"):
        assert visits.field(name).type == pa.list_(pa.string())
    ddi = pq.read_schema(files["out"] / "ddi.parquet")
    assert ddi.names == ["drug_a", "drug_b"]
    assert ddi.field("drug_a").type == ddi.field("drug_b").type == pa.string()


def test_output_reads_back_as_a_dataset(files):
    build(files)
    dataset = read_dataset(files["out"])
    assert dataset.ddi_pairs == ALL_PAIRS
    assert dataset.visits.drop_columns("split").to_pylist() == VISITS
    assert set(dataset.visits["split"].to_pylist()) <= {"train", "val", "test"}


def test_keeps_the_most_frequent_medications_and_diagnoses(files):
    # medication counts (distinct patient, admission, start date, ATC-3):
    # A02B 5, B01A 4, N02B 3, C03C 1. Diagnosis counts (whole table, distinct):
    # 4019 8, 0389 3, 25000 2, then 5849 = E8798 = V4581 = 1: the tie goes to 5849.
    build(files, top_medications=3, top_diagnoses=4, ddi_top_k=1)
    visits = pq.read_table(files["out"] / "visits.parquet").to_pylist()
    assert [(v["visit_id"], v["diagnoses"], v["medications"]) for v in visits] == [
        ("102", ["0389", "25000"], ["N02B"]),
        ("101", ["4019", "0389"], ["A02B", "B01A"]),
        ("201", ["4019", "25000", "5849"], ["A02B", "N02B"]),
        ("202", ["4019"], ["A02B", "B01A"]),
        ("401", ["0389", "4019"], ["N02B"]),
    ]
    # the commonest side effect gives A02B-B01A and A02B-C03C, but C03C is gone
    assert read_pairs(files["out"]) == [("A02B", "B01A")]


@pytest.mark.parametrize(
    ("ddi_types", "k", "pairs"),
    [
        ("top40", 1, [("A02B", "B01A"), ("A02B", "C03C")]),
        ("reference", 1, [("A02B", "N02B")]),
        ("top40", 2, [("A02B", "B01A"), ("A02B", "C03C"), ("B01A", "N02B")]),
        ("reference", 2, [("A02B", "N02B"), ("B01A", "N02B")]),
        ("reference", 40, ALL_PAIRS),
    ],
)
def test_ddi_side_effect_types(files, ddi_types, k, pairs):
    build(files, ddi_types=ddi_types, ddi_top_k=k)
    assert read_pairs(files["out"]) == pairs


def test_prescriptions_drop_ndc_zero_before_the_forward_fill(tmp_path):
    path = write_csv(
        tmp_path / "PRESCRIPTIONS.csv",
        (
            ["SUBJECT_ID", "HADM_ID", "ICUSTAY_ID", "STARTDATE", "NDC"],
            [
                [9, 900, "", "2100-01-01 00:00:00", N1],  # nothing above to fill from: dropped
                [1, 100, 7, "2100-01-02 00:00:00", N1],
                [1, 100, 7, "2100-01-03 00:00:00", "0"],
                [1, 100, "", "2100-01-03 00:00:00", ""],  # N1 from row 2, not "0" from row 3
                [1, 100, 7, "2100-01-02 00:00:00", N1],  # duplicate of row 2
                [1, 100, 6, "2100-01-04 00:00:00", N2],  # earlier ICU stay: sorts first
            ],
        ),
    )
    rows, step = load_prescriptions(path)
    assert [(s, h, str(d.date()), n) for s, h, d, n in rows.itertuples(index=False)] == [
        (1, 100, "2100-01-04", N2),
        (1, 100, "2100-01-02", N1),
        (1, 100, "2100-01-03", N1),
    ]
    assert (step.rows, step.kept) == (6, 3)
    assert step.dropped == {
        'with NDC "0"': 1,
        "incomplete after the forward fill": 1,
        "repeating an (admission, start date, NDC)": 1,
    }


def test_ranked_codes_breaks_ties_by_code():
    import pandas as pd

    assert ranked_codes(pd.Series(["b", "c", "a", "c", "b", "d"])) == ["b", "c", "a", "d"]


def test_reads_gzipped_lower_case_tables(files):
    mimic = files["mimic_dir"]
    for path in list(mimic.iterdir()):
        with (
            path.open("rb") as src,
            gzip.open(mimic / (path.stem.lower() + ".csv.gz"), "wb") as dst,
        ):
            shutil.copyfileobj(src, dst)
        path.unlink()
    build(files)
    assert pq.read_table(files["out"] / "visits.parquet").to_pylist() == VISITS


def test_mapping_file_is_parsed_never_executed(files, tmp_path):
    marker = tmp_path / "executed"
    files["ndc_rxnorm"].write_text(f"{{'{N1}': __import__('pathlib').Path('{marker}').touch()}}")
    with pytest.raises(InputError, match="ndc2rxnorm_mapping.txt: not a dict literal"):
        build(files)
    assert not marker.exists()


def test_mapping_file_as_json(files):
    files["ndc_rxnorm"].write_text(NDC_RXNORM.replace("'", '"'))
    build(files)
    assert pq.read_table(files["out"] / "visits.parquet").to_pylist() == VISITS


def test_no_mapped_medication_is_refused_saying_what_to_do(files):
    files["ndc_rxnorm"].write_text("{'99999999999': '1001'}")
    with pytest.raises(
        InputError,
        match="no prescription's NDC maps to ATC-3 through .*"
        "ndc2rxnorm_mapping.txt.*use SafeDrug's",
    ):
        build(files)
    assert not (files["out"] / "visits.parquet").exists()


def test_cli_writes_the_dataset(files):
    result = CliRunner().invoke(mimic3_command, cli_args(files))
    assert result.exit_code == 0, result.output
    assert "patients 3, visits 5" in result.output
    assert "prescriptions: 21 rows -> 18 distinct (admission, start date, NDC)" in result.output
    assert (files["out"] / "summary.json").is_file()
    assert pq.read_table(files["out"] / "visits.parquet").num_rows == 5
    assert read_pairs(files["out"]) == ALL_PAIRS


@pytest.mark.parametrize(
    ("key", "file", "column"),
    [
        ("mimic_dir", "PRESCRIPTIONS.csv", "NDC"),
        ("mimic_dir", "PRESCRIPTIONS.csv", "ICUSTAY_ID"),
        ("mimic_dir", "DIAGNOSES_ICD.csv", "ICD9_CODE"),
        ("mimic_dir", "PROCEDURES_ICD.csv", "SEQ_NUM"),
        ("mimic_dir", "ADMISSIONS.csv", "ADMITTIME"),
        ("rxnorm_atc", None, "ATC4"),
        ("ddi", None, "Polypharmacy Side Effect"),
    ],
)
def test_cli_missing_column_exits_2(files, key, file, column):
    path = files[key] / file if file else files[key]
    drop_column(path, column)
    result = CliRunner().invoke(mimic3_command, cli_args(files))
    assert result.exit_code == 2
    assert result.stderr == f"Error: {path}: column {column!r}: missing column\n"
    assert "Traceback" not in result.output


@pytest.mark.parametrize("key", ["mimic_dir", "ndc_rxnorm", "drug_atc"])
def test_cli_missing_file_exits_2(files, key):
    if key == "mimic_dir":
        (files[key] / "ADMISSIONS.csv").unlink()
        expected = f"{files[key] / 'ADMISSIONS.csv'}: file not found"
    else:
        files[key].unlink()
        expected = f"{files[key]}: file not found"
    result = CliRunner().invoke(mimic3_command, cli_args(files))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {expected}")
    assert result.stderr.count("\n") == 1


def test_cli_bad_id_names_the_line(files):
    path = files["mimic_dir"] / "DIAGNOSES_ICD.csv"
    path.write_text(path.read_text().replace("2,202,3,4019", "2,2O2,3,4019"))
    result = CliRunner().invoke(mimic3_command, cli_args(files))
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {path}: column 'HADM_ID', line 13: '2O2' is not an integer id\n"
    )


def test_visit_without_admission_row_is_an_input_error(files):
    path = files["mimic_dir"] / "ADMISSIONS.csv"
    path.write_text("".join(line for line in path.open() if ",1,102," not in line))
    with pytest.raises(InputError, match="no admission row for HADM_ID 102 of SUBJECT_ID 1"):
        build(files)


def test_cli_help_explains_the_sort_bug():
    result = CliRunner().invoke(mimic3_command, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "sort bug" in text
    assert "40 LEAST frequent" in text
    assert "--ddi-types [top40|reference]" in text
    assert "Example:" in text and "cognet data mimic3 --mimic-dir" in text
