"""The `cognet-batch` command line: score Parquet files of visits with an exported model.

A thin layer over `cognet.runtime.Scorer` and `cognet.runtime.writer`; see `score --help`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import click

from cognet.clitools import handle_errors, progress, setup_logging
from cognet.errors import InputError
from cognet.runtime import evaluation, reader, writer
from cognet.runtime.session import DEVICES

log = logging.getLogger(__name__)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """cognet-batch: medication recommendations for Parquet files of visits (no torch).

    \b
    Example:
      cognet-batch score visits.parquet --model model --out recs.parquet
    """


@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=False))
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="Model directory written by cognet-export.")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="Output Parquet file (rejected rows go to OUT with .rejects.parquet).")
@click.option("--beam", type=click.IntRange(min=1), default=None,
              help="Beam width (default: the model's, 4; 1 = greedy).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="Execution provider; auto = CUDA when available, else CPU.")
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True,
              help="Visits decoded together.")
@click.option("--all", "score_all", is_flag=True,
              help="Score every visit, not only those with null medications, and report "
                   "metrics against the known medications.")
@click.option("--explain", is_flag=True,
              help="Add per medication its copy share and the past visit it came from.")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted run with the same input, model and options.")
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None,
              help="Write counts, reject reasons, speed, providers (and metrics) as JSON.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local",
              show_default=True, help="Where to run (ray: not yet available).")
@click.option("--sort", "sort_rows", is_flag=True,
              help="Sort the rows by patient and visit_seq in memory (for files that fit).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Intra-op threads (default: the cores available to this process).")
@click.option("--max-history-visits", type=click.IntRange(min=0), default=None,
              help="Use only the last K past visits of a patient as history (default: all).")
@click.option("--quiet", is_flag=True, help="No progress bar nor closing line.")
@click.option("--verbose", is_flag=True, help="Log what happens on stderr.")
@handle_errors
def score(input_path, model_dir, out, beam, device, batch_size, score_all, explain, resume,
          summary_json, engine, sort_rows, threads, max_history_visits, quiet, verbose):
    """Recommend medications for the visits of INPUT (DESIGN.md §2 visits.parquet shape).

    A visit's history is its patient's earlier visits (smaller visit_seq) with known
    medications; the rows of a patient must be contiguous and ordered by visit_seq (or pass
    --sort). By default the visits whose medications are null are scored; the others are
    skipped (used as history only). Rows that cannot be scored (null key, duplicate
    visit_id, no diagnosis nor procedure, only unknown codes) go to the rejects file with
    their reason; scored + rejected + skipped = rows read.

    \b
    Example:
      cognet-batch score visits.parquet --model model --out recs.parquet \\
          --explain --summary-json summary.json
    """
    setup_logging(verbose)
    if engine == "ray":
        raise InputError("--engine ray is not yet available; use --engine local")
    from cognet.runtime.scorer import Scorer

    started = time.perf_counter()
    scorer = Scorer(model_dir, device=device, beam=beam, batch_size=batch_size, threads=threads,
                    max_history_visits=max_history_visits)
    source = reader.VisitFile(input_path)
    if not sort_rows:  # fail on a misordered file before scoring anything
        reader.check_order(source.batches(["patient_id", "visit_seq"]), input_path)
    parts = writer.PartWriter(out, _signature(input_path, scorer, score_all, explain, sort_rows),
                              explain, resume)
    batches = source.sorted_batches() if sort_rows else source.batches()
    scored_now = 0
    with progress(total=source.num_rows, desc="scoring", unit="visit", quiet=quiet) as bar:
        bar.update(parts.rows_done)
        for chunk in scorer.score_batches(batches, score_all=score_all, explain=explain,
                                          source=input_path, skip_rows=parts.rows_done):
            parts.write(chunk)
            scored_now += chunk.rows_scored
            bar.update(chunk.rows_read)
    totals = parts.totals()
    if totals["rows_read"] != source.num_rows or totals["rows_read"] != (
            totals["rows_scored"] + totals["rows_rejected"] + totals["rows_skipped"]):
        raise RuntimeError(f"row accounting is off: {totals}")
    metric_rows = parts.patient_metrics()
    out_path, rejects = parts.finish()
    seconds = time.perf_counter() - started
    summary = {
        "input": str(input_path), "output": str(out_path), "rejects": str(rejects),
        **totals, "resumed_rows": parts.resumed_rows,
        "seconds": round(seconds, 3), "visits_per_s": round(scored_now / seconds, 2),
        "providers": scorer.providers, "threads": scorer.threads,
        **{k: v for k, v in scorer.settings().items() if k in ("beam", "batch_size")},
    }
    if score_all:
        summary["metrics"] = (None if metric_rows is None or not len(metric_rows) else
                              evaluation.report(metric_rows, totals["visits_evaluated"]))
    if summary_json:
        writer.write_json(Path(summary_json), summary)
    if not quiet:
        click.echo(f"scored {totals['rows_scored']} of {totals['rows_read']} visits "
                   f"({totals['rows_rejected']} rejected, {totals['rows_skipped']} skipped) "
                   f"in {seconds:.1f}s, {summary['visits_per_s']:.0f} visits/s on "
                   f"{scorer.providers[0]} -> {out_path}", err=True)


def _signature(input_path, scorer, score_all: bool, explain: bool, sort_rows: bool) -> dict:
    """What a resumed run must share with the interrupted one."""
    stat = Path(input_path).stat()
    manifest = scorer.manifest
    return {
        "input": str(Path(input_path).resolve()), "input_size": stat.st_size,
        "input_mtime_ns": stat.st_mtime_ns,
        "model": {name: spec.sha256 for name, spec in manifest.graphs.items()},
        "score_all": score_all, "explain": explain, "sort": sort_rows, **scorer.settings(),
    }


if __name__ == "__main__":
    main()
