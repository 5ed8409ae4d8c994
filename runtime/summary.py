"""The run summary of `cognet-batch score --summary-json`, the same for both engines.

A run's counts are summed over its chunks (local engine: the committed parts; Ray: the
buckets) and must account for every input row: rows_read == scored + rejected + skipped ==
the rows of the input (`check_rows`), or the run fails. With `--all` the summary carries the
metrics of the scored visits with known medications (`cognet.core.metrics.report` of the
chunks' per-patient rows: what `cognet evaluate` reports for the same visits).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from cognet.core import metrics
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


def run_summary(
    *,
    source: str | Path,
    output: str | Path,
    rejects: str | Path,
    totals: Mapping,
    load_seconds: float,
    seconds: float,
    visits_scored: int,
    providers: Sequence[str] | None,
    threads: int | None,
    decoding: Decoding,
    batch_size: int | None,
    options: ScoreOptions,
    metric_rows: np.ndarray | None = None,
    resumed_rows: int = 0,
) -> dict:
    """The summary of a run whose counts are `totals` (`total_counts`).

    visits_scored: visits scored in `seconds` (a resumed run: by this run); metric_rows:
    the per-patient metric rows of a `--all` run, in input order (None without --all).
    The caller has checked the row accounting (`check_rows`)."""
    summary = {
        "input": str(source),
        "output": str(output),
        "rejects": str(rejects),
        **totals,
        "resumed_rows": resumed_rows,
        "load_seconds": round(load_seconds, 3),
        "seconds": round(seconds, 3),
        "visits_per_s": round(visits_scored / max(seconds, 1e-9), 2),
        "providers": None if providers is None else list(providers),
        "threads": threads,
        "decoding": decoding.to_json(),
        "beam": decoding.beam,
        "batch_size": batch_size,
        "ddi": options.ddi.to_json(),
        "options": options.to_json(),
    }
    if metric_rows is not None:
        n_visits = totals["visits_evaluated"]
        summary["metrics"] = metrics.report(metric_rows, n_visits) if len(metric_rows) else None
    return summary
