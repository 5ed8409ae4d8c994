"""The run summary of `cognet-batch score --summary-json`, the same for both engines.

A run's counts are summed over its chunks (local engine: the committed parts; Ray: the
buckets) and must account for every input row: rows_read == scored + rejected + skipped ==
the rows of the input (`check_rows`), or the run fails. With `--all` the summary carries the
metrics of the scored visits with known medications (`cognet.core.metrics.report` of the
chunks' per-patient rows: what `cognet evaluate` reports for the same visits), and those of
first visits (no history) and later visits apart, as `cognet evaluate`'s `by_history`.

What the console shows besides the counts is built here too: the metrics (`metric_lines`) and
the warnings of an input the model hardly knows (`input_warnings`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cognet.core import metrics
from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import Decoding
from cognet.runtime.options import ScoreOptions
from cognet.runtime.outputs import COUNTS, METRIC_PARTS

# Share of the visits to score rejected, or of their codes unknown to the model, above which
# a run warns: data coded otherwise than the training data (ICD-10 against ICD-9, say).
WARN_SHARE = 0.1


def total_counts(items: Iterable[Mapping]) -> dict:
    """COUNTS summed over `items` (mappings holding them and `reject_reasons`), and their
    reject reasons summed, in name order."""
    totals = dict.fromkeys(COUNTS, 0)
    reasons: dict[str, int] = {}
    for item in items:
        for key in COUNTS:
            totals[key] += item[key]
        for reason, n in item["reject_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    totals["reject_reasons"] = dict(sorted(reasons.items()))
    return totals


def check_rows(totals: Mapping, num_rows: int) -> None:
    """RuntimeError unless rows_read == scored + rejected + skipped == num_rows."""
    accounted = totals["rows_scored"] + totals["rows_rejected"] + totals["rows_skipped"]
    if not totals["rows_read"] == accounted == num_rows:
        raise RuntimeError(f"row accounting is off ({num_rows} rows in the input): {totals}")


@dataclass(frozen=True)
class Files:
    """The files of a run."""

    source: str | Path  # the input
    output: str | Path  # OUT
    rejects: str | Path  # its rejects file


@dataclass(frozen=True)
class Setup:
    """What a run scored with: its options and what the scorer made of them. A `Scorer` has
    these attributes (`Setup.of`); the Ray driver builds one from its workers' reports."""

    options: ScoreOptions
    decoding: Decoding  # the options' decoding resolved on the model's own
    providers: Sequence[str] | None = None  # ONNX Runtime's execution providers
    threads: int | None = None  # CPU threads in all
    batch_size: int | None = None  # visits decoded together at most
    ddi: DDIPolicy | None = None  # the policy run (None: the options'; off when they ask none)

    @classmethod
    def of(cls, scorer) -> Setup:
        """The setup of a `cognet.runtime.Scorer`."""
        return cls(
            scorer.options,
            scorer.decoding,
            scorer.providers,
            scorer.threads,
            scorer.batch_size,
            scorer.ddi,
        )


@dataclass(frozen=True)
class Timing:
    load_seconds: float  # loading the model and starting the engine
    seconds: float  # scoring
    visits_scored: int  # visits scored in `seconds` (a resumed run: by this run)


def run_summary(
    files: Files,
    setup: Setup,
    totals: Mapping,
    timing: Timing,
    metric_rows: np.ndarray | None = None,
    resumed_rows: int = 0,
) -> dict:
    """The summary of a run whose counts are `totals` (`total_counts`).

    metric_rows: the per-patient metric rows of a `--all` run, in input order (None without
    --all). The caller has checked the row accounting (`check_rows`)."""
    options, decoding, seconds = setup.options, setup.decoding, timing.seconds
    summary = {
        "input": str(files.source),
        "output": str(files.output),
        "rejects": str(files.rejects),
        **totals,
        "resumed_rows": resumed_rows,
        "load_seconds": round(timing.load_seconds, 3),
        "seconds": round(seconds, 3),
        "visits_per_s": round(timing.visits_scored / max(seconds, 1e-9), 2),
        "providers": None if setup.providers is None else list(setup.providers),
        "threads": setup.threads,
        "decoding": decoding.to_json(),
        "beam": decoding.beam,
        "batch_size": setup.batch_size,
        "ddi": (setup.ddi or options.request.ddi or DDIPolicy()).to_json(),
        "options": options.to_json(),
    }
    if metric_rows is not None:
        summary["metrics"] = _metrics(metric_rows, totals["visits_evaluated"])
    return summary


def _metrics(rows: np.ndarray, n_visits: int) -> dict | None:
    """`metrics.report` of the patients' rows over all their visits, with `by_history`: the
    metrics (`metrics.summary_of`, every patient) of the first visits and of the later ones,
    each with its n_visits and n_patients (None for a part without visits)."""
    if not len(rows):
        return None
    width = len(metrics.PATIENT_COLUMNS)
    out = metrics.report(rows[:, :width], n_visits)
    out["by_history"] = {}
    for part, key in enumerate(METRIC_PARTS[1:], start=1):
        counts = rows[:, -3 + part]
        mine = rows[counts > 0, part * width : (part + 1) * width]
        out["by_history"][key] = (
            {
                **metrics.summary_of(mine),
                "n_visits": int(counts.sum()),
                "n_patients": len(mine),
            }
            if len(mine)
            else None
        )
    return out


def shares(totals: Mapping) -> dict[str, tuple[int, int]]:
    """(count, out of) of the visits to score that were rejected ("visits") and of the codes
    of the visits used, scored or history, that the model does not know ("codes")."""
    asked = totals["rows_scored"] + totals["rows_rejected"]
    return {
        "visits": (totals["rows_rejected"], asked),
        "codes": (totals["unknown_codes"], totals["codes_given"]),
    }


def input_warnings(totals: Mapping, share: float = WARN_SHARE) -> list[str]:
    """One line per share of `shares` above `share`: how much, and what it suggests."""
    said = {
        "visits": "of the visits to score were rejected (reasons: the rejects file)",
        "codes": "of the codes of the visits used are unknown to the model (dropped)",
    }
    lines = []
    for key, (n, of) in shares(totals).items():
        if of and n / of > share:
            lines.append(f"{n / of:.0%} {said[key]}: {n} of {of}")
    if lines:
        lines[-1] += "; is the input coded as the model's training data?"
    return lines


def metric_lines(summary: Mapping) -> list[str]:
    """The `--all` metrics of a run summary as the console shows them (none without)."""
    rep = summary.get("metrics")
    if rep is None:
        return ["no scored visit has known medications: no metric"] if "metrics" in summary else []
    cells = [
        f"{title} {rep[key]['mean']:.4f} ± {rep[key]['std']:.4f}"
        for key, title in (*metrics.TABLE_COLUMNS[:3], ("ddi", "DDI rate"))
    ]
    lines = [
        f"metrics of {rep['n_visits']} visits with known medications ({rep['n_patients']} "
        f"patients; mean ± std over {rep['rounds']} draws of 80% of the patients): "
        + ", ".join(cells)
    ]
    parts = rep.get("by_history") or {}
    labels = {"first": "first visits (no history)", "later": "later visits"}
    for key, label in labels.items():
        part = parts.get(key)
        if part:
            lines.append(
                f"{label}: Jaccard {part['jaccard']:.4f}, F1 {part['f1']:.4f}, PRAUC "
                f"{part['prauc']:.4f}, DDI rate {part['ddi']:.4f} ({part['n_visits']} visits)"
            )
    return lines
