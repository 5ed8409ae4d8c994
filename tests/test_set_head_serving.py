"""The set head exported and served (`--decoding marginal`): its graph in the model directory
and the manifest, its parity with the torch head at several shapes, and the runtime's sets
against the torch reference's (what `cognet evaluate --decoding marginal` decodes)."""

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
from tiny import make_tiny, random_checkpoint

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError
from cognet.core.head_inputs import HEAD_INPUTS, HEAD_OUTPUT, patient_head_arrays
from cognet.core.history import patients_from_table
from cognet.core.manifest import Manifest, file_sha256, load_manifest
from cognet.export import ExportOptions, export
from cognet.export.graphs import HeadSizes, head_example
from cognet.export.validate import HEAD_ATOL, HEAD_CASES
from cognet.model import checkpoint
from cognet.model.torch_decoding import decode_patients
from cognet.runtime import ScoreOptions, Scorer
from cognet.runtime import scorer as scorer_module
from cognet.runtime.cli import main as batch_main

ALLOWLIST = Path(__file__).parents[1] / "export" / "onnx_ops_allowlist.txt"


class Headed(NamedTuple):
    data: Path
    ckpt: Path  # with a set head
    plain: Path  # the same networks, without a head
    model: Path  # `ckpt` exported (validated)
    plain_model: Path  # `plain` exported
    manifest: Manifest


@pytest.fixture(scope="module")
def headed(tmp_path_factory) -> Headed:
    """A tiny random model with a random set head, and the same model without it, exported."""
    root = tmp_path_factory.mktemp("headed")
    data, plain = make_tiny(root, n_patients=120)
    ckpt = random_checkpoint(data, root / "ckpt_head", head=True)
    manifest = export(ckpt, root / "model")
    export(plain, root / "plain_model", ExportOptions(validate=False))
    return Headed(data, ckpt, plain, root / "model", root / "plain_model", manifest)


@pytest.fixture(scope="module")
def head(headed):
    _, _, config = checkpoint.load(headed.ckpt)
    return checkpoint.load_head(headed.ckpt, config)


@pytest.fixture(scope="module")
def session(headed) -> ort.InferenceSession:
    return ort.InferenceSession(str(headed.model / "head.onnx"), providers=["CPUExecutionProvider"])


# -- export -------------------------------------------------------------------------------------
def test_export_lists_the_head_graph_in_the_manifest(headed, head):
    spec = load_manifest(headed.model).head
    assert spec == headed.manifest.head
    assert spec.file == "head.onnx"
    assert spec.sha256 == file_sha256(headed.model / "head.onnx")
    assert spec.input_names == HEAD_INPUTS and spec.output_names == (HEAD_OUTPUT,)
    shapes = {t.name: t.shape for t in (*spec.inputs, *spec.outputs)}
    assert shapes == {
        "diagnoses": ("N", "Ld"),
        "procedures": ("N", "Lp"),
        "last_meds": ("N", "Ll"),
        "past_meds": ("N", "Lh"),
        "has_history": ("N",),
        "marginals": ("N", head.cfg.n_med),
    }
    proto = onnx.load(str(headed.model / "head.onnx"))
    assert proto.opset_import[0].version == headed.manifest.opset == 18
    parity = headed.manifest.parity["head"]
    assert parity["passed"] and set(parity["cases"]) == set(HEAD_CASES)
    assert parity["max_abs_diff"] <= HEAD_ATOL


def test_head_operators_are_in_the_allowlist(headed):
    allowed = {
        line.strip() for line in ALLOWLIST.read_text().splitlines() if line and line[0] != "#"
    }
    ops = {n.op_type for n in onnx.load(str(headed.model / "head.onnx")).graph.node}
    assert ops <= allowed, ops - allowed
    assert ops <= set(headed.manifest.parity["ops"])


