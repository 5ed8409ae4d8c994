"""Set decoding: the model's best *set* of medications, from its own copy-or-predict
distribution (torch-free, numpy; the rules of docs/INTERNALS.md "Set decoding").

The paper's beam search returns the single most probable sequence, and the decoder orders
medications rare-first, so that sequence must open with a guess among rare alternatives.
Set decoding asks instead, for each medication k, how likely the model's own decoding is to
emit it at all, P(k in S), and returns the set a rule reads from them (`select_sets`): the
medications reaching a threshold tuned on validation, or the set of highest expected
Jaccard (`jaccard_sizes`); `cognet train` stores the rule that scores better there.

How P(k in S) is estimated: N seeded samples are decoded from Pr (the copy-or-predict
mixture, already-emitted medications masked and the rest renormalised, END finishing a
sample). Along each sample the probability of emitting k at each step it is still open is
summed: the conditional probability that k is emitted at step t, given the prefix, is that
step's p_t(k), so the sum has the expectation P(k in S) (a Rao-Blackwellised estimator; it
has far less variance than counting the samples that hold k, and is continuous, which
PRAUC needs). The estimate is the mean over the N samples.

The loop is `cognet.core.decoding.driver.run`; `SetSampler` is the rule it runs on the host (the
runtime's `search.SetGraphSampler` runs the same rule in the exported `set_select` graphs).

Random draws are counter-based: the uniform of (seed, visit, sample, step) is a hash of
those four numbers, so a visit's samples do not depend on its batch-mates, its row or the
engine, and the torch reference and the runtime draw the same numbers. One driver serves
both (any `DecoderSession`): they can differ only by the float32 rounding of the
log-probabilities they are given.

DDI policies (`cognet.core.ddi`): soft and hard act on every sampling step as in beam
search; the returned set is then built in decreasing probability, and `hard` skips a
medication that interacts with one already in the set, `max_rate R` skips one that would
lift the set's DDI rate above R.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cognet.core.ddi import RATE_TOLERANCE, DDIPolicy, check_adjacency
from cognet.core.decoding import ESTIMATORS, SAMPLES, SET_RULES, Decoding, driver
from cognet.core.decoding.driver import COMPACT_AT, LoopConfig, step_outputs
from cognet.core.graphspec import PROB_FLOOR

_SEED = np.uint64(0x9E3779B97F4A7C15)
_SAMPLE = np.uint64(0xD1B54A32D192ED03)
_STEP = np.uint64(0x8CB92BA72F3D8DD7)
_STRATUM = np.uint64(0xA0761D6478BD642F)
_TOKEN = np.uint64(0xE7037ED1A0B428DB)


def visit_key(visit_id: str) -> int:
    """A visit's random stream: 64 bits of blake2b of its id."""
    return int.from_bytes(hashlib.blake2b(visit_id.encode(), digest_size=8).digest(), "little")


