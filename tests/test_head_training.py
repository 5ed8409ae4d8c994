"""The set head on the torch side: its inputs, the network, its training, the checkpoint
that holds it, the marginal decoding's request rules and `cognet evaluate --decoding
marginal`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tiny import make_tiny

from cognet.cli import main
from cognet.core.decoding import Decoding
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError
from cognet.core.head_inputs import history_meds, patient_head_arrays, ragged
from cognet.core.history import Visit
from cognet.model import checkpoint
from cognet.model.set_head import HeadConfig, SetHead
from cognet.training.members import read_splits
from cognet.training.set_head import HeadRecipe, TeacherMarginals, train_head


@pytest.mark.parametrize("marks", [True, False])
def test_history_meds_equal_a_loop_over_visits(marks, monkeypatch):
    """Both ways of listing each visit's past medications once: marks in a bool matrix,
    or a sort when the matrix would be too large."""
    if not marks:
        monkeypatch.setattr("cognet.core.head_inputs.SEEN_CELLS", 0)
    rng = np.random.default_rng(0)
    n_med, rows = 9, 40
    meds = ragged(
        [sorted(rng.choice(n_med, rng.integers(0, 5), replace=False)) for _ in range(rows)]
    )
    histories = [sorted(rng.choice(rows, rng.integers(0, 6), replace=False)) for _ in range(25)]
    last, past = history_meds(meds, ragged(histories), n_med)
    for i, h in enumerate(histories):
        want_last = meds[h[-1]].tolist() if h else []
        want_past = sorted({m for r in h for m in meds[r].tolist()})
        assert last[i].tolist() == want_last
        assert past[i].tolist() == want_past


def test_patient_arrays_read_the_history_the_decoder_reads():
    v = lambda vid, meds: Visit("p", vid, (0, 1), (2,), meds)  # noqa: E731
    patient = [v("a", (3, 1)), v("b", None), v("c", (2,)), v("d", (0,))]
    arrays = patient_head_arrays([patient], (5, 6, 4), 4)
    pad = 4
    assert arrays["has_history"].tolist() == [0, 1, 1, 1]
    # "b" has unknown medications: never a history visit; "d" reads a and c
    assert arrays["last_meds"][3].tolist()[:1] == [2]
    assert sorted(x for x in arrays["past_meds"][3].tolist() if x != pad) == [1, 2, 3]
    assert sorted(x for x in arrays["past_meds"][2].tolist() if x != pad) == [1, 3]
    dropped = patient_head_arrays([patient], (5, 6, 4), 4, no_history=[0, 0, 1, 0])
    assert dropped["has_history"].tolist() == [0, 1, 0, 1]
    assert set(dropped["past_meds"][2].tolist()) == {pad}
    last_only = patient_head_arrays([patient], (5, 6, 4), 4, max_history=1)
    assert sorted(x for x in last_only["past_meds"][3].tolist() if x != pad) == [2]


def _head(seed: int = 0, hidden: int = 32) -> SetHead:
    torch.manual_seed(seed)
    head = SetHead(HeadConfig(7, 5, 6, hidden=hidden, dropout=0.0))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        for table in (head.diagnoses, head.procedures, head.last_meds, head.past_meds):
            table.weight[table.padding_idx].zero_()  # as training keeps it
    return head.eval()


def test_head_ignores_padding_and_order():
    head = _head()
    a = {
        "diagnoses": np.array([[0, 3, 7]]),
        "procedures": np.array([[5]]),
        "last_meds": np.array([[1, 6]]),
        "past_meds": np.array([[2, 1, 6]]),
        "has_history": np.array([1.0], np.float32),
    }
    b = {
        "diagnoses": np.array([[3, 0, 7, 7, 7]]),
        "procedures": np.array([[5, 5]]),
        "last_meds": np.array([[6, 1]]),
        "past_meds": np.array([[1, 2]]),
        "has_history": np.array([1.0], np.float32),
    }
    pa, pb = head.marginals(a), head.marginals(b)
    np.testing.assert_allclose(pa, pb, rtol=1e-6)
    assert pa.shape == (1, 6) and ((pa > 0) & (pa < 1)).all()
    no_history = dict(a, has_history=np.array([0.0], np.float32))
    assert not np.allclose(head.marginals(no_history), pa)


@pytest.mark.parametrize("rows, width", [(1, 1), (3, 4), (64, 9)])
def test_torchs_sums_equal_the_exported_graphs_sums(rows, width):
    # torch (training, `marginals`) sums embedding rows by embedding_bag, `forward` (the
    # exported graph) by gather + sum: the same P(k in S) and the same gradients, PAD rows
    # and repeated ids included
    rng = np.random.default_rng(rows)
    ids = {
        "diagnoses": rng.integers(0, 8, (rows, width)),
        "procedures": rng.integers(0, 6, (rows, width + 1)),
        "last_meds": rng.integers(0, 7, (rows, 2)),
        "past_meds": rng.integers(0, 7, (rows, width)),
    }
    inputs = [torch.from_numpy(ids[k]) for k in ids]
    inputs.append(torch.from_numpy((rng.random(rows) < 0.5).astype(np.float32)))
    read = {"bag": lambda h: torch.sigmoid(h.logits(*inputs)), "graph": lambda h: h(*inputs)}
    got = {}
    for name, probs in read.items():
        head = _head(seed=3)
        p = probs(head)
        (p * torch.linspace(-1, 1, p.shape[1])).sum().backward()
        got[name] = (p.detach(), {k: w.grad.clone() for k, w in head.named_parameters()})
    (bag, bag_grads), (graph, graph_grads) = got["bag"], got["graph"]
    torch.testing.assert_close(bag, graph, rtol=1e-6, atol=1e-6)
    assert bag_grads.keys() == graph_grads.keys()
    for key, grad in bag_grads.items():
        torch.testing.assert_close(grad, graph_grads[key], rtol=1e-5, atol=1e-6)
    assert (bag_grads["diagnoses.weight"][-1] == 0).all()  # PAD's row learns nothing
    arrays = dict(ids, has_history=inputs[-1].numpy())
    np.testing.assert_allclose(_head(seed=3).marginals(arrays), graph.double(), atol=1e-6)


def _small_run(tiny_dataset: Path, recipe: HeadRecipe, seed: int = 0):
    _, vocab, train, val = read_splits(tiny_dataset)
    visits = [v for p in train.patients for v in p]
    rng = np.random.default_rng(1)
    soft = rng.random((len(visits), vocab.n_med)).astype(np.float32)
    teacher = TeacherMarginals(soft, soft * 0.5)
    return train_head(recipe, vocab, train.patients, teacher, val.patients, seed, 0.6)


def test_head_training_is_deterministic_and_keeps_its_best_epoch(tiny_dataset):
    recipe = HeadRecipe(hidden=16, epochs=6, patience=3, batch_size=32)
    head, decoding, record = _small_run(tiny_dataset, recipe)
    again, decoding2, record2 = _small_run(tiny_dataset, recipe)
    for (k, a), b in zip(head.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert decoding == decoding2 and record["val_jaccard"] == record2["val_jaccard"]
    assert decoding.name == "marginal" and decoding.head_threshold is not None
    assert 1 <= record["best_epoch"] <= record["epochs_run"] <= 6
    other, _, _ = _small_run(tiny_dataset, recipe, seed=1)
    assert not torch.equal(other.out.weight, head.out.weight)


def test_checkpoint_keeps_the_head_and_refuses_a_damaged_one(tmp_path):
    data, ckpt = make_tiny(tmp_path / "t", n_patients=12)
    model, vocab, config = checkpoint.load(ckpt)
    assert checkpoint.load_head(ckpt, config) is None  # a checkpoint without a head
    head = SetHead(HeadConfig(vocab.n_diag, vocab.n_proc, vocab.n_med, hidden=8))
    out = tmp_path / "with_head"
    graphs = checkpoint.Graphs(*checkpoint.checks.read_graphs(ckpt, vocab.n_med), [])
    checkpoint.save(
        out, model, vocab, graphs, {"seed": 0}, checkpoint.Tuned(head=(head, {"mix": 0.5}))
    )
    _, _, config = checkpoint.load(out)
    loaded = checkpoint.load_head(out, config)
    for a, b in zip(head.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert config["head"]["training"] == {"mix": 0.5}
    raw = (out / "head.safetensors").read_bytes()
    middle = len(raw) // 2
    (out / "head.safetensors").write_bytes(
        raw[:middle] + bytes([raw[middle] ^ 1]) + raw[middle + 1 :]
    )
    with pytest.raises(InputError, match="head.safetensors: sha256 differs"):
        checkpoint.load_head(out, config)
    (out / "head.safetensors").unlink()
    with pytest.raises(InputError, match="head.safetensors is missing"):
        checkpoint.load_head(out, config)


def test_decoding_json_of_a_model_without_a_head_is_unchanged():
    old = {"name": "set", "beam": 4, "samples": 16, "threshold": 0.4, "seed": 0}
    old |= {"max_len": 45, "estimator": "stratified", "rule": "threshold"}
    assert Decoding.from_json(old).to_json() == old
    with_head = Decoding.from_json(old).with_changes(head_threshold=0.35, head_rule="threshold")
    assert with_head.to_json()["head_threshold"] == 0.35
    assert with_head.with_changes(name="marginal").selection == (0.35, "threshold")
    assert with_head.selection == (0.4, "threshold")


@pytest.mark.parametrize(
    "asked, message",
    [
        ({"samples": 8}, "--samples is for decodings that step"),
        ({"estimator": "plain"}, "--estimator is for decodings that step"),
        ({"beam": 2}, "--beam"),
    ],
)
def test_marginal_refuses_the_options_of_decodings_that_step(asked, message):
    with pytest.raises(ValueError, match=message):
        DecodingRequest(decoding="marginal", **asked)


def test_marginal_request_changes_the_heads_rule_not_set_decodings():
    from cognet.core.ddi import DDIPolicy

    stored = Decoding(name="set", threshold=0.4, head_threshold=0.3, head_rule="threshold")
    asked = DecodingRequest(decoding="marginal", threshold=0.45).decoding_on(stored)
    assert asked.selection == (0.45, "threshold") and asked.threshold == 0.4
    with pytest.raises(ValueError, match="--ddi-mode soft acts at each decoding step"):
        DecodingRequest(decoding="marginal", ddi=DDIPolicy("soft", 1.0)).resolve(stored)
    priced = DecodingRequest(decoding="marginal", ddi=DDIPolicy(pair_price=0.01))
    assert priced.resolve(stored)[0].selection[1] == "jaccard"


def test_evaluate_marginal_without_a_head_is_an_input_error(tmp_path):
    data, ckpt = make_tiny(tmp_path / "t", n_patients=12)
    args = ["evaluate", "--checkpoint", str(ckpt), "--data", str(data), "--split", "val"]
    res = CliRunner().invoke(main, [*args, "--decoding", "marginal", "--rounds", "1"])
    assert res.exit_code == 2, res.output
    assert "reads a set head and this checkpoint has none" in res.output


def test_train_teacher_adds_a_head_that_evaluate_reads(tmp_path, tiny_dataset):
    runner = CliRunner()
    small = ["--dim", "16", "--epochs", "1", "--quiet", "--members", "1", "--no-head"]
    base = tmp_path / "base"
    res = runner.invoke(main, ["train", "--data", str(tiny_dataset), "--out", str(base), *small])
    assert res.exit_code == 0, res.output
    out = tmp_path / "with_head"
    args = ["train", "--data", str(tiny_dataset), "--out", str(out), "--teacher", str(base)]
    res = runner.invoke(main, [*args, "--head-hidden", "16", "--quiet"])
    assert res.exit_code == 0, res.output
    config = json.loads((out / "config.json").read_text())
    assert config["head"]["config"]["hidden"] == 16
    assert config["head"]["training"]["teacher"]["members"] == 1
    assert config["decoding"]["head_threshold"] is not None
    assert config["decoding"]["name"] == "marginal"  # the head's one pass: the default
    base_cfg = json.loads((base / "config.json").read_text())
    assert base_cfg["decoding"]["name"] == "set"  # no head: set decoding stays the default
    assert (out / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    assert "head" not in base_cfg
    report = tmp_path / "r.json"
    args = ["evaluate", "--checkpoint", str(out), "--data", str(tiny_dataset), "--split", "val"]
    res = runner.invoke(main, [*args, "--json", str(report), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "marginal" in json.loads(report.read_text())["model"]
    bad = runner.invoke(
        main,
        ["train", "--data", str(tiny_dataset), "--out", str(tmp_path / "x")]
        + ["--teacher", str(base), "--dim", "32"],
    )
    assert bad.exit_code == 2 and "--dim does not apply" in bad.output
