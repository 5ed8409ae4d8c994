"""Set decoding's driver (`cognet.core.decoding.sampling`): counter-based draws, unbiased marginals
against exact enumeration, independence from batch-mates, set rules under DDI policies."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding.draws import uniforms, visit_keys
from cognet.core.decoding.driver import Visits
from cognet.core.decoding.sampling import SetConfig, _step_distribution, decode_sets, set_marginals
from cognet.core.decoding.set_rules import select_sets


class FixedSession:
    """A decoder whose next-token distribution is a fixed q per visit (the driver masks
    what a sample already holds): P(k in S) has a closed form by enumeration."""

    prefix_cache = False  # its cache is not the token prefix: the one loop

    def __init__(self, q: np.ndarray):
        self.q = np.log(np.asarray(q, np.float32))  # [n, V1]
        self.calls = 0

    def empty_cache(self, n, beam):
        return np.zeros((n, beam, 0), np.float32)

    def step(self, tokens, parent, cache, memories, outputs):
        self.calls += 1
        rows = memories  # the visit of each row
        lp = np.broadcast_to(self.q[rows][:, None, :], (*tokens.shape, self.q.shape[1])).copy()
        out = {"log_probs": lp}
        if "gate" in outputs:
            out["gate"] = np.full(tokens.shape, 0.25, np.float32)
            out["copy_probs"] = np.full((*tokens.shape, 3), 1 / 3, np.float32)
        return {k: out[k] for k in outputs}, np.concatenate([cache, tokens[..., None]], -1)

    def take(self, value, rows):
        return value[rows]


def exact_inclusion(q: np.ndarray) -> np.ndarray:
    """P(k in S) when tokens are drawn from q without replacement until END (last index)."""
    m = len(q) - 1
    prob = np.zeros(m)

    def walk(used: tuple[int, ...], p: float) -> None:
        free = [j for j in range(m + 1) if j not in used]
        total = sum(q[j] for j in free)
        for j in free:
            pj = p * q[j] / total
            if j == m:
                for k in used:
                    prob[k] += pj
            else:
                walk((*used, j), pj)

    walk((), 1.0)
    return prob


def test_uniforms_are_keyed_not_positional():
    keys = visit_keys(["a", "b", "c"])
    u = uniforms(7, keys, 5, 3)
    assert u.shape == (3, 5) and (u > 0).all() and (u < 1).all()
    # the same visit draws the same numbers in any batch, at any row
    assert np.array_equal(uniforms(7, keys[[2, 0]], 5, 3), u[[2, 0]])
    assert np.array_equal(uniforms(7, keys[1:2], 5, 3)[0], u[1])
    # and different numbers for another seed, step or sample
    assert not np.array_equal(uniforms(8, keys, 5, 3), u)
    assert not np.array_equal(uniforms(7, keys, 5, 4), u)
    assert len(np.unique(u)) == u.size
    many = uniforms(0, visit_keys([str(i) for i in range(2000)]), 50, 0).ravel()
    assert abs(many.mean() - 0.5) < 0.005
    hist = np.histogram(many, bins=10, range=(0, 1))[0] / many.size
    assert np.abs(hist - 0.1).max() < 0.005


@pytest.mark.parametrize("seed", [0, 1])
def test_marginals_are_unbiased(seed):
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.ones(5) * 0.7, size=3)  # 4 medications + END, 3 visits
    q[:, -1] = np.maximum(q[:, -1], 0.08)
    q /= q.sum(1, keepdims=True)
    cfg = SetConfig(end=4, samples=3000, seed=seed, max_len=10)
    est, _, _ = set_marginals(FixedSession(q), np.arange(3), cfg, Visits(3, keys=visit_keys("xyz")))
    exact = np.stack([exact_inclusion(row) for row in q])
    assert np.abs(est - exact).max() < 0.02
    # counting the samples that hold k is unbiased too, with more variance
    assert est.shape == (3, 4) and (est >= 0).all() and (est <= 1 + 1e-9).all()


def test_a_visit_does_not_depend_on_its_batch_mates():
    rng = np.random.default_rng(3)
    q = rng.dirichlet(np.ones(9), size=6)
    cfg = SetConfig(end=8, samples=16, threshold=0.3, max_len=12)
    ids = [f"V{i}" for i in range(6)]
    together = decode_sets(FixedSession(q), np.arange(6), cfg, Visits(6, keys=visit_keys(ids)))
    for i in (0, 4):
        visits = Visits(1, keys=visit_keys(ids[i : i + 1]))
        alone = decode_sets(FixedSession(q[i : i + 1]), np.arange(1), cfg, visits)
        assert np.array_equal(alone.meds[0], together.meds[i])
        assert np.allclose(alone.prauc_scores[0], together.prauc_scores[i], atol=0, rtol=0)


def test_sets_follow_threshold_and_order():
    marg = np.array([[0.1, 0.6, 0.6, 0.9, 0.3]])
    assert select_sets(marg, 0.5)[0].tolist() == [3, 1, 2]  # ties: smaller id first
    assert select_sets(marg, 0.3)[0].tolist() == [3, 1, 2, 4]
    assert select_sets(marg, 0.95)[0].tolist() == []


def test_hard_and_max_rate_hold_on_the_returned_set():
    m = 6
    adj = np.zeros((m, m), bool)
    for a, b in [(0, 1), (2, 3), (1, 3)]:
        adj[a, b] = adj[b, a] = True
    marg = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]])
    hard = select_sets(marg, 0.3, DDIPolicy(mode="hard"), adj)[0].tolist()
    assert hard == [0, 2, 4, 5]
    assert not any(adj[a, b] for a, b in itertools.combinations(hard, 2))
    capped = select_sets(marg, 0.3, DDIPolicy(max_rate=0.1), adj)[0].tolist()
    pairs = sum(adj[a, b] for a, b in itertools.combinations(capped, 2))
    assert pairs / (len(capped) * (len(capped) - 1) / 2) <= 0.1
    assert capped[:2] == [0, 2]


def test_hard_sampling_never_emits_a_clash_within_a_sample():
    q = np.full((2, 5), 0.2)
    adj = np.zeros((4, 4), bool)
    adj[0, 1] = adj[1, 0] = True
    cfg = SetConfig(end=4, samples=200, max_len=6, ddi=DDIPolicy(mode="hard"))
    session = FixedSession(q)
    res = decode_sets(session, np.arange(2), cfg, Visits(2, keys=visit_keys("ab"), ddi_adj=adj))
    # P(0 in S) + P(1 in S) counts the samples holding either; never both: <= 1
    assert (res.prauc_scores[:, 0] + res.prauc_scores[:, 1] <= 1 + 1e-6).all()


def test_kept_clash_counts_equal_the_product_at_every_step():
    """The sampler keeps each sample's interacting pairs as it emits (soft, hard): at every
    step they equal the product of its medications with the adjacency, which
    `apply_step_penalty` computes when not given them, so the draws are the same."""
    from cognet.core.decoding.driver import run
    from cognet.core.decoding.sampling import SetSampler

    rng = np.random.default_rng(3)
    q = rng.dirichlet(np.ones(9), size=4)
    adj = rng.random((8, 8)) < 0.4
    adj = np.triu(adj, 1)
    adj = adj | adj.T
    checked = []

    class Checking(SetSampler):
        def select(self, t, got, rows, parent):
            if self.clashes is not None:
                product = self.used[..., :8].astype(np.float32) @ adj.astype(np.float32)
                assert np.array_equal(self.clashes, product)
                checked.append(t)
            return super().select(t, got, rows, parent)

    for policy in (DDIPolicy("soft", 0.7), DDIPolicy("hard")):
        cfg = SetConfig(end=8, samples=16, max_len=8, ddi=policy)
        sampler = Checking(cfg, visit_keys("abcd"), ddi_adj=adj)
        run(FixedSession(q), np.arange(4), 4, sampler, cfg)
    assert len(checked) >= 8


def test_explanations_average_the_emitting_steps():
    q = np.full((1, 4), 0.25)
    cfg = SetConfig(end=3, samples=8, threshold=0.05, max_len=5)
    visits = Visits(1, keys=visit_keys("a"), explain=True)
    res = decode_sets(FixedSession(q), np.arange(1), cfg, visits)
    assert len(res.gates[0]) == len(res.meds[0]) > 0
    assert np.allclose(res.gates[0], 0.25)
    assert res.copies[0].shape == (len(res.meds[0]), 3)


# -- the estimators: how the samples draw ------------------------------------------------------


def _strata(u: np.ndarray, size) -> np.ndarray:
    return np.floor(u * size).astype(int)


def test_stratified_draws_take_every_stratum_once_per_visit_and_step():
    keys = visit_keys([f"V{i}" for i in range(50)])
    for step in (0, 7):
        u = uniforms(3, keys, 16, step, "stratified")
        assert (u > 0).all() and (u < 1).all()
        assert (np.sort(_strata(u, 16), axis=1) == np.arange(16)).all()
    # the strata move between steps and visits; the draws stay keyed, not positional
    a, b = uniforms(3, keys, 16, 0, "stratified"), uniforms(3, keys, 16, 1, "stratified")
    assert (_strata(a, 16) != _strata(b, 16)).any()
    assert np.array_equal(uniforms(3, keys[[4, 1]], 16, 0, "stratified"), a[[4, 1]])
    # marginally uniform: each sample's stratum is uniform over many visits
    many = uniforms(0, visit_keys([str(i) for i in range(4000)]), 8, 2, "stratified")
    counts = np.bincount(_strata(many[:, 0], 8), minlength=8) / 4000
    assert np.abs(counts - 1 / 8).max() < 0.03


def test_tree_draws_are_stratified_within_each_shared_prefix():
    keys = visit_keys(["a", "b"])
    prefix = np.array([[5, 5, 5, 9, 9, 1, 5, 9], [3, 3, 3, 3, 3, 3, 3, 3]], np.uint64)
    u = uniforms(1, keys, 8, 4, "tree", prefix)
    assert (u > 0).all() and (u < 1).all()
    for row, group in ((0, 5), (0, 9), (0, 1), (1, 3)):
        members = prefix[row] == group
        got = np.sort(_strata(u[row, members], members.sum()))
        assert got.tolist() == list(range(members.sum()))
    # one prefix for all (the first step) is the stratified draw
    same = uniforms(1, keys, 8, 4, "tree", np.zeros((2, 8), np.uint64))
    assert np.array_equal(same, uniforms(1, keys, 8, 4, "stratified"))


@pytest.mark.parametrize("estimator", ["stratified", "tree"])
def test_every_estimator_is_unbiased_and_batch_independent(estimator):
    rng = np.random.default_rng(11)
    q = rng.dirichlet(np.ones(5) * 0.7, size=3)
    q[:, -1] = np.maximum(q[:, -1], 0.08)
    q /= q.sum(1, keepdims=True)
    cfg = SetConfig(end=4, samples=3000, seed=2, max_len=10, estimator=estimator)
    est, _, _ = set_marginals(FixedSession(q), np.arange(3), cfg, Visits(3, keys=visit_keys("xyz")))
    exact = np.stack([exact_inclusion(row) for row in q])
    assert np.abs(est - exact).max() < 0.02
    small = SetConfig(end=4, samples=16, threshold=0.3, max_len=10, estimator=estimator)
    together = decode_sets(FixedSession(q), np.arange(3), small, Visits(3, keys=visit_keys("xyz")))
    alone = decode_sets(FixedSession(q[1:2]), np.arange(1), small, Visits(1, keys=visit_keys("y")))
    assert np.array_equal(alone.prauc_scores[0], together.prauc_scores[1])


def test_stratified_and_tree_draws_have_less_error_than_plain_ones():
    """Mean absolute error of P(k in S) against exact enumeration, 16 samples, 300 visits."""
    rng = np.random.default_rng(5)
    q = rng.dirichlet(np.ones(6) * 0.5, size=300)
    q[:, -1] = np.maximum(q[:, -1], 0.1)
    q /= q.sum(1, keepdims=True)
    exact = np.stack([exact_inclusion(row) for row in q])
    keys = visit_keys([f"V{i}" for i in range(300)])
    error = {}
    for estimator in ("plain", "stratified", "tree"):
        cfg = SetConfig(end=5, samples=16, max_len=10, estimator=estimator)
        est, _, _ = set_marginals(FixedSession(q), np.arange(300), cfg, Visits(300, keys=keys))
        error[estimator] = np.abs(est - exact).mean()
    assert error["tree"] < error["stratified"] < error["plain"]


def _every_row_marginals(q, cfg, keys, ddi_adj=None) -> np.ndarray:
    """P(k in S) the way the sampler computed it before it skipped finished samples: every
    sample's distribution at every step, a finished one's all on END."""
    n, s, end = len(q), cfg.samples, cfg.end
    logq = np.log(np.asarray(q, np.float32))
    used, finished = np.zeros((n, s, end + 1), bool), np.zeros((n, s), bool)
    hazard = np.zeros((n, end))
    for t in range(cfg.max_len):
        lp = np.broadcast_to(logq[:, None, :], (n, s, end + 1))
        p = _step_distribution(lp, used, finished, end, cfg.ddi, ddi_adj)
        hazard += p[..., :end].sum(1)
        cum = np.cumsum(p, -1)
        u = uniforms(cfg.seed, keys, s, t, cfg.estimator)
        tokens = np.minimum(np.count_nonzero(cum < (u * cum[..., -1])[..., None], -1), end)
        r, c = np.indices(tokens.shape)
        used[r, c, tokens] = True
        finished |= tokens == end
        if finished.all():
            break
    return np.minimum(hazard / s, 1.0)


@pytest.mark.parametrize("estimator", ["plain", "stratified"])
@pytest.mark.parametrize("mode", ["off", "soft"])
def test_skipping_finished_samples_changes_no_marginal(estimator, mode):
    """The sampler computes only the samples still open; what it returns is what computing
    every row gives, up to the order of a sum (1e-15), for visits whose samples end far
    apart (END's probability 0.02-0.5)."""
    rng = np.random.default_rng(17)
    q = rng.dirichlet(np.ones(9) * 0.6, size=40)
    q[:, -1] = rng.uniform(0.02, 0.5, 40)
    q[:, :-1] *= (1 - q[:, -1:]) / q[:, :-1].sum(1, keepdims=True)
    adj = np.zeros((8, 8), np.float32)
    adj[0, 3] = adj[3, 0] = adj[2, 5] = adj[5, 2] = 1
    ddi = DDIPolicy(mode, penalty=1.5) if mode == "soft" else DDIPolicy()
    cfg = SetConfig(end=8, samples=16, seed=4, max_len=9, estimator=estimator, ddi=ddi)
    keys = visit_keys([f"V{i}" for i in range(40)])
    est, _, _ = set_marginals(
        FixedSession(q), np.arange(40), cfg, Visits(40, keys=keys, ddi_adj=adj)
    )
    want = _every_row_marginals(q, cfg, keys, adj if mode == "soft" else None)
    assert np.abs(est - want).max() <= 1e-15
    assert (est > 0).sum() > 100  # the samples emitted medications
