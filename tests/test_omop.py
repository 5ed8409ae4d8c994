"""cognet.data.omop on a tiny OMOP CDM v5.4 extract written here, checked visit by visit.

The extract mixes what real ones hold: Athena vocabulary files (tab-separated, upper-case
CONCEPT.csv, dates YYYYMMDD, a concept name with a lone quote), comma-separated clinical
tables in lower case, visit_start_datetime sometimes empty, rows in no particular order.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omop_tables import (
    AMLODIPINE,
    ATHENA_DATES,
    C08C,
    COMBO,
    CONCEPT,
    CONCEPT_ANCESTOR,
    VISIT,
    rewrite_tables,
    write_table,
)

from cognet.data.omop import build_omop


def visit(pid, vid, seq, diagnoses, procedures, medications):
    return {
        "patient_id": pid,
        "visit_id": vid,
        "visit_seq": seq,
        "diagnoses": diagnoses,
        "procedures": procedures,
        "medications": medications,
    }


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
