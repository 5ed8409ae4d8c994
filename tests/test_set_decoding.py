"""Set decoding end to end: the runtime (ONNX Runtime, CPU) returns the torch reference's
sets, batch size notwithstanding; `--decoding beam` stays the paper's beam search on a model
whose default is the set; `cognet-batch score --all` agrees with `cognet evaluate
--predictions`; the checkpoint's tuned decoding travels into the manifest."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from cognet.cli import main as cognet_main
from cognet.core.decoding import Decoding
from cognet.core.manifest import load_manifest
from cognet.runtime.cli import main as batch_main
from tests.tiny import runtime_sets, set_agreement, torch_sets

torch.set_num_threads(1)


@pytest.mark.parametrize("batch_size", [5, 64])
def test_runtime_sets_equal_torch_on_the_tiny_model(tiny, batch_size):
    decoding = Decoding(name="set", samples=8, threshold=0.3)
    ref = torch_sets(tiny, decoding)
    got = runtime_sets(tiny, decoding="set", samples=8, threshold=0.3, batch_size=batch_size)
    assert len(ref) >= 200
    assert set_agreement(got, ref) >= 0.995
    assert len({len(v) for v in ref.values()}) > 3  # sets of varied sizes


@pytest.mark.parametrize("estimator", ["stratified", "tree"])
@pytest.mark.parametrize("selection", ["host", "device"])
def test_every_estimator_draws_alike_in_torch_and_the_runtime(tiny, estimator, selection):
    """The estimators' draws are the same numbers in the torch reference, the numpy
    selection and the search graphs (fed from the host), visit by visit."""
    decoding = Decoding(name="set", samples=8, threshold=0.3, estimator=estimator)
    ref = torch_sets(tiny, decoding)
    got = runtime_sets(
        tiny,
        decoding="set",
        samples=8,
        threshold=0.3,
        batch_size=64,
        estimator=estimator,
        selection=selection,
    )
    assert set_agreement(got, ref) >= 0.995
    plain = torch_sets(tiny, Decoding(name="set", samples=8, threshold=0.3, estimator="plain"))
    assert set_agreement(plain, ref) < 1.0  # another estimator, other draws


@pytest.mark.parametrize("selection", ["host", "device"])
def test_expected_jaccard_sets_alike_in_torch_and_the_runtime(tiny, selection):
    """`--set-rule jaccard` reads the same sets from the same P(k in S) in both; a
    threshold given alone still asks for the threshold rule."""
    decoding = Decoding(name="set", samples=8, threshold=0.3, rule="jaccard")
    ref = torch_sets(tiny, decoding)
    got = runtime_sets(
        tiny, decoding="set", samples=8, set_rule="jaccard", batch_size=64, selection=selection
    )
    assert set_agreement(got, ref) >= 0.995
    by_threshold = runtime_sets(tiny, decoding="set", samples=8, threshold=0.3, batch_size=64)
    assert set_agreement(by_threshold, ref) < 0.9  # another rule, other sets


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real-size synthetic dataset (131 medications), a checkpoint trained 3 epochs with
    the default recipe less the set head (set decoding its default, its threshold tuned on
    validation) and its export."""
    root = tmp_path_factory.mktemp("trained_set")
    runner = CliRunner()
    steps = [
        ["data", "synth", "--out", str(root / "data"), "--patients", "240", "--seed", "5"],
        [
            "train",
            "--data",
            str(root / "data"),
            "--out",
            str(root / "ckpt"),
            "--epochs",
            "3",
            "--threads",
            "1",
            "--no-head",
            "--quiet",
        ],
    ]
    for args in steps:
        res = runner.invoke(cognet_main, args)
        assert res.exit_code == 0, res.output
    from cognet.export import ExportOptions, export

    export(root / "ckpt", root / "model", ExportOptions(validate=False))
    return root


