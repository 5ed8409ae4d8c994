"""A DDI target: the soft DDI penalty, a per-set DDI cap and the set rule (a threshold, or the
expected-Jaccard rule), chosen together on the validation split, of best validation Jaccard
with a validation DDI rate <= R.

`cognet train --ddi-target R` runs `choose_target` after the threshold is tuned (after the
set head is trained, when the marginal decoding is the default: then over the head's
P(k in S), set rules only) and stores
the pair with the checkpoint (`cognet.core.ddi.DDITarget`, config.json and the manifest's
"ddi_target"): `cognet evaluate` and `cognet-batch score` then decode with it unless a
policy is asked. `cognet evaluate --ddi-target R` runs the same search for a checkpoint.

The marginals P(k in S) of the set decoding depend on the penalty (it acts on every sampling
step) but not on the threshold, so each penalty costs one decoding of the split and every
threshold of `cognet.training.tuning.THRESHOLDS`, and the expected-Jaccard rule (no
threshold), is then a cheap selection (`select_sets`). The
penalties tried: off, then the `LADDER` upwards while the best pair holding R improves
(a high threshold may hold R at a small penalty, a larger penalty at a lower threshold:
more medications), then `REFINE` rounds of geometric midpoints on both sides of the best
penalty so far. With every penalty, per-set caps (`max_rate`, `CAP_FACTORS` x R, and
none) are tried too: a cap acts on the selection only (no decoding), and one of at most R
holds R on any split. With every penalty, the expected-Jaccard rule is also read at each
pair price of `PRICES` (`cognet.core.ddi`: the set of highest expected Jaccard less that
price per interacting pair; a selection too). If nothing holds R, `hard` (DDI rate 0 on
every set) does. The best (penalty, cap or price, rule) over every one tried wins; ties:
the smaller penalty, then the threshold rule before the expected-Jaccard rule, then the
lower threshold, then the lower price.

Validation holding R does not prove that test does (unless the cap is <= R): `cognet
evaluate` prints the test DDI rate next to the target.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cognet.core.ddi import RATE_TOLERANCE, DDIPolicy, DDITarget
from cognet.core.decoding import Decoding
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.decoding.set_rules import select_sets
from cognet.core.history import Visit
from cognet.core.metrics import ddi_rate_of_sets, jaccard

log = logging.getLogger(__name__)

# Soft penalties tried after off, in order, until one holds the target.
LADDER = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
REFINE = 3  # rounds of midpoints around the best penalty so far
# Per-set DDI caps (`max_rate`) tried with every penalty and threshold, as multiples of the
# target (with none): a cap acts on the selection only, so it costs no decoding, and a cap
# <= R holds R on any split (the pooled rate of sets that each hold it holds it).
CAP_FACTORS = (1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0)
# Pair prices tried with the expected-Jaccard rule: 10% apart from 0.0002 to 0.05 (expected
# Jaccard given up per interacting pair), selections only.
PRICES = tuple(float(f"{p:.3g}") for p in np.geomspace(0.0002, 0.05, 59))


@dataclass(frozen=True, eq=False)
class Validation:
    """The split a DDI target is chosen on, fixed through a search: its patients (each a list
    of visits with their true medications) and the DDI adjacency, bool [M, M], that counts
    the DDI rate."""

    patients: Sequence[Sequence[Visit]]
    ddi_adj: np.ndarray


@dataclass(frozen=True)
class Grid:
    """The set rules a search tries with every policy: the threshold rule at each of
    `thresholds`, under each per-set cap of `caps` (None: none, then `CAP_FACTORS` x the
    target), and the expected-Jaccard rule at each pair price of `prices`."""

    thresholds: Sequence[float]
    caps: Sequence[float | None] | None = None
    prices: Sequence[float] = PRICES


@dataclass(frozen=True)
class Trial:
    """One (policy, set rule) scored on the validation split; `threshold` is read by the
    threshold rule only (the expected-Jaccard rule's trials carry 1.0)."""

    policy: DDIPolicy
    threshold: float
    jaccard: float
    ddi: float
    rule: str = "threshold"

    def to_json(self) -> dict:
        return {
            "policy": self.policy.label,
            "rule": self.rule,
            "threshold": self.threshold,
            "jaccard": self.jaccard,
            "ddi": self.ddi,
        }


def score_thresholds(
    split: Validation,
    marginals: np.ndarray,
    policy: DDIPolicy,
    thresholds: Sequence[float],
    caps: Sequence[float | None] = (None,),
    rules: Sequence[str] = ("threshold", "jaccard"),
    prices: Sequence[float] = (),
) -> list[Trial]:
    """Validation Jaccard and DDI rate (`cognet.core.metrics`: Jaccard averaged per patient
    then over patients, the DDI rate pooled over every visit; every patient once) of the
    sets that `policy`'s marginals [visits, M] of `split`'s visits give by each rule (the
    threshold rule at each threshold), under each per-set cap (`max_rate`; None: none), and
    by the expected-Jaccard rule at each pair price of `prices` (no cap)."""
    patients = split.patients
    visits = [v for p in patients for v in p]
    owner = np.array([i for i, p in enumerate(patients) for _ in p])
    counts = np.bincount(owner, minlength=len(patients))
    adj = np.asarray(split.ddi_adj, bool)

    def trial(asked: DDIPolicy, tau: float, rule: str) -> Trial:
        sets = select_sets(marginals, tau, asked, adj, rule)
        per_visit = [jaccard(s.tolist(), v.meds or ()) for v, s in zip(visits, sets, strict=True)]
        by_patient = np.bincount(owner, per_visit, len(patients)) / counts
        return Trial(asked, float(tau), float(by_patient.mean()), ddi_rate_of_sets(sets, adj), rule)

    tried = [(r, tau) for r in rules for tau in (thresholds if r == "threshold" else (1.0,))]
    trials = [
        trial(replace(policy, max_rate=cap), tau, rule) for cap in caps for rule, tau in tried
    ]
    trials += [trial(replace(policy, pair_price=price), 1.0, "jaccard") for price in prices]
    return trials


def search(
    marginals_of: Callable[[DDIPolicy], np.ndarray],
    split: Validation,
    target: float,
    grid: Grid,
    ladder: Sequence[float] = LADDER,
    refine: int = REFINE,
) -> tuple[DDITarget, list[Trial]]:
    """The pair of best validation Jaccard whose DDI rate is <= target (the module's
    docstring says which penalties are tried), and every trial. marginals_of(policy): the
    marginals P(k in S) [visits, M] of `split`'s visits decoded under that policy; `grid`:
    the set rules tried with each."""
    if not 0 <= target <= 1:
        raise ValueError(f"the DDI target must be in [0, 1], not {target}")
    caps, thresholds, prices = grid.caps, grid.thresholds, grid.prices
    if caps is None:
        caps = (None, *sorted({round(min(1.0, target * f), 6) for f in CAP_FACTORS}))
    trials: list[Trial] = []
    best: dict[float, Trial | None] = {}  # soft penalty (0: off) -> its best trial holding R

    def run(policy: DDIPolicy) -> Trial | None:
        margins = marginals_of(policy)
        got = score_thresholds(split, margins, policy, thresholds, caps, prices=prices)
        trials.extend(got)
        fits = [t for t in got if t.ddi <= target + RATE_TOLERANCE]
        top = max(fits, key=_preference, default=None)
        log.info("DDI target %g: %s -> %s", target, policy.label, top)
        return top

    def score(penalty: float) -> float:  # -1: no threshold holds the target
        if penalty not in best:
            best[penalty] = run(DDIPolicy("soft", penalty) if penalty else DDIPolicy())
        got = best[penalty]
        return -1.0 if got is None else got.jaccard

    def leader() -> float:  # the penalty of the best pair so far (ties: the smaller)
        return max(sorted(best), key=score)

    score(0.0)
    for penalty in ladder:  # upwards while the best pair holding the target improves
        lead = score(leader())
        if score(penalty) <= lead and lead >= 0:
            break
    if score(leader()) >= 0:
        for _ in range(refine):  # geometric midpoints on both sides of the leader
            lead = leader()
            below = [p for p in best if p < lead]
            above = [p for p in best if p > lead]
            if below:
                low = max(below)
                score(_round(np.sqrt(low * lead) if low else lead / 2))
            if above:  # off (0) and the next penalty: halve that one
                score(_round(np.sqrt(lead * min(above)) if lead else min(above) / 2))
        top = best[leader()]
    else:  # no soft penalty holds it: hard (no interacting pair in any set)
        top = run(DDIPolicy("hard"))
        if top is None:
            raise ValueError(f"no policy holds DDI rate {target} on the validation split")
    chosen = DDITarget(target, top.policy, top.threshold, top.jaccard, top.ddi, top.rule)
    return chosen, trials


def _preference(trial: Trial) -> tuple:
    """The best trial has the highest key: Jaccard, then the threshold rule, then the lower
    threshold, then the lower pair price."""
    return trial.jaccard, trial.rule == "threshold", -trial.threshold, -trial.policy.pair_price


def _round(penalty: float) -> float:
    return float(f"{penalty:.3g}")  # 3 significant digits: readable, and enough


def choose_target(
    model,
    vocab,
    split: Validation,
    decoding: Decoding,
    target: float,
    on_batch: Callable[[int], None] | None = None,
    head=None,
) -> tuple[DDITarget, list[Trial]]:
    """`search` for a torch model over `cognet.training.tuning.THRESHOLDS`: `decoding`
    decodes the validation patients of `split`. Set decoding (its samples and estimator)
    decodes them under each policy; the marginal decoding reads the set head `head` once,
    since its P(k in S) depend on no policy: only the set rules (cap, pair price, threshold
    or expected-Jaccard rule, hard's set rule) are searched, no soft penalty."""
    # torch: lazy, so that `cognet train --help` (which imports `describe`) runs without it
    from cognet.model.torch_decoding import decode_patients
    from cognet.training.tuning import THRESHOLDS

    patients, grid = split.patients, Grid(THRESHOLDS)
    if decoding.name == "marginal":
        plan = DecodingPlan(decoding, vocab.end)
        decoded = decode_patients(model, vocab, patients, plan, on_batch=on_batch, head=head)
        margins = np.stack([d.scores for d in decoded])
        chosen, trials = search(lambda _: margins, split, target, grid, ladder=(), refine=0)
        return replace(chosen, decoding="marginal"), trials
    if decoding.name != "set":
        raise ValueError("a DDI target is chosen for set or marginal decoding (its set rules)")
    probe = decoding.with_changes(threshold=1.0)  # the marginals do not depend on it

    def marginals_of(policy: DDIPolicy) -> np.ndarray:
        plan = DecodingPlan(probe, vocab.end, ddi=policy)
        decoded = decode_patients(model, vocab, patients, plan, on_batch)
        return np.stack([d.scores for d in decoded])

    return search(marginals_of, split, target, grid)


def describe(target: DDITarget) -> str:
    """One line: the pair found and its validation scores."""
    return (
        f"DDI target {target.target:g}: {target.policy.label}, {target.rule_label} "
        f"(validation Jaccard {target.val_jaccard:.4f}, DDI rate "
        f"{target.val_ddi:.4f})"
    )
