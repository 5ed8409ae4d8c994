"""cognet.data.omop on a tiny OMOP CDM v5.4 extract written here, checked visit by visit.

The extract mixes what real ones hold: Athena vocabulary files (tab-separated, upper-case
CONCEPT.csv, dates YYYYMMDD, a concept name with a lone quote), comma-separated clinical
tables in lower case, visit_start_datetime sometimes empty, rows in no particular order.
"""

from __future__ import annotations

import csv
import gzip
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cognet.data.omop import build_omop

HTN, T2DM, MI, CABG = 320128, 201826, 4329847, 4336464  # standard (SNOMED) concepts
I10, E119, PCS = 35207668, 45576876, 2000001  # their source concepts (ICD10CM, ICD10PCS)
LISINOPRIL, AMLODIPINE, COMBO, SALINE = 1308216, 1332418, 1545958, 967823
C09, C09A, C08C, A10B, A10BA, A10BA02 = 21601664, 21601782, 21601744, 21600712, 21600713, 21600714

ATHENA_DATES = ["19700101", "20991231", ""]  # valid_start_date, valid_end_date, invalid_reason
CONCEPT = (
    ["concept_id", "concept_name", "domain_id", "vocabulary_id", "concept_class_id",
     "standard_concept", "concept_code", "valid_start_date", "valid_end_date", "invalid_reason"],
    [row + ATHENA_DATES for row in [
        [HTN, "Essential hypertension", "Condition", "SNOMED", "Clinical Finding", "S",
         "59621000"],
        [T2DM, "Type 2 diabetes mellitus", "Condition", "SNOMED", "Clinical Finding", "S",
         "44054006"],
        [MI, "Myocardial infarction", "Condition", "SNOMED", "Clinical Finding", "S", "22298006"],
        [CABG, "Coronary artery bypass graft", "Procedure", "SNOMED", "Procedure", "S",
         "232717009"],
        [I10, "Essential (primary) hypertension", "Condition", "ICD10CM", "3-char billing code",
         "", "I10"],
        [E119, "Type 2 diabetes mellitus without complications", "Condition", "ICD10CM",
         "Billable Code", "", "E11.9"],
        [PCS, "Bypass Coronary Artery, One Artery from Aorta", "Procedure", "ICD10PCS",
         "ICD10PCS", "", "02703ZZ"],
        [LISINOPRIL, "lisinopril 10 MG Oral Tablet", "Drug", "RxNorm", "Clinical Drug", "S",
         "314076"],
        [AMLODIPINE, "amlodipine 5 MG Oral Tablet", "Drug", "RxNorm", "Clinical Drug", "S",
         "197361"],
        [COMBO, "amlodipine 5 MG / benazepril 10 MG Oral Capsule", "Drug", "RxNorm",
         "Clinical Drug", "S", "898342"],
        [SALINE, 'sodium chloride 9 MG/ML "Baxter', "Drug", "RxNorm", "Branded Drug", "S",
         "1807627"],
        [C09, "AGENTS ACTING ON THE RENIN-ANGIOTENSIN SYSTEM", "Drug", "ATC", "ATC 2nd", "C",
         "C09"],
        [C09A, "ACE INHIBITORS, PLAIN", "Drug", "ATC", "ATC 3rd", "C", "C09A"],
        [C08C, "SELECTIVE CALCIUM CHANNEL BLOCKERS", "Drug", "ATC", "ATC 3rd", "C", "C08C"],
        [A10B, "BLOOD GLUCOSE LOWERING DRUGS, EXCL. INSULINS", "Drug", "ATC", "ATC 3rd", "C",
         "A10B"],
        [A10BA, "Biguanides", "Drug", "ATC", "ATC 4th", "C", "A10BA"],
        [A10BA02, "metformin; oral", "Drug", "ATC", "ATC 5th", "C", "A10BA02"],
    ]],
)  # fmt: skip
CONCEPT_ANCESTOR = (
    ["ancestor_concept_id", "descendant_concept_id", "min_levels_of_separation",
     "max_levels_of_separation"],
    [
        [C09A, LISINOPRIL, 2, 2], [C09, LISINOPRIL, 3, 3], [LISINOPRIL, LISINOPRIL, 0, 0],
        [C08C, AMLODIPINE, 2, 2], [C08C, COMBO, 2, 2], [C09A, COMBO, 2, 2], [C09, COMBO, 3, 3],
        [C09, C09A, 1, 1], [C09A, C09A, 0, 0], [SALINE, SALINE, 0, 0],
    ],
)  # fmt: skip
PERSON = (
    ["person_id", "gender_concept_id", "year_of_birth", "race_concept_id",
     "ethnicity_concept_id"],
    [[3, 8532, 1950, 0, 0], [1, 8507, 1940, 0, 0], [2, 8532, 1961, 0, 0]],
)  # fmt: skip
VISIT = (
    ["visit_occurrence_id", "person_id", "visit_concept_id", "visit_start_date",
     "visit_start_datetime", "visit_end_date", "visit_type_concept_id"],
    [
        [10, 1, 9201, "2020-03-01", "", "2020-03-04", 32817],
        [100, 2, 9201, "2021-06-01", "", "2021-06-02", 32817],  # ties with 21: 21 first
        [11, 1, 262, "2020-01-15", "2020-01-15 14:00:00", "2020-01-16", 32817],
        [13, 1, 9201, "2020-02-01", "", "2020-02-02", 32817],  # no code: dropped (gap)
        [12, 1, 9201, "2020-01-15", "2020-01-15 08:00:00", "2020-01-15", 32817],
        [30, 3, 262, "2019-07-04", "", "2019-07-05", 32817],
        [21, 2, 9201, "2021-06-01", "", "2021-06-03", 32817],
        [20, 2, 9202, "2021-05-01", "2021-05-01 10:30:00", "2021-05-01", 32817],  # outpatient
        [40, 4, 9201, "2020-01-01", "", "2020-01-02", 32817],  # person 4 not in person
    ],
)  # fmt: skip
CONDITION = (
    ["condition_occurrence_id", "person_id", "condition_concept_id", "condition_start_date",
     "condition_type_concept_id", "visit_occurrence_id", "condition_source_value",
     "condition_source_concept_id"],
    [
        [1, 1, HTN, "2020-01-15", 32817, 12, "I10", I10],
        [2, 1, T2DM, "2020-01-15", 32817, 12, "E11.9", E119],
        [3, 1, HTN, "2020-01-15", 32817, 12, "I10", I10],  # repeated: one code
        [4, 1, MI, "2020-01-15", 32817, 11, "I21", 0],  # no source concept
        [5, 1, HTN, "2020-03-01", 32817, 10, "I10", I10],
        [6, 1, 99999999, "2020-03-01", 32817, 10, "X", 0],  # not in concept
        [7, 1, 0, "2020-02-01", 32817, 13, "Z99", 0],  # concept_id 0
        [8, 2, HTN, "2021-05-01", 32817, 20, "I10", I10],
        [9, 2, T2DM, "2021-06-01", 32817, 21, "E11.9", E119],
        [10, 2, HTN, "2021-06-01", 32817, 100, "I10", I10],
        [11, 3, T2DM, "2019-07-04", 32817, 30, "E11.9", E119],
        [12, 4, HTN, "2020-01-01", 32817, 40, "I10", I10],  # visit of an unknown person
        [13, 1, HTN, "2020-01-01", 32817, "", "I10", I10],  # no visit
        [14, 1, HTN, "2020-01-01", 32817, 999, "I10", I10],  # not in visit_occurrence
    ],
)  # fmt: skip
PROCEDURE = (
    ["procedure_occurrence_id", "person_id", "procedure_concept_id", "procedure_date",
     "procedure_type_concept_id", "visit_occurrence_id", "procedure_source_value",
     "procedure_source_concept_id"],
    [
        [1, 1, CABG, "2020-01-15", 32817, 12, "02703ZZ", PCS],
        [2, 2, CABG, "2021-06-01", 32817, 21, "02703ZZ", PCS],
    ],
)  # fmt: skip
DRUG = (
    ["drug_exposure_id", "person_id", "drug_concept_id", "drug_exposure_start_date",
     "drug_exposure_end_date", "drug_type_concept_id", "visit_occurrence_id",
     "drug_source_value", "drug_source_concept_id"],
    [
        [1, 1, LISINOPRIL, "2020-01-15", "2020-01-20", 32817, 12, "lis", 0],
        [2, 1, A10BA02, "2020-01-15", "2020-01-20", 32817, 12, "met", 0],  # itself ATC 5th
        [3, 1, COMBO, "2020-01-15", "2020-01-16", 32817, 11, "amlo/bena", 0],  # two classes
        [4, 1, SALINE, "2020-03-01", "2020-03-01", 32817, 10, "NaCl", 0],  # no ATC ancestor
        [5, 2, AMLODIPINE, "2021-06-01", "2021-06-03", 32817, 21, "amlo", 0],
        [6, 2, C09A, "2021-06-01", "2021-06-03", 32817, 21, "ACE", 0],  # itself ATC 3rd
        [7, 2, AMLODIPINE, "2021-06-01", "2021-06-02", 32817, 100, "amlo", 0],
        [8, 2, 0, "2021-06-01", "2021-06-02", 32817, 100, "unknown", 0],  # concept_id 0
        [9, 2, AMLODIPINE, "2021-06-01", "2021-06-02", 32817, "", "amlo", 0],  # no visit
        [10, 2, AMLODIPINE, "2021-06-01", "2021-06-02", 32817, 999, "amlo", 0],  # unknown
        [11, 1, LISINOPRIL, "2020-01-15", "2020-01-20", 32817, 12, "lis", 0],  # repeated
    ],
)  # fmt: skip
DDI = (
    ["drug_a", "drug_b"],
    [["C09A", "C08C"], ["C08C", "C09A"], ["A10B", "A10B"], ["C09A", "N02B"]],
)


