"""Training options: the auxiliary multi-label loss (a training signal only), the DDI term,
the learning rate decay, history dropout, and the width and dropout options of `cognet
train`."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from tiny import make_tiny

from cognet.cli import main
from cognet.core.history import load_split
from cognet.model import checkpoint
from cognet.model.batching import IGNORE, make_batch
from cognet.training.loss import aux_loss, ddi_loss
from cognet.training.train import TrainConfig, batch_loss

# small and quick: the options under test, not the recipe's size
# one network: what is tested is how each network trains
SMALL = ["--dim", "16", "--epochs", "2", "--seed", "3", "--quiet", "--members", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    data, ckpt = make_tiny(root, n_patients=45)
    return data, ckpt


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """Trainings of one seed: plain, with the auxiliary loss, and twice with history
    dropout."""
    root = tmp_path_factory.mktemp("trained")
    out = {}
    runs = (
        ("plain", []),
        ("aux", ["--aux-loss", "0.5", "--lr-decay", "0.5"]),
        ("nohist", ["--history-dropout", "0.5"]),
        ("nohist2", ["--history-dropout", "0.5"]),
        ("ddi", ["--ddi-loss", "2"]),
    )
    for name, extra in runs:
        out[name] = root / name
        res = CliRunner().invoke(
            main, ["train", "--data", str(tiny[0]), "--out", str(out[name]), *SMALL, *extra]
        )
        assert res.exit_code == 0, res.output
    return out


def _batch(tiny):
    import pyarrow.parquet as pq

    model, vocab, _ = checkpoint.load(tiny[1])
    patients = load_split(pq.read_table(tiny[0] / "visits.parquet"), vocab, "train").patients
    return model, vocab, make_batch(patients[:6], vocab)


def test_aux_loss_targets_the_medications_still_to_come():
    head = torch.nn.Linear(3, 4)
    hidden = torch.randn(2, 4, 3)
    # visit 0: meds 2, 0 then END (4); visit 1: med 3, END, padding
    target = torch.tensor([[2, 0, 4, IGNORE], [3, 4, IGNORE, IGNORE]])
    remaining = {
        (0, 0): {0, 2},
        (0, 1): {0},
        (0, 2): set(),
        (1, 0): {3},
        (1, 1): set(),
    }
    expected = 0.0
    for (n, t), meds in remaining.items():
        y = torch.tensor([float(k in meds) for k in range(4)])
        logits = head(hidden[n, t]).detach()
        expected += float(F.binary_cross_entropy_with_logits(logits, y, reduction="sum"))
    got = float(aux_loss(head, hidden, target).detach())
    assert got == pytest.approx(expected / len(remaining), rel=1e-5)


def test_batch_loss_adds_the_weighted_aux_loss(tiny):
    model, vocab, batch = _batch(tiny)
    model.eval()  # no dropout: the same forward pass each call
    head = torch.nn.Linear(model.cfg.dim, vocab.n_med)
    with torch.no_grad():
        plain = batch_loss(model, batch, vocab, TrainConfig())
        off = batch_loss(model, batch, vocab, TrainConfig(aux_loss=0.0), aux_head=head)
        on = batch_loss(model, batch, vocab, TrainConfig(aux_loss=0.7), aux_head=head)
        log_probs, hidden = model(batch, hidden=True)
        assert torch.equal(log_probs, model(batch))  # `hidden` changes nothing else
        aux = aux_loss(head, hidden, batch["dec_target"])
    assert float(off) == pytest.approx(float(plain), rel=1e-6)
    assert float(on) == pytest.approx(float(plain) + 0.7 * float(aux), rel=1e-5)
    assert float(aux) > 0


def test_aux_gradient_reaches_the_shared_network_not_the_output_heads(tiny):
    model, vocab, batch = _batch(tiny)
    head = torch.nn.Linear(model.cfg.dim, vocab.n_med)
    _, hidden = model(batch, hidden=True)
    aux_loss(head, hidden, batch["dec_target"]).backward()
    for shared in (model.diag_emb.weight, model.cross_d.q.weight, model.ffn[0].weight):
        assert shared.grad is not None and shared.grad.abs().sum() > 0
    assert head.weight.grad.abs().sum() > 0
    for output in (model.gen_head.weight, model.copy_query.weight, model.gate_head.weight):
        assert output.grad is None  # the recommendation's heads are left to the NLL


def test_aux_head_is_not_part_of_the_checkpoint(trained):
    plain = json.loads((trained["plain"] / "config.json").read_text())
    aux = json.loads((trained["aux"] / "config.json").read_text())
    assert plain["model"] == aux["model"]  # the same architecture
    assert (plain["train"]["aux_loss"], aux["train"]["aux_loss"]) == (0.0, 0.5)
    assert (plain["train"]["lr_decay"], aux["train"]["lr_decay"]) == (1.0, 0.5)
    model_a, _, config_a = checkpoint.load(trained["plain"])
    model_b, _, config_b = checkpoint.load(trained["aux"])
    assert config_b["train"]["aux_loss"] == 0.5  # round-trips through the loader
    a, b = model_a.state_dict(), model_b.state_dict()
    assert a.keys() == b.keys()
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert any(not torch.equal(a[k], b[k]) for k in a)  # trained differently


def test_lr_decay_is_applied_per_epoch(trained):
    log = (trained["aux"] / "train_log.jsonl").read_text().splitlines()
    lrs = [json.loads(line)["lr"] for line in log]
    assert lrs == pytest.approx([1e-3, 5e-4])
    plain = (trained["plain"] / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["lr"] for line in plain] == [1e-3, 1e-3]


def test_exported_graphs_do_not_depend_on_the_training_loss(trained, tmp_path):
    from cognet.export import GRAPH_FILES, ExportOptions, export

    def structure(path):
        graph = onnx.load(str(path)).graph
        return (
            [(n.op_type, list(n.input), list(n.output)) for n in graph.node],
            [i.name for i in graph.input],
            [o.name for o in graph.output],
            sorted((t.name, tuple(t.dims)) for t in graph.initializer),
        )

    for name in ("plain", "aux"):
        export(trained[name], tmp_path / name, ExportOptions(validate=False))
    for file in GRAPH_FILES.values():
        assert structure(tmp_path / "plain" / file) == structure(tmp_path / "aux" / file)
    weights = [
        np.concatenate(
            [onnx.numpy_helper.to_array(t).ravel() for t in onnx.load(str(p)).graph.initializer]
        )
        for p in (tmp_path / n / GRAPH_FILES["decoder_step"] for n in ("plain", "aux"))
    ]
    assert not np.array_equal(*weights)  # same graph, other weights


def test_history_dropout_decodes_the_drawn_visits_as_first_visits(tiny):
    """A visit whose history is dropped gets exactly the log-probabilities it would get as
    a patient's first visit; the others keep theirs."""
    model, vocab, plain = _batch(tiny)
    patients = _patients(tiny, vocab)[:6]
    visits = [v for p in patients for v in p]
    later = [i for i, pos in enumerate(j for p in patients for j in range(len(p))) if pos]
    assert later, "the fixture needs patients with several visits"
    dropped = [i in later[::2] for i in range(len(visits))]
    batch = make_batch(patients, vocab, no_history=dropped)
    model.eval()
    with torch.no_grad():
        ours, kept = model(batch), model(plain)
        for row, drop in enumerate(dropped):
            n = len(visits[row].meds) + 1  # the medications, then END
            alone = model(make_batch([[visits[row]]], vocab))[0]
            want = alone if drop or row not in later else kept[row]
            assert torch.allclose(ours[row, :n], want[:n], atol=1e-5), row
    mask = torch.tensor(dropped)
    assert not batch["hist_mask"][mask].any() and plain["hist_mask"][mask].any()


