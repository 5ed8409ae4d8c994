"""An ensemble checkpoint served by the exported side: `cognet-export` writes one model
directory with every member's graphs (validated member by member, and the ensemble's lists
against torch's), `cognet-batch score` / `Scorer` return the torch `Ensemble`'s lists
(beam search and set decoding, host and search-graph selection, several batch sizes, with
and without history), explanations and `--all` metrics work, a bad `members` is refused,
one-network models are as before, and the benchmark engines run an ensemble."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from tiny import as_targets, make_tiny, random_checkpoint

from cognet.core import metrics
from cognet.core.ddi import ddi_matrix
from cognet.core.decoding import Decoding
from cognet.core.decoding.ensemble import EnsembleSession
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.graphspec import MIX_GRAPH
from cognet.core.history import patients_from_table
from cognet.core.manifest import GRAPHS, load_manifest
from cognet.core.metrics import visit_results
from cognet.export.cli import main as export_main
from cognet.model import checkpoint
from cognet.model.batching import make_batch
from cognet.model.ensemble import Ensemble
from cognet.model.torch_decoding import beam_search, decode_patients
from cognet.runtime import ScoreOptions, Scorer
from cognet.runtime.cli import main as batch_main
from cognet.runtime.encoder import Encoder, EnsembleEncoder
from cognet.runtime.session import HostDecoder

torch.set_num_threads(1)

SET = {"decoding": "set", "samples": 8, "threshold": 0.3}  # the runtime's options
DECODINGS = {
    "beam": (Decoding(beam=4), {"decoding": "beam", "beam": 4}),
    "set": (Decoding(name="set", samples=8, threshold=0.3), SET),
}


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory) -> Path:
    """A folder with `data/`, `ens/` (a checkpoint of two random networks of the tiny
    dataset, whose own decoding is set decoding) and `model/`, its export by
    `cognet-export` (validated)."""
    root = tmp_path_factory.mktemp("ensemble")
    data, first = make_tiny(root, n_patients=40)
    second = random_checkpoint(data, root / "second", seed=1)
    (a, vocab, config), (b, _, _) = checkpoint.load(first), checkpoint.load(second)
    graphs = np.load(first / "graphs.npz")
    pairs = [tuple(p) for p in config["ddi_pairs"]]
    ckpt = root / "ens"
    nets = Ensemble([a, b])
    own = DECODINGS["set"][0].to_json()  # its own decoding: set decoding, as a trained one's
    both = checkpoint.Graphs(graphs["ehr"], graphs["ddi"], pairs)
    checkpoint.save(ckpt, nets, vocab, both, {}, checkpoint.Tuned(decoding=own))
    result = CliRunner().invoke(
        export_main, ["--checkpoint", str(ckpt), "--out", str(root / "model")]
    )
    assert result.exit_code == 0, result.output
    assert "beam-4 lists identical" in result.output
    return root


def _visits(root: Path, history: bool) -> pa.Table:
    """Every visit (each scored with its earlier visits as history), or only the first
    visit of each patient (no history)."""
    table = pq.read_table(root / "data" / "visits.parquet")
    return table if history else table.filter(pc.equal(table["visit_seq"], 0))


def _torch_lists(model, vocab, table: pa.Table, decoding: Decoding) -> dict:
    patients = list(patients_from_table(table, vocab))
    decoded = decode_patients(model, vocab, patients, DecodingPlan(decoding, vocab.end))
    flat = [v for p in patients for v in p]
    return {v.visit_id: d for v, d in zip(flat, decoded, strict=True)}


def _scored(scorer: Scorer, table: pa.Table, **kwargs):
    chunks = list(scorer.score_table(table, score_all=True, **kwargs))
    return chunks, pa.concat_tables([c.recommendations for c in chunks])


def test_export_writes_and_validates_every_member(ensemble):
    manifest = load_manifest(ensemble / "model")
    assert manifest.members == 2 and len(manifest.member_graphs) == 1
    for name, spec in manifest.member_graphs[0].graphs.items():
        assert spec.file == f"{name}.member1.onnx"
        assert spec.sha256 != manifest.graphs[name].sha256  # another network's weights
    parity = manifest.parity
    assert parity["passed"] and len(parity["float32"]["members"]) == 2
    assert all(m["max_abs_diff"] <= 1e-4 for m in parity["float32"]["members"])
    beam4 = parity["decoding"]["beam4"]
    assert beam4["identical"] == beam4["visits"] >= 64  # 64 patients' visits
    assert manifest.search[MIX_GRAPH].inputs[1].name == "log_probs_1"  # the mixture of both


def test_the_ensemble_is_not_one_of_its_members(ensemble):
    """The parity below could not pass with one member's lists."""
    model, vocab, _ = checkpoint.load(ensemble / "ens")
    assert isinstance(model, Ensemble)
    table = _visits(ensemble, history=True)
    for decoding, _ in DECODINGS.values():
        both = _torch_lists(model, vocab, table, decoding)
        for member in model.members:
            alone = _torch_lists(member, vocab, table, decoding)
            assert sum(alone[k].meds != both[k].meds for k in both) > 5