def visit(pid, vid, seq, diagnoses, procedures, medications):
    return {"patient_id": pid, "visit_id": vid, "visit_seq": seq, "diagnoses": diagnoses,
            "procedures": procedures, "medications": medications}  # fmt: skip


S_HTN, S_T2DM, S_MI = "SNOMED/59621000", "SNOMED/44054006", "SNOMED/22298006"
S_CABG = "SNOMED/232717009"
VISITS = [
    visit("1", "12", 0, [S_T2DM, S_HTN], [S_CABG], ["A10B", "C09A"]),
    visit("1", "11", 1, [S_MI], [], ["C08C", "C09A"]),
    visit("1", "10", 3, [S_HTN], [], None),  # 13 (seq 2) had no code
    visit("2", "20", 0, [S_HTN], [], None),
    visit("2", "21", 1, [S_T2DM], [S_CABG], ["C08C", "C09A"]),
    visit("2", "100", 2, [S_HTN], [], ["C08C"]),
    visit("3", "30", 0, [S_T2DM], [], None),
]


def write_table(path: Path, table: tuple[list, list], delimiter: str = ",") -> Path:
    header, rows = table
    with path.open("w", newline="", encoding="utf-8") as handle:
        if delimiter == "\t":  # Athena: no quoting at all
            handle.writelines("\t".join(map(str, row)) + "\n" for row in [header, *rows])
        else:
            writer = csv.writer(handle, delimiter=delimiter)
            writer.writerows([header, *rows])
    return path