def _patients(tiny, vocab):
    import pyarrow.parquet as pq

    return load_split(pq.read_table(tiny[0] / "visits.parquet"), vocab, "train").patients


def test_history_dropout_trains_deterministically(trained):
    config = json.loads((trained["nohist"] / "config.json").read_text())
    assert config["train"]["history_dropout"] == 0.5
    weights = [checkpoint.load(trained[n])[0].state_dict() for n in ("plain", "nohist", "nohist2")]
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])  # one seed
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--history-dropout", "1"], "--history-dropout"),
        (["--history-dropout", "-0.1"], "--history-dropout"),
        (["--aux-loss", "-1"], "--aux-loss"),
        (["--ddi-loss", "-1"], "--ddi-loss"),
        (["--ddi-loss", "nan"], "--ddi-loss"),
        (["--lr-decay", "0"], "--lr-decay"),
        (["--lr-decay", "1.5"], "--lr-decay"),
        (["--dim", "15"], "divisible by heads"),
        (["--emb-dropout", "1"], "--emb-dropout"),
    ],
)
def test_bad_options_exit_2(tiny, tmp_path, args, message):
    res = CliRunner().invoke(
        main, ["train", "--data", str(tiny[0]), "--out", str(tmp_path / "c"), "--quiet", *args]
    )
    assert res.exit_code == 2 and message in res.output
    assert not (tmp_path / "c").exists()


