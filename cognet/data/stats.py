"""Dataset statistics: the paper's statistics table plus copy structure and ground-truth DDI rate.

Torch-free and vectorised (numpy over flattened code lists), so that a million visits take
seconds, not minutes.
Fractions are in [0, 1]. Medication statistics use the visits whose medications are known;
a visit's "previous visit" for them is the patient's previous visit with known medications.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cognet.core.dataset import Dataset

_ROWS_PER_CHUNK = 65536  # bounds the dense visit x medication matrix of the DDI count


def _flat_codes(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(row, code id) of each distinct code of each row, sorted by row then id; the codes."""
    lists = column.combine_chunks()
    rows = pc.list_parent_indices(lists).to_numpy().astype(np.int64)
    encoded = pc.dictionary_encode(pc.list_flatten(lists))
    vocab = max(len(encoded.dictionary), 1)
    keys = np.sort(rows * vocab + encoded.indices.to_numpy().astype(np.int64))
    keys = keys[np.r_[True, keys[1:] != keys[:-1]]] if len(keys) else keys  # np.unique, faster
    return keys // vocab, keys % vocab, encoded.dictionary.to_pylist()


def _previous_rows(patient: np.ndarray) -> np.ndarray:
    """Index of the previous row of the same patient (rows are grouped), -1 for a first visit."""
    prev = np.arange(len(patient)) - 1
    first = np.ones(len(patient), dtype=bool)
    first[1:] = patient[1:] != patient[:-1]
    prev[first] = -1
    return prev


def _in_previous(rows, codes, vocab, prev) -> np.ndarray:
    """For each (row, code): whether the code is also in row prev[row]."""
    keys = rows * vocab + codes
    wanted = prev[rows] * vocab + codes
    pos = np.clip(np.searchsorted(keys, wanted), 0, max(len(keys) - 1, 0))
    return (prev[rows] >= 0) & (keys[pos] == wanted) if len(keys) else np.zeros(0, bool)


def _in_history(rows, codes, vocab, patient) -> np.ndarray:
    """For each (row, code): whether the code is in an earlier row of the same patient."""
    owner = patient[rows] * vocab + codes
    order = np.lexsort((rows, owner))
    first_of_owner = np.ones(len(order), dtype=bool)
    first_of_owner[1:] = owner[order][1:] != owner[order][:-1]
    out = np.empty(len(order), dtype=bool)
    out[order] = ~first_of_owner
    return out


def _ratio(num: np.ndarray, den: np.ndarray, keep: np.ndarray) -> np.ndarray:
    keep = keep & (den > 0)
    return num[keep] / den[keep]


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if len(x) else 0.0


def _median(x: np.ndarray) -> float:
    return float(np.median(x)) if len(x) else 0.0


