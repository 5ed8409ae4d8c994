"""cognet.export and cognet-export: graphs, manifest, parity with torch, the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from tiny import make_tiny

from cognet.core.errors import InputError
from cognet.core.graphspec import ENCODER_PARTS, MIX_GRAPH, STEP_INPUTS, STEP_OUTPUTS
from cognet.core.history import patients_from_table
from cognet.core.manifest import GRAPHS, Manifest, load_manifest
from cognet.core.vocab import Vocab
from cognet.export import (
    FP16_FILES,
    GRAPH_FILES,
    OPSET,
    PART_FILES,
    ExportOptions,
    cache_tensors,
    export,
)
from cognet.export import validate as val
from cognet.export.cli import main
from cognet.export.graphs import (
    GRAPH_IO,
    ReferenceStep,
    Sizes,
    example_inputs,
    tensor_specs,
)
from cognet.export.search_graphs import SEARCH_FILES
from cognet.model import checkpoint
from cognet.model.network import COGNet

ALLOWLIST = Path(__file__).parents[1] / "export" / "onnx_ops_allowlist.txt"


@pytest.fixture(scope="module")
def tiny300(tmp_path_factory) -> tuple[Path, Path]:
    """(data, ckpt) of a tiny random model over 300 patients: several hundred visits to
    compare lists on (the shared `tiny` fixture has 248)."""
    return make_tiny(tmp_path_factory.mktemp("tiny300"), n_patients=300)


class Exported(NamedTuple):
    manifest: Manifest
    out: Path  # the model directory
    model: COGNet
    vocab: Vocab
    ckpt: Path


@pytest.fixture(scope="module")
def exported(tiny300, tmp_path_factory) -> Exported:
    """The tiny checkpoint exported with its float16 variant (and validated)."""
    out = tmp_path_factory.mktemp("model")
    manifest = export(tiny300[1], out, ExportOptions(fp16=True))
    model, vocab, _ = checkpoint.load(tiny300[1])
    return Exported(manifest, out, model, vocab, tiny300[1])


def _graph_paths(model_dir: Path, files=GRAPH_FILES) -> dict[str, Path]:
    return {name: model_dir / files[name] for name in GRAPHS}


# -- the model directory ----------------------------------------------------------------------
def test_model_directory_holds_graphs_and_manifest(exported):
    manifest, out, model, vocab, _ = exported
    search = {k: v for k, v in SEARCH_FILES.items() if k != MIX_GRAPH}  # one network: no mixture
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", *GRAPH_FILES.values(), *FP16_FILES.values(), *search.values()]
        + list(PART_FILES.values())
    )
    loaded = load_manifest(out)
    assert {name: g.file for name, g in loaded.search.items()} == search
    assert loaded.to_json() == manifest.to_json()
    cfg = model.cfg
    assert loaded.opset == OPSET >= 18
    assert (loaded.dims.dim, loaded.dims.heads, loaded.dims.out_size) == (
        cfg.dim,
        cfg.heads,
        cfg.out_size,
    )
    assert (loaded.special.end, loaded.special.start, loaded.special.med_pad) == (
        vocab.end,
        vocab.start,
        vocab.med_pad,
    )
    assert loaded.vocabulary() == vocab
    assert (loaded.max_len, loaded.beam, loaded.ablation) == (45, 4, "none")
    assert len(loaded.ddi_pairs) > 0 and all(len(p) == 2 for p in loaded.ddi_pairs)
    assert loaded.checkpoint_sha256 == checkpoint.checkpoint_hash(exported.ckpt)
    assert {"torch", "onnx", "onnxruntime"} <= set(loaded.versions)


def test_graph_io_and_symbolic_axes(exported):
    """Every input keeps the symbolic axes of the spec (no axis specialised to its example
    size) and the graph I/O names and order are graphspec's."""
    manifest, out, model, _, _ = exported
    specs = tensor_specs(model)
    for name in GRAPHS:
        proto = onnx.load(str(out / GRAPH_FILES[name]))
        ins, outs = GRAPH_IO[name]
        assert tuple(v.name for v in proto.graph.input) == ins
        assert tuple(v.name for v in proto.graph.output) == outs
        for v in proto.graph.input:
            dims = tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)
            assert dims == specs[v.name].shape, (name, v.name)
            assert all(
                d.dim_param
                for d, s in zip(v.type.tensor_type.shape.dim, specs[v.name].shape, strict=True)
                if isinstance(s, str)
            )
        assert manifest.graph_spec(name).input_names == ins