TABLES = {
    "person": PERSON,
    "visit_occurrence": VISIT,
    "condition_occurrence": CONDITION,
    "procedure_occurrence": PROCEDURE,
    "drug_exposure": DRUG,
}


def write_extract(folder: Path) -> Path:
    """The extract above: clinical tables as comma CSV, vocabulary as Athena writes it."""
    folder.mkdir(parents=True)
    for name, table in TABLES.items():
        write_table(folder / f"{name}.csv", table)
    write_table(folder / "CONCEPT.csv", CONCEPT, "\t")
    write_table(folder / "CONCEPT_ANCESTOR.csv", CONCEPT_ANCESTOR, "\t")
    return folder


@pytest.fixture
def cdm(tmp_path: Path) -> Path:
    return write_extract(tmp_path / "cdm")


@pytest.fixture
def ddi_file(tmp_path: Path) -> Path:
    return write_table(tmp_path / "ddi_atc3.csv", DDI)


def rows_of(out: Path) -> list[dict]:
    return pq.read_table(out / "visits.parquet").to_pylist()


def steps(report) -> dict:
    return {s.name: s for s in report.steps}


def test_converts_visit_for_visit(cdm, ddi_file, tmp_path):
    report = build_omop(cdm, tmp_path / "out", ddi=ddi_file)
    assert rows_of(tmp_path / "out") == VISITS
    ddi = pq.read_table(tmp_path / "out" / "ddi.parquet").to_pylist()
    assert ddi == [{"drug_a": "C08C", "drug_b": "C09A"}]
    assert report.dataset == {
        "patients": 3,
        "visits": 7,
        "medications_null": 3,
        "diagnoses": 3,
        "procedures": 1,
        "medications": 3,
        "ddi_pairs": 1,
    }
    assert report.warnings == []


