"""DDI-aware decoding: the runtime (numpy beam search over ONNX) equals the torch reference
for hard, soft and max-rate policies; hard never recommends an interacting pair; the
trade-off report, the CLI options and `cognet-batch explain`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from beam_oracle import beam_search as torch_beam_search
from click.testing import CliRunner
from tiny import make_case, random_checkpoint

from cognet.cli import main as cognet_main
from cognet.core.ddi import RECOMMENDED_PENALTY, DDIPolicy, ddi_matrix, policy_from_options
from cognet.core.decoding import Decoding
from cognet.core.decoding.beam import BeamConfig, beam_search, ddi_rates
from cognet.core.decoding.driver import Visits
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.decoding.request import DecodingRequest
from cognet.core.graphspec import INIT_INPUTS
from cognet.core.history import patients_from_table
from cognet.evaluation import ddi_tradeoff
from cognet.evaluation.evaluate import EvalOptions, run_evaluation
from cognet.model import checkpoint
from cognet.model.batching import make_batch
from cognet.model.network import history_inputs
from cognet.model.session import TorchSession
from cognet.model.torch_decoding import decode_patients
from cognet.runtime import ScoreOptions, Scorer
from cognet.runtime.cli import main as batch_main

torch.set_num_threads(1)

POLICIES = [
    DDIPolicy("hard"),
    DDIPolicy("soft", 0.5),
    DDIPolicy("soft", 2.0),
    DDIPolicy("off", max_rate=0.1),
    DDIPolicy("soft", 1.0, max_rate=0.0),
]
IDS = [p.label for p in POLICIES]


def test_policy_from_options():
    assert policy_from_options() == DDIPolicy()
    assert policy_from_options("soft") == DDIPolicy("soft", RECOMMENDED_PENALTY)
    assert policy_from_options("soft", 2.0, 0.1) == DDIPolicy("soft", 2.0, 0.1)
    assert policy_from_options("hard", max_rate=0.0).label == "hard, max-rate 0"
    with pytest.raises(ValueError, match="soft only"):
        policy_from_options("hard", 1.0)
    with pytest.raises(ValueError):
        DDIPolicy("soft", -1.0)
    with pytest.raises(ValueError):
        DDIPolicy(max_rate=1.5)


# -- the numpy driver on the torch graphs: bit-identical to the reference --------------------------


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
@pytest.mark.parametrize("compact_at", [1.0, 0.5])
def test_driver_equals_torch_reference(policy, compact_at):
    model, vocab, patients = make_case(seed=7, n_patients=20)
    batch = make_batch(patients, vocab, targets=False)
    ref = torch_beam_search(model, batch, beam=4, ddi=policy)
    with torch.no_grad():
        enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
        inputs = history_inputs(batch, *enc, model.cfg)
    session = TorchSession(model)
    memories = session.init({k: v.numpy() for k, v in zip(INIT_INPUTS, inputs, strict=True)})
    adj = (model.ddi_gcn.adj > 0).numpy() & ~np.eye(vocab.n_med, dtype=bool)
    cfg = BeamConfig(end=vocab.end, compact_at=compact_at, ddi=policy)
    ours = beam_search(session, memories, cfg, Visits(len(ref), prauc=True, ddi_adj=adj))
    for i, r in enumerate(ref):
        assert tuple(ours.meds[i].tolist()) == r.meds
        assert ours.score[i] == np.float32(r.score)
        np.testing.assert_allclose(ours.med_probs[i], r.med_probs, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(ours.prauc_scores[i], r.scores, rtol=1e-4, atol=1e-6)


def test_an_active_policy_needs_the_adjacency():
    model, vocab, patients = make_case(seed=1, n_patients=2)
    session = TorchSession(model)
    with pytest.raises(ValueError, match="adjacency"):
        beam_search(session, None, BeamConfig(end=vocab.end, ddi=DDIPolicy("hard")), Visits(2))


# -- ONNX runtime vs torch reference on >= 200 visits ---------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny):
    model, vocab, config = checkpoint.load(tiny / "ckpt")
    visits = pq.read_table(tiny / "data" / "visits.parquet")
    patients = list(patients_from_table(visits, vocab))
    flat = [v.visit_id for p in patients for v in p]
    adj = ddi_matrix(vocab, config["ddi_pairs"])
    off = dict(
        zip(
            flat,
            decode_patients(model, vocab, patients, DecodingPlan(Decoding(beam=4), vocab.end)),
            strict=True,
        )
    )
    return {
        "model": model,
        "vocab": vocab,
        "visits": visits,
        "patients": patients,
        "flat": flat,
        "adj": adj,
        "off": off,
    }


def _rate(adj: np.ndarray, meds) -> float:
    used = np.zeros(adj.shape[0], bool)
    used[list(meds)] = True
    return float(ddi_rates(used, adj.astype(np.float32)))


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_onnx_runtime_equals_torch_reference(tiny, reference, policy):
    vocab, adj = reference["vocab"], reference["adj"]
    plan = DecodingPlan(Decoding(beam=4), vocab.end, ddi=policy)
    decoded = decode_patients(reference["model"], vocab, reference["patients"], plan)
    ref = dict(zip(reference["flat"], decoded, strict=True))
    scorer = Scorer(
        tiny / "model", ScoreOptions.of(device="cpu", batch_size=64, threads=1, ddi=policy)
    )
    out = [
        row
        for c in scorer.score_table(reference["visits"], score_all=True)
        for row in c.recommendations.to_pylist()
    ]
    assert len(out) == len(ref) >= 200
    changed, rates = 0, []
    for row in out:
        r = ref[row["visit_id"]]
        assert row["medications"] == vocab.med_codes(r.meds)
        assert row["score"] == pytest.approx(r.score, abs=1e-4)
        np.testing.assert_allclose(row["probabilities"], r.med_probs, rtol=1e-4, atol=1e-6)
        changed += r.meds != reference["off"][row["visit_id"]].meds
        rates.append(_rate(adj, r.meds))
        if policy.mode == "hard":
            assert rates[-1] == 0.0
    assert changed >= 20  # the policy is not a no-op on this model
    off_rate = np.mean([_rate(adj, d.meds) for d in reference["off"].values()])
    assert off_rate > 0.05 and np.mean(rates) < off_rate


# -- evaluate and the trade-off on a synthetic split (cognet.data.synth) ---------------------------


@pytest.fixture(scope="module")
def synth_ckpt(tiny_dataset, tmp_path_factory) -> Path:
    return random_checkpoint(tiny_dataset, tmp_path_factory.mktemp("synth") / "ckpt")


def test_hard_gives_ddi_rate_zero_on_the_synthetic_test_split(tiny_dataset, synth_ckpt):
    off = run_evaluation(synth_ckpt, tiny_dataset, EvalOptions(rounds=2))["report"]
    hard = run_evaluation(
        synth_ckpt,
        tiny_dataset,
        EvalOptions(request=DecodingRequest(ddi=DDIPolicy("hard")), rounds=2),
    )
    assert off["ddi"]["mean"] > 0
    assert hard["report"]["ddi"] == {"mean": 0.0, "std": 0.0}
    assert hard["report"]["ddi_policy"]["mode"] == "hard"
    assert "DDI hard" in hard["table"]


def test_tradeoff_rows_table_and_plot(tiny_dataset, synth_ckpt, tmp_path):
    policy_list = ddi_tradeoff.policies(penalties=(1.0, 8.0), max_rates=(0.0,))
    result = ddi_tradeoff.run_tradeoff(synth_ckpt, tiny_dataset, EvalOptions(rounds=2), policy_list)
    labels = [r.policy.label for r in result.rows]
    assert labels == ["off", "hard", "soft 1", "soft 8", "off, max-rate 0"]
    by = {r.policy.label: r for r in result.rows}
    assert by["hard"].mean("ddi") == 0.0
    assert by["soft 8"].mean("ddi") <= by["soft 1"].mean("ddi") <= by["off"].mean("ddi")
    assert by["off, max-rate 0"].mean("ddi") < by["off"].mean("ddi")
    for line, name in zip(result.table.splitlines()[1:], labels, strict=False):
        assert line.startswith(name)
    assert "ground-truth DDI rate" in result.table
    assert "| off |" in ddi_tradeoff.markdown_table(result.rows)
    png = ddi_tradeoff.plot(result.rows, tmp_path / "t.png", result.recommended)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(result.to_json())


def test_recommend_picks_the_safest_penalty_within_the_jaccard_budget():
    def row(policy, jaccard, ddi):
        return ddi_tradeoff.TradeoffRow(
            policy, {"jaccard": {"mean": jaccard}, "ddi": {"mean": ddi}}, 0.0
        )

    rows = [
        row(DDIPolicy(), 0.50, 0.08),
        row(DDIPolicy("hard"), 0.45, 0.0),
        row(DDIPolicy("soft", 1), 0.495, 0.05),
        row(DDIPolicy("soft", 2), 0.492, 0.04),
        row(DDIPolicy("soft", 4), 0.48, 0.02),
    ]
    assert ddi_tradeoff.recommend(rows).policy == DDIPolicy("soft", 2)
    assert ddi_tradeoff.recommend(rows[:2]) is None


def test_evaluate_cli_ddi_options(tiny_dataset, synth_ckpt, tmp_path):
    base = [
        "evaluate",
        "--checkpoint",
        str(synth_ckpt),
        "--data",
        str(tiny_dataset),
        "--rounds",
        "1",
        "--quiet",
    ]
    runner = CliRunner()
    res = runner.invoke(cognet_main, [*base, "--ddi-mode", "soft", "--ddi-penalty", "2"])
    assert res.exit_code == 0, res.output
    assert "DDI soft 2" in res.output
    out = tmp_path / "t.json"
    res = runner.invoke(
        cognet_main,
        [
            *base,
            "--ddi-tradeoff",
            "--penalties",
            "1",
            "--plot",
            str(tmp_path / "t.png"),
            "--json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert [r["label"] for r in json.loads(out.read_text())["rows"]] == ["off", "hard", "soft 1"]
    assert (tmp_path / "t.png").is_file()
    for bad in (
        ["--ddi-mode", "hard", "--ddi-penalty", "1"],
        ["--ddi-tradeoff", "--ddi-mode", "hard"],
        ["--plot", "x.png"],
        ["--ddi-tradeoff", "--penalties", "a,b"],
    ):
        res = runner.invoke(cognet_main, [*base, *bad])
        assert res.exit_code == 2, (bad, res.output)


# -- cognet-batch ---------------------------------------------------------------------------------


def test_score_cli_hard_mode_reports_zero_ddi(tiny, tmp_path):
    visits = tiny / "data" / "visits.parquet"
    summary = tmp_path / "s.json"
    res = CliRunner().invoke(
        batch_main,
        [
            "score",
            str(visits),
            "--model",
            str(tiny / "model"),
            "--out",
            str(tmp_path / "o.parquet"),
            "--all",
            "--quiet",
            "--ddi-mode",
            "hard",
            "--summary-json",
            str(summary),
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(summary.read_text())
    assert report["metrics"]["ddi"]["mean"] == 0.0
    assert report["ddi"] == {"mode": "hard", "penalty": 0.0, "max_rate": None}
    res = CliRunner().invoke(
        batch_main,
        [
            "score",
            str(visits),
            "--model",
            str(tiny / "model"),
            "--out",
            str(tmp_path / "p.parquet"),
            "--ddi-penalty",
            "1",
        ],
    )
    assert res.exit_code == 2 and "soft only" in res.output


def test_explain_prints_the_decoding_step_by_step(tiny, reference):
    visits = tiny / "data" / "visits.parquet"
    vid = next(v for v in reference["flat"] if v.endswith("-3"))
    args = ["explain", str(visits), "--model", str(tiny / "model"), "--visit-id", vid]
    res = CliRunner().invoke(batch_main, args)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("step"))
    for word in ("medication", "prob", "origin", "copy share", "from visit", "attended"):
        assert word in lines[head]
    ref = reference["off"][vid]
    steps = lines[head + 1 : head + 1 + len(ref.meds)]
    assert [s.split()[1] for s in steps] == reference["vocab"].med_codes(ref.meds)
    assert "history (3 visits" in res.output and "truth:" in res.output

    res = CliRunner().invoke(batch_main, [*args, "--json", "--ddi-mode", "hard"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output)
    assert obj["interacting_pairs"] == [] and obj["decoding"] == "beam 4, DDI hard"
    assert all(len(s["top_diagnoses"]) <= 3 for s in obj["steps"])
    assert {s["origin"] for s in obj["steps"]} <= {"generated", "copied"}

    res = CliRunner().invoke(batch_main, [*args[:-1], "NOPE"])
    assert res.exit_code == 2 and "no visit 'NOPE'" in res.output


def test_explanations_of_a_model_without_attention_output(tiny, reference):
    """Model directories exported before `diag_attention`: top_diagnoses is null."""
    from cognet.core.manifest import load_manifest
    from cognet.runtime.session import OrtModel

    manifest = load_manifest(tiny / "model")
    model = OrtModel(manifest, device="cpu", threads=1)
    model.decoder.step_outputs = tuple(
        o for o in model.decoder.step_outputs if o != "diag_attention"
    )
    scorer = Scorer.from_session(
        model.encoder, model.decoder, manifest.vocabulary(), manifest.dims.dim
    )
    chunks = scorer.score_table(reference["visits"].slice(0, 30), score_all=True, explain=True)
    rows = [r for c in chunks for r in c.recommendations.to_pylist()]
    explained = [ex for r in rows for ex in r["explanations"]]
    assert explained and all(ex["top_diagnoses"] is None for ex in explained)
