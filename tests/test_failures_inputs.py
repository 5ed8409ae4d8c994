"""Issue 59, every input error exits 2 with its file, column and row (`make failures`).

Bytes that are not UTF-8 in a key, a code list or a column name (Parquet stores what a
writer gave it; Python fails on it later), an integer column past the range it is read as
(a uint64 visit_seq >= 2^63), a column kept twice, a benchmark vocabulary whose word2idx
maps to arrays, and a checkpoint of the earlier format (no sha256 record) whose graphs.npz
is cut short: each is one line naming the file (column, row), exit 2, no traceback.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pickle_ops import (
    DIAG,
    FALSE,
    MEDS,
    NONE,
    PROC,
    ddi_matrix,
    ddi_stream,
    op_build,
    op_bytes,
    op_call,
    op_dict,
    op_dill,
    op_dtype,
    op_global,
    op_int,
    op_numpy_module,
    op_str,
    op_tuple,
    op_voc_class,
    stream,
)

from cognet.cli import main as cognet_main
from cognet.export.cli import main as export_main
from cognet.runtime.cli import main as batch_main

BAD = b"D\xff\xfe1"  # not UTF-8


def error(result) -> str:
    """The one line of a command refused with exit 2 (no traceback)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def raw_strings(values: list[bytes]) -> pa.Array:
    """A string array holding `values` as they are (pyarrow checks nothing on this path)."""
    offsets = np.cumsum([0, *map(len, values)]).astype(np.int32)
    buffers = [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(values))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers)


def with_bad_bytes(table: pa.Table, column: str, row: int) -> pa.Table:
    """`table` with BAD in `column` at `row` (a key, or the first code of a code list)."""
    values = table[column].to_pylist()
    i = table.schema.get_field_index(column)
    if isinstance(values[0], list):
        flat = [c.encode() for v in values for c in v or []]
        lengths = [len(v or []) for v in values]
        first = sum(lengths[:row])
        assert lengths[row], "pick a row with codes"
        flat[first] = BAD
        offsets = pa.array(np.cumsum([0, *lengths]).astype(np.int32))
        array = pa.ListArray.from_arrays(offsets, raw_strings(flat))
        return table.set_column(i, column, array.cast(table.schema.field(column).type))
    values = [v.encode() for v in values]
    values[row] = BAD
    return table.set_column(i, column, raw_strings(values))


def dataset(tiny: Path, visits: pa.Table, folder: Path) -> Path:
    folder.mkdir()
    pq.write_table(visits, folder / "visits.parquet")
    shutil.copy(tiny / "data" / "ddi.parquet", folder / "ddi.parquet")
    return folder


def readers(tiny: Path, folder: Path) -> dict:
    """{command: argv} of the three readers of a visits file in `folder`."""
    data = str(folder)
    out = str(folder.parent / f"{folder.name}.out.parquet")
    score = ["score", f"{data}/visits.parquet", "--model", str(tiny / "model"), "--out", out]
    return {
        "cognet-batch score": (batch_main, [*score, "--quiet"]),
        "cognet data stats": (cognet_main, ["data", "stats", data]),
        "cognet evaluate --baseline": (
            cognet_main,
            ["evaluate", "--data", data, "--baseline", "copy-last", "--quiet"],
        ),
    }


@pytest.mark.parametrize("column", ["patient_id", "visit_id", "diagnoses"])
def test_bytes_that_are_not_utf8_are_named_by_column_and_row(tiny, visits, tmp_path, column):
    row = 7
    folder = dataset(tiny, with_bad_bytes(visits, column, row), tmp_path / "d")
    for name, (main, argv) in readers(tiny, folder).items():
        line = error(CliRunner().invoke(main, argv))
        want = f"{folder}/visits.parquet: column '{column}', row {row}: "
        assert want in line and "is not UTF-8 text" in line, (name, line)


def test_a_column_name_that_is_not_utf8_is_named(tiny, visits, tmp_path):
    folder = tmp_path / "d"
    dataset(tiny, visits, folder)
    table = visits.append_column("extra_col_name", pa.array(["x"] * visits.num_rows))
    pq.write_table(table, folder / "visits.parquet", store_schema=False)
    data = (folder / "visits.parquet").read_bytes()
    assert data.count(b"extra_col_name")  # in the footer, uncompressed
    (folder / "visits.parquet").write_bytes(data.replace(b"extra_col_name", b"extra_col_\xffame"))
    for name, (main, argv) in readers(tiny, folder).items():
        line = error(CliRunner().invoke(main, argv))
        assert f"{folder}/visits.parquet: the column name b'extra_col_\\xffame'" in line, name
        assert "is not UTF-8 text" in line


