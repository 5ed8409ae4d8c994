"""The driver with the host beam selector equals the test oracle (tests/beam_oracle.py, the
plain torch loop) when it runs the torch model's graphs through the session interface, and so
does the torch beam search of cognet.model.torch_decoding; top-k keeps stable-sort order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from beam_oracle import beam_search as torch_beam_search
from tiny import DDI_IDS, DDI_POLICIES, make_case

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import Decoding
from cognet.core.decoding.beam import BeamConfig, beam_search, top_k_stable
from cognet.core.decoding.driver import Visits
from cognet.core.graphspec import INIT_INPUTS
from cognet.model.batching import make_batch
from cognet.model.network import history_inputs
from cognet.model.session import TorchSession
from cognet.model.torch_decoding import beam_search as model_beam_search

torch.set_num_threads(1)  # tiny tensors: threads only add contention


def run_both(model, vocab, patients, beam, max_len, compact_at, prauc=True, explain=False):
    batch = make_batch(patients, vocab, targets=False)
    ref = torch_beam_search(model, batch, beam=beam, max_len=max_len)
    with torch.no_grad():
        enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
        inputs = history_inputs(batch, *enc, model.cfg)
    session = TorchSession(model)
    memories = session.init({k: v.numpy() for k, v in zip(INIT_INPUTS, inputs, strict=True)})
    cfg = BeamConfig(end=vocab.end, beam=beam, max_len=max_len, compact_at=compact_at)
    visits = Visits(len(batch["target"]), prauc=prauc, explain=explain)
    ours = beam_search(session, memories, cfg, visits)
    return ref, ours


@pytest.mark.parametrize(
    "beam,max_len,compact_at,n_med,seed",
    [
        (4, 45, 1.0, 12, 0),  # compacts whenever a visit is done, like the reference
        (4, 45, 0.5, 12, 1),  # carries done visits a while
        (1, 45, 0.75, 12, 2),  # greedy
        (3, 4, 0.75, 12, 3),  # stopped by max_len
        (4, 12, 0.75, 4, 4),  # hypotheses run out of medications: -inf candidates
    ],
)
def test_driver_equals_torch_reference(beam, max_len, compact_at, n_med, seed):
    model, vocab, patients = make_case(n_med=n_med, seed=seed)
    ref, ours = run_both(model, vocab, patients, beam, max_len, compact_at)
    assert len(ours.meds) == len(ref)
    for i, r in enumerate(ref):
        assert tuple(ours.meds[i].tolist()) == r.meds
        assert ours.score[i] == np.float32(r.score)
        np.testing.assert_allclose(ours.med_probs[i], r.med_probs, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(ours.prauc_scores[i], r.scores, rtol=1e-4, atol=1e-6)


def test_driver_explains_along_the_best_hypothesis():
    model, vocab, patients = make_case(seed=5)
    ref, ours = run_both(model, vocab, patients, 4, 45, 0.75, prauc=False, explain=True)
    for i, r in enumerate(ref):
        k = len(r.meds)
        assert ours.gates[i].shape == (k,) and ours.copies[i].shape[0] == k
        assert ((ours.gates[i] >= 0) & (ours.gates[i] <= 1)).all()
        if k:
            np.testing.assert_allclose(ours.copies[i].sum(1), 1.0, rtol=1e-5)


def test_dead_rows_are_dropped_and_steps_stop_early():
    model, vocab, patients = make_case(seed=6)
    n = sum(map(len, patients))
    _, eager = run_both(model, vocab, patients, 4, 45, 1.0)
    _, lazy = run_both(model, vocab, patients, 4, 45, 0.3)
    assert eager.steps == lazy.steps < 45
    for a, b in zip(eager.meds, lazy.meds, strict=True):
        assert (a == b).all()
    assert len(eager.meds) == n


def _stable_top(x: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-x, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k_is_a_stable_descending_sort(k):
    rng = np.random.default_rng(k)
    cases = [
        rng.standard_normal((50, 40)).astype(np.float32),
        np.round(rng.standard_normal((50, 40)), 1).astype(np.float32),  # many ties
        np.where(rng.random((50, 40)) < 0.9, -np.inf, rng.standard_normal((50, 40))).astype(
            np.float32
        ),  # mostly -inf, some rows with < k finite values
        np.full((5, 40), -np.inf, np.float32),
        np.zeros((5, 40), np.float32),
    ]
    for x in cases:
        idx, val = top_k_stable(x.copy(), k)
        assert (idx == _stable_top(x, k)).all()
        assert (val == np.take_along_axis(x, idx, 1)).all()


@pytest.mark.parametrize("policy", DDI_POLICIES, ids=DDI_IDS)
@pytest.mark.parametrize("beam,max_len,n_med", [(4, 45, 12), (1, 45, 12), (3, 5, 4)])
def test_torch_beam_search_equals_the_oracle(policy, beam, max_len, n_med):
    """`cognet.model.torch_decoding.beam_search` (the driver over `TorchSession`) gives the oracle's
    answer on every visit, also for a subset of the batch's rows."""
    model, vocab, patients = make_case(n_med=n_med, seed=8, n_patients=16)
    batch = make_batch(patients, vocab, targets=False)
    rows = torch.arange(0, len(batch["target"]), 2)
    for some in (None, rows):
        ref = torch_beam_search(model, batch, beam, max_len, rows=some, ddi=policy)
        ours = model_beam_search(model, batch, beam, max_len, rows=some, ddi=policy)
        assert len(ours) == len(ref) == (len(batch["target"]) if some is None else len(some))
        for r, o in zip(ref, ours, strict=True):
            assert o.meds == r.meds
            assert np.float32(o.score) == np.float32(r.score)
            np.testing.assert_allclose(o.med_probs, r.med_probs, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(o.scores, r.scores, rtol=1e-4, atol=1e-6)


def test_beam_config_of_a_decoding_carries_its_beam_and_length():
    policy = DDIPolicy("soft", 2)
    decoding = Decoding("beam", beam=3, max_len=7)
    assert BeamConfig.of(decoding, 12, policy, 0.5) == BeamConfig(
        end=12, beam=3, max_len=7, compact_at=0.5, ddi=policy
    )
    assert BeamConfig.of(decoding, 12) == BeamConfig(end=12, beam=3, max_len=7)
