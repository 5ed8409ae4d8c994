"""What scoring produces: the output and rejects schemas, and the results of one chunk.

`cognet-batch score` writes OUTPUT_SCHEMA rows (plus `explanations` with `--explain`) to OUT
and REJECTS_SCHEMA rows to the rejects file; `ScoredChunk` carries both for one chunk of
input rows, with its counts and (with `--all`) its per-patient metric rows. The scorer
(`cognet.runtime.scorer`) builds them; the writer and the Ray engine only read them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from cognet.core.dataset import PREDICTIONS_SCHEMA
from cognet.core.decoding.attribution import copy_share_and_source, most_attended
from cognet.core.decoding.sampling import SetResult
from cognet.core.metrics import PATIENT_COLUMNS
from cognet.runtime import reader
from cognet.runtime.plan import REASONS, REJECTED, Plan

# Diagnoses a medication attended to most: top TOP_DIAGNOSES codes by the diagnosis
# cross-attention (mean over heads) at the step that emitted it, heaviest first.
TOP_DIAGNOSES = 3
ATTENDED = pa.struct([("code", pa.string()), ("weight", pa.float32())])
EXPLANATION = pa.struct(
    [
        ("copy_share", pa.float32()),
        ("source_visit", pa.string()),
        ("top_diagnoses", pa.list_(ATTENDED)),  # null when the model has no attention output
    ]
)
OUTPUT_SCHEMA = PREDICTIONS_SCHEMA  # also `cognet evaluate --predictions`
EXPLAIN_FIELD = pa.field("explanations", pa.list_(EXPLANATION))
REJECTS_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),  # 0-based row in the input file
        ("patient_id", pa.string()),
        ("visit_id", pa.string()),
        ("reason", pa.string()),  # one of plan.REASONS
    ]
)


def output_schema(explain: bool, kept: Iterable[pa.Field] = ()) -> pa.Schema:
    """The output's columns: OUTPUT_SCHEMA, `explanations` with explain, then the kept input
    columns (`--keep-columns`)."""
    schema = OUTPUT_SCHEMA.append(EXPLAIN_FIELD) if explain else OUTPUT_SCHEMA
    for kept_field in kept:
        schema = schema.append(kept_field)
    return schema


def kept_fields(table: pa.Table | pa.Schema) -> list[pa.Field]:
    """The kept input columns that travel with the rows of `table` (`reader.keep`), under
    their own names."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    prefix = reader.KEEP_PREFIX
    return [f.with_name(f.name[len(prefix) :]) for f in schema if f.name.startswith(prefix)]


def with_kept(out: pa.Table, rows: pa.Table) -> pa.Table:
    """The output rows `out` with the kept input columns of `rows` (the same visits, in the
    same order) appended under their own names."""
    for kept_field in kept_fields(rows):
        out = out.append_column(kept_field, rows[reader.KEEP_PREFIX + kept_field.name])
    return out


# The counts of a chunk (and of a run: `cognet.runtime.summary`).
COUNTS = (
    "rows_read",
    "rows_scored",
    "rows_rejected",
    "rows_skipped",
    "unknown_codes",
    "codes_given",
    "visits_evaluated",
)
# The per-patient metric rows of `--all` (`emit.patient_metrics`), one block of
# `cognet.core.metrics.patient_rows` columns per part of the patient's evaluated visits: all,
# first visits (no history: the model generates only), later visits; then the visit counts of
# the last two (a patient without visits of a part has NaN in its block).
METRIC_PARTS = ("all", "first", "later")
METRIC_COLUMNS = (
    *(f"{part}.{c}" for part in METRIC_PARTS for c in PATIENT_COLUMNS),
    *(f"{part}.n_visits" for part in METRIC_PARTS[1:]),
)
METRIC_WIDTH = len(METRIC_COLUMNS)