@pytest.mark.slow
def test_trained_model_carries_its_tuned_set_decoding(trained):
    config = json.loads((trained / "ckpt" / "config.json").read_text())
    stored = Decoding.from_json(config["decoding"])
    assert stored.name == "set" and 0.15 <= stored.threshold <= 0.6
    assert config["train"]["val_jaccard_by_threshold"]
    assert load_manifest(trained / "model").default_decoding() == stored


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [7, 128, 1024])
def test_runtime_sets_equal_torch_on_a_trained_model(trained, batch_size):
    stored = load_manifest(trained / "model").default_decoding()
    ref = torch_sets(trained, stored)
    got = runtime_sets(trained, batch_size=batch_size)  # the model's default: its set
    assert len(ref) > 500
    assert set_agreement(got, ref) >= 0.995
    lengths = [len(v) for v in ref.values()]
    assert np.mean(lengths) > 5


@pytest.mark.slow
def test_decoding_beam_is_the_paper_beam_search_on_a_set_model(trained):
    ref = torch_sets(trained, Decoding(name="beam", beam=4))
    got = runtime_sets(trained, decoding="beam", batch_size=64)
    assert got == ref


@pytest.mark.slow
def test_batch_all_agrees_with_evaluate_predictions(trained, tmp_path):
    runner = CliRunner()
    preds = tmp_path / "preds.parquet"
    res = runner.invoke(
        cognet_main,
        [
            "evaluate",
            "--checkpoint",
            str(trained / "ckpt"),
            "--data",
            str(trained / "data"),
            "--rounds",
            "1",
            "--predictions",
            str(preds),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "set, 16 samples" in res.output
    out = tmp_path / "recs.parquet"
    res = runner.invoke(
        batch_main,
        [
            "score",
            str(trained / "data" / "visits.parquet"),
            "--model",
            str(trained / "model"),
            "--out",
            str(out),
            "--all",
            "--device",
            "cpu",
            "--summary-json",
            str(tmp_path / "s.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["decoding"]["name"] == "set"
    evaluated = {r["visit_id"]: r for r in pq.read_table(preds).to_pylist()}
    scored = {r["visit_id"]: r for r in pq.read_table(out).to_pylist()}
    assert len(evaluated) > 50
    # A draw that lands within float rounding of a cumulative-probability boundary sends one
    # sample down another path in one engine: that visit's P(k in S) then moves by at most
    # about 1/samples. Allowed: 0.5% of the visits (at least one), each such a move only.
    differ = [k for k in evaluated if scored[k]["medications"] != evaluated[k]["medications"]]
    assert len(differ) <= max(1, int(0.005 * len(evaluated))), differ
    for k in differ:
        ev, sc = (
            dict(zip(r["medications"], r["probabilities"], strict=True))
            for r in (evaluated[k], scored[k])
        )
        assert len(set(ev) ^ set(sc)) <= 3, (k, ev, sc)
        assert max(abs(ev[m] - sc[m]) for m in set(ev) & set(sc)) <= 1 / 16 + 1e-3, (k, ev, sc)


def test_options_resolve_over_the_models_default():
    from cognet.core.errors import InputError
    from cognet.runtime.options import ScoreOptions

    def resolved(**asked) -> Decoding:
        return ScoreOptions.of(**asked).resolve(stored)[0]

    tuned = stored = Decoding(name="set", samples=16, threshold=0.3)
    assert resolved() == tuned
    assert resolved(beam=2).name == "beam"  # --beam alone
    assert resolved(beam=2).beam == 2
    changed = resolved(samples=8, threshold=0.4)
    assert (changed.name, changed.samples, changed.threshold) == ("set", 8, 0.4)
    assert resolved(decoding="beam").beam == 4
    stored = Decoding()  # a model from before set decoding: beam, no threshold
    assert resolved().name == "beam"
    with pytest.raises(InputError, match="needs a threshold"):
        resolved(decoding="set")
    assert resolved(decoding="set", threshold=0.3).threshold == 0.3
    with pytest.raises(InputError):
        ScoreOptions.of(threshold=1.5)
