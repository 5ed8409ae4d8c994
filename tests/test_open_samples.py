"""Set decoding's narrowed loop (`cognet.core.decoding.open_samples`): the same marginals as the one
loop, bit for bit, from a decoder whose rows do not depend on their batch; fewer rows;
the blocks of the memories; the runtime's sets unchanged."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import driver, open_samples
from cognet.core.decoding.draws import visit_keys
from cognet.core.decoding.sampling import SetConfig, SetSampler
from cognet.runtime import ScoreOptions, Scorer


class PrefixSession:
    """A decoder with the token-prefix cache whose every row is computed on its own, in
    float64: its log-probabilities depend on the visit's memory, the tokens fed before
    (by position) and the token fed now, never on the batch's shape, so any two loops that
    feed it the same rows get the same bits. Records the rows of every call."""

    prefix_cache = True

    def __init__(self, n_med: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.v1 = n_med + 1  # medications and END (START, fed only, is n_med + 1)
        self.table = rng.normal(0.0, 1.0, (n_med + 2, self.v1))  # token fed -> logit shift
        self.calls: list[tuple[int, int, int]] = []  # (visits, width, prefix length)

    def memories(self, n: int, seed: int = 1) -> dict[str, np.ndarray]:
        return {"logits": np.random.default_rng(seed).normal(0.0, 1.5, (n, self.v1))}

    def empty_cache(self, n, width):
        return (np.zeros((n, width, 0), np.int64),)

    def step(self, tokens, parent, cache, memories, outputs):
        (past,) = cache
        past = np.take_along_axis(past, parent[..., None], axis=1)
        present = np.concatenate([past, tokens[..., None]], axis=2)
        n, w, t = present.shape
        self.calls.append((n, w, t - 1))
        out = np.empty((n, w, self.v1), np.float32)
        for i in range(n):
            for j in range(w):
                z = memories["logits"][i].copy()
                for pos, tok in enumerate(present[i, j]):
                    z += self.table[tok] / (pos + 1.0)
                z -= z.max()
                out[i, j] = z - np.log(np.exp(z).sum())
        return {"log_probs": out}, (present,)

    def take(self, value, rows):
        if isinstance(value, dict):
            return {k: v[rows] for k, v in value.items()}
        return tuple(v[rows] for v in value)

    def rows(self) -> int:
        return sum(n * w for n, w, _ in self.calls)


@pytest.mark.parametrize(
    "samples,estimator,compact_at,ddi",
    [
        (16, "stratified", 0.75, DDIPolicy()),
        (16, "tree", 1.0, DDIPolicy()),
        (7, "plain", 0.5, DDIPolicy()),
        (12, "stratified", 0.75, DDIPolicy(mode="soft", penalty=1.0)),
        (1, "plain", 0.75, DDIPolicy()),
    ],
)
def test_narrowed_marginals_equal_the_one_loops_bit_for_bit(samples, estimator, compact_at, ddi):
    n, n_med = 40, 10
    adj = np.zeros((n_med, n_med), bool)
    adj[0, 1] = adj[1, 0] = adj[2, 5] = adj[5, 2] = True
    cfg = SetConfig(
        end=n_med,
        samples=samples,
        estimator=estimator,
        compact_at=compact_at,
        ddi=ddi,
        max_len=8,
    )
    full, packed = PrefixSession(n_med), PrefixSession(n_med)
    memories = full.memories(n)

    def marginals(loop, session):
        sampler = SetSampler(cfg, visit_keys([f"v{i}" for i in range(n)]), adj)
        assert open_samples.applies(session, sampler)
        return loop(session, memories, n, sampler, cfg)

    want, _, steps = marginals(driver.run, full)
    got, _, got_steps = marginals(open_samples.run, packed)
    assert np.array_equal(got, want) and got_steps == steps
    assert 0 < want.sum() and want.max() <= 1.0
    # fewer rows; at the first step every visit's samples share one prefix: one row each
    assert packed.rows() < full.rows()
    assert [(n, w) for n, w, t in packed.calls if t == 0] == [(n, 1)]


def test_call_widths_and_blocks():
    assert open_samples.widths(16) == (16, 12, 8, 4)
    assert open_samples.widths(32) == (32, 24, 16, 8, 4)
    assert open_samples.widths(6) == (6, 4)
    assert open_samples.widths(1) == (1,)
    table = open_samples._level_table(open_samples.widths(16))
    # open samples -> block: 13-16 the widest, 9-12, 5-8, 1-4, none: over
    assert table[[0, 1, 4, 5, 8, 9, 12, 13, 16]].tolist() == [4, 3, 3, 2, 2, 1, 1, 0, 0]


def test_visits_that_narrow_keep_every_block_contiguous():
    rng = np.random.default_rng(5)
    n, levels = 30, 3
    memories = {"m": rng.normal(size=(n, 3, 2)), "flag": np.arange(n, dtype=np.float32)}
    original = {k: v.copy() for k, v in memories.items()}
    blocks = open_samples._Blocks(memories, n, 4, levels, 5)
    target = np.zeros(n, np.int64)
    for _ in range(6):  # visits only ever narrow
        target = np.maximum(target, rng.integers(0, levels + 1, n))
        moving = np.flatnonzero(target > blocks.level)
        blocks.lower(moving, target[moving])
        assert (blocks.level == target).all()
        # block l holds exactly the visits of level l, and each row its visit's memories
        for lvl in range(levels + 1):
            rows = np.arange(blocks.start[lvl], blocks.start[lvl + 1])
            assert sorted(blocks.order[rows]) == sorted(np.flatnonzero(target == lvl))
        assert (blocks.order[blocks.at] == np.arange(n)).all()
        for k, v in original.items():
            assert np.array_equal(blocks.memories[k], v[blocks.order])
    assert all(np.array_equal(memories[k], v) for k, v in original.items())  # not written


@pytest.mark.parametrize("batch_size", [3, 64])
def test_runtime_sets_are_the_one_loops(tiny, batch_size, monkeypatch):
    table = pq.read_table(tiny / "data" / "visits.parquet")

    def score():
        scorer = Scorer(
            tiny / "model",
            ScoreOptions.of(
                device="cpu", decoding="set", samples=16, threshold=0.3, batch_size=batch_size
            ),
        )
        chunks = scorer.score_table(table, score_all=True)
        return pa.concat_tables([c.recommendations for c in chunks]).to_pylist()

    packed = score()
    monkeypatch.setattr(open_samples, "applies", lambda *_: False)
    full = score()
    assert len(full) == len(packed) >= 200
    same = sum(a["medications"] == b["medications"] for a, b in zip(full, packed, strict=True))
    assert same >= 0.995 * len(full)
    for a, b in zip(full, packed, strict=True):
        if a["medications"] == b["medications"]:
            assert np.allclose(a["probabilities"], b["probabilities"], atol=2e-6, rtol=0)