@dataclass
class ScoredChunk:
    """The results of one chunk of input rows [start, end) (stream positions)."""

    index: int
    start: int
    end: int
    recommendations: pa.Table  # output_schema(explain), in input order
    rejects: pa.Table  # REJECTS_SCHEMA
    rows_scored: int
    rows_rejected: int
    rows_skipped: int
    reject_reasons: dict[str, int]
    unknown_codes: int  # codes dropped from kept rows
    codes_given: int  # codes of those rows, known or not
    seconds: float  # time spent scoring this chunk
    # [patients, METRIC_WIDTH]: the metric rows of the scored visits with known medications
    # (score_all only, else None), and how many there were
    patient_metrics: np.ndarray | None = field(default=None, repr=False)
    visits_evaluated: int = 0

    @property
    def rows_read(self) -> int:
        return self.end - self.start

    def counts(self) -> dict:
        """COUNTS and the reject reasons of this chunk."""
        return {**{k: getattr(self, k) for k in COUNTS}, "reject_reasons": self.reject_reasons}


def rejects_table(plan: Plan) -> pa.Table:
    """The rejected rows of a planned chunk (REJECTS_SCHEMA), in input order."""
    rows = np.flatnonzero(plan.status == REJECTED)
    table = plan.table.take(pa.array(rows))
    reasons = np.asarray(REASONS, dtype=object)[plan.reason[rows]]
    return pa.table(
        {
            "row": table[reader.ROW],
            "patient_id": table["patient_id"],
            "visit_id": table["visit_id"],
            "reason": pa.array(list(reasons), pa.string()),
        },
        schema=REJECTS_SCHEMA,
    )


def explanations(plan: Plan, slots: dict, diag_codes: np.ndarray) -> pa.Array:
    """The `explanations` column of a chunk's targets (slots: target -> (its batch's
    result, its place there, its batch's decoder-init inputs); diag_codes: the vocabulary's
    diagnosis codes, an object array). Per medication k: its copy share, the part of its
    probability that came from the history (`cognet.core.decoding.attribution`; 0 for a
    medication in no past visit), the past visit whose slots of k carry most of it (null
    when none holds it), and the diagnoses of the visit it attended to most at its step.
    The marginal decoding's sets are explained by the set decoding's samples
    (`SetResult.emitted`): a medication they never emitted has all three null."""
    visit_ids = plan.table["visit_id"]
    out = []
    for i in range(plan.targets.size):
        res, k, inputs = slots[i]
        meds = res.meds[k]
        share = np.zeros(meds.size)
        hist = plan.histories[i]
        src: list[str | None] = [None] * meds.size
        if hist.size and meds.size:
            share, source = copy_share_and_source(
                res.shares[k],
                meds,
                inputs["slot_med"][k],
                inputs["slot_visit"][k],
                inputs["slot_mask"][k] > 0,
                hist.size,
            )
            src = [None if j is None else visit_ids[int(hist[j])].as_py() for j in source]
        top = _top_diagnoses(plan, plan.targets[i], res.attention, k, meds.size, diag_codes)
        marginal = isinstance(res, SetResult) and res.emitted is not None
        emitted = res.emitted[k] if marginal else [True] * meds.size
        out.append(
            [
                {"copy_share": float(s), "source_visit": v, "top_diagnoses": d}
                if seen
                else {"copy_share": None, "source_visit": None, "top_diagnoses": None}
                for s, v, d, seen in zip(share.tolist(), src, top, emitted, strict=True)
            ]
        )
    return pa.array(out, pa.list_(EXPLANATION))


def _top_diagnoses(
    plan: Plan,
    row: int,
    attention: list | None,
    k: int,
    n_meds: int,
    diag_codes: np.ndarray,
) -> list:
    """Per medication of one visit: [{code, weight}] of its TOP_DIAGNOSES most attended
    diagnoses (positions of the attention = the row's diagnosis ids, in plan order)."""
    if attention is None:
        return [None] * n_meds
    ids = plan.diag[row]
    weights, order = most_attended(attention[k], ids.size, TOP_DIAGNOSES)
    codes = diag_codes[ids]
    return [
        [{"code": codes[j], "weight": float(w[j])} for j in o if w[j] > 0]
        for o, w in zip(order, weights, strict=True)
    ]