def _ddi_counts(rows, codes, n_rows, med_names, ddi_pairs) -> tuple[int, int]:
    """(interacting pairs, all pairs) among each visit's medications, summed over visits."""
    index = {code: i for i, code in enumerate(med_names)}
    pairs = [(index[a], index[b]) for a, b in ddi_pairs if a in index and b in index]
    per_row = np.bincount(rows, minlength=n_rows).astype(np.int64)
    total = int((per_row * (per_row - 1) // 2).sum())
    if not pairs:
        return 0, total
    a, b = np.array(pairs).T
    interacting = 0
    bounds = np.searchsorted(rows, np.arange(0, n_rows + _ROWS_PER_CHUNK, _ROWS_PER_CHUNK))
    for chunk, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        dense = np.zeros((_ROWS_PER_CHUNK, len(med_names)), bool)  # visit x medication
        dense[rows[lo:hi] - chunk * _ROWS_PER_CHUNK, codes[lo:hi]] = True
        interacting += int(np.count_nonzero(dense[:, a] & dense[:, b]))
    return interacting, total


def compute_stats(dataset: Dataset) -> dict:
    """Statistics of a dataset (all splits together), as a flat JSON-ready dict."""
    visits = dataset.visits
    patient = pc.dictionary_encode(visits["patient_id"].combine_chunks()).indices.to_numpy()
    patient = patient.astype(np.int64)
    n_visits = len(patient)
    visits_per_patient = np.bincount(patient)
    split_counts = pc.value_counts(visits["split"].combine_chunks()).to_pylist()
    per_split = {item["values"]: item["counts"] for item in split_counts}

    def lengths(name: str) -> np.ndarray:
        return pc.list_value_length(visits[name]).to_numpy(zero_copy_only=False)

    n_diag, n_proc = lengths("diagnoses"), lengths("procedures")
    known = ~visits["medications"].is_null().to_numpy(zero_copy_only=False)
    n_med = np.nan_to_num(lengths("medications").astype(float)).astype(np.int64)

    d_rows, d_codes, d_names = _flat_codes(visits["diagnoses"])
    p_names = _flat_codes(visits["procedures"])[2]
    meds = visits["medications"].filter(pc.invert(visits["medications"].is_null()))
    m_rows, m_codes, med_names = _flat_codes(meds)
    d_vocab, p_vocab, m_vocab = len(d_names), len(p_names), len(med_names)
    m_patient = patient[known]
    m_distinct = np.bincount(m_rows, minlength=len(m_patient))

    # copy structure of non-first visits
    prev = _previous_rows(m_patient)
    stride = max(m_vocab, 1)
    in_prev = np.bincount(m_rows, _in_previous(m_rows, m_codes, stride, prev), len(m_patient))
    in_hist = np.bincount(m_rows, _in_history(m_rows, m_codes, stride, m_patient), len(m_patient))
    later = prev >= 0
    prev_distinct = np.where(later, m_distinct[np.maximum(prev, 0)], 0)
    union = m_distinct + prev_distinct - in_prev
    hist_frac = _ratio(in_hist, m_distinct, later)
    d_prev = _previous_rows(patient)
    d_distinct = np.bincount(d_rows, minlength=n_visits)
    d_repeat = np.bincount(d_rows, _in_previous(d_rows, d_codes, max(d_vocab, 1), d_prev), n_visits)

    # medication frequency skew
    counts = np.sort(np.bincount(m_codes, minlength=m_vocab))[::-1]
    share = np.cumsum(counts) / max(counts.sum(), 1)
    interacting, all_pairs = _ddi_counts(
        m_rows, m_codes, len(m_patient), med_names, dataset.ddi_pairs
    )
    return {
        "patients": int(len(visits_per_patient)),
        "visits": int(n_visits),
        "visits_train": int(per_split.get("train", 0)),
        "visits_val": int(per_split.get("val", 0)),
        "visits_test": int(per_split.get("test", 0)),
        "visits_unknown_medications": int((~known).sum()),
        "diagnosis_codes": int(d_vocab),
        "procedure_codes": int(p_vocab),
        "medication_codes": int(m_vocab),
        "visits_per_patient_mean": float(visits_per_patient.mean()),
        "visits_per_patient_max": int(visits_per_patient.max()),
        "single_visit_patients": float(np.mean(visits_per_patient == 1)),
        "patients_3plus_visits": float(np.mean(visits_per_patient >= 3)),
        "diagnoses_per_visit_mean": float(n_diag.mean()),
        "diagnoses_per_visit_max": int(n_diag.max()),
        "procedures_per_visit_mean": float(n_proc.mean()),
        "procedures_per_visit_max": int(n_proc.max()),
        "medications_per_visit_mean": _mean(n_med[known]),
        "medications_per_visit_max": int(n_med[known].max()) if known.any() else 0,
        "medications_per_visit_min": int(n_med[known].min()) if known.any() else 0,
        "ddi_pairs": len(dataset.ddi_pairs),
        "ddi_rate": interacting / all_pairs if all_pairs else 0.0,
        "med_in_previous_visit": _mean(_ratio(in_prev, m_distinct, later)),
        "med_in_history_mean": _mean(hist_frac),
        "med_in_history_median": _median(hist_frac),
        "jaccard_previous_visit": _mean(_ratio(in_prev, union, later)),
        "diagnoses_in_previous_visit": _mean(_ratio(d_repeat, d_distinct, d_prev >= 0)),
        "top10_medication_share": float(share[min(9, len(share) - 1)]) if len(share) else 0.0,
        "medications_covering_80pct": int(np.searchsorted(share, 0.8) + 1) if len(share) else 0,
    }


_ROWS = [
    # (label, format of the value(s)), grouped like the paper's statistics table
    ("# patients", "{patients:,}"),
    (
        "# visits (train / val / test)",
        "{visits:,} ({visits_train:,} / {visits_val:,} / {visits_test:,})",
    ),
    (
        "# diagnosis / procedure / medication codes",
        "{diagnosis_codes:,} / {procedure_codes:,} / {medication_codes:,}",
    ),
    (
        "avg / max # of visits per patient",
        "{visits_per_patient_mean:.2f} / {visits_per_patient_max}",
    ),
    (
        "patients with 1 visit / 3+ visits",
        "{single_visit_patients:.1%} / {patients_3plus_visits:.1%}",
    ),
    (
        "avg / max # of diagnoses per visit",
        "{diagnoses_per_visit_mean:.2f} / {diagnoses_per_visit_max}",
    ),
    (
        "avg / max # of procedures per visit",
        "{procedures_per_visit_mean:.2f} / {procedures_per_visit_max}",
    ),
    (
        "avg / max / min # of medications per visit",
        "{medications_per_visit_mean:.2f} / "
        "{medications_per_visit_max} / {medications_per_visit_min}",
    ),
    ("# DDI pairs", "{ddi_pairs:,}"),
    ("ground-truth DDI rate", "{ddi_rate:.4f}"),
    ("medications in the previous visit", "{med_in_previous_visit:.1%}"),
    (
        "medications in any earlier visit (mean / median)",
        "{med_in_history_mean:.1%} / {med_in_history_median:.1%}",
    ),
    ("Jaccard with the previous visit's medications", "{jaccard_previous_visit:.4f}"),
    ("diagnoses in the previous visit", "{diagnoses_in_previous_visit:.1%}"),
    ("share of the 10 commonest medications", "{top10_medication_share:.1%}"),
    ("# medications covering 80% of prescriptions", "{medications_covering_80pct}"),
]


def format_stats(stats: dict) -> str:
    """A two-column text table of `compute_stats` output (copy figures: non-first visits)."""
    rows = [(label, fmt.format(**stats)) for label, fmt in _ROWS]
    if stats.get("visits_unknown_medications"):
        rows.insert(
            2, ("visits with unknown medications", f"{stats['visits_unknown_medications']:,}")
        )
    width = max(len(label) for label, _ in rows)
    lines = [f"{'Item':<{width}}  Value", f"{'-' * width}  {'-' * 24}"]
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)
