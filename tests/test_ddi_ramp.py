"""`--ddi-loss-target`: the DDI term weighed per batch by how far the batch's predicted DDI
rate lies above a target (SafeDrug's ramp)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from tiny import make_tiny, train_small

from cognet.core.history import load_split
from cognet.model import checkpoint
from cognet.model.batching import IGNORE, ddi_adjacency, make_batch
from cognet.training.loss import ddi_loss, ddi_terms, ramp
from cognet.training.train import DDI_RAMP, TrainConfig, batch_loss


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ramp")
    data, ckpt = make_tiny(root, n_patients=40)
    model, vocab, _ = checkpoint.load(ckpt)
    visits = pq.read_table(data / "visits.parquet")
    batch = make_batch(load_split(visits, vocab, "train").patients[:6], vocab)
    table = pq.read_table(data / "ddi.parquet")
    pairs = list(zip(*(table.column(c).to_pylist() for c in ("drug_a", "drug_b")), strict=True))
    ddi = torch.from_numpy(ddi_adjacency(pairs, vocab))
    return data, model.eval(), vocab, batch, ddi


def test_the_predicted_rate_is_interacting_pairs_over_pairs():
    # medications 0..2, END 3, START 4, PAD 5; 0 interacts with 1
    ddi = torch.zeros(3, 3)
    ddi[0, 1] = ddi[1, 0] = 1.0
    log_probs = torch.randn(1, 3, 4).log_softmax(-1)
    p = log_probs.exp()[0]
    inputs = torch.tensor([[4, 0, 1]])
    target = torch.tensor([[0, 1, 3]])
    # step 1 (prefix {0}): 1 interacts, 1 and 2 make a pair with 0; step 2 (prefix {0, 1}):
    # 0 and 1 interact with one of the prefix, and make a pair with the other one; 2 with both
    interacting = p[1, 1] + p[2, 0] + p[2, 1]
    pairs = p[1, 1] + p[1, 2] + p[2, 0] + p[2, 1] + 2 * p[2, 2]
    term, rate = ddi_terms(log_probs, inputs, target, ddi)
    assert float(rate) == pytest.approx(float(interacting / pairs), rel=1e-6)
    assert float(term) == pytest.approx(float(ddi_loss(log_probs, inputs, target, ddi)))
    assert not rate.requires_grad
    no_pairs = torch.tensor([[4, 3, 5]]), torch.tensor([[3, IGNORE, IGNORE]])
    assert float(ddi_terms(log_probs, *no_pairs, ddi)[1]) == 0.0  # no pair: rate 0, not NaN


def test_the_ramp_rises_from_the_target():
    r = torch.tensor
    assert ramp(r(0.05), 0.06, 0.05) == 0.0
    assert ramp(r(0.06), 0.06, 0.05) == 0.0
    assert ramp(r(0.085), 0.06, 0.05) == pytest.approx(0.5)
    assert ramp(r(0.2), 0.06, 0.05) == 1.0


def test_batch_loss_weighs_the_ddi_term_by_the_ramp(tiny):
    _, model, vocab, batch, ddi = tiny
    with torch.no_grad():
        plain = float(batch_loss(model, batch, vocab, TrainConfig()))
        term, rate = ddi_terms(model(batch), batch["dec_input"], batch["dec_target"], ddi)
        under = TrainConfig(ddi_loss=3.0, ddi_loss_target=1.0)  # every rate is <= 1
        assert float(batch_loss(model, batch, vocab, under, ddi=ddi)) == pytest.approx(plain)
        target = float(rate) - DDI_RAMP / 4  # a quarter of the way up the ramp
        part = TrainConfig(ddi_loss=3.0, ddi_loss_target=target)
        got = float(batch_loss(model, batch, vocab, part, ddi=ddi))
    assert 0 < float(rate) < 1 and float(term) > 0
    assert got == pytest.approx(plain + 3.0 * 0.25 * float(term), rel=1e-5)


def test_train_records_the_target_and_refuses_it_alone(tiny, tmp_path):
    data = tiny[0]
    out = tmp_path / "ramp"
    args = ["--ddi-loss", "2", "--ddi-loss-target", "0.05"]
    res = train_small(data, out, "--seed", "3", *args)
    assert res.exit_code == 0, res.output
    trained = json.loads((out / "config.json").read_text())["train"]
    assert (trained["ddi_loss"], trained["ddi_loss_target"]) == (2.0, 0.05)
    res = train_small(data, tmp_path / "x", "--ddi-loss-target", "0.05")
    assert res.exit_code == 2 and "--ddi-loss-target needs --ddi-loss" in res.output
    assert not (tmp_path / "x").exists()
