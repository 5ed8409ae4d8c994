"""Medication-recommendation metrics of the COGNet paper (appendix), torch-free.

The reference model, the baselines and the runtime all report through this module, so
every number in a comparison is computed the same way.

Per visit, on medication-id sets (predicted P, truth T):
- jaccard = |P & T| / |P | T|, precision = |P & T| / |P|, recall = |P & T| / |T|,
  f1 = 2 p r / (p + r). Edge cases: when P and T are both empty the visit is a correct
  abstention and all four are 1.0; otherwise any 0/0 is 0.0 (an empty prediction scores 0;
  a non-empty prediction for an empty truth scores 0).
- prauc = average precision of per-medication scores against the truth (sklearn's
  `average_precision_score`: one operating point per distinct score, so tied scores enter
  together); 0.0 when the truth is empty (no positive class, as sklearn returns).
- avg_drugs = |P|.
Averages: jaccard, precision, recall, f1, prauc, avg_drugs are averaged over a patient's
visits, then over patients. The DDI rate is a pooled ratio instead, as in the SafeDrug /
COGNet reference code: interacting pairs / all unordered pairs, each summed over every
evaluated visit (single-drug and empty sets add no pair); 0.0 when there is no pair at all.

Test figures (`bootstrap_report`; `report` of per-patient rows) are the mean and std (ddof=0,
as numpy's default used by the reference code) over seeded rounds that each draw 80% of the
patients *without* replacement (the reference code draws with replacement; without it a round
never counts a patient twice). Per-patient rows (`patient_rows`) are what a caller that sees
visits in chunks of whole patients keeps: the runtime's `--all` and `cognet evaluate` report
through the same functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cognet.core.ddi import pair_counts
from cognet.core.history import Visit

# Metrics averaged per patient then over patients, in the order reports list them.
AVERAGED = ("jaccard", "precision", "recall", "f1", "prauc", "avg_drugs")
METRICS = (*AVERAGED, "ddi")
# Columns of `patient_rows`: the averaged metrics, then the DDI pair counts (summed).
PATIENT_COLUMNS = (*AVERAGED, "ddi_hit", "ddi_pairs")
# Columns of the paper's Table 2: (report key, header).
TABLE_COLUMNS = (
    ("jaccard", "Jaccard"),
    ("f1", "F1"),
    ("prauc", "PRAUC"),
    ("ddi", "DDI"),
    ("avg_drugs", "Avg #Drugs"),
)


@dataclass(frozen=True)
class VisitResult:
    """One evaluated visit: the recommendation and the ground truth (medication ids)."""

    patient_id: str
    predicted: tuple[int, ...]  # generation order
    truth: tuple[int, ...]
    # float [M]: probability of each medication (for PRAUC); None -> the binary prediction.
    scores: np.ndarray | None = None


# -- per visit ------------------------------------------------------------------------------


def jaccard(predicted: Iterable[int], truth: Iterable[int]) -> float:
    p, t = set(predicted), set(truth)
    if not p and not t:
        return 1.0
    return len(p & t) / len(p | t)


def precision(predicted: Iterable[int], truth: Iterable[int]) -> float:
    p, t = set(predicted), set(truth)
    if not p:
        return 1.0 if not t else 0.0
    return len(p & t) / len(p)


def recall(predicted: Iterable[int], truth: Iterable[int]) -> float:
    p, t = set(predicted), set(truth)
    if not t:
        return 1.0 if not p else 0.0
    return len(p & t) / len(t)


def f1(predicted: Iterable[int], truth: Iterable[int]) -> float:
    p, r = precision(predicted, truth), recall(predicted, truth)
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)


def average_precision(scores: np.ndarray, truth_multi_hot: np.ndarray) -> float:
    """Area under the precision-recall curve as sklearn's `average_precision_score`.

    scores: float [M]; truth_multi_hot: 0/1 or bool [M]. AP = sum_k (R_k - R_{k-1}) P_k over
    the distinct score values in descending order (tied scores form one threshold).
    """
    scores = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(truth_multi_hot).ravel().astype(bool)
    if scores.shape != y.shape:
        raise ValueError(f"scores {scores.shape} and truth {y.shape} differ in shape")
    n_pos = int(y.sum())
    if n_pos == 0:
        return 0.0
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], y[order]
    # last index of each run of equal scores = one threshold
    cut = np.r_[np.flatnonzero(np.diff(s)), s.size - 1]
    tps = np.cumsum(y)[cut]
    prec = tps / (cut + 1)
    rec = tps / n_pos
    return float(np.sum(np.diff(rec, prepend=0.0) * prec))


def ddi_pairs_count(meds: Iterable[int], ddi_adj: np.ndarray) -> tuple[int, int]:
    """(interacting pairs, all unordered pairs) among a set of medication ids.

    ddi_adj: bool [M, M]; a pair interacts when either direction is marked.
    """
    ids = np.fromiter(set(meds), dtype=np.int64)
    n = ids.size
    if n < 2:
        return 0, 0
    sub = np.asarray(ddi_adj, dtype=bool)[np.ix_(ids, ids)]
    sub = sub | sub.T
    np.fill_diagonal(sub, False)
    pairs, total = pair_counts(np.ones(n, bool), sub.astype(np.float32))  # the decoders' count
    return int(pairs), int(total)


def ddi_rate_of_sets(med_sets: Iterable[Iterable[int]], ddi_adj: np.ndarray) -> float:
    """Pooled DDI rate of many medication sets (e.g. the ground truth of a split)."""
    hit = total = 0
    for meds in med_sets:
        h, t = ddi_pairs_count(meds, ddi_adj)
        hit += h
        total += t
    return hit / total if total else 0.0


def _multi_hot(ids: Iterable[int], size: int) -> np.ndarray:
    out = np.zeros(size, dtype=bool)
    out[list(ids)] = True
    return out


def visit_metrics(result: VisitResult, ddi_adj: np.ndarray) -> dict[str, float]:
    """Every per-visit metric of one result, plus its DDI pair counts (`ddi_hit`,
    `ddi_pairs`)."""
    ddi_adj = np.asarray(ddi_adj, dtype=bool)
    m = ddi_adj.shape[0]
    for name in ("predicted", "truth"):
        ids = getattr(result, name)
        if any(not 0 <= i < m for i in ids):
            raise ValueError(f"patient {result.patient_id}: {name} id out of range 0..{m - 1}")
    scores = result.scores
    if scores is None:
        scores = _multi_hot(result.predicted, m).astype(np.float64)
    elif np.shape(scores) != (m,):
        raise ValueError(f"patient {result.patient_id}: scores shape {np.shape(scores)} != ({m},)")
    hit, pairs = ddi_pairs_count(result.predicted, ddi_adj)
    p, t = result.predicted, result.truth
    return {
        "jaccard": jaccard(p, t),
        "precision": precision(p, t),
        "recall": recall(p, t),
        "f1": f1(p, t),
        "prauc": average_precision(scores, _multi_hot(t, m)),
        "avg_drugs": float(len(set(p))),
        "ddi_hit": float(hit),
        "ddi_pairs": float(pairs),
    }


# -- over visits and patients -----------------------------------------------------------------


def visit_rows(results: Sequence[VisitResult], ddi_adj: np.ndarray) -> np.ndarray:
    """float64 [visits, len(PATIENT_COLUMNS)]: each result's `visit_metrics`, in order."""
    adj = np.asarray(ddi_adj, dtype=bool)
    rows = [visit_metrics(r, adj) for r in results]
    return np.array([[vm[k] for k in PATIENT_COLUMNS] for vm in rows], np.float64)


