"""COGNet in torch: step-wise decoding equals teacher forcing, padding and order never
change a result, beam search follows the documented semantics, and the model learns."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cognet.core.history import Visit
from cognet.core.metrics import jaccard
from cognet.core.vocab import Vocab
from cognet.model.batching import ehr_adjacency, make_batch
from cognet.model.network import ABLATIONS, COGNet, ModelConfig, history_inputs
from cognet.model.torch_decoding import beam_search
from cognet.training.loss import mix_inputs
from cognet.training.train import TrainConfig, train_epoch

D, P, M = 30, 20, 12


def make_vocab(seed: int = 0) -> Vocab:
    rng = np.random.default_rng(seed)
    return Vocab(
        tuple(f"d{i:02d}" for i in range(D)),
        tuple(f"p{i:02d}" for i in range(P)),
        tuple(f"m{i:02d}" for i in range(M)),
        tuple(int(x) for x in rng.integers(1, 50, M)),
    )


def random_patients(vocab: Vocab, n: int, seed: int = 0, max_visits: int = 5) -> list[list[Visit]]:
    rng = np.random.default_rng(seed)

    def visit(pid: str, i: int) -> Visit:
        diag = rng.choice(D, rng.integers(0, 6), replace=False).tolist()
        proc = rng.choice(P, rng.integers(0 if diag else 1, 4), replace=False).tolist()
        meds = vocab.rare_first(rng.choice(M, rng.integers(1, 6), replace=False).tolist())
        return Visit(pid, f"{pid}-{i}", tuple(diag), tuple(proc), tuple(meds))

    return [[visit(f"p{k}", i) for i in range(rng.integers(1, max_visits + 1))] for k in range(n)]


def make_model(
    vocab: Vocab, patients, ablation: str = "none", seed: int = 0, dim: int = 32, heads: int = 4
) -> COGNet:
    torch.manual_seed(seed)
    cfg = ModelConfig(D, P, M, dim=dim, heads=heads, ffn=64, ablation=ablation)
    rng = np.random.default_rng(seed)
    ddi = (rng.random((M, M)) < 0.1).astype(np.float32)
    model = COGNet(cfg, ehr_adjacency(patients, M), np.maximum(ddi, ddi.T))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def step_log_probs(model: COGNet, batch) -> torch.Tensor:
    """Decode the teacher-forced inputs one position at a time through the KV cache."""
    enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
    memories = model.decoder_init(*history_inputs(batch, *enc, model.cfg))
    n, length = batch["dec_input"].shape
    past_key, past_value = model.empty_cache(n, 1)
    parent = torch.zeros(n, 1, dtype=torch.long)
    out = []
    for t in range(length):
        lp, _, _, past_key, past_value = model.decoder_step(
            batch["dec_input"][:, t : t + 1], parent, past_key, past_value, *memories
        )
        out.append(lp[:, 0])
    return torch.stack(out, 1)


@pytest.mark.parametrize("ablation", ABLATIONS)
@pytest.mark.parametrize("n_patients,seed", [(1, 0), (4, 1), (9, 2)])
def test_step_decoding_equals_teacher_forcing(ablation, n_patients, seed):
    vocab = make_vocab()
    patients = random_patients(vocab, n_patients, seed)
    model = make_model(vocab, patients, ablation, seed)
    batch = make_batch(patients, vocab)
    with torch.no_grad():
        full, step = model(batch), step_log_probs(model, batch)
    valid = batch["dec_target"] != -100
    assert (step - full)[valid].abs().max().item() <= 1e-5
    assert torch.isfinite(full[valid]).all()


def test_probabilities_sum_to_one_and_no_history_means_no_copy():
    vocab = make_vocab()
    patients = random_patients(vocab, 6, 3)
    model = make_model(vocab, patients)
    batch = make_batch(patients, vocab)
    enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
    memories = model.decoder_init(*history_inputs(batch, *enc, model.cfg))
    with torch.no_grad():
        lp, gate, copy = model.decode_teacher_forced(batch["dec_input"], memories)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(lp.shape[:2]), atol=1e-5, rtol=0)
    first = torch.tensor([i == 0 for p in patients for i in range(len(p))])
    assert torch.all(gate[first] == 1.0)  # a first visit has no history: Pr = Pr_g
    assert torch.all(gate[~first] < 1.0)


def test_padding_and_code_order_never_change_a_result():
    vocab = make_vocab()
    patients = random_patients(vocab, 5, 4)
    model = make_model(vocab, patients)
    rng = random.Random(0)
    shuffled = [
        [
            Visit(
                v.patient_id,
                v.visit_id,
                tuple(rng.sample(v.diag, len(v.diag))),
                tuple(rng.sample(v.proc, len(v.proc))),
                v.meds,
            )
            for v in p
        ]
        for p in patients
    ]
    # a longer extra patient forces more padding on every axis
    extra = [
        Visit("x", f"x{i}", tuple(range(D - 1)), tuple(range(P - 1)), tuple(range(M)))
        for i in range(6)
    ]
    with torch.no_grad():
        base = model(make_batch(patients, vocab))
        padded = model(make_batch([*shuffled, extra], vocab))
    n, length = base.shape[:2]
    valid = make_batch(patients, vocab)["dec_target"] != -100
    assert (padded[:n, :length] - base)[valid].abs().max().item() <= 1e-5


def test_beam_result_does_not_depend_on_batch_mates():
    vocab = make_vocab()
    patients = random_patients(vocab, 8, 5)
    model = make_model(vocab, patients)
    batch = make_batch(patients, vocab, targets=False)
    everyone = beam_search(model, batch, beam=4)
    rows = torch.tensor([7, 2, 11])
    some = beam_search(model, batch, beam=4, rows=rows)
    for r, res in zip(rows.tolist(), some, strict=True):
        assert res.meds == everyone[r].meds
        assert res.score == pytest.approx(everyone[r].score, abs=1e-5)
    alone = beam_search(model, make_batch(patients[:1], vocab, targets=False), beam=4)
    assert [r.meds for r in alone] == [r.meds for r in everyone[: len(alone)]]


@pytest.mark.parametrize("beam", [1, 2, 4])
def test_beam_search_semantics(beam):
    vocab = make_vocab()
    patients = random_patients(vocab, 6, 6)
    model = make_model(vocab, patients)
    batch = make_batch(patients, vocab, targets=False)
    results = beam_search(model, batch, beam=beam, max_len=8)
    for r in results:
        assert len(set(r.meds)) == len(r.meds)  # no repeats
        assert len(r.meds) <= 8
        assert all(0 <= m < M for m in r.meds)
        assert r.score <= 0
        assert len(r.med_probs) == len(r.meds) and all(0 < p <= 1 for p in r.med_probs)
        assert r.scores.shape == (M,)


def test_wider_beam_never_scores_worse_on_its_own_objective():
    vocab = make_vocab()
    patients = random_patients(vocab, 10, 7)
    model = make_model(vocab, patients)
    batch = make_batch(patients, vocab, targets=False)
    g = beam_search(model, batch, beam=1)
    b = beam_search(model, batch, beam=4)
    # not a theorem for every visit, but the total must not get worse
    assert sum(r.score for r in b) >= sum(r.score for r in g) - 1e-4


@pytest.mark.parametrize("sampling", [0.0, 0.4])
def test_tiny_dataset_is_overfit(sampling):
    """The whole loss / copy path learns: 20 patients memorised to train Jaccard > 0.9
    (also when training feeds the decoder some of its own predictions)."""
    vocab = make_vocab()
    patients = random_patients(vocab, 20, 8, max_visits=3)
    torch.manual_seed(0)
    cfg = TrainConfig.from_recipe(
        batch_size=4, lr=3e-3, dropout=0.0, dim=32, scheduled_sampling=sampling
    )
    model = COGNet(
        ModelConfig(D, P, M, dim=32, heads=4, ffn=64, dropout=0.0),
        ehr_adjacency(patients, M),
        np.zeros((M, M), np.float32),
    )
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rng = random.Random(0)
    for _ in range(60):
        train_epoch(model, optim, list(patients), vocab, cfg, rng)
    model.eval()
    decoded = beam_search(model, make_batch(patients, vocab, targets=False), beam=1)
    visits = [v for p in patients for v in p]
    score = np.mean([jaccard(d.meds, v.meds) for d, v in zip(decoded, visits, strict=True)])
    assert score > 0.9


def test_scheduled_sampling_replaces_only_medications_after_start():
    start, pad, end = M + 1, M + 2, M
    inputs = torch.tensor([[start, 3, 5, 7, pad, pad], [start, 1, 2, 4, 6, 8]])
    predicted = torch.tensor([[9, 10, end, 11, 2, 3], [0, end, 5, 6, 7, 1]])  # for t + 1
    assert torch.equal(mix_inputs(inputs, predicted, 0.0, M), inputs)
    mixed = mix_inputs(inputs, predicted, 1.0, M)
    # position t takes predicted[t - 1] when both are medications
    assert mixed.tolist() == [[start, 9, 10, 7, pad, pad], [start, 0, 2, 5, 6, 7]]
    gen = torch.Generator().manual_seed(0)
    half = mix_inputs(inputs.repeat(200, 1), predicted.repeat(200, 1), 0.5, M, gen)
    changed = (half != inputs.repeat(200, 1)).float().sum() / (200 * 5)  # 5 swappable
    assert 0.4 < float(changed) < 0.6


def test_hard_ddi_mode_never_emits_an_interacting_pair():
    from cognet.core.ddi import DDIPolicy, ddi_rates

    vocab = make_vocab()
    patients = random_patients(vocab, 10, 9)
    model = make_model(vocab, patients)
    ddi = ((model.ddi_gcn.adj > 0).float() - torch.eye(M)).numpy() > 0
    batch = make_batch(patients, vocab, targets=False)
    off = beam_search(model, batch, beam=4)
    hard = beam_search(model, batch, beam=4, ddi=DDIPolicy("hard"))

    def rate(results):
        used = np.zeros((len(results), 1, M), bool)
        for i, r in enumerate(results):
            used[i, 0, list(r.meds)] = True
        return ddi_rates(used, ddi)

    assert rate(off).sum() > 0  # the random model does prescribe interacting pairs
    assert rate(hard).sum() == 0
    soft = beam_search(model, batch, beam=4, ddi=DDIPolicy("soft", penalty=2.0))
    assert rate(soft).mean() <= rate(off).mean()
    capped = beam_search(model, batch, beam=4, ddi=DDIPolicy("off", max_rate=0.0))
    assert rate(capped).mean() <= rate(off).mean()
