"""The dataset contract (cognet.schema): reading, validation errors, splits and writing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from cognet.cli.data import data
from cognet.core.dataset import (
    DDI_SCHEMA,
    SPLITS,
    VISITS_SCHEMA,
    check_visits_columns,
    read_dataset,
    split_patients,
    write_ddi,
    write_visits,
)
from cognet.core.errors import InputError

CODES = pa.list_(pa.string())


def visits(**replace) -> dict:
    """Columns of a valid visits table: patients A (3 visits), B (1), C (2); `replace` edits."""
    columns = {
        "patient_id": ["A", "A", "B", "A", "C", "C"],
        "visit_id": ["a0", "a1", "b0", "a2", "c0", "c1"],
        "visit_seq": [0, 1, 0, 2, 0, 5],
        "diagnoses": [["428.0"], ["428.0", "584.9"], ["486"], [], ["V45.81"], ["401.9"]],
        "procedures": [[], ["39.61"], [], ["96.71"], [], []],
        "medications": [["N02B"], ["N02B", "B01A"], ["J01D"], None, ["A12C"], ["A12C"]],
        "split": ["train", "train", "test", "train", "val", "val"],
    }
    columns.update(replace)
    return {name: value for name, value in columns.items() if value is not None}


def table(columns: dict, **types) -> pa.Table:
    default = {f.name: f.type for f in VISITS_SCHEMA}
    return pa.table(
        {name: pa.array(values, types.get(name, default[name])) for name, values in columns.items()}
    )


def dataset(root: Path, visits_table: pa.Table, pairs=(("B01A", "N02B"),)) -> Path:
    """A dataset directory written with plain pyarrow (no validation on the way in)."""
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(visits_table, root / "visits.parquet")
    pq.write_table(
        pa.table({"drug_a": [a for a, _ in pairs], "drug_b": [b for _, b in pairs]}),
        root / "ddi.parquet",
    )
    return root


def test_reads_a_valid_dataset_grouped_and_sorted(tmp_path):
    ds = read_dataset(dataset(tmp_path, table(visits())))
    assert ds.visits.schema == VISITS_SCHEMA
    assert ds.visits["visit_id"].to_pylist() == ["a0", "a1", "a2", "b0", "c0", "c1"]
    assert ds.visits["medications"].to_pylist()[2] is None  # unknown medications stay null
    assert ds.ddi_pairs == [("B01A", "N02B")]
    assert ds.split("val")["visit_id"].to_pylist() == ["c0", "c1"]


def test_rows_of_a_patient_need_not_be_contiguous_or_ordered(tmp_path):
    shuffled = visits(
        patient_id=["B", "A", "C", "A", "A", "C"],
        visit_id=["b0", "a2", "c1", "a0", "a1", "c0"],
        visit_seq=[0, 7, 9, 0, 3, 1],
        split=["test", "train", "val", "train", "train", "val"],
    )
    ds = read_dataset(dataset(tmp_path, table(shuffled)))
    assert ds.visits["visit_id"].to_pylist() == ["b0", "a0", "a1", "a2", "c0", "c1"]


def test_harmless_types_are_cast(tmp_path):
    columns = visits(patient_id=[1, 1, 2, 1, 3, 3])
    columns.pop("split")
    loose = table(
        columns,
        patient_id=pa.int64(),
        visit_id=pa.large_string(),
        visit_seq=pa.int64(),
        diagnoses=pa.large_list(pa.large_string()),
        procedures=pa.list_(pa.dictionary(pa.int32(), pa.string())),
    )
    ds = read_dataset(dataset(tmp_path, loose))
    assert ds.visits.schema == VISITS_SCHEMA
    assert ds.visits["patient_id"].to_pylist()[:3] == ["1", "1", "1"]


def test_all_null_medications_column_is_accepted(tmp_path):
    ds = read_dataset(
        dataset(tmp_path, table(visits(medications=[None] * 6), medications=pa.null()))
    )
    assert ds.visits["medications"].null_count == 6


def test_duplicate_and_self_ddi_pairs_are_dropped(tmp_path):
    pairs = [("N02B", "B01A"), ("B01A", "N02B"), ("A12C", "A12C"), ("J01D", "A12C")]
    ds = read_dataset(dataset(tmp_path, table(visits()), pairs))
    assert ds.ddi_pairs == [("A12C", "J01D"), ("B01A", "N02B")]


# -- every input error: InputError from the library, exit 2 and one line from the CLI ---------

ERRORS = {
    "missing column": (
        lambda: table(visits(procedures=None)),
        "column 'procedures': missing column",
    ),
    "wrong type": (
        lambda: table(visits(visit_seq=[0.0, 1.0, 0.0, 2.0, 0.0, 5.0]), visit_seq=pa.float64()),
        "column 'visit_seq': wrong type double",
    ),
    "codes not a list": (
        lambda: table(visits(diagnoses=["428.0"] * 6), diagnoses=pa.string()),
        "column 'diagnoses': wrong type string",
    ),
    "duplicate visit_id": (
        lambda: table(visits(visit_id=["a0", "a1", "b0", "a2", "a1", "c1"])),
        r"column 'visit_id', row 4: duplicate visit_id 'a1' \(first at row 1\)",
    ),
    "visit_seq repeated": (
        lambda: table(visits(visit_seq=[0, 2, 0, 2, 0, 5])),
        r"column 'visit_seq', row 3: patient 'A' has visit_seq 2 twice",
    ),
    "no diagnoses nor procedures": (
        lambda: table(visits(diagnoses=[[]] * 6)),
        "column 'diagnoses', row 0: diagnoses and procedures are both empty",
    ),
    "unknown split": (
        lambda: table(visits(split=["train"] * 4 + ["dev", "dev"])),
        "column 'split', row 4: unknown split 'dev'",
    ),
    "patient in two splits": (
        lambda: table(visits(split=["train", "test"] + ["train"] * 4)),
        "column 'split', row 1: patient 'A' has visits in more than one",
    ),
    "null patient_id": (
        lambda: table(visits(patient_id=["A", "A", None, "A", "C", "C"])),
        "column 'patient_id', row 2: null value",
    ),
    "null code": (
        lambda: table(visits(procedures=[[], [], [], [], [], ["39.61", None]])),
        "column 'procedures', row 5: empty or null code",
    ),
    "visit_seq overflow": (
        lambda: table(visits(visit_seq=[0, 1, 0, 2**40, 0, 5]), visit_seq=pa.int64()),
        "column 'visit_seq', row 3: value 1099511627776 out of the int32",
    ),
    "no rows": (lambda: table(visits()).slice(0, 0), "visits.parquet: no visits"),
}


def _bad_dataset(root: Path, case: str) -> Path:
    make, _ = ERRORS[case]
    return dataset(root, make())


def test_a_null_code_list_is_read_as_an_empty_one(tmp_path):
    """The one rule of every command (issue 23, class 9): a null diagnoses or procedures list
    holds no codes; a visit left with no code at all is refused as an empty one."""
    nulls = visits(diagnoses=[["1"], ["2"], ["3"], None, ["4"], ["5"]])
    got = read_dataset(dataset(tmp_path / "ok", table(nulls))).visits
    by_id = dict(zip(got["visit_id"].to_pylist(), got["diagnoses"].to_pylist(), strict=True))
    assert by_id["a2"] == [] and got["diagnoses"].null_count == 0
    empty = visits(
        procedures=[[], ["39.61"], None, None, [], []], diagnoses=[["1"]] * 3 + [None, ["4"], ["5"]]
    )
    with pytest.raises(InputError, match="row 3: diagnoses and procedures are both empty"):
        read_dataset(dataset(tmp_path / "bad", table(empty)))


@pytest.mark.parametrize("case", ERRORS)
def test_input_errors_raise(tmp_path, case):
    with pytest.raises(InputError, match=ERRORS[case][1]) as info:
        read_dataset(_bad_dataset(tmp_path, case))
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(str(tmp_path / "visits.parquet"))


@pytest.mark.parametrize("case", ERRORS)
def test_input_errors_exit_2_with_one_line(tmp_path, case):
    result = CliRunner().invoke(data, ["stats", str(_bad_dataset(tmp_path, case))])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output


def _missing_visits(root: Path) -> Path:
    root.mkdir()
    write_ddi(root / "ddi.parquet", [("A12C", "B01A")])
    return root


def _missing_ddi(root: Path) -> Path:
    dataset(root, table(visits()))
    (root / "ddi.parquet").unlink()
    return root


def _garbage_visits(root: Path) -> Path:
    dataset(root, table(visits()))
    (root / "visits.parquet").write_bytes(b"this is not parquet")
    return root


def _truncated_visits(root: Path) -> Path:
    dataset(root, table(visits()))
    content = (root / "visits.parquet").read_bytes()
    (root / "visits.parquet").write_bytes(content[: len(content) // 2])
    return root


def _ddi_without_drug_b(root: Path) -> Path:
    dataset(root, table(visits()))
    pq.write_table(pa.table({"drug_a": ["A12C"]}), root / "ddi.parquet")
    return root


FILE_ERRORS = {
    "no directory": (lambda root: root / "nowhere", "nowhere: dataset directory not found"),
    "no visits file": (_missing_visits, "visits.parquet: file not found"),
    "no ddi file": (_missing_ddi, "ddi.parquet: file not found"),
    "not parquet": (_garbage_visits, "visits.parquet: not a readable Parquet file"),
    "truncated parquet": (_truncated_visits, "visits.parquet: not a readable Parquet file"),
    "ddi column missing": (_ddi_without_drug_b, "ddi.parquet: column 'drug_b': missing column"),
}


@pytest.mark.parametrize("case", FILE_ERRORS)
def test_file_errors(tmp_path, case):
    make, message = FILE_ERRORS[case]
    root = make(tmp_path / "ds")
    with pytest.raises(InputError, match=message):
        read_dataset(root)
    result = CliRunner().invoke(data, ["stats", str(root)])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_check_visits_columns_for_streams():
    schema = table(visits(split=None)).schema
    assert check_visits_columns(schema, "in.parquet").names == VISITS_SCHEMA.names[:-1]
    with pytest.raises(InputError, match="in.parquet: column 'split': missing column"):
        check_visits_columns(schema, "in.parquet", require_split=True)


# -- splits --------------------------------------------------------------------------------------


def test_split_patients_proportions_and_seed():
    split = split_patients(600, seed=0)
    assert np.bincount(split).tolist() == [400, 100, 100]  # train, val, test
    assert (split_patients(600, seed=0) == split).all()
    assert (split_patients(600, seed=1) != split).any()
    assert np.bincount(split_patients(7), minlength=3).tolist() == [4, 2, 1]


def test_split_is_drawn_by_patient_when_absent(tmp_path):
    n = 90
    columns = {
        "patient_id": [f"p{i % n}" for i in range(2 * n)],
        "visit_id": [f"v{i}" for i in range(2 * n)],
        "visit_seq": [i // n for i in range(2 * n)],
        "diagnoses": [["428.0"]] * (2 * n),
        "procedures": [[]] * (2 * n),
        "medications": [["N02B"]] * (2 * n),
    }
    root = dataset(tmp_path, table(columns))
    ds = read_dataset(root, split_seed=3)
    by_patient = {}
    for pid, split in zip(
        ds.visits["patient_id"].to_pylist(), ds.visits["split"].to_pylist(), strict=True
    ):
        by_patient.setdefault(pid, set()).add(split)
    assert all(len(s) == 1 for s in by_patient.values())
    counts = {s: sum(by_patient[p] == {s} for p in by_patient) for s in SPLITS}
    assert counts == {"train": 60, "val": 15, "test": 15}
    assert read_dataset(root, split_seed=3).visits.equals(ds.visits)
    assert not read_dataset(root, split_seed=4).visits.equals(ds.visits)


# -- writing -------------------------------------------------------------------------------------


def test_write_visits_streams_batches_atomically(tmp_path):
    full = table(visits())
    out = write_visits(
        tmp_path / "visits.parquet", full.to_batches(max_chunksize=2), row_group_size=2
    )
    assert pq.read_table(out).equals(full.cast(VISITS_SCHEMA))
    assert pq.ParquetFile(out).num_row_groups == 3
    assert os.listdir(tmp_path) == ["visits.parquet"]


def test_write_visits_leaves_nothing_on_failure(tmp_path):
    def batches():
        yield table(visits()).to_batches()[0]
        raise RuntimeError("upstream failed")

    with pytest.raises(RuntimeError):
        write_visits(tmp_path / "visits.parquet", batches())
    assert os.listdir(tmp_path) == []


def test_write_visits_rejects_bad_columns(tmp_path):
    with pytest.raises(InputError, match="column 'patient_id', row 1: null value"):
        write_visits(tmp_path / "v.parquet", table(visits(patient_id=["A", None] + ["B"] * 4)))


def test_write_ddi_round_trip(tmp_path):
    out = write_ddi(tmp_path / "ddi.parquet", [("A12C", "B01A")])
    assert pq.read_table(out).schema == DDI_SCHEMA
