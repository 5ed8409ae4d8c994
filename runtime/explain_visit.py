"""One visit's decoding, step by step, like the case study of the COGNet paper (torch-free).

    explanation = explain_visit(Scorer("model"), "visits.parquet", "V0012-3")
    print(format_explanation(explanation))

The visit's patient is read from the file (two streaming passes: find the visit, then keep
its patient's rows), its earlier visits with known medications are its history, and the
visit is scored alone with explanations (the scorer's `ScoreOptions.ddi` policy applies). Each
recommended medication comes with its probability at its step, whether it was mostly
generated or copied (its copy share, `cognet.core.decoding.attribution`), the past visit it
was copied from, and the diagnoses it attended to most. When the visit's medications are
known they are shown as the truth (the visit is still scored as if they were not).

The marginal decoding (`--decoding marginal`) reads its set from the set head, which has no
steps: its medications come in decreasing P(k in S), and their copy shares, source visits
and attended diagnoses from COGNet's own set decoding of the visit (`explained_by`; null for
a medication that decoding's samples never emitted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cognet.core.errors import InputError
from cognet.core.metrics import jaccard
from cognet.runtime import reader
from cognet.runtime.scorer import Scorer

# Copy share from which a medication is called copied rather than generated.
COPIED_FROM = 0.5
# The decoding that explains each decoding that has no steps of its own to explain
EXPLAINED_BY = {"marginal": "set decoding"}


@dataclass(frozen=True)
class ExplainedStep:
    step: int  # 1-based generation order
    medication: str
    probability: float  # of the medication at its step
    # the part of its probability copied from the history; None: never emitted by the
    # decoding that explains it (`VisitExplanation.explained_by`)
    copy_share: float | None
    source_visit: str | None  # past visit holding most of its copy weight
    top_diagnoses: list[tuple[str, float]] | None  # (code, attention), heaviest first
    in_truth: bool | None  # None when the visit's medications are unknown

    @property
    def origin(self) -> str | None:
        if self.copy_share is None:
            return None
        return "copied" if self.copy_share >= COPIED_FROM else "generated"


@dataclass(frozen=True)
class VisitExplanation:
    patient_id: str
    visit_id: str
    visit_seq: int
    diagnoses: list[str]
    procedures: list[str]
    history: list[str]  # visit_ids of the earlier visits with known medications
    truth: list[str] | None  # the visit's known medications (None when unknown)
    steps: list[ExplainedStep]
    score: float  # sum of log-probabilities of the hypothesis (END included)
    interacting_pairs: list[tuple[str, str]]  # among the recommended medications
    decoding: str  # the decoding (beam width, or set samples and threshold) and DDI policy
    # the decoding whose steps the copy shares, sources and attention come from, when not
    # the one that recommended (the marginal decoding's: "set decoding"); None: the same
    explained_by: str | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        for s, step in zip(out["steps"], self.steps, strict=True):
            s["origin"] = step.origin
        return out


def patient_rows(path: str | Path, visit_id: str) -> tuple[pa.Table, dict]:
    """The rows of `visit_id`'s patient up to that visit (ordered by visit_seq, ROW kept),
    and the visit's own row as a dict. InputError when the visit is not in the file."""
    source = reader.VisitFile(path)
    target = None
    for batch in source.batches(["patient_id", "visit_id", "visit_seq"]):
        hit = batch.filter(pc.fill_null(pc.equal(batch["visit_id"], visit_id), False))
        if len(hit):
            target = hit.slice(0, 1).to_pylist()[0]
            break
    if target is None:
        raise InputError(f"{path}: column 'visit_id': no visit {visit_id!r}")
    if target["patient_id"] is None or target["visit_seq"] is None:
        raise InputError(
            f"{path}: row {target[reader.ROW]}: visit {visit_id!r} has no patient_id or visit_seq"
        )
    parts = []
    for batch in source.batches():
        mine = pc.fill_null(pc.equal(batch["patient_id"], target["patient_id"]), False)
        earlier = pc.less(batch["visit_seq"], target["visit_seq"])
        keep = pc.or_(
            pc.and_(mine, pc.fill_null(earlier, False)),
            pc.equal(batch[reader.ROW], target[reader.ROW]),
        )
        parts.append(batch.filter(keep))
    table = pa.concat_tables(parts)
    order = np.lexsort((table[reader.ROW].to_numpy(), table["visit_seq"].to_numpy()))
    table = table.take(pa.array(order))
    row = next(r for r in table.to_pylist() if r[reader.ROW] == target[reader.ROW])
    return table, row