def test_counts_every_dropped_row(cdm, ddi_file, tmp_path):
    by_name = steps(build_omop(cdm, tmp_path / "out", ddi=ddi_file))
    assert by_name["visit_occurrence"].dropped == {
        "of other visit types (--visit-concepts)": 0,
        "of a person not in person": 1,
    }
    assert by_name["condition_occurrence"].dropped == {
        "without visit_occurrence_id": 1,
        "of a visit not in visit_occurrence": 1,
        "of a visit dropped above": 1,
        "with concept_id 0": 1,
        "with a concept_id not in concept": 1,
    }
    assert by_name["condition_occurrence"].kept == 9
    assert by_name["drug_exposure"].dropped == {
        "without visit_occurrence_id": 1,
        "of a visit not in visit_occurrence": 1,
        "of a visit dropped above": 0,
        "with concept_id 0": 1,
        "with no ATC 3rd ancestor": 1,
    }
    assert by_name["drug_exposure"].kept == 7
    assert by_name["visits"].dropped == {"without a condition or procedure": 1}
    assert by_name["ddi"].dropped == {
        "self pairs": 1,
        "outside the dataset's medications": 1,
        "repeated": 1,
    }
    for step in by_name.values():
        if step.name not in ("concept", "concept_ancestor"):  # vocabulary: rows used
            assert step.rows == step.kept + sum(step.dropped.values()), step


def test_atc_classes_in_any_case_and_below_the_3rd_level(cdm, tmp_path):
    """A hand-made vocabulary: class names in upper case, amlodipine under its ATC 5th class
    only, and no C08C concept at all: still C08C."""
    header, rows = CONCEPT
    rows = [[*r[:4], r[4].upper(), *r[5:]] for r in rows if r[0] != C08C]
    rows.append([77, "amlodipine; oral", "Drug", "ATC", "ATC 5TH", "C", "C08CA01", *ATHENA_DATES])
    write_table(cdm / "CONCEPT.csv", (header, rows), "\t")
    header, rows = CONCEPT_ANCESTOR
    rows = [r for r in rows if r[0] != C08C] + [[77, AMLODIPINE, 1, 1], [77, COMBO, 1, 1]]
    write_table(cdm / "CONCEPT_ANCESTOR.csv", (header, rows), "\t")
    build_omop(cdm, tmp_path / "out")
    assert rows_of(tmp_path / "out") == VISITS


def test_visit_concepts_keep_only_those_types(cdm, tmp_path):
    report = build_omop(cdm, tmp_path / "out", visit_concepts=[9201, 262])
    kept = [(v["visit_id"], v["visit_seq"]) for v in rows_of(tmp_path / "out")]
    assert kept == [("12", 0), ("11", 1), ("10", 3), ("21", 0), ("100", 1), ("30", 0)]
    by_name = steps(report)
    assert by_name["visit_occurrence"].dropped["of other visit types (--visit-concepts)"] == 1
    assert by_name["condition_occurrence"].dropped["of a visit dropped above"] == 2


def test_source_codes(cdm, tmp_path):
    report = build_omop(cdm, tmp_path / "out", source_codes=True)
    got = {v["visit_id"]: (v["diagnoses"], v["procedures"]) for v in rows_of(tmp_path / "out")}
    assert got == {
        "12": (["ICD10CM/E11.9", "ICD10CM/I10"], ["ICD10PCS/02703ZZ"]),
        "10": (["ICD10CM/I10"], []),
        "20": (["ICD10CM/I10"], []),
        "21": (["ICD10CM/E11.9"], ["ICD10PCS/02703ZZ"]),
        "100": (["ICD10CM/I10"], []),
        "30": (["ICD10CM/E11.9"], []),
    }  # 11 had only MI, whose source concept is 0
    assert steps(report)["visits"].dropped == {"without a condition or procedure": 2}
    assert steps(report)["condition_occurrence"].dropped["with concept_id 0"] == 3


