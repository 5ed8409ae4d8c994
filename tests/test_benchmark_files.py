"""cognet data benchmark and cognet.data.pickles, on pickles written here in the shapes of
records_final.pkl, voc_final.pkl and ddi_A_final.pkl (no dill, no benchmark data).

The dill-shaped streams are assembled opcode by opcode (`op_*` below); hostile ones are built
from the allowed names themselves, and each shows that nothing ran: the command they would
run touches a marker file that must stay absent.
"""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pickle_ops import (
    FALSE,
    NONE,
    ddi_matrix,
    ddi_stream,
    op_build,
    op_bytes,
    op_call,
    op_code,
    op_dict,
    op_dill,
    op_dtype,
    op_function,
    op_global,
    op_int,
    op_numpy_module,
    op_str,
    op_tuple,
    op_voc_class,
    stream,
    voc_stream,
)

from cognet.cli.data import data
from cognet.core.dataset import read_dataset
from cognet.core.errors import InputError
from cognet.data.benchmark import split_names
from cognet.data.pickles import load

# 7 patients: split point int(7 * 2 / 3) = 4, then int(3 / 2) = 1 patient, then 2
RECORDS = [
    [[[0, 1], [0], [0, 1]], [[2], [1], [1, 2, 3]]],
    [[[1], [], [2]]],
    [[[0], [0, 1], [3]], [[1, 2], [1], [0]], [[2], [0], [1]]],
    [[[2], [1], [0, 3]]],
    [[[0], [], [1]]],
    [[[1, 2], [0], [2]], [[0], [1], [3]]],
    [[[2], [0], [0]]],
]


def write_files(folder: Path, records: bytes | None = None, voc=None, ddi=None) -> dict:
    paths = {name: folder / f"{name}_final.pkl" for name in ("records", "voc", "ddi_A")}
    paths["records"].write_bytes(records or pickle.dumps(RECORDS, protocol=4))
    paths["voc"].write_bytes(voc or voc_stream())
    paths["ddi_A"].write_bytes(ddi or ddi_stream(ddi_matrix()))
    return paths


def convert(paths: dict, out: Path, *extra: str):
    args = ["benchmark", "--records", str(paths["records"]), "--voc", str(paths["voc"])]
    args += ["--ddi", str(paths["ddi_A"]), "--out", str(out), *extra]
    return CliRunner().invoke(data, args)


def visits_of(out: Path) -> list[dict]:
    return pq.read_table(out / "visits.parquet").to_pylist()


# -- valid files ------------------------------------------------------------------------------


def test_converts_the_three_files(tmp_path):
    result = convert(write_files(tmp_path), tmp_path / "out")
    assert result.exit_code == 0, result.output
    dataset = read_dataset(tmp_path / "out")
    assert dataset.ddi_pairs == [("A01A", "B01A"), ("C07A", "N02B")]
    rows = visits_of(tmp_path / "out")
    assert len(rows) == sum(len(p) for p in RECORDS)
    assert rows[0] == {
        "patient_id": "0",
        "visit_id": "0-0",
        "visit_seq": 0,
        "diagnoses": ["4019", "25000"],
        "procedures": ["3961"],
        "medications": ["A01A", "B01A"],
        "split": "train",
    }
    assert [(r["patient_id"], r["visit_id"], r["visit_seq"]) for r in rows[3:6]] == [
        ("2", "2-0", 0),
        ("2", "2-1", 1),
        ("2", "2-2", 2),
    ]
    assert rows[2]["procedures"] == [] and rows[4]["medications"] == ["A01A"]
    assert "test patients 1, test visits 1" in result.output
    assert "med voc 4; summary" in result.output