def patient_rows(
    results: Sequence[VisitResult], ddi_adj: np.ndarray, rows: np.ndarray | None = None
) -> np.ndarray:
    """float64 [patients, len(PATIENT_COLUMNS)]: per patient (in order of first appearance)
    the mean of each averaged metric over its visits, then its summed DDI hits and pairs;
    `rows`: the results' `visit_rows` when already computed.

    Everything `summary_of` and `report` need: a caller that sees its visits in chunks of
    whole patients (the runtime, `cognet-batch score --all`) keeps these rows only and
    concatenates them."""
    if not results:
        raise ValueError("no visit to evaluate")
    rows = visit_rows(results, ddi_adj) if rows is None else rows
    patients: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        patients.setdefault(r.patient_id, []).append(i)
    out = np.empty((len(patients), len(PATIENT_COLUMNS)))
    for i, at in enumerate(patients.values()):
        v = rows[at]
        out[i, :-2] = v[:, :-2].mean(axis=0)
        out[i, -2:] = v[:, -2:].sum(axis=0)
    return out


def summary_of(rows: np.ndarray) -> dict[str, float]:
    """The metrics of the patients behind `patient_rows` rows: the averaged metrics' means over
    patients and the pooled DDI rate."""
    means = rows[:, :-2].mean(axis=0)
    hit, pairs = rows[:, -2:].sum(axis=0)
    out = {k: float(v) for k, v in zip(AVERAGED, means, strict=True)}
    out["ddi"] = float(hit / pairs) if pairs else 0.0
    return out


