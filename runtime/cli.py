"""The `cognet-batch` command line: score Parquet files of visits with an exported model.

A thin layer over `cognet.runtime.Scorer` (scoring, configured by one `ScoreOptions`),
`cognet.runtime.reader` (input), `cognet.runtime.writer` (output parts, resume, atomic
files) and `cognet.runtime.summary` (the run summary); see `score --help`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

import click
import numpy as np

from cognet.core import strict_json
from cognet.core.code_names import CodeNames
from cognet.core.commandline import (
    FiniteFloat,
    OneLineGroup,
    count_option,
    decoding_options,
    handle_errors,
    setup_logging,
)
from cognet.core.decoding import BEAM
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError
from cognet.core.files import Reads, check_not_read
from cognet.core.lock import claimed
from cognet.core.manifest import VARIANTS
from cognet.core.progress import progress
from cognet.core.sinks import check_name
from cognet.runtime import preflight, ray_engine, reader, summary, writer
from cognet.runtime.explain_visit import explain_visit, format_explanation
from cognet.runtime.options import DEVICES, MAX_CODES, SELECTIONS, ScoreOptions
from cognet.runtime.outputs import METRIC_WIDTH
from cognet.runtime.scorer import Scorer
from cognet.runtime.signature import RunFlags
from cognet.runtime.signature import signature as run_signature

BEAM_HELP = f"Beam width (default {BEAM}; 1 = greedy)."
model_option = click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Model directory written by cognet-export.",
)

# the fields of ScoreOptions: `score_options` gives the options so named to the options value
SCORE_FIELDS = frozenset(f.name for f in fields(ScoreOptions))


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """cognet-batch: medication recommendations for Parquet files of visits (no torch).

    \b
    Example:
      cognet-batch score visits.parquet --model model --out recs.parquet
    """


def score_options(func):
    """The decoding options (`decoding_options`), --device, --selection, --variant,
    --batch-size, --threads, --streams, --max-history-visits, --max-codes-per-visit and
    --keep-columns, given to `func` as one `options: ScoreOptions`."""

    @functools.wraps(func)
    def wrapper(*args, keep_columns, keep_all_columns, **kwargs):
        # the options below (and decoding_options' request) are ScoreOptions' fields by name
        asked = {name: kwargs.pop(name) for name in SCORE_FIELDS & kwargs.keys()}
        try:
            options = ScoreOptions(keep_columns=_kept(keep_columns, keep_all_columns), **asked)
        except InputError as exc:  # a mix of options (--variant int8 --device cuda)
            raise click.UsageError(str(exc)) from None
        return func(*args, options=options, **kwargs)

    options = [
        click.option(
            "--device",
            type=click.Choice(DEVICES),
            default="auto",
            show_default=True,
            help="Execution provider; auto = CUDA when available, else CPU.",
        ),
        click.option(
            "--selection",
            type=click.Choice(SELECTIONS),
            default="auto",
            show_default=True,
            help="Where each decoding step picks its candidates: device = the "
            "model's search graphs, on the execution provider; host = numpy; "
            "auto = device on a GPU, host on the CPU (faster there).",
        ),
        click.option(
            "--variant",
            type=click.Choice(VARIANTS),
            default=None,
            help="Score with the model's float16 graphs (cognet-export --fp16) or "
            "its int8 graphs (cognet-export --int8: MatMul weights quantized, CPU only; "
            "with --device cuda or tensorrt a usage error, --device auto picks the CPU). "
            "Both answer some visits differently from float32; default: float32, the "
            "exact path.",
        ),
        count_option(
            "--batch-size",
            help="Visits decoded together at most (default: 128 on the CPU, 512 on a "
            "GPU); batches of long histories are cut smaller (at most 4,096 "
            "padded past-medication slots per batch on the CPU).",
        ),
        count_option(
            "--threads",
            help="CPU threads (default: the cores this process may use; --engine "
            "ray: per worker, default 1).",
        ),
        count_option(
            "--streams",
            help="Batches decoded at once, each by its own thread (default: one per "
            "thread on the CPU, 1 on a GPU, where more host threads can feed "
            "the one device).",
        ),
        click.option(
            "--max-history-visits",
            type=click.IntRange(min=0),
            default=None,
            help="History = only the last K earlier visits with known medications "
            "(default: all; 0 = none, generation without copy).",
        ),
        count_option(
            "--max-codes-per-visit",
            default=MAX_CODES,
            help="Reject a visit (too_many_codes; it is no history either) with more "
            "distinct known codes of one kind: the memory guard, far above real visits "
            "(`cognet data stats` prints a dataset's most codes per visit).",
        ),
        click.option(
            "--keep-columns",
            default="",
            metavar="A,B",
            help="Input columns to carry into the output, comma-separated (to join "
            "results back, e.g. on an admission date), each with its name and type; the "
            "rejects file carries the input row number instead.",
        ),
        click.option(
            "--keep-all-columns", is_flag=True, help="Carry every input column the output lacks."
        ),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return decoding_options(wrapper)


def _kept(keep_columns: str, keep_all: bool) -> tuple[str, ...]:
    names = tuple(n.strip() for n in keep_columns.split(",") if n.strip())
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # one output column per name
        raise click.UsageError(f"--keep-columns: {', '.join(twice)} named twice")
    if keep_all and names:
        raise click.UsageError("--keep-columns and --keep-all-columns exclude each other")
    return (reader.KEEP_ALL,) if keep_all else names


def ray_options(func):
    """--engine and the options of --engine ray, given to `func` as `ray`: a
    `ray_engine.RayOptions`, or None for the local engine."""

    @functools.wraps(func)
    def wrapper(*args, engine, address, num_workers, gpus_per_worker, block_rows, **kwargs):
        ray = None
        if engine == "ray":
            ray = ray_engine.RayOptions(address, num_workers, gpus_per_worker, block_rows)
        return func(*args, ray=ray, **kwargs)

    options = [
        click.option(
            "--engine",
            type=click.Choice(["local", "ray"]),
            default="local",
            show_default=True,
            help="local: this process; ray: a Ray cluster, INPUT "
            "may be a directory or a glob of Parquet files.",
        ),
        click.option(
            "--address",
            default=None,
            help="--engine ray: auto or ray://HOST:10001 (default: start Ray here).",
        ),
        count_option(
            "--num-workers",
            help="--engine ray: scoring workers (default: as many as the cluster holds).",
        ),
        click.option(
            "--gpus-per-worker",
            type=FiniteFloat(min=0),
            default=0.0,
            help="--engine ray: GPUs of each worker (default 0: CPU workers).",
        ),
        count_option(
            "--block-rows",
            default=16384,
            help="--engine ray: rows of whole patients a worker scores at a time.",
        ),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path())
@model_option
@click.option(
    "--out",
    required=True,
    type=click.Path(),
    help="Output Parquet file (--engine ray: a directory); rejected rows go to OUT "
    "with .rejects.parquet.",
)
@score_options
@click.option(
    "--all",
    "score_all",
    is_flag=True,
    help="Score every visit, not only those with null medications, and compute "
    "metrics against the known medications (printed, and in --summary-json): all "
    "visits, first visits (no history) and later ones.",
)
@click.option(
    "--split",
    type=click.Choice(reader.SPLITS),
    default=None,
    help="Score only the rows of this split (the input's split column, as `cognet data` "
    "writes it); the other rows are history only (skipped). With --all: metrics of one split.",
)
@click.option(
    "--explain",
    is_flag=True,
    help="Add per medication its copy share, the past visit it came from and the "
    "diagnoses it attended to most.",
)
@click.option(
    "--resume", is_flag=True, help="Finish an interrupted run (same input, model and options)."
)
@click.option(
    "--summary-json",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the row counts, reject reasons, speed, providers, the options it ran with "
    "(the fields of cognet.runtime.ScoreOptions) and, with --all, the metrics as JSON.",
)
@ray_options
@click.option(
    "--sort",
    "sort_rows",
    is_flag=True,
    help="Sort the rows by patient and visit_seq in memory (files that fit).",
)
@click.option(
    "--max-unknown-share",
    type=FiniteFloat(min=0, max=1),
    default=None,
    metavar="SHARE",
    help="Fail (exit 2) when more than SHARE of the visits to score are rejected or more "
    f"than SHARE of their codes are unknown to the model (default: warn above "
    f"{summary.WARN_SHARE:g} and go on). The local engine then writes no output.",
)
@click.option("--quiet", is_flag=True, help="No progress bar nor closing line.")
@click.option("--verbose", is_flag=True, help="Log what happens on stderr.")
@handle_errors
def score(
    input_path: str,
    model_dir: str,
    out: str,
    options: ScoreOptions,
    score_all: bool,
    split: str | None,
    explain: bool,
    resume: bool,
    summary_json: str | None,
    ray,
    sort_rows: bool,
    max_unknown_share: float | None,
    quiet: bool,
    verbose: bool,
) -> None:
    """Recommend medications for the visits of INPUT (visits.parquet's columns: user guide "Data").

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
    for option, path in (("--out", out), ("--summary-json", summary_json)):
        if path is not None:  # OUT's other files are named from it: it must name a file
            check_name(path, option)
    # never onto the model in use (its manifest, graphs, engines); the input: `preflight`
    outputs = {**preflight.outputs_of(out), "--summary-json": summary_json}
    check_not_read(outputs, Reads(models=[model_dir]))
    if ray is not None:  # the same Scorer on a Ray cluster (cognet.runtime.ray_engine)
        if resume:
            raise InputError("--resume is for --engine local; rerun the --engine ray command")
        if split:
            raise InputError("--split is for --engine local; filter the input files instead")
        preflight.check_summary(summary_json, input_path, preflight.outputs_of(out))
        flags = RunFlags(score_all, explain)  # --sort: Ray's buckets are always sorted
        with claimed([summary_json], "cognet-batch score"):  # OUT's locks: ray_tasks.locked
            result = ray_engine.score(
                input_path, model_dir, out, ray, options, flags, verbose=verbose
            )
            _check_known(result, max_unknown_share)
            _report(result, summary_json, quiet, f"{result['workers']} Ray worker(s)", score_all)
        return
    preflight.check_local(input_path, out, summary_json)  # before reading or writing anything
    # one writer per output, whatever the command (cognet/core/lock.py)
    flags = RunFlags(score_all, explain, sort_rows, split)
    asked = _Asked(resume, summary_json, max_unknown_share, quiet)
    with claimed([*writer.outputs(out), summary_json], "cognet-batch score"):
        _score_local(input_path, model_dir, out, options, flags, asked)


class _Asked(NamedTuple):
    """What `score` asks of the local engine beside its ScoreOptions and RunFlags."""

    resume: bool
    summary_json: str | None
    max_unknown_share: float | None
    quiet: bool


def _score_local(
    input_path: str,
    model_dir: str,
    out: str,
    options: ScoreOptions,
    flags: RunFlags,
    asked: _Asked,
) -> None:
    """`score` with the local engine, OUT locked."""
    loading = time.perf_counter()
    scorer = Scorer(model_dir, options)
    source = reader.VisitFile(input_path, keep=options.keep_columns)
    if not flags.sort:  # fail on a misordered file before scoring anything
        reader.check_order(source.batches(["patient_id", "visit_seq"]), input_path)
    in_split = None if flags.split is None else reader.split_rows(input_path, flags.split)
    signature = _signature(input_path, scorer, flags)
    parts = writer.PartWriter(
        out, signature, flags.explain, asked.resume, source.kept_fields, rows=source.num_rows
    )
    try:
        started = time.perf_counter()
        scored = _run(scorer, source, parts, flags, asked.quiet, in_split)
        timing = summary.Timing(started - loading, time.perf_counter() - started, scored)
        result = _finish(scorer, source, parts, flags.score_all, timing, asked.max_unknown_share)
    except BaseException:
        parts.discard()  # keep only what --resume needs
        raise
    _report(result, asked.summary_json, asked.quiet, scorer.providers[0], flags.score_all)


def _check_known(totals: dict, max_share: float | None) -> None:
    """InputError when more than `max_share` of the visits were rejected or of the codes
    unknown (--max-unknown-share)."""
    if max_share is not None:
        failed = summary.input_warnings(totals, max_share)
        if failed:
            raise InputError(f"{'; '.join(failed)} (--max-unknown-share {max_share:g})")


def _report(
    result: dict, summary_json: str | None, quiet: bool, where: str, score_all: bool
) -> None:
    """Write the summary JSON and print on stderr the one-line result, the metrics (--all),
    the warnings of an input the model hardly knows, and how to score a file it skipped."""
    if summary_json:
        writer.write_json(Path(summary_json), result)
    for line in summary.input_warnings(result):  # even --quiet: the run may be worthless
        click.echo(f"Warning: {line}", err=True)
    if quiet:
        return
    click.echo(
        f"scored {result['rows_scored']} of {result['rows_read']} visits "
        f"({result['rows_rejected']} rejected, {result['rows_skipped']} skipped) "
        f"in {result['seconds']:.1f}s, {result['visits_per_s']:.0f} visits/s on "
        f"{where} -> {result['output']}",
        err=True,
    )
    for line in summary.metric_lines(result):
        click.echo(line, err=True)
    if not score_all and result["rows_skipped"] and not result["rows_scored"]:
        click.echo(
            "no visit scored: without --all only the visits whose medications are null "
            "are; --all scores every visit and reports the metrics against the known "
            "medications",
            err=True,
        )


def _run(
    scorer: Scorer,
    source: reader.VisitFile,
    parts: writer.PartWriter,
    flags: RunFlags,
    quiet: bool,
    in_split=None,
) -> int:
    """Score the chunks not yet committed, committing each; returns visits scored now.
    in_split: bool per input row, the rows to score (--split; None: every row)."""
    batches = source.sorted_batches() if flags.sort else source.batches()
    if in_split is not None:
        batches = reader.asked(batches, in_split)
    scored = 0
    with progress(total=source.num_rows, desc="scoring", unit="visit", quiet=quiet) as bar:
        bar.update(parts.rows_done)
        chunks = scorer.score_batches(
            batches,
            score_all=flags.score_all,
            explain=flags.explain,
            source=source.path,
            skip_rows=parts.rows_done,
        )
        for chunk in chunks:
            parts.write(chunk)
            scored += chunk.rows_scored
            bar.update(chunk.rows_read)
    scorer.close()
    return scored


def _finish(
    scorer: Scorer,
    source: reader.VisitFile,
    parts: writer.PartWriter,
    score_all: bool,
    timing: summary.Timing,
    max_unknown_share: float | None = None,
) -> dict:
    """Check the row accounting and the share of unknown input (--max-unknown-share), merge
    the parts into the outputs, and build the summary (timing: the seconds to load the
    model and to score, and the visits scored now)."""
    totals = parts.totals()
    summary.check_rows(totals, source.num_rows)
    try:
        _check_known(totals, max_unknown_share)
    except InputError:
        parts.clear()  # an input error writes nothing, not even what --resume would need
        raise
    metric_rows = None
    if score_all:
        metric_rows = parts.patient_metrics()
        if metric_rows is None:
            metric_rows = np.zeros((0, METRIC_WIDTH))
    out, rejects = parts.finish()
    return summary.run_summary(
        summary.Files(source.path, out, rejects),
        summary.Setup.of(scorer),
        totals,
        timing,
        metric_rows,
        resumed_rows=parts.resumed_rows,
    )


def _signature(input_path: str, scorer: Scorer, flags: RunFlags) -> dict:
    """What a resumed run must share with the interrupted one (`runtime/signature.py`)."""
    return run_signature(
        input_path, scorer.manifest.model_dir, scorer.options, scorer.chunk_targets, flags
    )


@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=False))
@model_option
@click.option("--visit-id", required=True, help="The visit to explain.")
@decoding_options
@click.option("--json", "as_json", is_flag=True, help="Print the explanation as JSON.")
@click.option(
    "--names",
    "names_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Code names to show, before the shipped ICD-9-CM ones: CSV or TSV (.gz too) with "
    "columns code, name and optionally kind (diagnosis, procedure, medication), e.g. "
    "ATC names, which cognet does not ship.",
)
@handle_errors
def explain(
    input_path: str,
    model_dir: str,
    visit_id: str,
    request: DecodingRequest,
    as_json: bool,
    names_file: str | None,
) -> None:
    """Print one visit's decoding step by step: medication, probability, generated or
    copied (copy share), the past visit it was copied from and the diagnoses it attended
    to most (the paper's case study), with the names of ICD-9-CM codes. Its patient's
    earlier visits with known medications are the history; known medications of the visit
    itself are shown as the truth. With --decoding marginal the set comes from the set head
    and the explanation from COGNet's own set decoding of the visit (the header says so).

    \b
    Example:
      cognet-batch explain visits.parquet --model model --visit-id V0012-3
    """

    setup_logging()
    names = CodeNames.load(names_file)  # a bad names file fails before the model loads
    scorer = Scorer(model_dir, ScoreOptions(request=request, device="cpu", threads=1))
    result = explain_visit(scorer, input_path, visit_id, names)
    text = strict_json.dumps(result.to_json(), indent=1) if as_json else None
    click.echo(text or format_explanation(result))


if __name__ == "__main__":
    main()