def explain_visit(scorer: Scorer, path: str | Path, visit_id: str) -> VisitExplanation:
    """Score one visit of the file at `path` with explanations (see the module docstring)."""
    table, row = patient_rows(path, visit_id)
    is_target = pc.equal(table[reader.ROW], row[reader.ROW])
    meds = table["medications"]
    unknown = pa.nulls(len(table), meds.type)
    table = table.set_column(
        table.schema.get_field_index("medications"),
        "medications",
        pc.if_else(is_target, unknown, meds),
    )
    chunks = list(scorer.score_batches([table], explain=True, source=path))
    recs = pa.concat_tables([c.recommendations for c in chunks]).to_pylist()
    if not recs:
        rejects = pa.concat_tables([c.rejects for c in chunks]).to_pylist()
        reason = next((r["reason"] for r in rejects if r["row"] == row[reader.ROW]), "not scored")
        raise InputError(
            f"{path}: row {row[reader.ROW]}: visit {visit_id!r} cannot be scored ({reason})"
        )
    rec = recs[0]
    truth = row["medications"]
    steps = [
        ExplainedStep(
            step=i + 1,
            medication=med,
            probability=float(prob),
            copy_share=None if ex["copy_share"] is None else float(ex["copy_share"]),
            source_visit=ex["source_visit"],
            top_diagnoses=None
            if ex["top_diagnoses"] is None
            else [(d["code"], float(d["weight"])) for d in ex["top_diagnoses"]],
            in_truth=None if truth is None else med in truth,
        )
        for i, (med, prob, ex) in enumerate(
            zip(rec["medications"], rec["probabilities"], rec["explanations"], strict=True)
        )
    ]
    earlier = [r for r in table.to_pylist() if r[reader.ROW] != row[reader.ROW]]
    cfg = scorer.beam_config
    return VisitExplanation(
        patient_id=row["patient_id"],
        visit_id=visit_id,
        visit_seq=int(row["visit_seq"]),
        diagnoses=list(row["diagnoses"] or []),
        procedures=list(row["procedures"] or []),
        history=[r["visit_id"] for r in earlier if r["medications"] is not None],
        truth=None if truth is None else list(truth),
        steps=steps,
        score=float(rec["score"]),
        interacting_pairs=scorer.interacting_pairs(rec["medications"]),
        decoding=f"{scorer.decoding.label}, DDI {cfg.ddi.label}",
        explained_by=EXPLAINED_BY.get(scorer.decoding.name),
    )


def format_explanation(e: VisitExplanation) -> str:
    """The step table with a header (visit, codes, history) and a footer (truth, DDI)."""
    lines = [
        f"patient {e.patient_id}, visit {e.visit_id} (visit_seq {e.visit_seq}); decoding: "
        f"{e.decoding}",
        f"history ({len(e.history)} visits with medications): {', '.join(e.history) or 'none'}",
        *(
            [
                f"explained by: {e.explained_by} of this visit (copy share, from visit and "
                "attended diagnoses; n/a where its samples never emitted the medication)"
            ]
            if e.explained_by
            else []
        ),
        f"diagnoses ({len(e.diagnoses)}): {' '.join(e.diagnoses) or '-'}",
        f"procedures ({len(e.procedures)}): {' '.join(e.procedures) or '-'}",
        "",
    ]
    head = [
        "step",
        "medication",
        "prob",
        "origin",
        "copy share",
        "from visit",
        "attended diagnoses",
    ]
    if e.truth is not None:
        head.append("in truth")
    body = []
    for s in e.steps:
        top = (
            "n/a"
            if s.top_diagnoses is None
            else ", ".join(f"{c} {w:.2f}" for c, w in s.top_diagnoses) or "-"
        )
        cells = [
            str(s.step),
            s.medication,
            f"{s.probability:.3f}",
            s.origin or "n/a",
            "n/a" if s.copy_share is None else f"{s.copy_share:.2f}",
            s.source_visit or "-",
            top,
        ]
        if e.truth is not None:
            cells.append("yes" if s.in_truth else "no")
        body.append(cells)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    right = {0, 2, 4}  # numbers
    for r in [head, *body]:
        lines.append(
            "  ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    predicted = [s.medication for s in e.steps]
    lines += ["", f"{len(predicted)} medications, score {e.score:.3f}"]
    if e.truth is not None:
        missed = [m for m in e.truth if m not in predicted]
        hits = len(set(predicted) & set(e.truth))
        lines.append(
            f"truth: {len(e.truth)} medications, {hits} recommended, Jaccard "
            f"{jaccard(predicted, e.truth):.3f}; missed: {' '.join(missed) or 'none'}"
        )
    pairs = ", ".join(f"{a}-{b}" for a, b in e.interacting_pairs)
    lines.append(f"interacting pairs in the recommendation: {pairs or 'none'}")
    return "\n".join(lines)