@pytest.mark.parametrize("history", [True, False], ids=["history", "first-visits"])
@pytest.mark.parametrize("batch_size", [1, 3, 64])
@pytest.mark.parametrize("name", list(DECODINGS))
def test_runtime_equals_torch_ensemble(ensemble, name, batch_size, history):
    decoding, options = DECODINGS[name]
    model, vocab, config = checkpoint.load(ensemble / "ens")
    table = _visits(ensemble, history)
    ref = _torch_lists(model, vocab, table, decoding)
    scorer = Scorer(
        ensemble / "model", ScoreOptions.of(device="cpu", batch_size=batch_size, **options)
    )
    assert isinstance(scorer.decoder, EnsembleSession) and len(scorer.decoder.members) == 2
    chunks, out = _scored(scorer, table)
    assert out.num_rows == len(ref) > (100 if history else 30)
    rows = out.to_pylist()
    same = sum(r["medications"] == vocab.med_codes(ref[r["visit_id"]].meds) for r in rows)
    if name == "beam":
        assert same == len(rows)
        for r in rows:
            assert r["score"] == pytest.approx(ref[r["visit_id"]].score, abs=1e-4)
            probs = ref[r["visit_id"]].med_probs
            np.testing.assert_allclose(r["probabilities"], probs, rtol=1e-4, atol=1e-6)
        # --all: the metrics of torch's lists (PRAUC from the mixture's scores)
        patients = list(patients_from_table(table, vocab))
        decoded = [ref[v.visit_id] for p in patients for v in p]
        want = metrics.bootstrap_report(
            visit_results(patients, decoded), ddi_matrix(vocab, config["ddi_pairs"])
        )
        got = metrics.report(
            # the block of all visits, before those of first and later visits
            np.concatenate([c.patient_metrics for c in chunks])[:, : len(metrics.PATIENT_COLUMNS)],
            sum(c.visits_evaluated for c in chunks),
        )
        for key in metrics.METRICS:
            assert got[key]["mean"] == pytest.approx(want[key]["mean"], abs=1e-6)
    else:  # the set decoding's guard: float ties of P(k in S) aside
        assert same / len(rows) >= 0.995


@pytest.mark.parametrize("name", list(DECODINGS))
@pytest.mark.parametrize("path", ["device-selection", "gpu-path"])
def test_search_graphs_decode_the_ensemble_like_torch(ensemble, name, path):
    """Each member's set decoding in the search graphs (its own draws), and what a GPU runs
    (device bindings, encodings gathered by init_gather) on the CPU provider."""
    from cognet.runtime.scoring_model import open_model

    decoding, options = DECODINGS[name]
    model, vocab, _ = checkpoint.load(ensemble / "ens")
    table = _visits(ensemble, history=True)
    ref = _torch_lists(model, vocab, table, decoding)
    opts = ScoreOptions.of(device="cpu", threads=1, batch_size=16, **options)
    if path == "gpu-path":
        scorer = Scorer(open_model(ensemble / "model", opts, gpu_path=True), opts)
        assert scorer.encode.search is not None  # every member's encodings gathered there
    else:
        scorer = Scorer(ensemble / "model", opts.with_fields(selection="device"))
    assert scorer.decoding_plan.on_device
    # beam search selects in the graphs too: the members' steps mixed by the mixture graph
    assert scorer.decoder.search is not None
    # every visit a target of its own patient: without --all, whose beam search PRAUC
    # scores are the host path's
    out = pa.concat_tables([c.recommendations for c in scorer.score_table(as_targets(table))])
    rows = out.to_pylist()
    same = sum(r["medications"] == vocab.med_codes(ref[r["visit_id"]].meds) for r in rows)
    assert len(rows) > 30 and same / len(rows) >= (1.0 if name == "beam" else 0.995)


@pytest.mark.parametrize("name", list(DECODINGS))
def test_explanations_of_an_ensemble(ensemble, name):
    _, options = DECODINGS[name]
    table = _visits(ensemble, history=True)
    scorer = Scorer(ensemble / "model", ScoreOptions.of(device="cpu", **options))
    _, out = _scored(scorer, table, explain=True)
    rows = table.to_pylist()
    earlier = {
        row["visit_id"]: {
            r["visit_id"]
            for r in rows
            if r["patient_id"] == row["patient_id"] and r["visit_seq"] < row["visit_seq"]
        }
        for row in rows
    }
    copied = 0
    for row in out.to_pylist():
        assert len(row["explanations"]) == len(row["medications"])
        for e in row["explanations"]:
            assert 0.0 <= e["copy_share"] <= 1.0 + 1e-6
            if e["source_visit"] is not None:
                assert e["source_visit"] in earlier[row["visit_id"]]
                copied += 1
            assert e["top_diagnoses"] is None or all(d["weight"] >= 0 for d in e["top_diagnoses"])
    assert copied > 10