def test_ddi_loss_counts_the_expected_interacting_pairs_each_step_adds():
    # medications 0..3, END 4, START 5, PAD 6; 0 interacts with 2, 1 with 3
    ddi = torch.zeros(4, 4)
    ddi[0, 2] = ddi[2, 0] = ddi[1, 3] = ddi[3, 1] = 1.0
    log_probs = torch.randn(2, 4, 5).log_softmax(-1)
    p = log_probs.exp()
    # visit 0 recommends 0 then 1 then END; visit 1 recommends 2 then END, then padding
    inputs = torch.tensor([[5, 0, 1, 6], [5, 2, 6, 6]])
    target = torch.tensor([[0, 1, 4, IGNORE], [2, 4, IGNORE, IGNORE]])
    expected = [
        0.0,  # nothing before the first medication
        p[0, 1, 2],  # after 0: 2 interacts
        p[0, 2, 2] + p[0, 2, 3],  # after 0 and 1: 2 and 3
        0.0,
        p[1, 1, 0],  # after 2: 0 interacts
    ]
    got = ddi_loss(log_probs, inputs, target, ddi)
    assert float(got) == pytest.approx(float(sum(expected)) / 5, rel=1e-6)
    assert float(ddi_loss(log_probs, inputs, target, torch.zeros(4, 4))) == 0.0


def test_ddi_loss_gradient_lowers_the_expected_interacting_pairs(tiny):
    """A small step on the DDI term alone lowers it: the gradient reaches the network and
    points away from interacting medications."""
    model, vocab, batch = _batch(tiny)
    model.eval()
    ddi = torch.from_numpy(model_ddi(tiny, vocab))
    inputs, target = batch["dec_input"], batch["dec_target"]
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    before = ddi_loss(model(batch), inputs, target, ddi)
    before.backward()
    assert model.gen_head.weight.grad.abs().sum() > 0
    optim.step()
    with torch.no_grad():
        after = ddi_loss(model(batch), inputs, target, ddi)
    assert 0 < float(after) < float(before.detach())


def model_ddi(tiny, vocab):
    import pyarrow.parquet as pq

    from cognet.model.batching import ddi_adjacency

    table = pq.read_table(tiny[0] / "ddi.parquet")
    pairs = list(zip(*(table.column(c).to_pylist() for c in ("drug_a", "drug_b")), strict=True))
    return ddi_adjacency(pairs, vocab)


def test_batch_loss_adds_the_weighted_ddi_term(tiny):
    model, vocab, batch = _batch(tiny)
    model.eval()
    ddi = torch.from_numpy(model_ddi(tiny, vocab))
    with torch.no_grad():
        plain = batch_loss(model, batch, vocab, TrainConfig())
        on = batch_loss(model, batch, vocab, TrainConfig(ddi_loss=3.0), ddi=ddi)
        term = ddi_loss(model(batch), batch["dec_input"], batch["dec_target"], ddi)
    assert float(term) > 0
    assert float(on) == pytest.approx(float(plain) + 3.0 * float(term), rel=1e-5)


def test_ddi_loss_trains_another_model_and_is_recorded(trained):
    config = json.loads((trained["ddi"] / "config.json").read_text())
    assert config["train"]["ddi_loss"] == 2.0
    plain = json.loads((trained["plain"] / "config.json").read_text())
    assert plain["train"]["ddi_loss"] == 0.0 and plain["model"] == config["model"]
    a = checkpoint.load(trained["plain"])[0].state_dict()
    b = checkpoint.load(trained["ddi"])[0].state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_ddi_loss_without_pairs_is_refused(tiny, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    data = tmp_path / "data"
    shutil.copytree(tiny[0], data)
    no_pairs = pq.read_table(data / "ddi.parquet").slice(0, 0)  # the columns, no pair
    pq.write_table(no_pairs, data / "ddi.parquet")
    res = CliRunner().invoke(
        main,
        ["train", "--data", str(data), "--out", str(tmp_path / "c"), *SMALL, "--ddi-loss", "1"],
    )
    assert res.exit_code == 2 and "--ddi-loss" in res.output and "ddi" in res.output
    assert not (tmp_path / "c").exists()
