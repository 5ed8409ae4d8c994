"""The `cognet-batch` command line: score Parquet files of visits with an exported model.

A thin layer over `cognet.runtime.Scorer` (scoring), `cognet.runtime.reader` (input) and
`cognet.runtime.writer` (output parts, resume, atomic files); see `score --help`.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
from cognet.runtime import reader, writer
from cognet.runtime.scorer import Scorer
from cognet.runtime.session import DEVICES

from cognet.core import metrics
from cognet.core.clitools import ddi_options, ddi_policy, handle_errors, progress, setup_logging
from cognet.core.errors import InputError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """cognet-batch: medication recommendations for Parquet files of visits (no torch).

    \b
    Example:
      cognet-batch score visits.parquet --model model --out recs.parquet
    """


# fmt: off
@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path())
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="Model directory written by cognet-export.")
@click.option("--out", required=True, type=click.Path(),
              help="Output Parquet file (--engine ray: a directory); rejected rows go to OUT "
                   "with .rejects.parquet.")
@click.option("--beam", type=click.IntRange(min=1), default=None,
              help="Beam width (default: the model's, 4; 1 = greedy).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="Execution provider; auto = CUDA when available, else CPU.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Visits decoded together at most (default: 128 on the CPU, 512 on a "
                   "GPU); batches of long histories are cut smaller (at most 4,096 padded "
                   "past-medication slots per batch on the CPU).")
@click.option("--all", "score_all", is_flag=True,
              help="Score every visit, not only those with null medications, and report "
                   "metrics against the known medications.")
@click.option("--explain", is_flag=True,
              help="Add per medication its copy share, the past visit it came from and the "
                   "diagnoses it attended to most.")
@click.option("--resume", is_flag=True,
              help="Finish an interrupted run (same input, model and options).")
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None,
              help="Write counts, reject reasons, speed, providers (and metrics) as JSON.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local",
              show_default=True, help="local: this process; ray: a Ray cluster, INPUT may be "
                                      "a directory or a glob of Parquet files.")
@click.option("--address", default=None,
              help="--engine ray: auto or ray://HOST:10001 (default: start Ray here).")
@click.option("--num-workers", type=click.IntRange(min=1), default=None,
              help="--engine ray: scoring workers (default: as many as the cluster holds).")
@click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=0.0,
              help="--engine ray: GPUs of each worker (default 0: CPU workers).")
@click.option("--block-rows", type=click.IntRange(min=1), default=16384, show_default=True,
              help="--engine ray: rows of whole patients a worker scores at a time.")
@click.option("--sort", "sort_rows", is_flag=True,
              help="Sort the rows by patient and visit_seq in memory (files that fit).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads (default: the cores this process may use; --engine ray: "
                   "per worker, default 1).")
@click.option("--max-history-visits", type=click.IntRange(min=0), default=None,
              help="History = only the last K earlier visits with known medications "
                   "(default: all; 0 = none, generation without copy).")
@ddi_options
@click.option("--quiet", is_flag=True, help="No progress bar nor closing line.")
@click.option("--verbose", is_flag=True, help="Log what happens on stderr.")
@handle_errors
def score(input_path, model_dir, out, beam, device, batch_size, score_all, explain, resume,
          summary_json, engine, address, num_workers, gpus_per_worker, block_rows, sort_rows,
          threads, max_history_visits, ddi_mode, ddi_penalty, ddi_max_rate, quiet, verbose):
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
    if engine == "ray":  # the same Scorer on a Ray cluster (cognet.runtime.ray_engine)
        from cognet.runtime import ray_engine

        if resume:
            raise InputError("--resume is for --engine local; rerun the --engine ray command")
        summary = ray_engine.score(
            input_path, model_dir, out,
            ray_engine.RayOptions(address, num_workers, threads or 1, gpus_per_worker, block_rows),
            ray_engine.ScoreOptions(device, beam, batch_size, max_history_visits, score_all,
                                    explain, ddi_policy(ddi_mode, ddi_penalty, ddi_max_rate)),
            verbose=verbose)
        _report(summary, summary_json, quiet, f"{summary['workers']} Ray worker(s)")
        return
    loading = time.perf_counter()
    scorer = Scorer(model_dir, device=device, beam=beam, batch_size=batch_size,
                    threads=threads, max_history_visits=max_history_visits,
                    ddi=ddi_policy(ddi_mode, ddi_penalty, ddi_max_rate))
    source = reader.VisitFile(input_path)
    if not sort_rows:  # fail on a misordered file before scoring anything
        reader.check_order(source.batches(["patient_id", "visit_seq"]), input_path)
    signature = _signature(input_path, scorer, score_all, explain, sort_rows)
    parts = writer.PartWriter(out, signature, explain, resume)
    started = time.perf_counter()
    scored = _run(scorer, source, parts, score_all, explain, sort_rows, quiet)
    summary = _finish(scorer, source, parts, score_all, scored, started - loading,
                      time.perf_counter() - started)
    _report(summary, summary_json, quiet, scorer.providers[0])
# fmt: on


def _report(summary: dict, summary_json, quiet: bool, where: str) -> None:
    """Write the summary JSON and print the one-line result on stderr."""
    if summary_json:
        writer.write_json(Path(summary_json), summary)
    if not quiet:
        click.echo(
            f"scored {summary['rows_scored']} of {summary['rows_read']} visits "
            f"({summary['rows_rejected']} rejected, {summary['rows_skipped']} skipped) "
            f"in {summary['seconds']:.1f}s, {summary['visits_per_s']:.0f} visits/s on "
            f"{where} -> {summary['output']}",
            err=True,
        )


def _run(scorer: Scorer, source: reader.VisitFile, parts: writer.PartWriter, score_all: bool,
         explain: bool, sort_rows: bool, quiet: bool) -> int:  # fmt: skip
    """Score the chunks not yet committed, committing each; returns visits scored now."""
    batches = source.sorted_batches() if sort_rows else source.batches()
    scored = 0
    with progress(total=source.num_rows, desc="scoring", unit="visit", quiet=quiet) as bar:
        bar.update(parts.rows_done)
        chunks = scorer.score_batches(batches, score_all=score_all, explain=explain,
                                      source=source.path, skip_rows=parts.rows_done)  # fmt: skip
        for chunk in chunks:
            parts.write(chunk)
            scored += chunk.rows_scored
            bar.update(chunk.rows_read)
    scorer.close()
    return scored


def _finish(scorer: Scorer, source: reader.VisitFile, parts: writer.PartWriter,
            score_all: bool, scored: int, load_seconds: float, seconds: float) -> dict:  # fmt: skip
    """Check the row accounting, merge the parts into the outputs, and build the summary."""
    totals = parts.totals()
    accounted = totals["rows_scored"] + totals["rows_rejected"] + totals["rows_skipped"]
    if not totals["rows_read"] == accounted == source.num_rows:
        raise RuntimeError(f"row accounting is off ({source.num_rows} rows in the file): {totals}")
    metric_rows = parts.patient_metrics()
    out, rejects = parts.finish()
    summary = {
        "input": str(source.path), "output": str(out), "rejects": str(rejects), **totals,
        "resumed_rows": parts.resumed_rows, "load_seconds": round(load_seconds, 3),
        "seconds": round(seconds, 3), "visits_per_s": round(scored / max(seconds, 1e-9), 2),
        "providers": scorer.providers, "threads": scorer.threads,
        "beam": scorer.beam_config.beam, "batch_size": scorer.batch_size,
        "ddi": scorer.beam_config.ddi.to_json(),
    }  # fmt: skip
    if score_all:
        summary["metrics"] = (
            metrics.report(metric_rows, totals["visits_evaluated"])
            if metric_rows is not None and len(metric_rows) else None
        )  # fmt: skip
    return summary


def _signature(input_path, scorer: Scorer, score_all: bool, explain: bool,
               sort_rows: bool) -> dict:  # fmt: skip
    """What a resumed run must share with the interrupted one."""
    stat = Path(input_path).stat()
    return {
        "input": str(Path(input_path).resolve()), "input_size": stat.st_size,
        "input_mtime_ns": stat.st_mtime_ns,
        "model": {name: spec.sha256 for name, spec in scorer.manifest.graphs.items()},
        "score_all": score_all, "explain": explain, "sort": sort_rows, **scorer.settings(),
    }  # fmt: skip


# fmt: off
@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=False))
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="Model directory written by cognet-export.")
@click.option("--visit-id", required=True, help="The visit to explain.")
@click.option("--beam", type=click.IntRange(min=1), default=None,
              help="Beam width (default: the model's, 4; 1 = greedy).")
@ddi_options
@click.option("--json", "as_json", is_flag=True, help="Print the explanation as JSON.")
@handle_errors
def explain(input_path, model_dir, visit_id, beam, ddi_mode, ddi_penalty, ddi_max_rate,
            as_json):
    """Print one visit's decoding step by step: medication, probability, generated or
    copied (copy share), the past visit it was copied from and the diagnoses it attended
    to most (the paper's case study). Its patient's earlier visits with known medications
    are the history; known medications of the visit itself are shown as the truth.

    \b
    Example:
      cognet-batch explain visits.parquet --model model --visit-id V0012-3
    """
    import json

    from cognet.runtime.explain import explain_visit, format_explanation

    setup_logging()
    scorer = Scorer(model_dir, device="cpu", beam=beam, threads=1,
                    ddi=ddi_policy(ddi_mode, ddi_penalty, ddi_max_rate))
    result = explain_visit(scorer, input_path, visit_id)
    click.echo(json.dumps(result.to_json(), indent=1) if as_json else format_explanation(result))
# fmt: on


if __name__ == "__main__":
    main()