def test_cognet_explain_opens_an_ensemble(ensemble):
    from cognet.runtime.explain_visit import explain_visit

    table = _visits(ensemble, history=True)
    later = [r["visit_id"] for r in table.to_pylist() if r["visit_seq"] >= 2]
    got = explain_visit(
        Scorer(ensemble / "model", ScoreOptions.of(device="cpu")),
        ensemble / "data" / "visits.parquet",
        later[0],
    )
    assert got.history and got.steps
    assert all(0.0 <= s.probability <= 1.0 for s in got.steps)


def _manifest_with(model: Path, where: Path, **fields) -> Path:
    out = where / "model"
    shutil.copytree(model, out)
    data = json.loads((out / "manifest.json").read_text())
    data.update(fields)
    (out / "manifest.json").write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(
    "members,named",
    [
        (0, "'members'"),
        (17, "'members'"),
        ("2", "'members'"),
        (True, "'members'"),
        (2.0, "'members'"),
        (None, "'members'"),
        (3, "'member_graphs'"),
        (1, "'member_graphs'"),
    ],
)
def test_a_bad_members_value_exits_2_naming_the_file(ensemble, tmp_path, members, named):
    model = _manifest_with(ensemble / "model", tmp_path, members=members)
    out = tmp_path / "recs.parquet"
    visits = ensemble / "data" / "visits.parquet"
    args = ["score", str(visits), "--model", str(model), "--out", str(out), "--quiet"]
    result = CliRunner().invoke(batch_main, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert str(model / "manifest.json") in lines[0] and named in lines[0]
    assert not out.exists()


def test_an_ensemble_has_its_own_format_version(ensemble, tmp_path):
    """Version 2 for an ensemble's manifest, so that a runtime from before ensembles refuses
    it instead of serving member 0 alone; a manifest without members keeps version 1."""
    from cognet.core.errors import InputError

    assert json.loads((ensemble / "model" / "manifest.json").read_text())["format_version"] == 2
    old = _manifest_with(ensemble / "model", tmp_path / "old", format_version=1)
    with pytest.raises(InputError, match=r"version 1 \(expected 2 for an ensemble\)"):
        load_manifest(old, verify=False)
    bare = _manifest_with(ensemble / "model", tmp_path / "bare")
    data = json.loads((bare / "manifest.json").read_text())
    del data["members"], data["member_graphs"]
    (bare / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"version 2 \(expected 1\)"):
        load_manifest(bare, verify=False)


def test_a_missing_or_odd_member_is_refused(ensemble, tmp_path):
    from cognet.core.errors import InputError

    model = _manifest_with(ensemble / "model", tmp_path)
    (model / "decoder_step.member1.onnx").unlink()
    with pytest.raises(InputError, match=r"decoder_step\.member1\.onnx: graph file missing"):
        load_manifest(model)
    data = json.loads((model / "manifest.json").read_text())
    graphs = data["member_graphs"][0]["graphs"]
    data["member_graphs"][0]["variants"] = {"fp16": {g: graphs[g] for g in GRAPHS}}
    (model / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"'member_graphs\.1\.variants'"):
        load_manifest(model, verify=False)


def test_one_network_models_are_as_before(tiny):
    """No ensemble field in a one-network manifest, no member file, the plain sessions."""
    data = json.loads((tiny / "model" / "manifest.json").read_text())
    assert "members" not in data and "member_graphs" not in data
    assert not [p for p in (tiny / "model").iterdir() if "member" in p.name]
    assert load_manifest(tiny / "model").members == 1
    scorer = Scorer(tiny / "model", ScoreOptions.of(device="cpu"))
    assert isinstance(scorer.decoder, HostDecoder) and isinstance(scorer.encode, Encoder)


def test_benchmark_engines_run_an_ensemble(ensemble):
    from cognet.benchmarks import engines
    from cognet.benchmarks.workload import Pool

    ckpt, model_dir = ensemble / "ens", ensemble / "model"
    assert "ensemble" in engines.availability("torch-perpatient", ckpt)
    assert engines.availability("torch-batched", ckpt) is None
    vocab = load_manifest(model_dir).vocabulary()
    batch = Pool(pq.read_table(ensemble / "data" / "visits.parquet"), vocab).batch(0, 30)
    reference = engines.load("torch-batched", model_dir, ckpt, 1)
    ort = engines.load("ort-cpu", model_dir, None, 1)
    assert isinstance(ort.scorer.encode, EnsembleEncoder)
    for beam in (4, engines.SET):
        for engine in (reference, ort):
            engine.prepare(beam, 64)
        want = reference.recommendations(batch, reference.run(batch))
        got = ort.recommendations(batch, ort.run(batch))
        assert got == want and len(got) == 30
    # the guard's tie check scores a list under the mixture, as beam search scored it
    reference.prepare(4, 64)
    lists = reference.recommendations(batch, reference.run(batch))
    scored = reference.list_scores(batch.patients, [lists[v] for v in batch.visit_ids])
    last = torch.tensor(np.cumsum([len(p) for p in batch.patients]) - 1)
    tensors = make_batch(batch.patients, vocab, targets=False)
    decoded = beam_search(reference.model, tensors, beam=4, rows=last)
    assert scored == pytest.approx([d.score for d in decoded], abs=1e-4)
