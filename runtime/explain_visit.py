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

In words (`format_explanation`): names beside codes where a public source has them
(`cognet.core.code_names`: ICD-9-CM diagnoses and procedures; a user's `--names` file first),
the source visit only beside a medication called copied (copy share from COPIED_FROM up), set
decoding's order called a rank, what the score means, and the interacting pairs by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cognet.core.code_names import CodeNames
from cognet.core.decoding.attribution import COPIED_FROM
from cognet.core.errors import InputError
from cognet.core.metrics import jaccard
from cognet.runtime import reader
from cognet.runtime.scorer import Scorer

# The decoding that explains each decoding that has no steps of its own to explain
EXPLAINED_BY = {"marginal": "set decoding"}


@dataclass(frozen=True)
class ExplainedStep:
    step: int  # 1-based: generation order (beam), rank in the set (set decoding)
    medication: str
    probability: float  # of the medication at its step
    # the part of its probability copied from the history; None: never emitted by the
    # decoding that explains it (`VisitExplanation.explained_by`)
    copy_share: float | None
    source_visit: str | None  # past visit holding most of its copy weight (whatever the share)
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
    score: float  # beam: sum of log-probabilities (END included); set: mean P(k in S)
    interacting_pairs: list[tuple[str, str]]  # among the recommended medications
    decoding: str  # the decoding (beam width, or set samples and threshold) and DDI policy
    # the decoding whose steps the copy shares, sources and attention come from, when not
    # the one that recommended (the marginal decoding's: "set decoding"); None: the same
    explained_by: str | None = None
    ranked: bool = False  # set decoding: steps are ranks in the set, not generation steps
    # {kind: {code: name}} of the codes shown that have a name (`cognet.core.code_names`)
    names: dict[str, dict[str, str]] | None = None

    @property
    def score_meaning(self) -> str:
        if self.ranked:
            return "the mean P(k in S) of the recommended medications (0 to 1)"
        return (
            "the sum of the log-probabilities of the list's steps, its end included "
            "(0 at most; closer to 0: likelier)"
        )

    def name(self, kind: str, code: str) -> str | None:
        return (self.names or {}).get(kind, {}).get(code)

    def to_json(self) -> dict:
        out = asdict(self)
        for s, step in zip(out["steps"], self.steps, strict=True):
            s["origin"] = step.origin
        out["score_meaning"] = self.score_meaning
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


def explain_visit(
    scorer: Scorer, path: str | Path, visit_id: str, names: CodeNames | None = None
) -> VisitExplanation:
    """Score one visit of the file at `path` with explanations (see the module docstring);
    names: the code names to show (default: the shipped ones)."""
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
    cfg = scorer.decoding_plan.beam
    diagnoses, procedures = list(row["diagnoses"] or []), list(row["procedures"] or [])
    shown = {
        "diagnosis": diagnoses,
        "procedure": procedures,
        "medication": [*rec["medications"], *(truth or [])],
    }
    names = names or CodeNames.load()
    found = {
        kind: {c: n for c in codes if c is not None and (n := names.name(kind, c))}
        for kind, codes in shown.items()
    }
    return VisitExplanation(
        patient_id=row["patient_id"],
        visit_id=visit_id,
        visit_seq=int(row["visit_seq"]),
        diagnoses=diagnoses,
        procedures=procedures,
        history=[r["visit_id"] for r in earlier if r["medications"] is not None],
        truth=None if truth is None else list(truth),
        steps=steps,
        score=float(rec["score"]),
        interacting_pairs=scorer.interacting_pairs(rec["medications"]),
        decoding=f"{scorer.decoding.label}, DDI {cfg.ddi.label}",
        explained_by=EXPLAINED_BY.get(scorer.decoding.name),
        ranked=scorer.decoding.name != "beam",
        names=found,
    )


def format_explanation(e: VisitExplanation) -> str:
    """The step table with a header (visit, score, codes by name, history) and a footer
    (what the columns mean, truth, interacting pairs by name)."""
    order = "rank" if e.ranked else "step"
    lines = [
        f"patient {e.patient_id}, visit {e.visit_id} (visit_seq {e.visit_seq}); decoding: "
        f"{e.decoding}",
        f"score {e.score:.3f}: {e.score_meaning}",
        f"history ({len(e.history)} visits with medications): {', '.join(e.history) or 'none'}",
        *(
            [
                f"explained by: {e.explained_by} of this visit (copy share, from visit and "
                "attended diagnoses; n/a where its samples never emitted the medication)"
            ]
            if e.explained_by
            else []
        ),
        *_codes(e, "diagnoses", "diagnosis", e.diagnoses),
        *_codes(e, "procedures", "procedure", e.procedures),
        "",
    ]
    head = [order, "medication", "prob", "origin", "copy share", "from visit", "attended diagnoses"]
    if e.truth is not None:
        head.append("in truth")
    body = []
    for s in e.steps:
        top = (
            "n/a"
            if s.top_diagnoses is None
            else ", ".join(f"{c} {w:.2f}" for c, w in s.top_diagnoses) or "-"
        )
        name = e.name("medication", s.medication)
        cells = [
            str(s.step),
            f"{s.medication} {name}" if name else s.medication,
            f"{s.probability:.3f}",
            s.origin or "n/a",
            "n/a" if s.copy_share is None else f"{s.copy_share:.2f}",
            # a visit is named only for what was copied: a generated one came from no visit
            (s.source_visit or "-") if s.origin == "copied" else "-",
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
    prob = "P(k in S), the share of sampled sets holding k" if e.ranked else "P(k) at its step"
    lines += [
        "",
        f"{order}: "
        + ("place in the set, most probable first" if e.ranked else "generation order")
        + f"; prob: {prob}",
        f"origin: copied from a copy share of {COPIED_FROM:g} up (the share of its "
        "probability that came from the history), from the past visit named; attended "
        "diagnoses: the visit's diagnoses it attended to most (weights)",
        f"{len(predicted)} medications",
    ]
    if e.truth is not None:
        missed = [m for m in e.truth if m not in predicted]
        hits = len(set(predicted) & set(e.truth))
        lines.append(
            f"truth: {len(e.truth)} medications, {hits} recommended, Jaccard "
            f"{jaccard(predicted, e.truth):.3f}; missed: "
            + (", ".join(_named(e, "medication", m) for m in missed) or "none")
        )
    if e.interacting_pairs:
        lines.append(
            f"interacting pairs in the recommendation: {len(e.interacting_pairs)} (pairs the "
            "model's DDI graph lists as adverse drug-drug interactions; --ddi-mode and "
            "--ddi-pair-price bound them)"
        )
        lines += [
            f"  {_named(e, 'medication', a)} - {_named(e, 'medication', b)}"
            for a, b in e.interacting_pairs
        ]
    else:
        lines.append("interacting pairs in the recommendation: none")
    return "\n".join(lines)


def _named(e: VisitExplanation, kind: str, code: str) -> str:
    name = e.name(kind, code)
    return f"{code} ({name})" if name else code


def _codes(e: VisitExplanation, title: str, kind: str, codes: list[str]) -> list[str]:
    """A code list: on one line when no code has a name, else one code and name a line."""
    if not any(e.name(kind, c) for c in codes):
        return [f"{title} ({len(codes)}): {' '.join(codes) or '-'}"]
    width = max(len(c) for c in codes)
    return [f"{title} ({len(codes)}):"] + [
        f"  {c.ljust(width)}  {e.name(kind, c) or ''}".rstrip() for c in codes
    ]