def summarize(results: Sequence[VisitResult], ddi_adj: np.ndarray) -> dict[str, float]:
    """jaccard, precision, recall, f1, prauc, avg_drugs (per patient, then over patients) and
    the pooled ddi rate of all results; ddi_adj: bool [M, M]."""
    return summary_of(patient_rows(results, np.asarray(ddi_adj, dtype=bool)))


def report(
    rows: np.ndarray, n_visits: int, rounds: int = 10, fraction: float = 0.8, seed: int = 0
) -> dict:
    """Mean and std of every metric over `rounds` draws of `fraction` of the patients behind
    `patient_rows` rows (without replacement, numpy Generator seeded with `seed`).

    Returns {metric: {"mean", "std"}, "n_patients", "n_visits", "rounds"}; rounds=1 with
    fraction=1.0 reproduces `summary_of` exactly.
    """
    if rounds < 1 or not 0 < fraction <= 1:
        raise ValueError("rounds must be >= 1 and fraction in (0, 1]")
    n = rows.shape[0]
    size = max(1, round(fraction * n))
    rng = np.random.default_rng(seed)
    draws = [
        summary_of(rows[np.sort(rng.choice(n, size=size, replace=False))]) for _ in range(rounds)
    ]
    out: dict = {}
    for k in METRICS:
        values = np.array([d[k] for d in draws])
        out[k] = {"mean": float(values.mean()), "std": float(values.std())}
    out.update(n_patients=n, n_visits=n_visits, rounds=rounds)
    return out


def bootstrap_report(
    results: Sequence[VisitResult],
    ddi_adj: np.ndarray,
    rounds: int = 10,
    fraction: float = 0.8,
    seed: int = 0,
) -> dict:
    """`report` of the patients of `results`: what `cognet evaluate` prints and what
    `cognet-batch score --all` computes chunk by chunk; ddi_adj: bool [M, M]."""
    rows = patient_rows(results, np.asarray(ddi_adj, dtype=bool))
    return report(rows, len(results), rounds, fraction, seed)


def visit_results(patients: Sequence[Sequence[Visit]], decoded: Sequence) -> list[VisitResult]:
    """One VisitResult per visit of `patients` (in order), from the decoded answers (each with
    `meds` and `scores`, e.g. `cognet.model.torch_decoding.Decoded`)."""
    visits = [v for p in patients for v in p]
    return [
        VisitResult(v.patient_id, d.meds, tuple(v.meds or ()), d.scores)
        for v, d in zip(visits, decoded, strict=True)
    ]


def evaluation_report(
    results: Sequence[VisitResult], ddi_adj: np.ndarray, rounds: int = 10, seed: int = 0
) -> dict:
    """What `cognet evaluate` reports: `bootstrap_report` over 80% of the patients, or with
    rounds <= 1 every patient once."""
    if rounds <= 1:
        return bootstrap_report(results, ddi_adj, rounds=1, fraction=1.0, seed=seed)
    return bootstrap_report(results, ddi_adj, rounds=rounds, fraction=0.8, seed=seed)


def format_table(reports: dict[str, dict]) -> str:
    """A text table like the paper's Table 2: one row per model, `mean ± std` per column.

    A report may be a `bootstrap_report` ({"mean", "std"} per metric) or a plain `summarize`
    dict (floats, shown without a std).
    """

    def cell(value) -> str:
        if isinstance(value, dict):
            return f"{value['mean']:.4f} ± {value['std']:.4f}"
        return f"{value:.4f}"

    header = ["Model", *(title for _, title in TABLE_COLUMNS)]
    rows = [[name, *(cell(rep[k]) for k, _ in TABLE_COLUMNS)] for name, rep in reports.items()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
