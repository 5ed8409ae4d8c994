"""Explanations of a decoding, in one place (torch-free): what each recommended medication
took from the history.

COGNet's step distribution is the mixture Pr[k] = w_g Pr_g[k] + (1 - w_g) sum over the
history slots s holding k of copy[s]. The part of Pr[k] that came from slot s is

    share[s] = (1 - w_g) copy[s] / Pr[k]        (`copy_share_by_slot`)

with w_g, copy and Pr[k] (before any DDI penalty) of the step that emitted k; summed over
k's own slots it is k's copy share (`copy_share_and_source`, which also names the past
visit holding most of it). Beam search takes them at the one step that emitted k
(`beam_shares`, from its trace back); set decoding takes the mean over the steps at which
its samples emitted k (`add_emissions` while sampling, then `set_explanations`). The
diagnoses a medication attended to most at its step come from the decoder's
cross-attention (`most_attended`).

`cognet-batch score --explain` writes them (`cognet.runtime.outputs`); `cognet explain`
shows one visit step by step (`cognet.runtime.explain_visit`).
"""

from __future__ import annotations

import numpy as np

from cognet.core.graphspec import PROB_FLOOR

# Copy share from which a medication is called copied rather than generated, and its source
# visit shown (docs/guide/explanations.md).
COPIED_FROM = 0.5


def copy_share_by_slot(gate: np.ndarray, copy: np.ndarray, prob: np.ndarray) -> np.ndarray:
    """[..., S]: (1 - w_g) copy[s] / Pr[k] of each emission (gate [...], copy [..., S],
    prob [...] float64, floored at PROB_FLOOR)."""
    return (1.0 - gate)[..., None] * copy / np.maximum(prob, PROB_FLOOR)[..., None]


def beam_shares(
    gates: list[np.ndarray], copies: list[np.ndarray], med_probs: list[np.ndarray]
) -> list[np.ndarray]:
    """Per visit of a beam search: [meds, S] share by slot at each medication's step
    (Pr[k] is its `med_probs` entry)."""
    return [
        copy_share_by_slot(g, c, p.astype(np.float64))
        for g, c, p in zip(gates, copies, med_probs, strict=True)
    ]


def add_emissions(sums, n, end, got, rows, tokens, emitted) -> dict:
    """Accumulate, per visit and medication, the gate, copy distribution, share by slot
    and diagnosis attention of the steps at which a sample emitted it (set decoding; `got`
    holds the step's outputs, `emitted` [R, samples] which samples emitted `tokens`)."""
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
    # Pr before any DDI penalty; the gate in float64, as the sums are
    prob = np.exp(got["log_probs"][r, smp, med].astype(np.float64))
    share = copy_share_by_slot(got["gate"][r, smp].astype(np.float64), copy[r, smp, :width], prob)
    if "share" not in sums:
        sums["share"] = np.zeros_like(sums["copy"])
    np.add.at(sums["share"], (vis, med), share)
    if "diag_attention" in got:
        att = got["diag_attention"].mean(1)  # [R, S, Ld] over heads
        if "attention" not in sums:
            sums["attention"] = np.zeros((n, end, att.shape[2]))
        np.add.at(sums["attention"], (vis, med), att[r, smp])
    return sums


def set_explanations(result, sums: dict, meds: list[np.ndarray]) -> None:
    """Fill a SetResult's gates, copies, shares and attention: per medication of each set,
    the means at the steps where samples emitted it (sums of `add_emissions`; empty when
    none did)."""
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


def copy_share_and_source(
    shares: np.ndarray,
    meds: np.ndarray,
    slot_med: np.ndarray,
    slot_visit: np.ndarray,
    real: np.ndarray,
    n_history: int,
) -> tuple[np.ndarray, list[int | None]]:
    """(copy share [meds] in [0, 1], the history visit index holding most of it or None)
    of one visit: its shares by slot [meds, S] summed over each medication's own real
    slots, and grouped by the past visit of each slot."""
    weight = shares * ((slot_med[None, :] == meds[:, None]) & real)
    share = np.clip(weight.sum(1), 0.0, 1.0)
    per_visit = np.zeros((meds.size, n_history))
    for j in range(meds.size):
        per_visit[j] = np.bincount(slot_visit, weight[j], minlength=n_history)[:n_history]
    best = per_visit.argmax(1)
    source: list[int | None] = [None] * meds.size
    for j in np.flatnonzero(per_visit.max(1) > 0):
        source[j] = int(best[j])
    return share, source


def most_attended(attention: np.ndarray, n_codes: int, top: int) -> tuple[np.ndarray, np.ndarray]:
    """(weights float32 [meds, n_codes], order [meds, <= top]) of one visit's diagnosis
    attention [meds, Ld]: the `top` heaviest diagnoses of each medication, heaviest first
    (ties: the earlier diagnosis)."""
    weights = attention[:, :n_codes].astype(np.float32)  # [meds, diagnoses]
    return weights, np.argsort(-weights, axis=1, kind="stable")[:, :top]