def test_encoder_parts_compute_the_encoders_outputs(exported):
    """Each encoder part takes one kind of code and gives that kind's outputs of the encoder
    graph, bit for bit (the same nodes), at several shapes; the manifest names them."""
    manifest, out, model, _, _ = exported
    full = ort.InferenceSession(
        str(out / GRAPH_FILES["encoder"]), providers=["CPUExecutionProvider"]
    )
    parts = {
        name: ort.InferenceSession(str(out / PART_FILES[name]), providers=["CPUExecutionProvider"])
        for name in ENCODER_PARTS
    }
    assert manifest.encoder_parts
    for name, (ins, outs) in ENCODER_PARTS.items():
        assert manifest.graph_spec(name).input_names == ins
        assert manifest.graph_spec(name).output_names == outs
        assert [i.name for i in parts[name].get_inputs()] == list(ins)
    for n, lengths in ((2, (3, 2, 4)), (5, (7, 1, 2)), (3, (2, 6, 1))):
        inputs = example_inputs(model, Sizes(N=n, Ld=lengths[0], Lp=lengths[1], Lm=lengths[2]))
        feed = {k: inputs[k].numpy() for k in GRAPH_IO["encoder"][0]}
        want = dict(zip(GRAPH_IO["encoder"][1], full.run(None, feed), strict=True))
        for name, (ins, outs) in ENCODER_PARTS.items():
            got = parts[name].run(None, {k: feed[k] for k in ins})
            for o, value in zip(outs, got, strict=True):
                np.testing.assert_array_equal(value, want[o], err_msg=f"{name} {o} at N={n}")


def test_fp16_variant_types(exported):
    manifest, out, _, _, _ = exported
    step = manifest.graph_spec("decoder_step", "fp16")
    dtypes = {t.name: t.dtype for t in (*step.inputs, *step.outputs)}
    assert dtypes["log_probs"] == "float32"  # beam scores accumulate in float32
    assert dtypes["copy_onehot"] == dtypes["gate"] == "float16"
    assert dtypes["tokens"] == dtypes["past_tokens"] == dtypes["present_tokens"] == "int64"
    for name in GRAPHS:
        onnx.checker.check_model(onnx.load(str(out / FP16_FILES[name])), full_check=True)


# -- operators --------------------------------------------------------------------------------
def _ops(paths) -> set[str]:
    return {n.op_type for p in paths for n in onnx.load(str(p)).graph.node}


def test_operators_are_in_the_allowlist(exported):
    allowed = {
        line.strip()
        for line in ALLOWLIST.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    out = exported.out
    ops = _ops([*_graph_paths(out).values(), *_graph_paths(out, FP16_FILES).values()])
    assert ops - allowed == set(), f"operators outside {ALLOWLIST.name}: {ops - allowed}"
    assert not ops & {"If", "Loop", "Scan", "ScatterElements", "ScatterND"}


def test_step_cache_is_the_token_prefix(exported, tmp_path):
    """The step carries no keys or values between steps, only each row's tokens (int64); the
    values it gathers by them from its table go straight into the attention's MatMul, and
    the attention's scores are gathered from the table of token pairs straight into its
    Softmax (no q . k), before and after ONNX Runtime's optimisations."""
    step = exported.out / GRAPH_FILES["decoder_step"]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(tmp_path / "step.opt.onnx")
    ort.InferenceSession(str(step), opts, providers=["CPUExecutionProvider"])
    for path in (step, tmp_path / "step.opt.onnx"):
        graph = onnx.load(str(path)).graph
        io = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output)}
        assert io["past_tokens"] == io["present_tokens"] == onnx.TensorProto.INT64
        assert not {"past_key", "past_value", "present_key", "present_value"} & set(io)
        cache = cache_tensors(graph)
        assert {"past_tokens", "present_tokens"} <= cache
        gathers = [n for n in graph.node if n.op_type == "Gather"]
        by_prefix = {out for n in gathers if n.input[1] in cache for out in n.output}
        users = [n.op_type for n in graph.node if set(n.input) & by_prefix]
        assert len(by_prefix) == 1 and users == ["MatMul"], path.name
        (scores,) = [n.output[0] for n in gathers if n.input[0] == "score_table"]
        moved = cache_tensors(graph, (scores,))
        users = {n.op_type for n in graph.node if set(n.input) & moved}
        assert "Softmax" in users and users <= {"Softmax", "Transpose", "Unsqueeze"}, path.name
        assert not {"k_table", "q_table"} & {i.name for i in graph.initializer}


