"""The run summary of `cognet-batch score --summary-json`, the same for both engines.

A run's counts are summed over its chunks (local engine: the committed parts; Ray: the
buckets) and must account for every input row: rows_read == scored + rejected + skipped ==
the rows of the input (`check_rows`), or the run fails. With `--all` the summary carries the
metrics of the scored visits with known medications (`cognet.core.metrics.report` of the
chunks' per-patient rows: what `cognet evaluate` reports for the same visits).
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
from cognet.runtime.outputs import COUNTS


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
        n_visits = totals["visits_evaluated"]
        summary["metrics"] = metrics.report(metric_rows, n_visits) if len(metric_rows) else None
    return summary