def visit_keys(visit_ids: Sequence[str]) -> np.ndarray:
    return np.fromiter((visit_key(v) for v in visit_ids), np.uint64, len(visit_ids))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64 with full avalanche), wrapping."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(
    seed: int,
    keys: np.ndarray,
    samples: int,
    step: int,
    estimator: str = "plain",
    prefix: np.ndarray | None = None,
) -> np.ndarray:
    """float64 [n, samples], strictly inside (0, 1): the draws of step `step` of every
    sample of the visits with these keys.

    - "plain": each draw a hash of (seed, visit, sample, step).
    - "stratified": the samples of a visit take the strata [j/S, (j+1)/S) of (0, 1),
      j = 0..S-1, in a random order at each step (the ranks of a second hash), each draw
      uniform inside its stratum.
    - "tree": the same within each group of samples that share their prefix (`prefix`
      [n, samples]: a hash of each sample's tokens so far, `Draws`): g samples that reached
      the same node of the prefix tree, and so draw from the same distribution, take the g
      strata of (0, 1) in a random order. Their children then get g x their probability of
      the samples, give or take one, instead of a binomial count.
    Marginally every draw is uniform whatever the estimator: each sample is an exact sample
    of the model and P(k in S) stays unbiased; stratified draws cover (0, 1) evenly, so
    samples that share a distribution spread over it instead of clumping (less variance at
    the same cost)."""
    with np.errstate(over="ignore"):
        base = _mix(np.asarray(keys, np.uint64) ^ _mix(np.uint64(seed % 2**64) * _SEED))
        sample = np.arange(1, samples + 1, dtype=np.uint64) * _SAMPLE
        x = _mix(_mix(base[:, None] ^ sample[None, :]) ^ (np.uint64(step + 1) * _STEP))
        u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        if estimator == "plain":
            return u
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}")
        order_key = _mix(x ^ _STRATUM)
    n = u.shape[0]
    if estimator == "stratified" or prefix is None:
        prefix = np.zeros((n, samples), np.uint64)
    row = np.repeat(np.arange(n), samples)
    group = prefix.ravel()
    order = np.lexsort((order_key.ravel(), group, row))  # by visit, prefix, random key
    first = np.ones(order.size, bool)
    first[1:] = (group[order][1:] != group[order][:-1]) | (row[order][1:] != row[order][:-1])
    starts = np.flatnonzero(first)
    which = np.cumsum(first) - 1
    rank = np.empty(order.size, np.float64)
    size = np.empty(order.size, np.float64)
    rank[order] = np.arange(order.size) - starts[which]
    size[order] = np.diff(np.append(starts, order.size))[which]
    return (rank.reshape(n, samples) + u) / size.reshape(n, samples)


class Draws:
    """The draws of a set decoding's samples, step by step (`uniforms`), and the prefix
    hash of every sample that the "tree" estimator groups them by (kept per row; `keep`
    compacts it with the batch)."""

    def __init__(self, cfg: SetConfig, keys: np.ndarray, n: int):
        self.cfg, self.keys = cfg, keys
        tree = cfg.estimator == "tree"
        self.prefix = np.zeros((n, cfg.samples), np.uint64) if tree else None

    def at(self, t: int, rows: np.ndarray) -> np.ndarray:
        """float64 [R, S]: the draws of step t of the visits `rows`."""
        cfg = self.cfg
        return uniforms(cfg.seed, self.keys[rows], cfg.samples, t, cfg.estimator, self.prefix)

    def drawn(self, tokens: np.ndarray) -> None:
        """Step the prefixes by the tokens [R, S] just drawn."""
        if self.prefix is not None:
            with np.errstate(over="ignore"):
                step = (np.asarray(tokens, np.uint64) + np.uint64(1)) * _TOKEN
                self.prefix = _mix(self.prefix ^ step)

    def keep(self, live: np.ndarray) -> None:
        if self.prefix is not None:
            self.prefix = self.prefix[live]


@dataclass(frozen=True)
class SetConfig(LoopConfig):
    """The set decoding's driver configuration (`LoopConfig`: end, max_len, compact_at, ddi)."""

    samples: int = SAMPLES
    threshold: float | None = 0.5  # the threshold rule's; None with the jaccard rule
    seed: int = 0
    estimator: str = "plain"  # how the samples are drawn (`uniforms`)
    rule: str = "threshold"  # how the set is read from P(k in S) (`select_sets`)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples < 1:
            raise ValueError("samples and max_len must be >= 1")
        if self.rule not in SET_RULES:
            raise ValueError(f"unknown set rule {self.rule!r}")
        if self.threshold is None and self.rule == "threshold":
            raise ValueError("the threshold rule needs a threshold")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise ValueError("the set threshold must be in (0, 1]")

    @classmethod
    def of(
        cls,
        decoding: Decoding,
        end: int,
        ddi: DDIPolicy = DDIPolicy(),
        compact_at: float = COMPACT_AT,
    ) -> SetConfig:
        """The driver configuration of a set `Decoding` (`cognet.core.decoding`)."""
        return cls(
            end=end,
            samples=decoding.samples,
            threshold=decoding.threshold,
            max_len=decoding.max_len,
            seed=decoding.seed,
            estimator=decoding.estimator,
            rule=decoding.rule,
            ddi=ddi,
            compact_at=compact_at,
        )


