"""Every graph `cognet-export` writes is valid ONNX: `onnx.checker.check_model(full_check=True)`
passes on the model graphs, their float16 variant and every search graph (each input and
output has a rank), and the manifest lists each graph with the shapes the file declares."""

from __future__ import annotations

import json

import onnx
import pytest

from cognet.core.graphspec import TAKE_DTYPES, TAKE_RANKS, take_graph_name


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    """The tiny checkpoint exported with its float16 variant (unvalidated: parity is
    tests/test_export.py's)."""
    from cognet.export import ExportOptions, export

    out = tmp_path_factory.mktemp("checked") / "model"
    export(tiny / "ckpt", out, ExportOptions(validate=False, fp16=True))
    return out


def _graph_files(model_dir) -> dict[str, str]:
    manifest = json.loads((model_dir / "manifest.json").read_text())
    files = {name: g["file"] for name, g in manifest["graphs"].items()}
    for variant, graphs in manifest["variants"].items():
        files.update({f"{name}.{variant}": g["file"] for name, g in graphs.items()})
    files.update({name: g["file"] for name, g in manifest["search"].items()})
    return files


def test_every_exported_graph_passes_the_onnx_checker(exported):
    files = _graph_files(exported)
    on_disk = {p.name for p in exported.rglob("*.onnx")}
    assert set(files.values()) == on_disk  # the manifest names every graph written
    assert {take_graph_name(t, r) for t in TAKE_DTYPES for r in TAKE_RANKS} <= set(files)
    for name, file in sorted(files.items()):
        model = onnx.load(str(exported / file))
        onnx.checker.check_model(model, full_check=True)  # raises on an invalid graph
        for value in [*model.graph.input, *model.graph.output]:
            assert value.type.tensor_type.HasField("shape"), f"{name}: {value.name} has no rank"


def test_the_manifest_records_each_search_graph_rank(exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    for t in TAKE_DTYPES:
        for rank in TAKE_RANKS:
            spec = manifest["search"][take_graph_name(t, rank)]
            shapes = {io["name"]: io["shape"] for io in [*spec["inputs"], *spec["outputs"]]}
            assert len(shapes["x"]) == len(shapes["y"]) == rank and shapes["rows"] == ["K"]


def test_a_model_exported_before_keeps_its_one_take_graph_of_any_rank():
    """Models exported before the ranked take graphs have one `take_<dtype>` of any rank
    (no shape on x and y): the runtime gathers every rank with it."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from cognet.runtime.device_selectors import SearchGraphs

    node = helper.make_node("Gather", ["x", "rows"], ["y"], axis=0)
    graph = helper.make_graph(
        [node],
        "take_float32",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("rows", TensorProto.INT64, ["K"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    search = SearchGraphs({"take_float32": sess}, ("cpu", 0))
    x = np.arange(9 * 2 * 3 * 4 * 5, dtype=np.float32).reshape(9, 2, 3, 4, 5)
    rows = np.array([8, 0, 3, 3])
    got = search.take(ort.OrtValue.ortvalue_from_numpy(x, "cpu", 0), rows)
    np.testing.assert_array_equal(got.numpy(), x[rows])


def test_a_whole_model_exported_before_the_ranked_take_graphs_still_loads(
    exported, visits, tmp_path
):
    """The manifest of such a model gives its take graphs' x and y the any-rank shape
    ["..."]: the load checks accept it, and the device selection scores with it as the host
    one does."""
    import hashlib
    import shutil

    import pyarrow as pa
    from onnx import TensorProto, helper

    from cognet.runtime import ScoreOptions, Scorer

    old = tmp_path / "model"
    shutil.copytree(exported, old)
    manifest = json.loads((old / "manifest.json").read_text())
    elem = dict(
        zip(
            TAKE_DTYPES,
            (
                TensorProto.FLOAT,
                TensorProto.FLOAT16,
                TensorProto.DOUBLE,
                TensorProto.INT64,
                TensorProto.BOOL,
            ),
            strict=True,
        )
    )
    for dtype in TAKE_DTYPES:
        for rank in TAKE_RANKS:
            name = take_graph_name(dtype, rank)
            entry = manifest["search"][name]
            if rank != 2:  # only take_<dtype> existed, for every rank
                (old / manifest["search"].pop(name)["file"]).unlink()
                continue
            x, rows = (
                helper.make_tensor_value_info("x", elem[dtype], None),
                helper.make_tensor_value_info("rows", TensorProto.INT64, ["K"]),
            )
            y = helper.make_tensor_value_info("y", elem[dtype], None)
            node = helper.make_node("Gather", ["x", "rows"], ["y"], axis=0)
            graph = helper.make_graph([node], name, [x, rows], [y])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
            model.ir_version = 8
            path = old / entry["file"]
            path.write_bytes(model.SerializeToString())
            entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
            entry["inputs"] = [
                {"name": "x", "dtype": dtype, "shape": ["..."]},
                {"name": "rows", "dtype": "int64", "shape": ["K"]},
            ]
            entry["outputs"] = [{"name": "y", "dtype": dtype, "shape": ["..."]}]
    (old / "manifest.json").write_text(json.dumps(manifest))
    from tiny import last_visits_unknown

    targets = last_visits_unknown(visits)  # scored without --all: the device path throughout
    lists = {}
    for selection in ("host", "device"):
        scorer = Scorer(
            old,
            ScoreOptions.of(
                device="cpu",
                threads=1,
                selection=selection,
                decoding="beam",
                batch_size=16,
                compact_at=0.9,
            ),
        )
        chunks = scorer.score_table(targets)
        lists[selection] = pa.concat_tables([c.recommendations for c in chunks])["medications"]
    assert lists["host"].equals(lists["device"]) and len(lists["host"]) > 20
