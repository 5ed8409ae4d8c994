"""Set decoding: the model's best *set* of medications, from its own copy-or-predict
distribution (torch-free, numpy; the rules of docs/DESIGN.md "Set decoding").

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
runtime's `device_selectors.SetGraphSampler` runs the same rule in the exported `set_select`
graphs).

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cognet.core.ddi import DDIPolicy, apply_step_penalty, check_adjacency
from cognet.core.decoding import SAMPLES, SET_RULES, Decoding, driver, open_samples
from cognet.core.decoding.attribution import add_emissions, set_explanations
from cognet.core.decoding.draws import Draws
from cognet.core.decoding.driver import (
    COMPACT_AT,
    DecoderSession,
    LoopConfig,
    Visits,
    step_outputs,
)
from cognet.core.decoding.set_rules import select_sets
from cognet.core.ragged import Ragged


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
        """The driver configuration of a set `Decoding` (`cognet.core.decoding`); of a
        marginal one, its set rule (the samples then unused)."""
        threshold, rule = decoding.selection
        return cls(
            end=end,
            samples=decoding.samples,
            threshold=threshold,
            max_len=decoding.max_len,
            seed=decoding.seed,
            estimator=decoding.estimator,
            rule=rule,
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
    # per visit: [meds, S] mean copy share by slot (`attribution.copy_share_by_slot`)
    shares: list[np.ndarray] | None = None
    attention: list[np.ndarray] | None = None  # per visit: [meds, Ld] mean diagnosis attention
    steps: int = 0
    # per visit: bool [meds], whether a sample emitted it (the marginal decoding's
    # explanations: its sets are not its samples'); None: every medication of a set was
    emitted: list[np.ndarray] | None = None


class SetRule:
    """What the host and the device set samplers share (`cognet.core.decoding.driver.Selector`
    less `select`): each visit's samples, their finished flags and random draws, and each
    visit's P(k in S), read from its hazard sums when it is over. Result: (P(k in S) float64
    [n, M], the explanation sums or None, steps run)."""

    on_device = False

    def __init__(self, cfg: SetConfig, keys: np.ndarray):
        self.cfg, self.keys, self.width = cfg, keys, cfg.samples

    def start(self, n: int) -> None:
        self.finished = np.zeros((n, self.cfg.samples), bool)
        self.out = np.zeros((n, self.cfg.end), np.float64)
        self.sums: dict | None = None
        self.draws = Draws(self.cfg, self.keys, n)

    def hazard_of(self, newly: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """float64 [k, M]: the hazard sums (over samples and steps of p_t(k)) of the rows
        `newly`, whose visits are `rows[newly]`."""
        raise NotImplementedError

    def finish(self, t: int, newly: np.ndarray, rows: np.ndarray) -> None:
        # an estimate may pass 1 (an unbiased sum, not a probability): clip it
        self.out[rows[newly]] = np.minimum(self.hazard_of(newly, rows) / self.cfg.samples, 1.0)

    def keep(self, live: np.ndarray) -> None:
        self.finished = self.finished[live]
        self.draws.keep(live)

    def result(self, steps: int) -> tuple[np.ndarray, dict | None, int]:
        return self.out, self.sums, steps

    def empty(self) -> tuple[np.ndarray, dict | None, int]:
        return np.zeros((0, self.cfg.end), np.float64), None, 0


class SetSampler(SetRule):
    """The set decoding's rule on the host (a `cognet.core.decoding.driver.Selector`): each step,
    every sample draws its next medication from Pr (masked, DDI policy applied); the sums
    of the step probabilities estimate P(k in S)."""

    def __init__(
        self,
        cfg: SetConfig,
        keys: np.ndarray,
        ddi_adj: np.ndarray | None = None,
        explain: bool = False,
        attention: bool = False,
    ):
        super().__init__(cfg, keys)
        self.explain = explain
        self.ddi_adj = ddi_adj
        if cfg.ddi.mode in ("soft", "hard"):
            self.ddi_adj = check_adjacency(cfg.ddi, ddi_adj, cfg.end)
        self.outputs = step_outputs(explain, attention)

    def start(self, n: int) -> None:
        super().start(n)
        s, end = self.cfg.samples, self.cfg.end
        self.n = n
        self.used = np.zeros((n, s, end + 1), bool)
        self.hazard = np.zeros((n, end), np.float64)  # sum over samples and steps of p_t(k)
        # each sample's interacting pairs with every medication, kept as it emits (soft, hard)
        self.clashes = None
        if self.cfg.ddi.mode in ("soft", "hard"):
            self.clashes = np.zeros((n, s, end), np.float32)

    def select(self, t, got, rows, parent):
        cfg, end = self.cfg, self.cfg.end
        # Only the open samples are computed: a finished sample's distribution is all on
        # END, so it adds nothing below END to the sums and draws END again. A visit's open
        # samples are summed together (reduceat), so the totals depend on its own rows alone
        # and differ from a sum over every row by summation order only (a few ulps).
        vis, smp = np.nonzero(~self.finished)  # visit-major, samples in order
        tokens = np.full(self.finished.shape, end, np.int64)
        if vis.size:
            logp = got["log_probs"][vis, smp]
            clashes = None if self.clashes is None else self.clashes[vis, smp]
            p = _step_distribution(
                logp, self.used[vis, smp], None, end, cfg.ddi, self.ddi_adj, clashes
            )
            first = np.flatnonzero(np.concatenate(([True], vis[1:] != vis[:-1])))
            self.hazard[rows[vis[first]]] += np.add.reduceat(p[:, :end], first, axis=0)
            u = self.draws.at(t, rows)[vis, smp]
            cum = np.cumsum(p, -1, out=p)  # p is not needed after this
            below = cum < (u * cum[:, -1])[:, None]
            tokens[vis, smp] = np.minimum(np.count_nonzero(below, axis=-1), end)
        emitted = ~self.finished & (tokens < end)
        if self.explain:
            self.sums = add_emissions(self.sums, self.n, end, got, rows, tokens, emitted)
        self.used[vis, smp, tokens[vis, smp]] = True
        if self.clashes is not None:
            at = np.nonzero(emitted)
            self.clashes[at] += self.ddi_adj[tokens[at]]
        self.finished = self.finished | (tokens == end)
        self.draws.drawn(tokens)
        return tokens, parent, self.finished.all(1)  # samples never change rows

    def open(self) -> np.ndarray:
        """bool [R, S]: the samples not finished, whose step output `select` reads."""
        return ~self.finished

    def hazard_of(self, newly, rows) -> np.ndarray:
        return self.hazard[rows[newly]]  # kept for every visit: rows are the visits' own

    def keep(self, live) -> None:
        super().keep(live)
        self.used = self.used[live]
        if self.clashes is not None:
            self.clashes = self.clashes[live]


def set_marginals(
    session: DecoderSession, memories: Any, cfg: SetConfig, visits: Visits
) -> tuple[np.ndarray, dict | None, int]:
    """(P(k in S) float64 [n, M], the explanation sums or None, steps run) of the
    `visits.n` visits whose memories come from `session.init`, drawn from `visits.keys`."""
    sampler = SetSampler(cfg, visits.drawn_keys(), visits.ddi_adj, visits.explain, visits.attention)
    loop = open_samples.run if open_samples.applies(session, sampler) else driver.run
    return loop(session, memories, visits.n, sampler, cfg)


# what gives a set decoding's marginals: `set_marginals`, or the runtime's search graphs
Marginals = Callable[[DecoderSession, Any, SetConfig, Visits], tuple[np.ndarray, dict | None, int]]


_TINY = 2.0**-100  # a row whose unshifted exponentials sum below this is shifted first


def _step_distribution(log_probs, used, finished, end, policy, ddi_adj, clashes=None) -> np.ndarray:
    """float64 [..., V1]: each sample's next-token distribution: Pr with the medications
    it holds masked (and the DDI policy applied), renormalised; a finished sample (bool
    `finished` [...], or None where every row is open) has all its mass on END.

    The exponentials are float32, of the log-probabilities as given: numpy's float32 exp is
    vectorised where its float64 exp is scalar on a CPU without AVX-512, and each is
    within 2 float32 ulps of the exact value of the float32
    log-probability, which carries as much rounding itself. No shift by the row's maximum:
    the model's log-probabilities lie in [log 1e-20, 0] (its floor) and END's is never held,
    so a row's sum is at least 1e-20; a row whose sum falls below 2^-100 all the same (other
    inputs, a DDI penalty) is computed again from its log-probabilities less their maximum.
    The DDI penalty is subtracted in float32 (`clashes`: the interacting pairs when kept by
    the caller); the normalisation and all that follows (sums, CDF) are float64. The search
    graphs' `set_select` computes the same."""
    x = _logits(log_probs, used, finished, end, policy, ddi_adj, clashes)
    keep = ~used  # a held medication: 0 after the exp (cheaper than -inf before it)
    if finished is not None:
        keep |= finished[..., None]  # a finished sample: END alone, whatever it holds
    e = np.exp(x, out=x)
    np.multiply(e, keep, out=e)
    p = e.astype(np.float64)
    total = p.sum(-1, keepdims=True)
    low = total[..., 0] < _TINY
    if low.any():
        y = _logits(
            log_probs[low],
            used[low],
            None if finished is None else finished[low],
            end,
            policy,
            ddi_adj,
            None if clashes is None else clashes[low],
        )
        y[~keep[low]] = -np.inf
        y -= y.max(-1, keepdims=True)
        p[low] = np.exp(y, out=y)
        total[low] = p[low].sum(-1, keepdims=True)
    p /= total
    return p


