"""Metrics of scored visits with known medications (`--all`), accumulated chunk by chunk.

Only one row per patient is kept (its per-visit means and DDI pair counts), so memory
stays small on large files; the report is `cognet.core.metrics.bootstrap_report`'s, computed
from those rows (patients never span chunks, so chunk rows concatenate into the whole).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from cognet.core.metrics import AVERAGED, METRICS, VisitResult, visit_metrics
from cognet.core.vocab import Vocab

COLUMNS = (*AVERAGED, "ddi_hit", "ddi_pairs")


def ddi_matrix(vocab: Vocab, pairs: Iterable[Sequence[str]]) -> np.ndarray:
    """bool [M, M]: symmetric interacting pairs among the vocabulary's medications."""
    index = {code: i for i, code in enumerate(vocab.medications)}
    adj = np.zeros((vocab.n_med, vocab.n_med), bool)
    for a, b in pairs:
        i, j = index.get(a), index.get(b)
        if i is not None and j is not None and i != j:
            adj[i, j] = adj[j, i] = True
    return adj


def patient_rows(results: Sequence[VisitResult], ddi_adj: np.ndarray) -> np.ndarray:
    """float64 [patients, len(COLUMNS)]: per patient (first appearance order) the mean of
    each averaged metric over its visits, then its summed DDI hits and pairs."""
    groups: dict[str, list[list[float]]] = {}
    for r in results:
        m = visit_metrics(r, ddi_adj)
        groups.setdefault(r.patient_id, []).append([m[k] for k in COLUMNS])
    out = np.empty((len(groups), len(COLUMNS)))
    for i, visits in enumerate(groups.values()):
        v = np.asarray(visits)
        out[i, : len(AVERAGED)] = v[:, : len(AVERAGED)].mean(axis=0)
        out[i, len(AVERAGED) :] = v[:, len(AVERAGED) :].sum(axis=0)
    return out


def _summary(rows: np.ndarray) -> dict[str, float]:
    means = rows[:, : len(AVERAGED)].mean(axis=0)
    hit, pairs = rows[:, len(AVERAGED) :].sum(axis=0)
    out = {k: float(v) for k, v in zip(AVERAGED, means, strict=True)}
    out["ddi"] = float(hit / pairs) if pairs else 0.0
    return out


def report(
    rows: np.ndarray, n_visits: int, rounds: int = 10, fraction: float = 0.8, seed: int = 0
) -> dict:
    """What `cognet.core.metrics.bootstrap_report` returns for the visits behind `rows`."""
    n = rows.shape[0]
    size = max(1, round(fraction * n))
    rng = np.random.default_rng(seed)
    draws = [
        _summary(rows[np.sort(rng.choice(n, size=size, replace=False))]) for _ in range(rounds)
    ]
    out: dict = {}
    for k in METRICS:
        values = np.array([d[k] for d in draws])
        out[k] = {"mean": float(values.mean()), "std": float(values.std())}
    out.update(n_patients=n, n_visits=n_visits, rounds=rounds)
    return out