@dataclass
class SetResult:
    """The set of each of N visits (fields as `BeamResult`'s, read for a set)."""

    meds: list[np.ndarray]  # per visit: the set, by decreasing probability (ties: smaller id)
    score: np.ndarray  # float32 [N]: mean probability of the set's medications (0 if empty)
    med_probs: list[np.ndarray]  # per visit: P(k in S) of each medication of the set
    prauc_scores: np.ndarray  # float32 [N, M]: P(k in S) of every medication
    gates: list[np.ndarray] | None = None  # per visit: mean w_g where the samples emitted it
    copies: list[np.ndarray] | None = None  # per visit: [meds, S] mean copy distribution
    # per visit: [meds, S] mean copy share by slot, (1 - w_g) copy[s] / Pr[k] (README --explain)
    shares: list[np.ndarray] | None = None
    attention: list[np.ndarray] | None = None  # per visit: [meds, Ld] mean diagnosis attention
    steps: int = 0


class SetSampler:
    """The set decoding's rule on the host (a `cognet.core.decoding.driver.Selector`): each step,
    every sample draws its next medication from Pr (masked, DDI policy applied); the sums
    of the step probabilities estimate P(k in S). Result: (P(k in S) float64 [n, M], the
    explanation sums or None, steps run)."""

    on_device = False

    def __init__(
        self,
        cfg: SetConfig,
        keys: np.ndarray,
        ddi_adj: np.ndarray | None = None,
        explain: bool = False,
        attention: bool = False,
    ):
        self.cfg, self.keys, self.explain = cfg, keys, explain
        self.ddi_adj = ddi_adj
        if cfg.ddi.mode in ("soft", "hard"):
            self.ddi_adj = check_adjacency(cfg.ddi, ddi_adj, cfg.end)
        self.width = cfg.samples
        self.outputs = step_outputs(explain, attention)

    def start(self, n: int) -> None:
        s, end = self.cfg.samples, self.cfg.end
        self.n = n
        self.finished = np.zeros((n, s), bool)
        self.used = np.zeros((n, s, end + 1), bool)
        self.hazard = np.zeros((n, end), np.float64)  # sum over samples and steps of p_t(k)
        self.out = np.zeros((n, end), np.float64)
        self.sums: dict | None = None
        self.draws = Draws(self.cfg, self.keys, n)

    def select(self, t, got, rows, parent):
        cfg, end = self.cfg, self.cfg.end
        p = _step_distribution(
            got["log_probs"], self.used, self.finished, end, cfg.ddi, self.ddi_adj
        )
        self.hazard[rows] += p[..., :end].sum(1)  # finished samples have p = 0 below END
        u = self.draws.at(t, rows)
        cum = np.cumsum(p, -1)
        tokens = np.minimum((cum < (u * cum[..., -1])[..., None]).sum(-1), end)
        r_ix, s_ix = np.indices(tokens.shape)
        emitted = ~self.finished & (tokens < end)
        if self.explain:
            self.sums = _add_explanation(self.sums, self.n, end, got, rows, tokens, emitted)
        self.used[r_ix, s_ix, tokens] = True
        self.finished = self.finished | (tokens == end)
        self.draws.drawn(tokens)
        return tokens, parent, self.finished.all(1)  # samples never change rows

    def finish(self, t, newly, rows) -> None:
        # an estimate may pass 1 (an unbiased sum, not a probability): clip it
        self.out[rows[newly]] = np.minimum(self.hazard[rows[newly]] / self.cfg.samples, 1.0)

    def keep(self, live) -> None:
        self.finished, self.used = self.finished[live], self.used[live]
        self.draws.keep(live)

    def result(self, steps: int) -> tuple[np.ndarray, dict | None, int]:
        return self.out, self.sums, steps

    def empty(self) -> tuple[np.ndarray, dict | None, int]:
        return np.zeros((0, self.cfg.end), np.float64), None, 0


