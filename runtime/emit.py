"""Emitting, the last stage of scoring (plan -> encode -> decode -> emit): a chunk's output
rows in target order from each batch's decoding, and the per-patient metrics of the visits
whose medications are known (`--all`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from cognet.core.decoding.beam import BeamResult
from cognet.core.metrics import PATIENT_COLUMNS, VisitResult, patient_rows, visit_rows
from cognet.runtime.outputs import METRIC_WIDTH, explanations, output_schema, with_kept
from cognet.runtime.plan import Plan


def recommendations(
    plan: Plan,
    parts: Sequence[np.ndarray],
    results: Sequence[BeamResult],
    slots: dict,
    codes: pa.Array,
    diag_codes: np.ndarray | None = None,
) -> pa.Table:
    """The output rows of the targets, in target order, from each batch's result (lists
    built batch by batch, then put in order by one Arrow take). `parts`: the targets of each
    batch; `codes`: the medication codes by id; `diag_codes` (the diagnosis codes by id):
    add the explanations, from `slots` (per target: its batch's result, its place there,
    its batch's decoder-init inputs)."""
    lengths = np.concatenate(
        [np.zeros(0, np.int64)]
        + [np.fromiter(map(len, r.meds), np.int64, len(r.meds)) for r in results]
    )
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = np.concatenate([np.zeros(0, np.int64)] + [m for r in results for m in r.meds])
    probs = np.concatenate([np.zeros(0, np.float32)] + [p for r in results for p in r.med_probs])
    scores = np.concatenate([np.zeros(0, np.float32)] + [r.score for r in results])
    order = np.concatenate([np.zeros(0, np.int64)] + list(parts))  # target at each place
    place = np.empty(order.size, np.int64)
    place[order] = np.arange(order.size)  # the inverse permutation
    place = pa.array(place)
    medications = pa.ListArray.from_arrays(offsets, codes.take(pa.array(flat)))
    probabilities = pa.ListArray.from_arrays(offsets, pa.array(probs, pa.float32()))
    table = plan.table.take(pa.array(plan.targets))
    columns = {
        "patient_id": table["patient_id"],
        "visit_id": table["visit_id"],
        "medications": medications.take(place),
        "score": pa.array(scores, pa.float32()).take(place),
        "probabilities": probabilities.take(place),
    }
    explain = diag_codes is not None
    if explain:
        columns["explanations"] = explanations(plan, slots, diag_codes)
    return with_kept(pa.table(columns, schema=output_schema(explain)), table)


def patient_metrics(plan: Plan, slots: dict, ddi_adj: np.ndarray) -> tuple[np.ndarray, int]:
    """(the per-patient metric rows of the targets with known medications, `outputs`'
    METRIC_WIDTH columns: all visits, first visits (no history), later visits; their count)."""
    pids = plan.table["patient_id"]
    no_history = plan.histories.lengths == 0
    results, first = [], []
    for i, row in enumerate(plan.targets.tolist()):
        if not plan.has_meds[row]:
            continue
        res, k, _ = slots[i]
        results.append(
            VisitResult(
                pids[row].as_py(),
                tuple(res.meds[k].tolist()),
                tuple(plan.meds[row].tolist()),
                res.prauc_scores[k],
            )
        )
        first.append(bool(no_history[i]))
    if not results:
        return np.zeros((0, METRIC_WIDTH)), 0
    patients = {p: i for i, p in enumerate(dict.fromkeys(r.patient_id for r in results))}
    width = len(PATIENT_COLUMNS)
    out = np.full((len(patients), METRIC_WIDTH), np.nan)
    visits = visit_rows(results, ddi_adj)  # each visit's metrics once, for every part
    out[:, :width] = patient_rows(results, ddi_adj, visits)
    for part, want in enumerate((True, False), start=1):
        mine = np.flatnonzero(np.array(first) == want)
        subset = [results[i] for i in mine]
        at = [patients[r.patient_id] for r in subset]
        out[:, -3 + part] = np.bincount(at, minlength=len(patients))
        if subset:
            rows = list(dict.fromkeys(at))  # patient_rows' order: first appearance
            block = patient_rows(subset, ddi_adj, visits[mine])
            out[rows, part * width : (part + 1) * width] = block
    return out, len(results)