# -- parity -----------------------------------------------------------------------------------
def test_parity_report_covers_four_shape_cases(exported):
    parity = exported.manifest.parity
    assert parity["passed"]
    cases = parity["float32"]["cases"]
    assert set(cases) == set(val.SHAPE_CASES) and len(cases) >= 4
    for case in cases.values():
        outputs = {key.split(".")[1] for key in case}
        assert outputs >= set(STEP_OUTPUTS)
        assert max(case.values()) <= val.FLOAT32_ATOL
    assert parity["decoding"]["beam4"]["identical"] == parity["decoding"]["beam4"]["visits"]
    f16 = parity["float16"]
    assert f16["passed"] and f16["max_abs_diff"] <= val.FLOAT16_ATOL
    assert f16["top1_agreement"] >= val.FLOAT16_MIN_TOP1


@pytest.mark.parametrize("case", list(val.SHAPE_CASES))
def test_parity_at_shape_case(exported, case):
    """Rerun one shape case directly: every output of every graph within FLOAT32_ATOL."""
    _, out, model, _, _ = exported
    graphs = val.Graphs.load(_graph_paths(out), threads=1)
    sizes, lengths = val.SHAPE_CASES[case]
    only = dict(val.SHAPE_CASES)
    val.SHAPE_CASES.clear()
    val.SHAPE_CASES[case] = (sizes, lengths)
    try:
        report = val.compare_outputs(model, graphs)
    finally:
        val.SHAPE_CASES.clear()
        val.SHAPE_CASES.update(only)
    assert report["max_abs_diff"] <= val.FLOAT32_ATOL, report["cases"][case]


def test_step_accepts_an_empty_cache(exported):
    """Exported with T = 2, run at T = 0 (the first step) and at T = 45, against the model's
    own KV-cached step fed the same prefix."""
    _, out, model, _, _ = exported
    graphs = val.Graphs.load(_graph_paths(out), threads=1)
    step = ReferenceStep(model)
    for t in (0, 45):
        inputs = example_inputs(model, Sizes(N=2, B=4, T=t))
        with torch.no_grad():
            ref = step(*(inputs[k] for k in STEP_INPUTS))
        got = graphs.run("decoder_step", {k: inputs[k].numpy() for k in STEP_INPUTS})
        assert got["present_tokens"].shape == (2, 4, t + 1)
        np.testing.assert_array_equal(got["present_tokens"], ref[-1].numpy())
        np.testing.assert_allclose(got["log_probs"], ref[0].numpy(), atol=val.FLOAT32_ATOL)


def test_beam4_and_greedy_lists_equal_torch_on_real_visits(exported, tiny300):
    """Beam-4 (and greedy) medication lists decoded through the ONNX graphs equal the torch
    reference on every visit of the tiny dataset (several hundred)."""
    _, out, model, vocab, _ = exported
    table = pq.read_table(tiny300[0] / "visits.parquet")
    patients = list(patients_from_table(table, vocab))
    graphs = val.Graphs.load(_graph_paths(out), threads=1)
    report = val.compare_decoding(model, graphs, vocab, patients)
    for beam in ("beam1", "beam4"):
        assert report[beam]["visits"] >= 200
        assert report[beam]["identical"] == report[beam]["visits"], report[beam]["mismatches"]
        assert report[beam]["max_score_diff"] < 1e-3


@pytest.mark.parametrize("ablation", ["no-diagnoses", "no-copy"])
def test_ablations_export_with_every_input(tmp_path, ablation):
    """An ablation that leaves graph inputs unused still exports them (same I/O for all)."""
    _, ckpt = make_tiny(tmp_path, ablation=ablation)
    manifest = export(ckpt, tmp_path / "model", ExportOptions(n_patients=16))
    assert manifest.parity["passed"] and manifest.ablation == ablation
    assert manifest.graph_spec("decoder_init").input_names == GRAPH_IO["decoder_init"][0]


def test_parity_failure_writes_report_and_no_manifest(tiny300, tmp_path, monkeypatch):
    monkeypatch.setattr(val, "FLOAT32_ATOL", 0.0)
    result = CliRunner().invoke(
        main, ["--checkpoint", str(tiny300[1]), "--out", str(tmp_path / "m")]
    )
    assert result.exit_code == 1
    assert "parity failed" in result.output and "Traceback" not in result.output
    report = json.loads((tmp_path / "m" / "parity_report.json").read_text())
    assert report["passed"] is False
    assert not (tmp_path / "m" / "manifest.json").exists()


# -- CLI --------------------------------------------------------------------------------------
def test_cli_help():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for option in ("--checkpoint", "--out", "--no-validate", "--fp16", "--tensorrt"):
        assert option in result.output