CASES = {
    "one_visit": (HeadSizes(N=1, Ld=6, Lp=3, Ll=5, Lh=9), 0.0),
    "one_first_visit": (HeadSizes(N=1, Ld=1, Lp=1, Ll=1, Lh=1), 1.0),
    "seven": (HeadSizes(N=7, Ld=9, Lp=4, Ll=6, Lh=15), 0.4),
    "sixty_four_long_lists": (HeadSizes(N=64, Ld=80, Lp=40, Ll=60, Lh=400), 0.25),
    "sixty_four_empty": (HeadSizes(N=64, Ld=1, Lp=1, Ll=1, Lh=1), 1.0),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_head_graph_matches_torch(head, session, case):
    """Long and empty code lists, visits with and without history: within HEAD_ATOL."""
    sizes, empty = CASES[case]
    inputs = head_example(head.cfg, sizes, seed=3, empty=empty)
    has, n = int(inputs["has_history"].sum()), sizes.N
    if empty == 1.0:  # every list empty, no history
        assert has == 0 and (inputs["diagnoses"] == head.cfg.n_diag).all()
    elif n > 1:  # visits with and without history, some lists empty
        assert 0 < has < n and (inputs["diagnoses"] == head.cfg.n_diag).all(1).any()
    with torch.no_grad():
        want = head(*(inputs[k] for k in HEAD_INPUTS)).numpy()
    (got,) = session.run([HEAD_OUTPUT], {k: inputs[k].numpy() for k in HEAD_INPUTS})
    assert got.shape == (sizes.N, head.cfg.n_med)
    assert np.abs(got - want).max() <= HEAD_ATOL


def test_head_graph_matches_torch_on_real_visits(headed, head, session):
    """The arrays of real visits (`patient_head_arrays`), histories included."""
    _, vocab, _ = checkpoint.load(headed.ckpt)
    patients = list(patients_from_table(pq.read_table(headed.data / "visits.parquet"), vocab))
    arrays = patient_head_arrays(patients, (vocab.n_diag, vocab.n_proc, vocab.n_med), vocab.n_med)
    assert 0 < arrays["has_history"].sum() < arrays["has_history"].size
    (got,) = session.run([HEAD_OUTPUT], arrays)
    assert np.abs(got - head.marginals(arrays)).max() <= HEAD_ATOL


def test_checkpoint_without_head_exports_as_before(headed):
    """No head.onnx, no `head` field; the rest of the manifest and every graph file are those
    of the same networks exported with a head."""
    plain = json.loads((headed.plain_model / "manifest.json").read_text())
    with_head = json.loads((headed.model / "manifest.json").read_text())
    assert not (headed.plain_model / "head.onnx").exists() and "head" not in plain
    assert load_manifest(headed.plain_model).head is None
    differ = {"head", "checkpoint_sha256", "parity"}  # parity: not run for `plain`
    assert {k: v for k, v in plain.items() if k not in differ} == {
        k: v for k, v in with_head.items() if k not in differ
    }
    assert set(with_head) - set(plain) == {"head"}


def test_reexport_without_head_removes_the_head_graph(headed, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(headed.model, out)
    export(headed.plain, out, ExportOptions(validate=False))
    assert not (out / "head.onnx").exists()
    assert load_manifest(out).head is None


def test_corrupted_head_graph_is_refused(headed, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(headed.model, out)
    with open(out / "head.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(InputError, match="head.onnx: sha256 does not match"):
        load_manifest(out)


def test_head_of_another_vocabulary_is_refused(headed, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(headed.model, out)
    obj = json.loads((out / "manifest.json").read_text())
    obj["head"]["outputs"][0]["shape"] = ["N", 3]
    (out / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(InputError, match="field 'head.outputs'"):
        load_manifest(out)


# -- serving ------------------------------------------------------------------------------------
REQUESTS = {
    "jaccard": DecodingRequest(decoding="marginal"),
    "threshold": DecodingRequest(decoding="marginal", threshold=0.4),
    "hard": DecodingRequest(decoding="marginal", ddi=DDIPolicy("hard")),
    "max-rate": DecodingRequest(decoding="marginal", ddi=DDIPolicy("off", max_rate=0.05)),
    "pair-price": DecodingRequest(decoding="marginal", ddi=DDIPolicy("off", pair_price=0.2)),
}


@pytest.mark.parametrize("name", list(REQUESTS), ids=list(REQUESTS))
def test_runtime_marginal_sets_equal_torch(headed, head, name):
    """The runtime's sets, probabilities and PRAUC scores against the torch reference's
    (`decode_patients`, what `cognet evaluate --decoding marginal` runs) on every visit."""
    model, vocab, config = checkpoint.load(headed.ckpt)
    table = pq.read_table(headed.data / "visits.parquet")
    patients = list(patients_from_table(table, vocab))
    request = REQUESTS[name]
    decoding, ddi = request.resolve(Scorer(headed.model, ScoreOptions.of(device="cpu")).decoding)
    want = decode_patients(
        model, vocab, patients, DecodingPlan(decoding, vocab.end, ddi=ddi), head=head
    )
    with Scorer(headed.model, ScoreOptions.of(request=request, device="cpu", threads=1)) as scorer:
        assert scorer.decoding == decoding and scorer.ddi == ddi
        chunks = list(scorer.score_table(table, score_all=True))
    rows = {r["visit_id"]: r for c in chunks for r in c.recommendations.to_pylist()}
    visits = [v for p in patients for v in p]
    assert len(rows) == len(visits) > 300
    same = 0
    for v, w in zip(visits, want, strict=True):
        got = rows[v.visit_id]
        meds = tuple(vocab.medications[m] for m in w.meds)
        same += tuple(got["medications"]) == meds
        if tuple(got["medications"]) == meds:
            np.testing.assert_allclose(got["probabilities"], w.med_probs, atol=HEAD_ATOL)
            assert got["score"] == pytest.approx(w.score, abs=HEAD_ATOL)
    assert same / len(visits) >= 0.995, f"{same} of {len(visits)} sets equal"
    assert any(len(r["medications"]) for r in rows.values())


def test_marginal_scoring_runs_no_encoder_nor_decoder(headed, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("an encoder or decoder graph ran")

    table = pq.read_table(headed.data / "visits.parquet")
    with Scorer(
        headed.model, ScoreOptions.of(decoding="marginal", device="cpu", threads=1)
    ) as scorer:
        monkeypatch.setattr(scorer_module, "encode_plan", boom)
        monkeypatch.setattr(scorer.decoder, "init", boom)
        monkeypatch.setattr(scorer.decoder, "step", boom)
        chunks = list(scorer.score_table(table, score_all=True))
    assert sum(c.rows_scored for c in chunks) == len(table)
    assert sum(c.visits_evaluated for c in chunks) == len(table)


def test_a_gpus_path_calls_the_head_in_its_budget_and_reads_the_same_rows(headed, monkeypatch):
    """The GPU's call sizes (here on the CPU provider, its code path): far fewer calls than
    the CPU's budget makes (a small one here), the same rows but for float rounding."""
    from cognet.runtime import head as head_module
    from cognet.runtime.scoring_model import open_model

    monkeypatch.setattr(head_module, "HEAD_BATCH", 16)
    calls = {}
    real = head_module.HeadSession.marginals

    def counted(self, plan, part):
        calls[self.budget] = calls.get(self.budget, 0) + 1
        return real(self, plan, part)

    monkeypatch.setattr(head_module.HeadSession, "marginals", counted)
    table = pq.read_table(headed.data / "visits.parquet")
    options = ScoreOptions.of(decoding="marginal", device="cpu", threads=1)
    rows = {}
    for gpu_path in (False, True):
        with Scorer(open_model(headed.model, options, gpu_path), options) as scorer:
            rows[gpu_path] = [
                r
                for c in scorer.score_table(table, score_all=True)
                for r in c.recommendations.to_pylist()
            ]
    assert len(rows[True]) == len(rows[False]) == len(table)
    same = 0
    for a, b in zip(rows[False], rows[True], strict=True):
        assert a["visit_id"] == b["visit_id"]
        same += a["medications"] == b["medications"]
        if a["medications"] == b["medications"]:  # another call's padding: float rounding
            np.testing.assert_allclose(a["probabilities"], b["probabilities"], atol=HEAD_ATOL)
    assert same / len(table) >= 0.995, f"{same} of {len(table)} sets equal"
    gpu = (head_module.GPU_HEAD_BATCH, head_module.GPU_HEAD_CELLS)
    assert calls[(16, head_module.HEAD_CELLS)] >= len(table) // 16 > calls[gpu] >= 1


def test_the_one_pass_reports_the_providers_of_the_head_graph(headed):
    """onnxruntime falls back to the CPU silently: the marginal decoding's providers are
    read back from the head's session, the only graph it runs."""
    from cognet.runtime.scoring_model import open_model

    class Fallen:  # a head session that did not get the provider asked for
        def __init__(self, session):
            self.session = session

        def get_providers(self):
            return ["FallenBackExecutionProvider"]

        def __getattr__(self, name):
            return getattr(self.session, name)

    for decoding, want in (
        ("marginal", ["FallenBackExecutionProvider"]),
        ("beam", ["CPUExecutionProvider"]),
    ):
        options = ScoreOptions.of(decoding=decoding, device="cpu", threads=1)
        model = open_model(headed.model, options)
        model.head.session = Fallen(model.head.session)
        assert Scorer(model, options).providers == want


def test_marginal_explanations_come_from_set_decoding(headed):
    """The sets are the head's; each medication's copy share and source come from the set
    decoding's samples of the visit, null where they never emitted it."""
    table = pq.read_table(headed.data / "visits.parquet")
    with Scorer(
        headed.model, ScoreOptions.of(decoding="marginal", device="cpu", threads=1)
    ) as scorer:
        plain, explained = (
            [r for c in scorer.score_table(table, **kw) for r in c.recommendations.to_pylist()]
            for kw in ({"score_all": True}, {"score_all": True, "explain": True})
        )
    rows = table.to_pylist()
    earlier = {
        r["visit_id"]: {q["visit_id"] for q in rows if q["patient_id"] == r["patient_id"]}
        for r in rows
    }
    nulls = shares = 0
    for p, e in zip(plain, explained, strict=True):
        assert p["medications"] == e["medications"] and p["probabilities"] == e["probabilities"]
        for ex in e["explanations"]:
            if ex["copy_share"] is None:
                nulls += 1
                assert ex["source_visit"] is None and ex["top_diagnoses"] is None
                continue
            shares += 1
            assert 0.0 <= ex["copy_share"] <= 1.0
            assert ex["source_visit"] is None or ex["source_visit"] in earlier[e["visit_id"]]
    assert len(explained) == len(table)
    assert shares > 0 and nulls > 0  # the head's sets hold medications no sample emitted


def test_model_without_head_marginal_exits_2(headed, tmp_path):
    visits = headed.data / "visits.parquet"
    out = tmp_path / "recs.parquet"
    args = ["score", str(visits), "--model", str(headed.plain_model), "--out", str(out)]
    result = CliRunner().invoke(batch_main, [*args, "--decoding", "marginal"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(headed.plain_model) in lines[0] and "set head" in lines[0]


@pytest.mark.parametrize(
    "extra", [["--samples", "4"], ["--beam", "2"], ["--ddi-mode", "soft"]], ids=str
)
def test_step_options_with_marginal_exit_2(headed, tmp_path, extra):
    visits = headed.data / "visits.parquet"
    args = ["score", str(visits), "--model", str(headed.model), "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(batch_main, [*args, "--decoding", "marginal", *extra])
    assert result.exit_code == 2, result.output
    assert "--decoding marginal" in result.output


def test_cli_scores_with_the_head(headed, tmp_path):
    visits = headed.data / "visits.parquet"
    out, summary = tmp_path / "recs.parquet", tmp_path / "summary.json"
    args = ["score", str(visits), "--model", str(headed.model), "--out", str(out), "--all"]
    args += ["--decoding", "marginal", "--summary-json", str(summary), "--quiet"]
    result = CliRunner().invoke(batch_main, args)
    assert result.exit_code == 0, result.output
    got = json.loads(summary.read_text())
    assert got["decoding"]["name"] == "marginal"
    assert got["rows_scored"] == pq.read_table(visits).num_rows == pq.read_table(out).num_rows


def test_cli_explain_says_where_the_explanation_comes_from(headed):
    visits = headed.data / "visits.parquet"
    table = pq.read_table(visits).to_pylist()
    vid = next(r["visit_id"] for r in table if r["visit_seq"] == 2)
    args = ["explain", str(visits), "--model", str(headed.model), "--visit-id", vid]
    text = CliRunner().invoke(batch_main, [*args, "--decoding", "marginal"])
    assert text.exit_code == 0, text.output
    assert "explained by: set decoding" in text.output
    assert "marginal (set head, one pass)" in text.output
    obj = json.loads(
        CliRunner().invoke(batch_main, [*args, "--decoding", "marginal", "--json"]).output
    )
    assert obj["explained_by"] == "set decoding"
    beam = json.loads(CliRunner().invoke(batch_main, [*args, "--json"]).output)
    assert beam["explained_by"] is None


def test_model_without_head_scores_as_before(headed):
    """A model directory written without a head loads and scores as one with it does (beam
    and set decoding do not read the head)."""
    table = pq.read_table(headed.data / "visits.parquet")
    results = []
    for model in (headed.plain_model, headed.model):
        for decoding in ({"beam": 2}, {"decoding": "set", "set_rule": "jaccard", "samples": 4}):
            with Scorer(model, ScoreOptions.of(device="cpu", threads=1, **decoding)) as scorer:
                chunks = list(scorer.score_table(table, score_all=True))
            results.append([c.recommendations for c in chunks])
    assert results[0] == results[2] and results[1] == results[3]


# -- cognet-bench ------------------------------------------------------------------------------
# the runs alone: no series, trade-off nor profile (minutes on a busy machine)
NO_SERIES = ["--past-visits", "", "--input-sizes", "", "--batch-sizes", "8"]
NO_SERIES += ["--no-ddi-tradeoff", "--no-profile"]


def test_bench_runs_the_marginal_decoding(headed, tmp_path):
    """`--beams marginal`: the runtime (the head's graph alone) against torch-batched (the
    checkpoint's head) within the set decodings' tolerance, labelled "marginal"."""
    from cognet.benchmarks import engines as eng
    from cognet.benchmarks.cli import main as bench_main

    out = tmp_path / "bench"
    args = ["--quick", "--model", str(headed.model), "--checkpoint", str(headed.ckpt)]
    args += ["--data", str(headed.data), "--out", str(out), "--beams", "marginal"]
    args += ["--engines", "torch-batched,ort-cpu", *NO_SERIES]
    result = CliRunner().invoke(bench_main, args)
    assert result.exit_code == 0, result.output
    runs = json.loads((out / "results.json").read_text())["runs"]
    marginal = [r for r in runs if r["beam"] == eng.MARGINAL]
    assert {r["engine"] for r in marginal} == {"torch-batched", "ort-cpu"}
    assert all(r["matches_reference"] for r in marginal), marginal
    assert eng.decoding_label(eng.MARGINAL) == "marginal"
    assert "marginal" in (out / "results.md").read_text()


def test_bench_skips_the_marginal_decoding_of_a_model_without_head(headed, tmp_path):
    from cognet.benchmarks.cli import main as bench_main

    out = tmp_path / "bench"
    args = ["--quick", "--model", str(headed.plain_model), "--data", str(headed.data)]
    args += ["--out", str(out), "--beams", "1,marginal", "--engines", "ort-cpu", *NO_SERIES]
    result = CliRunner().invoke(bench_main, args)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert {r["beam"] for r in results["runs"]} == {1}
    assert "marginal decoding skipped: the model has no set head" in results["notes"]


def test_bench_engine_options_of_the_marginal_decoding():
    from cognet.benchmarks import engines as eng

    engine = object.__new__(eng.OrtEngine)  # its options only: no model loaded
    engine.device, engine.threads, engine.selection = "cpu", 1, "auto"
    engine.variant, engine.streams = None, None
    assert engine.options(eng.MARGINAL, 256).request.decoding == "marginal"


def test_evaluate_names_the_marginal_decoding():
    from cognet.core.decoding import Decoding
    from cognet.evaluation.evaluate import model_name

    name = model_name(Decoding("marginal", head_threshold=0.4, head_rule="threshold"))
    assert name == "COGNet (marginal (set head, one pass), threshold 0.4)"
    assert model_name(Decoding("beam", beam=4)) == "COGNet (beam 4)"