def test_summary_json_holds_the_counts_kept_and_dropped(tmp_path):
    # a symmetric matrix: each pair is marked twice; one diagonal entry more is dropped
    matrix = ddi_matrix()
    matrix[1, 1] = 1
    result = convert(write_files(tmp_path, ddi=ddi_stream(matrix)), tmp_path / "out")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["source"] == "benchmark"
    steps = {s["name"]: s for s in summary["steps"]}
    visits = sum(len(p) for p in RECORDS)
    assert steps["records"] == {
        "name": "records",
        "rows": visits,
        "kept": visits,
        "what": "visits",
        "dropped": {},
    }
    assert steps["ddi_A_final"] == {
        "name": "ddi_A_final",
        "rows": 5,
        "kept": 2,
        "what": "interacting pairs",
        "dropped": {
            "the mirror of a pair's other entry": 2,
            "on the diagonal (a drug with itself)": 1,
        },
    }
    dataset = summary["dataset"]
    assert (dataset["visits"], dataset["ddi_pairs"], dataset["med_voc"]) == (visits, 2, 4)
    assert [dataset[f"{s}_patients"] for s in ("train", "val", "test")] == [4, 2, 1]
    assert "diagonal entries (a drug with itself) dropped" in summary["warnings"][0]


def with_weights_and_numpy_ids(records: list) -> list:
    """The other versions' visits: numpy integer ids and a fourth field, a numpy float."""
    return [
        [[[np.int64(c) for c in field] for field in visit] + [np.float64(0.5)] for visit in p]
        for p in records
    ]


def test_fourth_field_and_numpy_ids_give_the_same_dataset(tmp_path):
    plain, weighted = tmp_path / "plain", tmp_path / "weighted"
    assert convert(write_files(tmp_path), plain).exit_code == 0
    records = pickle.dumps(with_weights_and_numpy_ids(RECORDS), protocol=4)
    assert b"scalar" in records  # numpy's own scalar reconstructor, numpy 2's module name
    result = convert(write_files(tmp_path, records=records), weighted)
    assert result.exit_code == 0, result.output
    assert visits_of(weighted) == visits_of(plain)


def test_numpy1_names_and_numpy_protocol_2_pickles(tmp_path):
    """numpy 1's module names (numpy.core), a plain numpy pickle of the matrix, and protocol
    2 (bytes as _codecs.encode) read as the dill-written files do."""
    i8 = op_dtype("i8")
    scalar = op_global("numpy.core.multiarray", "scalar")
    records = [
        [
            [
                [op_call(scalar, i8, op_bytes(struct.pack("<q", c))) for c in field]
                for field in visit
            ]
            for visit in p
        ]
        for p in RECORDS
    ]

    def op_list(items):
        return b"](" + b"".join(items) + b"e"

    body = op_list([op_list([op_list([op_list(f) for f in v]) for v in p]) for p in records])
    paths = write_files(
        tmp_path, records=stream(body), ddi=ddi_stream(ddi_matrix(), "numpy.core.multiarray")
    )
    assert convert(paths, tmp_path / "numpy1").exit_code == 0
    paths["ddi_A"].write_bytes(pickle.dumps(ddi_matrix(), protocol=2))
    result = convert(paths, tmp_path / "plain_numpy")
    assert result.exit_code == 0, result.output
    assert visits_of(tmp_path / "plain_numpy") == visits_of(tmp_path / "numpy1")
    assert read_dataset(tmp_path / "plain_numpy").ddi_pairs == [("A01A", "B01A"), ("C07A", "N02B")]


@pytest.mark.parametrize(
    "order, expected",
    [
        ("test-first", ["train"] * 4 + ["test"] + ["val"] * 2),
        ("val-first", ["train"] * 4 + ["val"] + ["test"] * 2),
    ],
)
def test_split_orders(tmp_path, order, expected):
    result = convert(write_files(tmp_path), tmp_path / "out", "--split-order", order)
    assert result.exit_code == 0, result.output
    by_patient = {r["patient_id"]: r["split"] for r in visits_of(tmp_path / "out")}
    assert [by_patient[str(i)] for i in range(len(RECORDS))] == expected


def test_split_sizes_of_the_mimic3_benchmark():
    names = split_names(6350, "test-first")
    assert (names.count("train"), names.count("test"), names.count("val")) == (4233, 1058, 1059)
    assert names[4233:4234] == ["test"] and names[-1] == "val"