def test_cli_exports_without_validation(tiny300, tmp_path):
    result = CliRunner().invoke(
        main, ["--checkpoint", str(tiny300[1]), "--out", str(tmp_path / "m"), "--no-validate"]
    )
    assert result.exit_code == 0, result.output
    assert load_manifest(tmp_path / "m").parity is None


@pytest.mark.skipif(
    "TensorrtExecutionProvider" in ort.get_available_providers(),
    reason="TensorRT is installed here",
)
def test_cli_tensorrt_without_tensorrt_exits_2(tiny300, tmp_path):
    result = CliRunner().invoke(
        main, ["--checkpoint", str(tiny300[1]), "--out", str(tmp_path / "m"), "--tensorrt"]
    )
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "TensorRT" in result.output
    assert not (tmp_path / "m").exists()


def test_cli_missing_checkpoint_exits_2(tmp_path):
    result = CliRunner().invoke(
        main, ["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "m")]
    )
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "not a cognet checkpoint" in result.output


def test_cli_corrupt_checkpoint_exits_2(tiny300, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(tiny300[1], bad)
    (bad / "model.safetensors").write_bytes(b"garbage")
    result = CliRunner().invoke(main, ["--checkpoint", str(bad), "--out", str(tmp_path / "m")])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "model.safetensors: sha256 differs" in result.output


def test_api_bad_checkpoint_raises_input_error(tmp_path):
    with pytest.raises(InputError):
        export(tmp_path, tmp_path / "m")


def test_export_refused_after_corruption(exported, tmp_path):
    """The runtime-side check on a real export: a flipped byte in a graph is refused."""
    out = tmp_path / "m"
    shutil.copytree(exported.out, out)
    data = bytearray((out / "decoder_step.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "decoder_step.onnx").write_bytes(bytes(data))
    with pytest.raises(InputError, match="sha256 does not match"):
        load_manifest(out)


def test_float32_parity_compares_log_probs_above_the_floor():
    """A float32 rounding of a near-impossible medication's log-probability (a relative
    error of 1.25e-4 on p = 4e-5, as measured on a trained MIMIC-III network) does not fail
    the export; a probability that moves across the floor, or a NaN, still does."""
    ref = np.log(np.array([0.6, 0.3, 0.1 - 4e-5, 4e-5], np.float32))
    rounded = ref.copy()
    rounded[3] += 1.25e-4
    assert val.max_abs_diff(ref, rounded) > val.FLOAT32_ATOL  # raw: would fail
    assert val.max_abs_diff(val.floored(ref), val.floored(rounded)) == 0.0
    wrong = ref.copy()
    wrong[3] = np.log(np.float32(0.01))  # 4e-5 -> 0.01: a real error
    assert val.max_abs_diff(val.floored(ref), val.floored(wrong)) > 1.0
    close = ref.copy()
    close[1] += 2e-4  # above the floor, compared as before
    assert val.max_abs_diff(val.floored(ref), val.floored(close)) > val.FLOAT32_ATOL
    nan = ref.copy()
    nan[3] = np.nan
    assert val.max_abs_diff(val.floored(ref), val.floored(nan)) == float("inf")


class CountingBar:
    """A tqdm-like bar recording its description, total and count (`export`'s progress)."""

    def __init__(self, made: list, total=None, desc="", unit="it"):
        self.total, self.desc, self.n = total, desc, 0
        made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def __enter__(self):
        return self

    def __exit__(self, *_) -> None:
        pass


def test_export_of_a_set_model_checks_its_sets_and_shows_progress(tiny, tmp_path):
    """A model whose own decoding is set decoding has its sets compared with torch's, and
    the graphs written and the parity checks each move a bar to its end."""
    from tiny import with_set_decoding

    ckpt = with_set_decoding(tiny / "ckpt", tmp_path, "config.json")
    made: list[CountingBar] = []
    manifest = export(
        ckpt,
        tmp_path / "model",
        ExportOptions(n_patients=16),
        progress=lambda **kw: CountingBar(made, **kw),
    )
    assert [(b.desc, b.n == b.total) for b in made] == [
        ("writing graphs", True),
        ("parity check", True),
    ]
    sets = manifest.parity["sets"]
    assert sets["decoding"] == "set, 4 samples, threshold 0.3"
    assert sets["identical"] == sets["visits"] > 0
    result = CliRunner().invoke(main, ["--checkpoint", str(ckpt), "--out", str(tmp_path / "m2")])
    assert result.exit_code == 0, result.output
    assert "greedy lists identical" in result.output and "beam-4 lists identical" in result.output
    assert "sets of its decoding (set, 4 samples, threshold 0.3) identical" in result.output