def _logits(log_probs, used, finished, end, policy, ddi_adj, clashes=None) -> np.ndarray:
    """float32 [..., V1], a new array: the log-probabilities with the DDI policy applied and
    a finished sample's mass on END (0 there, -inf elsewhere); held medications as given."""
    x = np.array(log_probs, np.float32)
    apply_step_penalty(x, used, ddi_adj, policy, clashes)
    if finished is not None and finished.any():
        x[finished] = -np.inf
        x[finished, end] = 0.0
    return x


def decode_sets(
    session: DecoderSession,
    memories: Any,
    cfg: SetConfig,
    visits: Visits,
    marginals: Marginals = set_marginals,
) -> SetResult:
    """The set of each of the `visits.n` visits, with what `BeamResult` carries for a
    hypothesis, from their `marginals` (`set_marginals`, or the runtime's search graphs)."""
    found, sums, steps = marginals(session, memories, cfg, visits)
    explained = (sums or {}) if visits.explain else None
    return set_result(found, steps, cfg, visits.ddi_adj, explained)


def set_probabilities(
    marginals: np.ndarray, meds: list[np.ndarray]
) -> tuple[list[np.ndarray], np.ndarray]:
    """(per visit, P(k in S) float32 of its set's medications; float32 [n], their mean, 0 for
    an empty set), gathered once for all visits rather than visit by visit (the host's time
    per visit bounds a GPU's visits/s). The means of the sets of one size are one [sets,
    size] mean: numpy sums each row as it sums one visit's array, so a score is the same
    float32 as that visit's own mean."""
    n = len(meds)
    lengths = np.fromiter(map(len, meds), np.int64, n)
    rows = np.repeat(np.arange(n), lengths)
    flat = marginals[rows, np.concatenate([np.zeros(0, np.int64), *meds])].astype(np.float32)
    sets = Ragged.of_lengths(flat, lengths)
    score = np.zeros(n, np.float32)
    for size in np.unique(lengths[lengths > 0]).tolist():
        same = np.flatnonzero(lengths == size)
        score[same] = flat[sets.offsets[same, None] + np.arange(size)].mean(axis=1)
    return sets.rows(), score


def set_result(
    marginals: np.ndarray,
    steps: int,
    cfg: SetConfig,
    ddi_adj: np.ndarray | None = None,
    sums: dict | None = None,
) -> SetResult:
    """The sets of the marginals P(k in S) [n, M] (`set_marginals`, or the runtime's search
    graphs), with their explanations when given the sums of `attribution.add_emissions`."""
    meds = select_sets(marginals, cfg.threshold, cfg.ddi, ddi_adj, cfg.rule)
    probs, score = set_probabilities(marginals, meds)
    result = SetResult(meds, score, probs, marginals.astype(np.float32), steps=steps)
    if sums is not None:
        set_explanations(result, sums, meds)
    return result
