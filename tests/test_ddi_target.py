"""The DDI target (`cognet train/evaluate --ddi-target`, `cognet.training.ddi_target`): the search
holds the target on validation, the pair found travels checkpoint -> manifest -> scorer
as the model's default policy, an asked policy overrides it, and a model without one decodes
as before. Also the trade-off plot's --mark points."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from cognet.cli import main as cognet_main
from cognet.core.ddi import DDIPolicy, DDITarget
from cognet.core.decoding import Decoding
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError
from cognet.core.manifest import load_manifest
from cognet.evaluation.evaluate import EvalOptions, run_evaluation
from cognet.runtime import ScoreOptions, Scorer
from cognet.runtime.cli import main as batch_main
from cognet.training.ddi_target import Grid, Validation, search

TARGET = 0.05  # below the validation DDI rate of the model decoded without a policy


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


# (what is trained, the decoding its target is chosen for): the default (the set head: its
# marginals searched, set rules only), and set decoding (no head: every step policy too)
TRAININGS = {"head": ([], "marginal"), "no-head": (["--no-head"], "set")}


@pytest.fixture(scope="module", params=sorted(TRAININGS))
def targeted(request, tiny_dataset, tmp_path_factory) -> Path:
    """A model trained 2 epochs with --ddi-target TARGET on the 60-patient synthetic set,
    with the set head (the marginal decoding its default) and without (set decoding)."""
    args, decoding = TRAININGS[request.param]
    out = tmp_path_factory.mktemp("targeted") / "ckpt"
    res = CliRunner().invoke(
        cognet_main,
        [
            "train",
            "--data",
            str(tiny_dataset),
            "--out",
            str(out),
            "--epochs",
            "2",
            "--ddi-target",
            str(TARGET),
            "--quiet",
            *args,
        ],
    )
    assert res.exit_code == 0, res.output
    assert f"DDI target {TARGET:g}: " in res.output
    config = _json(out / "config.json")
    assert config["decoding"]["name"] == decoding
    assert DDITarget.from_json(config["ddi_target"]).decoding == decoding
    return out


def _threshold(decoding: dict) -> float | None:
    """The threshold the decoding reads its sets with (set decoding's or the head's)."""
    return Decoding.from_json(decoding).selection[0]


def _evaluate(ckpt, data, tmp_path, *args) -> dict:
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    res = CliRunner().invoke(
        cognet_main,
        [
            "evaluate",
            "--checkpoint",
            str(ckpt),
            "--data",
            str(data),
            "--split",
            "val",
            "--rounds",
            "1",
            "--quiet",
            "--json",
            str(out),
            *args,
        ],
    )
    assert res.exit_code == 0, res.output
    return _json(out) | {"output": res.output}


def test_trained_target_holds_on_validation_and_is_the_default(targeted, tiny_dataset, tmp_path):
    config = _json(targeted / "config.json")
    stored = DDITarget.from_json(config["ddi_target"])
    assert stored.target == TARGET and stored.val_ddi <= TARGET
    # evaluate without a DDI option decodes with the stored pair: the validation rate holds
    rep = _evaluate(targeted, tiny_dataset, tmp_path)
    assert rep["ddi_policy"] == stored.policy.to_json()
    assert _threshold(rep["decoding"]) == stored.threshold
    assert rep["ddi"]["mean"] <= TARGET
    assert rep["ddi"]["mean"] == pytest.approx(stored.val_ddi, abs=1e-6)
    assert rep["jaccard"]["mean"] == pytest.approx(stored.val_jaccard, abs=1e-6)
    assert rep["ddi_target"] == stored.to_json()
    assert f"DDI target {TARGET:g}, chosen on validation" in rep["output"]
    # --ddi-mode off overrides it: the threshold tuned without a policy, above the target
    off = _evaluate(targeted, tiny_dataset, tmp_path, "--ddi-mode", "off")
    assert off["ddi_policy"] == DDIPolicy().to_json() and "ddi_target" not in off
    assert _threshold(off["decoding"]) == _threshold(config["decoding"])
    assert off["ddi"]["mean"] > TARGET  # so the target was not met by doing nothing
    # another decoding asked than the one it was chosen for: the pair does not apply
    other = "set" if stored.decoding == "marginal" else "beam"
    beam = _evaluate(targeted, tiny_dataset, tmp_path, "--decoding", other)
    assert beam["ddi_policy"] == DDIPolicy().to_json() and "ddi_target" not in beam
    if stored.decoding == "marginal":  # one pass: no step for a soft penalty to act on
        assert stored.policy.mode != "soft"


def test_stored_pair_reaches_the_manifest_and_the_scorer(targeted, tiny_dataset, tmp_path):
    from cognet.export import ExportOptions, export

    stored = DDITarget.from_json(_json(targeted / "config.json")["ddi_target"])
    model = tmp_path / "model"
    export(targeted, model, ExportOptions(validate=False))
    manifest = load_manifest(model)
    assert manifest.default_target() == stored
    assert _json(model / "manifest.json")["ddi_target"] == stored.to_json()
    scorer = Scorer(model, ScoreOptions.of(device="cpu", threads=1))
    assert scorer.ddi == stored.policy and scorer.decoding.selection[0] == stored.threshold
    assert scorer.settings()["ddi"] == stored.policy.to_json()
    off = Scorer(model, ScoreOptions.of(device="cpu", threads=1, ddi=DDIPolicy()))
    assert off.ddi == DDIPolicy()
    assert off.decoding == manifest.default_decoding()
    # cognet-batch score: the stored pair by default, --ddi-mode off overrides it; its lists
    # are the ones `cognet evaluate` (torch) gives with the same pair
    visits = tmp_path / "test.parquet"
    table = pq.read_table(tiny_dataset / "visits.parquet")
    pq.write_table(table, visits)
    preds = tmp_path / "torch.parquet"
    run_evaluation(targeted, tiny_dataset, EvalOptions(rounds=1, predictions=preds))
    for args, policy in (([], stored.policy), (["--ddi-mode", "off"], DDIPolicy())):
        out, summary = tmp_path / f"s{len(args)}.parquet", tmp_path / f"s{len(args)}.json"
        res = CliRunner().invoke(
            batch_main,
            [
                "score",
                str(visits),
                "--model",
                str(model),
                "--out",
                str(out),
                "--device",
                "cpu",
                "--threads",
                "1",
                "--all",
                "--summary-json",
                str(summary),
                *args,
            ],
        )
        assert res.exit_code == 0, res.output
        assert _json(summary)["ddi"] == policy.to_json()
    scored = pq.read_table(tmp_path / "s0.parquet").to_pydict()
    runtime = dict(zip(scored["visit_id"], scored["medications"], strict=True))
    want = pq.read_table(preds).to_pydict()
    same = [runtime[v] == m for v, m in zip(want["visit_id"], want["medications"], strict=True)]
    assert np.mean(same) >= 0.95


def test_model_without_a_target_is_unchanged(tiny, tmp_path):
    assert "ddi_target" not in _json(tiny / "ckpt" / "config.json")
    manifest = load_manifest(tiny / "model")
    assert manifest.default_target() is None
    scorer = Scorer(tiny / "model", ScoreOptions.of(device="cpu", threads=1))
    assert scorer.ddi == DDIPolicy() and scorer.decoding == manifest.default_decoding()
    default = run_evaluation(tiny / "ckpt", tiny / "data", EvalOptions(rounds=2))["report"]
    off = run_evaluation(
        tiny / "ckpt",
        tiny / "data",
        EvalOptions(rounds=2, request=DecodingRequest(ddi=DDIPolicy())),
    )
    assert default == off["report"] and "ddi_target" not in default


def test_evaluate_ddi_target_searches_validation_then_reports_the_split(
    tiny_dataset, targeted, tmp_path
):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        cognet_main,
        [
            "evaluate",
            "--checkpoint",
            str(targeted),
            "--data",
            str(tiny_dataset),
            "--rounds",
            "1",
            "--quiet",
            "--ddi-target",
            "0.07",
            "--json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    rep = _json(out)
    found = DDITarget.from_json(rep["ddi_target"])
    assert found.target == 0.07 and found.val_ddi <= 0.07
    assert rep["ddi_policy"] == found.policy.to_json() and rep["split"] == "test"
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("DDI target 0.07, chosen on validation") and "test DDI" in line
    assert f"{rep['ddi']['mean']:.4f}" in line
    for bad in (["--ddi-mode", "hard"], ["--decoding", "beam"], ["--ddi-tradeoff"]):
        res = CliRunner().invoke(
            cognet_main,
            [
                "evaluate",
                "--checkpoint",
                str(targeted),
                "--data",
                str(tiny_dataset),
                "--ddi-target",
                "0.07",
                *bad,
            ],
        )
        assert res.exit_code == 2, (bad, res.output)


def test_search_keeps_the_best_pair_holding_the_target():
    """A model whose DDI rate falls as the penalty grows and whose Jaccard falls too: the
    search keeps the smallest penalty that holds the target, at the best threshold."""
    from cognet.core.history import Visit

    rng = np.random.default_rng(0)
    n, m = 60, 6
    adj = np.zeros((m, m), bool)
    adj[0, 1] = adj[1, 0] = True  # 0 and 1 interact; the truth holds 0, 2, 3
    visits = [[Visit(f"P{i}", f"V{i}", (), (), (0, 2, 3))] for i in range(n)]
    base = np.tile([0.9, 0.5, 0.8, 0.7, 0.1, 0.05], (n, 1)) + rng.uniform(-0.02, 0.02, (n, m))
    asked = []

    def marginals_of(policy: DDIPolicy) -> np.ndarray:
        asked.append(policy.label)
        out = base.copy()
        out[:, 1] *= np.exp(-policy.penalty)  # the penalty removes the interacting one
        return out

    found, trials = search(
        marginals_of, Validation(visits, adj), 0.0, Grid((0.2, 0.45), caps=(None,), prices=())
    )
    assert found.val_ddi == 0.0 and found.val_jaccard == 1.0
    assert found.policy.mode == "soft" and 0 < found.policy.penalty
    assert found.threshold == 0.45
    smaller = [t for t in trials if t.policy.penalty < found.policy.penalty]
    assert smaller and all(t.ddi > 0 for t in smaller)  # the smallest penalty that holds it
    assert asked[0] == "off" and len(asked) == len(set(asked))  # each policy decoded once
    # a penalty that changes nothing: no soft pair holds it, hard does (drops 1 after 0)
    fixed = lambda policy: base  # noqa: E731
    found, _ = search(
        fixed, Validation(visits, adj), 0.0, Grid((0.2,), caps=(None,), prices=()), refine=1
    )
    assert found.policy == DDIPolicy("hard") and found.val_ddi == 0.0
    # a per-set cap needs no penalty: off with max-rate 0 drops 1 (it follows 0) at once
    asked.clear()
    found, trials = search(marginals_of, Validation(visits, adj), 0.0, Grid((0.2, 0.45), prices=()))
    assert found.policy == DDIPolicy("off", max_rate=0.0) and found.val_jaccard == 1.0
    assert {t.policy.max_rate for t in trials} == {None, 0.0}
    assert found.threshold == 0.2 and asked[:2] == ["off", "soft 0.25"]
    # a pair price needs no penalty either: the expected-Jaccard set less the price passes
    # over 1 (it interacts with 0, the most probable); the lowest such price wins
    found, trials = search(
        marginals_of, Validation(visits, adj), 0.0, Grid((0.2, 0.45), caps=(None,))
    )
    assert found.policy.mode == "off" and found.policy.pair_price > 0 and found.rule == "jaccard"
    assert (found.val_jaccard, found.val_ddi) == (1.0, 0.0)
    cheaper = [t for t in trials if 0 < t.policy.pair_price < found.policy.pair_price]
    assert cheaper and all(t.ddi > 0 for t in cheaper if t.policy.mode == "off")


def test_search_weighs_the_expected_jaccard_rule_with_the_thresholds():
    """Visits of very different certainty, true sets drawn from the marginals: the
    expected-Jaccard rule beats every threshold, so the search keeps it, and the target
    carries it through JSON (a target stored before the rule existed reads as threshold)."""
    from cognet.core.history import Visit

    rng = np.random.default_rng(1)
    n, m = 600, 20
    marg = rng.beta(0.3, 0.3, size=(n, m)) * rng.uniform(0.3, 1.0, size=(n, 1))
    truths = [tuple(np.flatnonzero(rng.random(m) < row).tolist()) for row in marg]
    visits = [[Visit(f"P{i}", f"V{i}", (), (), t)] for i, t in enumerate(truths)]
    adj = np.zeros((m, m), bool)
    grid = Grid((0.3, 0.4, 0.5), caps=(None,))
    found, trials = search(lambda policy: marg, Validation(visits, adj), 0.5, grid)
    by_rule = {t.rule for t in trials}
    assert by_rule == {"threshold", "jaccard"} and found.rule == "jaccard"
    assert found.val_jaccard > max(t.jaccard for t in trials if t.rule == "threshold")
    assert found.rule_label == "expected-Jaccard rule"
    stored = found.to_json()
    assert DDITarget.from_json(stored) == found
    del stored["rule"]
    assert DDITarget.from_json(stored).rule == "threshold"
    with pytest.raises(ValueError, match="set rule"):
        DDITarget.from_json({**stored, "rule": "median"})
    # sets that are exactly a threshold's: the threshold rule, at that threshold
    cut = [
        [Visit(f"P{i}", f"V{i}", (), (), tuple(np.flatnonzero(row >= 0.4).tolist()))]
        for i, row in enumerate(marg)
    ]
    found, _ = search(lambda policy: marg, Validation(cut, adj), 0.5, grid)
    assert (found.rule, found.threshold, found.val_jaccard) == ("threshold", 0.4, 1.0)


def test_malformed_stored_targets_are_one_line_errors(targeted, tiny, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    manifest = _json(model / "manifest.json")
    manifest["ddi_target"] = {"target": 2, "policy": {"mode": "soft"}}
    (model / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="manifest.json: malformed ddi_target"):
        load_manifest(model)


@pytest.mark.parametrize(
    "mark", ["SafeDrug", "SafeDrug=0.52", "=0.52@0.05", "SafeDrug=a@0.05", "X=0.5@1.5"]
)
def test_bad_mark_is_a_one_line_usage_error(tiny_dataset, targeted, tmp_path, mark):
    res = CliRunner().invoke(
        cognet_main,
        [
            "evaluate",
            "--checkpoint",
            str(targeted),
            "--data",
            str(tiny_dataset),
            "--ddi-tradeoff",
            "--plot",
            str(tmp_path / "t.png"),
            "--mark",
            mark,
        ],
    )
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if line.startswith("Error")]
    assert errors == [errors[0]] and "--mark" in errors[0] and "NAME=JACCARD@DDI" in errors[0]
    assert not (tmp_path / "t.png").exists()


def test_tradeoff_plot_with_marks(tiny_dataset, targeted, tmp_path):
    png = tmp_path / "t.png"
    res = CliRunner().invoke(
        cognet_main,
        [
            "evaluate",
            "--checkpoint",
            str(targeted),
            "--data",
            str(tiny_dataset),
            "--rounds",
            "1",
            "--quiet",
            "--ddi-tradeoff",
            "--penalties",
            "0.5,2",
            "--plot",
            str(png),
            "--mark",
            "SafeDrug=0.5213@0.0589",
            "--mark",
            "RASNet=0.5401@0.0599",
        ],
    )
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in res.output


def test_a_marginal_target_round_trips_and_has_no_step_policy():
    from dataclasses import replace

    found = DDITarget(0.06, DDIPolicy(max_rate=0.06), 0.4, 0.5, 0.05, decoding="marginal")
    assert DDITarget.from_json(found.to_json()) == found
    assert "decoding" not in replace(found, decoding="set").to_json()  # set's: as before
    with pytest.raises(ValueError, match="soft penalty"):
        DDITarget(0.06, DDIPolicy("soft", 1.0), 0.4, 0.5, 0.05, decoding="marginal")
    with pytest.raises(ValueError, match="set or marginal"):
        DDITarget.from_json({**found.to_json(), "decoding": "beam"})


def test_tradeoff_of_the_heads_decoding_reads_its_set_rules_only(targeted, tiny_dataset):
    """--ddi-tradeoff on a model whose default is the head's one pass: the soft penalties
    (a step policy) are left out, the set rules each give a row, and a pair price reads
    the expected-Jaccard set of the same marginals."""
    from cognet.evaluation.ddi_tradeoff import policies, run_tradeoff

    config = _json(targeted / "config.json")
    asked = policies((0.5, 1.0), max_rates=(0.05,), pair_prices=(0.01,))
    options = EvalOptions(rounds=1, split="val")
    got = run_tradeoff(targeted, tiny_dataset, options, asked).rows
    if config["decoding"]["name"] == "set":
        assert [r.policy for r in got] == asked
        return
    assert [r.policy for r in got] == [p for p in asked if p.mode != "soft"]
    off, hard, capped, priced = (r.report for r in got)
    assert hard["ddi"]["mean"] == 0.0 and capped["ddi"]["mean"] <= 0.05 + 1e-9
    assert priced["ddi"]["mean"] <= off["ddi"]["mean"]
