"""Set rules: the set a visit gets from its P(k in S), host-side arithmetic after the same
graphs (`select_sets`): the medications reaching the tuned threshold, or the set of highest
expected Jaccard (`jaccard_sizes`; with the policy's `pair_price`, less that price per
interacting pair: `priced_sets`); then the DDI policy's set rules (`hard`: no interacting
pair; `max_rate R`: a DDI rate <= R), in decreasing probability."""

from __future__ import annotations

import numpy as np

from cognet.core.ddi import RATE_TOLERANCE, DDIPolicy
from cognet.core.ragged import Ragged


def select_sets(
    marginals: np.ndarray,
    threshold: float,
    policy: DDIPolicy = DDIPolicy(),
    ddi_adj: np.ndarray | None = None,
    rule: str = "threshold",
) -> list[np.ndarray]:
    """Per visit, the set read from P(k in S) [n, M] by `rule` (`cognet.core.decoding`
    SET_RULES: the medications with P(k in S) >= threshold, or `jaccard_sizes` of them in
    decreasing probability; with a `pair_price`, `priced_sets`), in decreasing probability
    (ties: smaller id), under the policy's set rules (`hard`: no interacting pair;
    `max_rate`: DDI rate <= R)."""
    if rule == "threshold" and not policy.pair_price:
        sets = threshold_sets(marginals, threshold)
    else:
        if policy.pair_price:
            if rule != "jaccard":
                raise ValueError("a DDI pair price reads the expected-Jaccard set (rule jaccard)")
            if ddi_adj is None:
                raise ValueError("a DDI pair price needs the DDI adjacency")
            order, sizes = priced_sets(marginals, np.asarray(ddi_adj, bool), policy.pair_price)
        elif rule == "jaccard":
            order = np.argsort(-marginals, axis=1, kind="stable")
            sizes = jaccard_sizes(np.take_along_axis(marginals, order, 1))
        else:
            raise ValueError(f"unknown set rule {rule!r}")
        sets = [idx[:size].astype(np.int64) for idx, size in zip(order, sizes, strict=True)]
    if policy.mode == "hard" or policy.max_rate is not None:
        adj = np.asarray(ddi_adj, bool)
        sets = [_ddi_filter(idx, policy, adj) for idx in sets]
    return sets


def threshold_sets(marginals: np.ndarray, threshold: float) -> list[np.ndarray]:
    """Per visit, the medications (int64) with P(k in S) >= threshold in decreasing
    probability, ties by smaller id. Only those are sorted, in one [visits, largest set]
    matrix: a whole row's argsort per visit was most of the host's time per visit on a
    GPU's path."""
    rows, cols = np.nonzero(marginals >= threshold)  # by visit, then by id
    sizes = np.bincount(rows, minlength=len(marginals))
    width = int(sizes.max(initial=0))
    at = np.arange(rows.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # place in its set
    keys = np.full((len(marginals), width), np.inf)
    keys[rows, at] = -marginals[rows, cols]
    ids = np.zeros((len(marginals), width), np.int64)
    ids[rows, at] = cols
    ranked = np.take_along_axis(ids, np.argsort(keys, axis=1, kind="stable"), 1)
    return Ragged.of_lengths(ranked[np.arange(width) < sizes[:, None]], sizes).rows()


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


def priced_sets(
    marginals: np.ndarray, ddi_adj: np.ndarray, price: float
) -> tuple[np.ndarray, np.ndarray]:
    """(order [n, M], sizes [n]): per visit, the set of highest (expected Jaccard) - price x
    (interacting pairs in it), its `size` medications first in `order`, in decreasing
    probability (ties: smaller id). Expected Jaccard as `jaccard_sizes` reads it, (sum of P
    inside) / (size + sum of P outside). Built greedily: from the empty set, add the
    medication of largest gain while one gains (ties: smaller id), so that a probable
    medication that interacts with the set already chosen can be passed over for a less
    probable one that does not. ddi_adj: bool [M, M], symmetric, zero diagonal."""
    p = np.clip(marginals.astype(np.float64), 0.0, 1.0)
    n, m = p.shape
    adj = np.asarray(ddi_adj, np.float64)
    total = p.sum(1)
    chosen = np.zeros((n, m), bool)
    size, inside, current = np.zeros(n), np.zeros(n), np.zeros(n)
    clashes = np.zeros((n, m))  # interacting pairs each medication would add
    growing = np.ones(n, bool)
    rows = np.arange(n)
    for _ in range(m):
        if not growing.any():
            break
        gained = (inside[:, None] + p) / (size[:, None] + 1 + (total - inside)[:, None] - p)
        gain = gained - current[:, None] - price * clashes
        gain[chosen] = -np.inf
        best = gain.argmax(1)
        growing &= gain[rows, best] > 0
        at, k = rows[growing], best[growing]
        chosen[at, k] = True
        size[at] += 1
        inside[at] += p[at, k]
        current[at] = gained[at, k]
        clashes[at] += adj[k]
    # chosen first, each part in decreasing probability (a stable sort: ties, smaller id)
    order = np.lexsort((-p, ~chosen), axis=1)
    return order, size.astype(np.int64)


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