def test_a_uint64_visit_seq_past_int64_names_column_and_row(tiny, visits, tmp_path):
    seq = visits["visit_seq"].to_numpy().astype(np.uint64)
    seq[9] = 2**63 + 5
    i = visits.schema.get_field_index("visit_seq")
    table = visits.set_column(i, "visit_seq", pa.array(seq, pa.uint64()))
    folder = dataset(tiny, table, tmp_path / "d")
    for name, (main, argv) in readers(tiny, folder).items():
        line = error(CliRunner().invoke(main, argv))
        want = f"{folder}/visits.parquet: column 'visit_seq', row 9: value {2**63 + 5} out of"
        assert want in line, (name, line)


def test_a_column_kept_twice_is_a_usage_error(tiny, visits, tmp_path):
    pq.write_table(visits, tmp_path / "in.parquet")
    out = tmp_path / "o.parquet"
    argv = ["score", str(tmp_path / "in.parquet"), "--model", str(tiny / "model")]
    line = error(
        CliRunner().invoke(batch_main, [*argv, "--out", str(out), "--keep-columns", "split,split"])
    )
    assert "--keep-columns: split named twice" in line
    assert not out.exists()


# -- a benchmark vocabulary whose word2idx maps to arrays ---------------------------------------
def op_array(values: list[int]) -> bytes:
    """A numpy int64 array, as dill writes one (`ddi_stream`'s recipe)."""
    reconstruct = op_call(op_dill("_get_attr"), op_numpy_module(), op_str("_reconstruct"))
    empty = op_tuple(op_global("numpy", "ndarray"), op_tuple(op_int(0)), op_bytes(b"b"))
    raw = op_bytes(np.asarray(values, "<i8").tobytes())
    state = op_tuple(op_int(1), op_tuple(op_int(len(values))), op_dtype("i8"), FALSE, raw)
    return op_call(op_dill("_create_array"), reconstruct, empty, state, NONE)


def voc_with_array_ids() -> bytes:
    """voc_final.pkl's shape, med_voc's word2idx mapping each word to an array [id, id]."""

    def voc(cls: bytes, words: dict[int, str], arrays: bool) -> bytes:
        idx2word = op_dict(*[(op_int(k), op_str(w)) for k, w in words.items()])
        value = (lambda k: op_array([k, k])) if arrays else op_int
        word2idx = op_dict(*[(op_str(w), value(k)) for k, w in words.items()])
        state = op_dict((op_str("idx2word"), idx2word), (op_str("word2idx"), word2idx))
        return op_build(cls + b")\x81", state)

    vocs = [voc(op_voc_class() + b"p0\n", DIAG, False), voc(b"g0\n", PROC, False)]
    vocs.append(voc(b"g0\n", MEDS, True))
    names = [op_str(n) for n in ("diag_voc", "pro_voc", "med_voc")]
    return stream(op_dict(*zip(names, vocs, strict=True)))


def test_a_word2idx_of_arrays_is_named(tmp_path):
    files = {n: tmp_path / f"{n}.pkl" for n in ("records", "voc", "ddi")}
    files["records"].write_bytes(pickle.dumps([[[[0], [0], [0, 1]]], [[[1], [1], [2]]]]))
    files["voc"].write_bytes(voc_with_array_ids())
    files["ddi"].write_bytes(ddi_stream(ddi_matrix()))
    argv = ["data", "benchmark", "--records", str(files["records"]), "--voc", str(files["voc"])]
    out = tmp_path / "data"
    line = error(
        CliRunner().invoke(cognet_main, [*argv, "--ddi", str(files["ddi"]), "--out", str(out)])
    )
    assert f"{files['voc']}: med_voc: word2idx entry 'A01A': " in line, line
    assert "is not word -> id" in line and not out.exists()


# -- a checkpoint of the earlier format, its graphs.npz cut short -----------------------------
def test_a_cut_graphs_file_of_an_unhashed_checkpoint_is_named(tiny, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny / "ckpt", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    del config["sha256"]  # saved before the hashes: must keep loading
    (ckpt / "config.json").write_text(json.dumps(config))
    graphs = ckpt / "graphs.npz"
    graphs.write_bytes(graphs.read_bytes()[: graphs.stat().st_size // 2])
    runs = {
        "cognet-export": (export_main, ["--checkpoint", str(ckpt), "--out", str(tmp_path / "m")]),
        "cognet evaluate": (
            cognet_main,
            ["evaluate", "--checkpoint", str(ckpt), "--data", str(tiny / "data"), "--quiet"],
        ),
    }
    for name, (main, argv) in runs.items():
        line = error(CliRunner().invoke(main, argv))
        assert f"{graphs}: unreadable (" in line, (name, line)
    assert not (tmp_path / "m").exists()