def set_marginals(
    session: Any,
    memories: Any,
    n: int,
    cfg: SetConfig,
    keys: np.ndarray,
    ddi_adj: np.ndarray | None = None,
    explain: bool = False,
    attention: bool = False,
) -> tuple[np.ndarray, dict | None, int]:
    """(P(k in S) float64 [n, M], the explanation sums or None, steps run) of the n visits
    whose memories come from `session.init` (a `cognet.core.decoding.driver.DecoderSession`)."""
    sampler = SetSampler(cfg, keys, ddi_adj, explain, attention)
    return driver.run(session, memories, n, sampler, cfg)


def _step_distribution(log_probs, used, finished, end, policy, ddi_adj) -> np.ndarray:
    """float64 [R, S, V1]: each sample's next-token distribution: Pr with the medications
    it holds masked (and the DDI policy applied), renormalised; a finished sample has all
    its mass on END."""
    logp = log_probs.astype(np.float64)
    if policy.mode in ("soft", "hard"):
        clashes = used[..., :end].astype(np.float32) @ ddi_adj
        if policy.mode == "hard":
            logp[..., :end][clashes > 0] = -np.inf
        else:
            logp[..., :end] -= policy.penalty * clashes
    logp[used] = -np.inf
    logp[finished] = -np.inf
    logp[finished, end] = 0.0
    p = np.exp(logp - logp.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _add_explanation(sums, n, end, got, rows, tokens, emitted) -> dict:
    """Accumulate, per visit and medication, the gate, copy distribution and diagnosis
    attention of the steps at which a sample emitted it."""
    r, smp = np.nonzero(emitted)
    vis, med = rows[r], tokens[r, smp]
    if sums is None:
        sums = {"count": np.zeros((n, end)), "gate": np.zeros((n, end))}
    np.add.at(sums["count"], (vis, med), 1.0)
    np.add.at(sums["gate"], (vis, med), got["gate"][r, smp])
    copy = got["copy_probs"]
    if "copy" not in sums:
        sums["copy"] = np.zeros((n, end, copy.shape[2]))
    width = min(copy.shape[2], sums["copy"].shape[2])  # rows keep their slot count
    np.add.at(sums["copy"], (vis, med), copy[r, smp, :width])
    # what the emission copied, by slot: (1 - w_g) copy[s] / Pr[k], Pr before any DDI penalty
    prob = np.exp(got["log_probs"][r, smp, med].astype(np.float64))
    weight = (1.0 - got["gate"][r, smp]) / np.maximum(prob, PROB_FLOOR)
    if "share" not in sums:
        sums["share"] = np.zeros_like(sums["copy"])
    np.add.at(sums["share"], (vis, med), copy[r, smp, :width] * weight[:, None])
    if "diag_attention" in got:
        att = got["diag_attention"].mean(1)  # [R, S, Ld] over heads
        if "attention" not in sums:
            sums["attention"] = np.zeros((n, end, att.shape[2]))
        np.add.at(sums["attention"], (vis, med), att[r, smp])
    return sums


def select_sets(
    marginals: np.ndarray,
    threshold: float,
    policy: DDIPolicy = DDIPolicy(),
    ddi_adj: np.ndarray | None = None,
    rule: str = "threshold",
) -> list[np.ndarray]:
    """Per visit, the set read from P(k in S) [n, M] by `rule` (`cognet.core.decoding`
    SET_RULES: the medications with P(k in S) >= threshold, or `jaccard_sizes` of them in
    decreasing probability), in decreasing probability (ties: smaller id), under the
    policy's set rules (`hard`: no interacting pair; `max_rate`: DDI rate <= R)."""
    out = []
    order = np.argsort(-marginals, axis=1, kind="stable")
    if rule == "jaccard":
        sizes = jaccard_sizes(np.take_along_axis(marginals, order, 1))
    elif rule == "threshold":
        sizes = (marginals >= threshold).sum(1)
    else:
        raise ValueError(f"unknown set rule {rule!r}")
    for idx, size in zip(order, sizes, strict=True):
        idx = idx[:size]
        if policy.mode == "hard" or policy.max_rate is not None:
            idx = _ddi_filter(idx, policy, np.asarray(ddi_adj, bool))
        out.append(idx.astype(np.int64))
    return out


def jaccard_sizes(ranked: np.ndarray) -> np.ndarray:
    """int [n]: per visit, the k whose k most probable medications (P(k in S) [n, M], sorted
    decreasing) have the highest expected Jaccard, (sum of P inside) / (k + sum of P
    outside): expected intersection over expected union. No parameter; the smallest such k;
    0 when every P is 0."""
    p = np.clip(ranked.astype(np.float64), 0.0, 1.0)
    if p.shape[1] == 0:
        return np.zeros(p.shape[0], np.int64)
    inside = np.cumsum(p, 1)
    outside = inside[:, -1:] - inside
    expected = inside / (np.arange(1, p.shape[1] + 1) + outside)
    best = expected.argmax(1)
    return np.where(expected[np.arange(len(p)), best] > 0, best + 1, 0).astype(np.int64)


def _ddi_filter(candidates: np.ndarray, policy: DDIPolicy, adj: np.ndarray) -> np.ndarray:
    kept: list[int] = []
    pairs = 0
    for k in candidates.tolist():
        clash = int(adj[k, kept].sum()) if kept else 0
        if policy.mode == "hard" and clash:
            continue
        if policy.max_rate is not None and kept:
            size = len(kept) + 1
            if (pairs + clash) / (size * (size - 1) / 2) > policy.max_rate + RATE_TOLERANCE:
                continue
        kept.append(k)
        pairs += clash
    return np.array(kept, np.int64)


def decode_sets(
    session: Any,
    memories: Any,
    n: int,
    cfg: SetConfig,
    keys: np.ndarray,
    ddi_adj: np.ndarray | None = None,
    explain: bool = False,
    attention: bool = False,
) -> SetResult:
    """The set of each of the n visits, with what `BeamResult` carries for a hypothesis."""
    marginals, sums, steps = set_marginals(
        session, memories, n, cfg, keys, ddi_adj, explain, attention
    )
    return set_result(marginals, steps, cfg, ddi_adj, (sums or {}) if explain else None)


def set_result(
    marginals: np.ndarray,
    steps: int,
    cfg: SetConfig,
    ddi_adj: np.ndarray | None = None,
    sums: dict | None = None,
) -> SetResult:
    """The sets of the marginals P(k in S) [n, M] (`set_marginals`, or the runtime's search
    graphs), with their explanations when given the sums of `_add_explanation`."""
    meds = select_sets(marginals, cfg.threshold, cfg.ddi, ddi_adj, cfg.rule)
    probs = [marginals[i, m].astype(np.float32) for i, m in enumerate(meds)]
    score = np.array([p.mean() if p.size else 0.0 for p in probs], np.float32)
    result = SetResult(meds, score, probs, marginals.astype(np.float32), steps=steps)
    if sums is not None:
        _explain(result, sums, meds)
    return result


def _explain(result: SetResult, sums: dict, meds: list[np.ndarray]) -> None:
    """Per medication of each set: mean gate, copy distribution and diagnosis attention at
    the steps where samples emitted it (sums of `_add_explanation`; empty when none did)."""
    n, m = result.prauc_scores.shape
    count = np.maximum(sums.get("count", np.zeros((n, m))), 1.0)
    gate = sums.get("gate", np.ones((n, m)))
    copy = sums.get("copy", np.zeros((n, m, 0)))
    att = sums.get("attention")
    result.gates = [(gate[i, k] / count[i, k]).astype(np.float32) for i, k in enumerate(meds)]
    result.copies = [
        (copy[i, k] / count[i, k, None]).astype(np.float32) for i, k in enumerate(meds)
    ]
    share = sums.get("share", np.zeros_like(copy))
    result.shares = [
        (share[i, k] / count[i, k, None]).astype(np.float32) for i, k in enumerate(meds)
    ]
    if att is not None:
        result.attention = [
            (att[i, k] / count[i, k, None]).astype(np.float32) for i, k in enumerate(meds)
        ]