def test_asymmetric_matrix_is_kept_and_warned(tmp_path):
    matrix = ddi_matrix()
    matrix[3, 2] = 0
    result = convert(write_files(tmp_path, ddi=ddi_stream(matrix)), tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "1 pair(s) marked in one direction only" in result.stderr
    assert len(read_dataset(tmp_path / "out").ddi_pairs) == 2


# -- refused inputs ---------------------------------------------------------------------------


def assert_refused(result, out: Path, *texts: str) -> None:
    """Exit 2 with one line naming the problem, and no dataset written."""
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    for text in texts:
        assert text in result.stderr
    assert "Traceback" not in result.output
    assert not out.exists()


def bad_records(records_changes) -> bytes:
    records = [[[list(f) for f in v] for v in p] for p in RECORDS]
    records_changes(records)
    return pickle.dumps(records, protocol=4)


@pytest.mark.parametrize(
    "change, where, problem",
    [
        (
            lambda r: r[1][0][2].append(9),
            "patient 1, visit 0, medications, item 1",
            "id 9 is not in med_voc",
        ),
        (
            lambda r: r[2][1][0].__setitem__(0, -1),
            "patient 2, visit 1, diagnoses, item 0",
            "id -1 is not in diag_voc",
        ),
        (
            lambda r: r[0][1][1].__setitem__(0, "3961"),
            "patient 0, visit 1, procedures, item 0",
            "is not an id",
        ),
        (
            lambda r: r[0][0][2].__setitem__(0, 1.0),
            "patient 0, visit 0, medications, item 0",
            "float",
        ),
        (
            lambda r: r[0][0][2].__setitem__(0, True),
            "patient 0, visit 0, medications, item 0",
            "bool",
        ),
        (lambda r: r[3][0].pop(), "patient 3, visit 0", "got 2 fields"),
        (lambda r: r[4].clear(), "patient 4", "non-empty list of visits"),
        (lambda r: r[1][0].__setitem__(0, []), "patient 1, visit 0", "both empty"),
    ],
)
def test_bad_record_names_file_and_position(tmp_path, change, where, problem):
    paths = write_files(tmp_path, records=bad_records(change))
    result = convert(paths, tmp_path / "out")
    assert_refused(result, tmp_path / "out", f"{paths['records']}: {where}", problem)


def test_matrix_of_another_size_is_refused(tmp_path):
    paths = write_files(tmp_path, ddi=ddi_stream(np.zeros((3, 3))))
    result = convert(paths, tmp_path / "out")
    assert_refused(result, tmp_path / "out", f"{paths['ddi_A']}: expected a 4 x 4 matrix")


def test_truncated_pickle_is_refused(tmp_path):
    paths = write_files(tmp_path, voc=voc_stream()[:-40])
    result = convert(paths, tmp_path / "out")
    assert_refused(result, tmp_path / "out", f"{paths['voc']}: not a readable pickle")


# -- hostile pickles: nothing runs ------------------------------------------------------------


def hostile_cases(marker: Path) -> list[tuple[str, str, bytes, str]]:
    """(id, file slot, stream, text of the refusal): each would touch `marker` if run."""
    touch = op_str(f"touch {marker}")
    python = op_str(f"__import__('os').system('touch {marker}')")
    ddi_tail = (NONE, NONE)
    function = op_function("__init__")
    numpy = op_numpy_module()
    return [
        ("os-system", "records", op_call(op_global("os", "system"), touch), "global os.system"),
        (
            "create-array-os-system",
            "ddi_A",
            op_call(
                op_dill("_create_array"), op_global("os", "system"), op_tuple(touch), *ddi_tail
            ),
            "global os.system",
        ),
        (
            "create-array-eval",
            "ddi_A",
            op_call(
                op_dill("_create_array"), op_global("builtins", "eval"), op_tuple(python), *ddi_tail
            ),
            "global builtins.eval",
        ),
        (
            "create-array-allowed-function",
            "ddi_A",
            op_call(
                op_dill("_create_array"),
                op_dill("_import_module"),
                op_tuple(op_str("os")),
                *ddi_tail,
            ),
            "the function must be numpy's _reconstruct, got dill._dill._import_module",
        ),
        (
            "function-placeholder-called",
            "voc",
            op_call(function, touch),
            "REDUCE would call function __init__ (a placeholder, never called)",
        ),
        (
            "code-placeholder-called",
            "voc",
            op_call(op_code(), touch),
            "REDUCE would call a code object",
        ),
        (
            "class-placeholder-called",
            "voc",
            op_call(op_voc_class(), touch),
            "REDUCE would call class Voc",
        ),
        (
            "import-module-os",
            "ddi_A",
            op_call(
                op_call(
                    op_dill("_get_attr"),
                    op_call(op_dill("_import_module"), op_str("os")),
                    op_str("system"),
                ),
                touch,
            ),
            "dill._dill._import_module('os')",
        ),
        (
            "get-attr-system",
            "ddi_A",
            op_call(op_call(op_dill("_get_attr"), numpy, op_str("system")), touch),
            "_get_attr(module numpy.core._multiarray_umath, 'system')",
        ),
        ("object-dtype", "ddi_A", op_dtype("O"), "numpy.dtype('O')"),
        (
            "load-type-function",
            "voc",
            op_call(op_dill("_load_type"), op_str("FunctionType")),
            "_load_type('FunctionType')",
        ),
        (
            "create-type-other-class",
            "voc",
            op_call(
                op_dill("_create_type"),
                op_call(op_dill("_load_type"), op_str("type")),
                op_str("Evil"),
                op_tuple(),
                op_dict(),
            ),
            "only class Voc(object)",
        ),
        (
            "create-type-reduce-method",
            "voc",
            op_call(
                op_dill("_create_type"),
                op_call(op_dill("_load_type"), op_str("type")),
                op_str("Voc"),
                op_tuple(op_call(op_dill("_load_type"), op_str("object"))),
                op_dict((op_str("__reduce__"), function)),
            ),
            "class attribute '__reduce__' is not allowed",
        ),
        (
            "build-on-class",
            "voc",
            op_build(op_voc_class(), op_dict((op_str("__call__"), function))),
            "BUILD on class Voc",
        ),
        (
            "build-voc-other-key",
            "voc",
            op_build(op_voc_class() + b")\x81", op_dict((op_str("__class__"), function))),
            "only idx2word and word2idx",
        ),
        (
            "newobj-ndarray",
            "ddi_A",
            op_global("numpy", "ndarray") + b")\x81",
            "NEWOBJ of numpy.ndarray",
        ),
        ("inst", "records", b"(" + touch + b"ios\nsystem\n", "INST (a class call)"),
        ("obj", "voc", b"(" + op_dill("_load_type") + op_str("type") + b"o", "OBJ (a class call)"),
        ("persistent-id", "records", touch + b"Q", "a persistent id"),
        ("extension-code", "records", b"\x82\x01", "an extension code"),
        (
            "array-from-list",
            "ddi_A",
            op_call(
                op_dill("_create_array"),
                op_call(op_dill("_get_attr"), numpy, op_str("_reconstruct")),
                op_tuple(op_global("numpy", "ndarray"), op_tuple(op_int(0)), op_bytes(b"b")),
                op_tuple(op_int(1), op_tuple(op_int(1)), op_dtype(), FALSE, b"](" + touch + b"e"),
                NONE,
            ),
            "only numeric dtypes from raw bytes",
        ),
    ]


HOSTILE_IDS = [case[0] for case in hostile_cases(Path("m"))]


@pytest.mark.parametrize("case", HOSTILE_IDS)
def test_hostile_pickle_is_refused_and_nothing_runs(tmp_path, case):
    marker = tmp_path / "ran"
    _, slot, body, text = next(c for c in hostile_cases(marker) if c[0] == case)
    paths = write_files(tmp_path, **{"ddi" if slot == "ddi_A" else slot: stream(body)})
    result = convert(paths, tmp_path / "out")
    assert_refused(result, tmp_path / "out", f"{paths[slot]}: refused: ", text)
    assert "nothing in the file was run" in result.stderr
    assert not marker.exists()


def test_load_refuses_before_running_and_never_imports_dill(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pkl"
    path.write_bytes(stream(op_call(op_global("os", "system"), op_str(f"touch {marker}"))))
    with pytest.raises(InputError, match=r"refused: global os\.system is not one of the names"):
        load(path)
    assert not marker.exists()
    (tmp_path / "voc.pkl").write_bytes(voc_stream())
    code = (
        "import sys; from cognet.data.pickles import load; "
        f"v = load({str(tmp_path / 'voc.pkl')!r}); "
        "assert v['med_voc'].idx2word[3] == 'N02B'; assert 'dill' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