ALL_TABLES = {**TABLES, "concept": CONCEPT, "concept_ancestor": CONCEPT_ANCESTOR}


def rewrite_tables(folder: Path, suffix: str, delimiter: str = ",") -> None:
    """Rewrite every table in ``folder`` as ``NAME`` + ``suffix`` (.parquet, .csv.gz, or .csv
    with ``delimiter``), upper-case names, rows shuffled."""
    rng = random.Random(0)
    for path in sorted(folder.iterdir()):
        path.unlink()
    for name, (header, body) in ALL_TABLES.items():
        body = list(body)
        rng.shuffle(body)
        target = folder / (name.upper() + suffix)
        if suffix == ".parquet":
            columns = [[None if v == "" else v for v in col] for col in zip(*body, strict=True)]
            pq.write_table(pa.table(dict(zip(header, columns, strict=True))), target)
        elif suffix == ".csv.gz":
            plain = write_table(folder / "plain.txt", (header, body), delimiter)
            with plain.open("rb") as src, gzip.open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            plain.unlink()
        else:
            write_table(target, (header, body), delimiter)


@pytest.mark.parametrize(
    ("suffix", "delimiter"), [(".parquet", ","), (".csv.gz", ","), (".csv", "\t"), (".csv", ",")]
)
def test_same_visits_whatever_the_format_and_row_order(cdm, tmp_path, suffix, delimiter):
    rewrite_tables(cdm, suffix, delimiter)
    build_omop(cdm, tmp_path / "out")
    assert rows_of(tmp_path / "out") == VISITS


def test_optional_columns_may_be_missing(cdm, tmp_path):
    """visit_start_datetime is optional: without it, same-day visits go by their id."""
    header, body = VISIT
    at = header.index("visit_start_datetime")
    write_table(
        cdm / "visit_occurrence.csv",
        (
            [h for i, h in enumerate(header) if i != at],
            [[v for i, v in enumerate(r) if i != at] for r in body],
        ),
    )
    build_omop(cdm, tmp_path / "out")
    assert [v["visit_id"] for v in rows_of(tmp_path / "out")][:2] == ["11", "12"]


def test_ids_written_as_floats_and_athena_dates(cdm, tmp_path):
    """What pandas writes for an id column with gaps (12.0, empty), and YYYYMMDD dates."""
    path = cdm / "drug_exposure.csv"
    text = path.read_text()
    path.write_text(text.replace(",32817,12,", ",32817,12.0,").replace(",32817,,", ",32817,NULL,"))
    path = cdm / "visit_occurrence.csv"
    path.write_text(path.read_text().replace("2020-03-01", "20200301"))
    report = build_omop(cdm, tmp_path / "out")
    assert rows_of(tmp_path / "out") == VISITS
    assert steps(report)["drug_exposure"].dropped["without visit_occurrence_id"] == 1


def test_parquet_float_ids_with_nan_and_upper_case_columns(cdm, tmp_path):
    """What other tools write: float64 ids where a value is missing, a real NaN (not null)
    among them, column names in upper case."""
    rewrite_tables(cdm, ".parquet")
    path = cdm / "DRUG_EXPOSURE.parquet"
    table = pq.read_table(path)
    ids = [
        float("nan") if v is None else float(v) for v in table["visit_occurrence_id"].to_pylist()
    ]
    table = table.set_column(
        table.schema.get_field_index("visit_occurrence_id"),
        "visit_occurrence_id",
        pa.array(ids, pa.float64(), from_pandas=False),
    )
    pq.write_table(table.rename_columns([n.upper() for n in table.column_names]), path)
    report = build_omop(cdm, tmp_path / "out")
    assert rows_of(tmp_path / "out") == VISITS
    assert steps(report)["drug_exposure"].dropped["without visit_occurrence_id"] == 1
