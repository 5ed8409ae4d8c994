"""The int8 variant (cognet.export.int8): `cognet-export --int8` writes it, validates it and
names it in the manifest; `cognet-batch --variant int8` scores with it on the CPU only;
TensorRT never meets its graphs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import onnx
import onnxruntime as ort
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import as_targets, last_visits_unknown, make_tiny

from cognet.core.errors import InputError
from cognet.core.manifest import GRAPHS, Manifest, file_sha256, load_manifest
from cognet.export import GRAPH_FILES, INT8_FILES
from cognet.export import validate as val
from cognet.export.cli import main as export_main
from cognet.export.int8 import FLOAT32_MODULES, kept_float32, quantize
from cognet.runtime import Scorer
from cognet.runtime.cli import main as batch_main
from cognet.runtime.options import ScoreOptions

ALLOWLIST = Path(__file__).parents[1] / "export" / "onnx_ops_allowlist.txt"


class Exported(NamedTuple):
    root: Path  # data/, ckpt/ and model/
    manifest: Manifest
    output: str  # what cognet-export printed


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Exported:
    """A tiny random model over 300 patients (881 visits), exported by the CLI with --int8
    and validated."""
    root = tmp_path_factory.mktemp("int8")
    _, ckpt = make_tiny(root, n_patients=300)
    args = ["--checkpoint", str(ckpt), "--out", str(root / "model"), "--int8"]
    result = CliRunner().invoke(export_main, args)
    assert result.exit_code == 0, result.output
    return Exported(root, load_manifest(root / "model"), result.output)


def _ops(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


# -- the export -------------------------------------------------------------------------------
def test_export_writes_the_int8_graphs_and_names_them_in_the_manifest(exported):
    model, manifest = exported.root / "model", exported.manifest
    assert sorted(manifest.variants) == ["int8"]
    for name in GRAPHS:
        spec, float32 = manifest.graph_spec(name, "int8"), manifest.graph_spec(name)
        assert spec.file == INT8_FILES[name] == f"{name}.int8.onnx"
        assert spec.sha256 == file_sha256(model / spec.file) != float32.sha256
        # fed and read as the float32 graph: same tensors, same types, same axes
        assert (spec.inputs, spec.outputs) == (float32.inputs, float32.outputs)
        assert {"DynamicQuantizeLinear", "MatMulInteger"} <= _ops(model / spec.file)


def _as_exported(exported: Exported, name: str, out: Path) -> Path:
    """Graph `name` of the checkpoint as torch exports it: what the int8 variant is quantized
    from (the float32 files have their linear layers fused afterwards, `linear_fusion`)."""
    import torch

    from cognet.export.onnx_export import export_graph
    from cognet.model import checkpoint

    net, _, _ = checkpoint.load(exported.root / "ckpt")
    path = out / f"{name}.onnx"
    with torch.no_grad():
        export_graph(net, name, path)
    return path


def test_the_step_heads_stay_float32(exported, tmp_path):
    """The generation, copy and gate heads are found by name in the step graph (a renamed
    module would otherwise be quantized silently) and keep their float32 MatMul."""
    model = exported.root / "model"
    step = _as_exported(exported, "decoder_step", tmp_path)
    heads = kept_float32(onnx.load(str(step)).graph)
    assert sorted(h.split("/")[1] for h in heads) == sorted(FLOAT32_MODULES)
    quantized = onnx.load(str(model / INT8_FILES["decoder_step"])).graph
    left = {n.name for n in quantized.node if n.op_type == "MatMul"}
    assert set(heads) <= left


def test_int8_graphs_are_byte_identical_for_the_same_graph(exported, tmp_path):
    for name in GRAPHS:
        again = tmp_path / f"{name}.int8.onnx"
        quantize(_as_exported(exported, name, tmp_path), again)
        assert file_sha256(again) == exported.manifest.graph_spec(name, "int8").sha256, name


def test_parity_report_has_the_int8_section(exported):
    parity = exported.manifest.parity
    assert parity["passed"] and parity["float32"]["atol"] == val.FLOAT32_ATOL == 1e-4
    int8 = parity["int8"]
    assert int8["passed"] and (int8["atol"], int8["min_top1"]) == (
        val.INT8_ATOL,
        val.INT8_MIN_TOP1,
    )
    assert 0 < int8["probs_max_abs_diff"] <= val.INT8_ATOL
    assert val.INT8_MIN_TOP1 <= int8["top1_agreement"] < 1
    assert set(int8["cases"]) == set(val.SHAPE_CASES)
    beam4 = int8["decoding"]["beam4"]
    visits = parity["decoding"]["beam4"]["visits"]  # float32's: all identical
    assert beam4["visits"] == visits and 0 <= beam4["identical"] <= visits
    printed = exported.output.strip().splitlines()[-1]
    assert f"int8 max probability diff {int8['probs_max_abs_diff']:.2g}" in printed
    assert f"beam-4 lists identical {beam4['identical']}/{visits}" in printed


def test_int8_outside_its_bars_fails_the_export(exported, tmp_path, monkeypatch):
    monkeypatch.setattr(val, "INT8_ATOL", 1e-6)
    args = ["--checkpoint", str(exported.root / "ckpt"), "--out", str(tmp_path / "m"), "--int8"]
    result = CliRunner().invoke(export_main, args)
    assert result.exit_code == 1
    assert "int8 max probability diff" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m" / "manifest.json").exists()


# -- TensorRT never meets the int8 graphs -----------------------------------------------------
def test_int8_operators_are_outside_the_tensorrt_allowlist_only(exported):
    """The allow-list (TensorRT's operators) covers the float32 and float16 graphs and the
    parity report's operator list; the int8 graphs add exactly the two quantized ops."""
    allowed = {
        line.strip()
        for line in ALLOWLIST.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    model = exported.root / "model"
    ops = set().union(*(_ops(model / INT8_FILES[name]) for name in GRAPHS))
    assert ops - allowed == {"DynamicQuantizeLinear", "MatMulInteger"}
    assert set(exported.manifest.parity["ops"]) <= allowed


def test_tensorrt_engines_are_built_from_the_float32_graphs(exported, tmp_path, monkeypatch):
    """`build_engines` (no TensorRT here: its sessions are recorded) opens the float32 graphs
    only, and the runtime refuses the int8 graphs on TensorRT and CUDA."""
    from cognet.export.tensorrt import build_engines

    opened = []

    class Recorded:
        def __init__(self, path, providers):
            opened.append(Path(path).name)

        def get_providers(self):
            return ["TensorrtExecutionProvider"]

        def run(self, names, feeds):
            return []

    model = tmp_path / "model"
    shutil.copytree(exported.root / "model", model)
    monkeypatch.setattr(ort, "InferenceSession", Recorded)
    manifest = build_engines(load_manifest(model))
    assert opened == [GRAPH_FILES[name] for name in GRAPHS]
    assert set(manifest.tensorrt["profiles"]) == set(GRAPHS)
    for device in ("cuda", "tensorrt"):
        with pytest.raises(InputError, match="the int8 graphs run on the CPU only"):
            ScoreOptions(device=device, variant="int8")


# -- scoring ----------------------------------------------------------------------------------
def test_int8_lists_agree_with_float32_on_most_visits(exported):
    """Beam 4 through the whole runtime. The tiny random model is the hardest case: flat
    distributions, near-ties at every step (the default model's graphs: 92% of beam-4 lists
    equal torch's). Measured here (AVX2, 7-bit weights exact in int32): same first
    medication on 86.7% of the 881 visits, mean Jaccard of the lists 0.928; bounds: about
    twice the measured disagreement."""
    visits = pq.read_table(exported.root / "data" / "visits.parquet")
    runs = {}
    for variant in (None, "int8"):
        scorer = Scorer(
            exported.root / "model",
            ScoreOptions.of(device="cpu", threads=1, beam=4, variant=variant),
        )
        assert scorer.model.providers == ("CPUExecutionProvider",)
        chunks = scorer.score_table(as_targets(visits))
        runs[variant] = {
            r["visit_id"]: r["medications"] for c in chunks for r in c.recommendations.to_pylist()
        }
    float32, int8 = runs[None], runs["int8"]
    assert float32.keys() == int8.keys() and len(int8) == 881
    assert all(isinstance(meds, list) and meds for meds in int8.values())
    first = sum(float32[k][:1] == int8[k][:1] for k in int8) / len(int8)
    jaccard = sum(
        len(set(float32[k]) & set(int8[k])) / len(set(float32[k]) | set(int8[k])) for k in int8
    ) / len(int8)
    assert first >= 0.75 and jaccard >= 0.85, (first, jaccard)


def test_a_model_without_int8_graphs_exits_2_with_one_line(tiny, visits, tmp_path):
    """The session fixture's model has no variant: one line naming the manifest and the
    way to get one; and the GPU devices are refused before any model is read."""
    inp = tmp_path / "in.parquet"
    pq.write_table(last_visits_unknown(visits), inp)
    for extra, says in (
        ([], "no 'int8' variant (available: none); re-export the model with cognet-export --int8"),
        (["--device", "cuda"], "the int8 graphs run on the CPU only"),
    ):
        args = ["score", str(inp), "--model", str(tiny / "model"), "--out", str(tmp_path / "o")]
        result = CliRunner().invoke(batch_main, [*args, "--variant", "int8", *extra])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.output
        assert not (tmp_path / "o").exists()
