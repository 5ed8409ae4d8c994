"""The `cognet-bench` command line: latency and throughput of every engine side by side,
written as results.json, results.md, latency.png and throughput.png (see BENCHMARKS.md for
the method). With --model it runs on a runtime-only install (no torch: the torch engines
are skipped with their reason)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import click

from cognet.benchmarks import engines as eng
from cognet.benchmarks.harness import run_all
from cognet.benchmarks.latency import line
from cognet.benchmarks.report import ratios, write_all
from cognet.benchmarks.settings import RUNTIME_BATCH, Context, Settings
from cognet.benchmarks.workload import Pool, dataset_visits, synthetic_visits
from cognet.core.commandline import (
    FiniteFloat,
    OneLineCommand,
    count_option,
    guard_outputs,
    handle_errors,
    setup_logging,
)
from cognet.core.errors import InputError
from cognet.core.files import Reads
from cognet.core.manifest import load_manifest
from cognet.data.synth import generate
from cognet.evaluation.ddi_tradeoff import plot, run_tradeoff
from cognet.evaluation.options import EvalOptions

log = logging.getLogger(__name__)

DEMO_PATIENTS, DEMO_EPOCHS = 2000, 8  # the Makefile's `make demo` model
TRADEOFF_PATIENTS = 500  # test patients of the DDI trade-off (a policy ~ one torch decode)
QUICK = {  # --quick: a smoke run (what CI runs)
    "batch_sizes": "1,8",
    "latency_sizes": "1,8",
    "beams": "1,4",
    "repeats": 1,
    "visits": 16,
    "perpatient_visits": 4,
    "past_visits": "0,2",
    "input_sizes": "300",
}


def _beams(text: str) -> tuple[int, ...]:
    """--beams: widths, and the decodings named (`engines.DECODING_NAMES`) by their codes."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    widths = _ints(",".join(t for t in names if t not in eng.DECODING_NAMES), "--beams")
    return (*widths, *(eng.DECODING_NAMES[t] for t in names if t in eng.DECODING_NAMES))


def _ints(text: str, name: str) -> tuple[int, ...]:
    scale = {"k": 1_000, "m": 1_000_000}
    try:
        out = tuple(
            int(float(t[:-1]) * scale[t[-1].lower()]) if t[-1].lower() in scale else int(t)
            for t in (p.strip() for p in text.split(","))
            if t
        )
    except (ValueError, IndexError):
        raise click.BadParameter(
            f"expected comma-separated integers, got {text!r}", param_hint=name
        ) from None
    if any(x < 0 for x in out):
        raise click.BadParameter("values must be >= 0", param_hint=name)
    return out


@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Model directory from cognet-export (default: build the demo model into "
    "OUT/demo, or reuse it).",
)
@click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    help="The torch checkpoint the model was exported from (torch engines and the "
    "correctness guard; default: MODEL/../ckpt when its hash matches).",
)
@click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Dataset directory whose patients are scored (default: synthetic patients "
    "the demo model never saw).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default="bench",
    show_default=True,
    help="Where results.json, results.md, latency.png, throughput.png go.",
)
@click.option(
    "--latency-sizes",
    default="1,16,128,1024,default",
    show_default=True,
    help="Visits per request of the latency series: each request one call of the runtime "
    "with its defaults, p50 / p95 / p99 per request and per visit; `default`: the runtime's "
    "default batch size; '' to skip.",
)
@click.option(
    "--batch-sizes",
    default="1,16,256,4096",
    show_default=True,
    help="Visits decoded together in the throughput runs ('' to skip them: latency only).",
)
@click.option(
    "--beams",
    default="1,4,set",
    show_default=True,
    help="Beam widths, `set` for the model's set decoding and `marginal` for its set "
    "head's (when it has them).",
)
@count_option("--repeats", default=3, help="Timed passes per run (the median is reported).")
@click.option(
    "--engines",
    "engine_names",
    default="all",
    show_default=True,
    help="Comma-separated subset of: torch-perpatient, torch-batched, ort-cpu, ort-cpu-device, "
    "ort-cpu-fp16, ort-cpu-int8, ort-cpu-gpupath, ort-cuda, ort-cuda-host, ort-cuda-fp16, "
    "ort-cuda-streams, ort-cuda-fp16-streams, ort-tensorrt, torch-cuda (-device / -host: the "
    "other candidate selection, runtime/device_selectors.py; -fp16 / -int8: the float16 / "
    "int8 graphs, "
    "agreement reported, the demo model exported with its int8 graphs when -int8 is "
    "selected; -gpupath: what a GPU runs, on the CPU, to measure its host side; -streams: 4 "
    "host threads feeding the GPU).",
)
@count_option(
    "--threads", default=1, help="Intra-op threads of every engine (torch and ONNX Runtime alike)."
)
@count_option(
    "--visits", default=256, help="Visits per run (a batch size above it runs one full batch)."
)
@count_option(
    "--perpatient-visits", default=64, help="Visits decoded by the slow torch-perpatient engine."
)
@click.option(
    "--past-visits",
    default="0,1,4,16",
    show_default=True,
    help="Points of the throughput-against-history series ('' to skip).",
)
@click.option(
    "--input-sizes",
    default="10k,50k",
    show_default=True,
    help="Rows of the cognet-batch end-to-end series, e.g. 10k,100k,1M for the "
    "large points (minutes each); '' to skip.",
)
@click.option(
    "--max-run-seconds",
    type=FiniteFloat(min=0),
    default=45.0,
    show_default=True,
    help="Time budget of one run: no repeat starts that would end past it (the "
    "first always runs), and an engine skips a batch size whose one pass is "
    "estimated to take longer.",
)
@click.option(
    "--ddi-tradeoff/--no-ddi-tradeoff",
    default=None,
    help="Also report the checkpoint's DDI trade-off (off, hard, soft at several penalties; "
    "torch) on the test split of --data or of the demo data: a table in results.md and "
    "ddi_tradeoff.png. Default: when a torch engine is among --engines.",
)
@click.option(
    "--profile/--no-profile",
    default=True,
    show_default=True,
    help="Profile ort-cpu (graphs, operators, Python) at its best batch size.",
)
@click.option(
    "--reference",
    type=click.Choice(("torch-batched", "torch-cuda", "none")),
    default="torch-batched",
    show_default=True,
    help="Engine every other engine's recommendations are checked against; when it is not "
    "among --engines it still runs, untimed, as the correctness reference (`none`: no "
    "check, only the engines asked run). On a GPU, torch-cuda: torch-batched (CPU) is too "
    "slow for batches of 16k+ visits.",
)
@click.option("--quick", is_flag=True, help="A smoke run: tiny sizes, 1 repeat.")
@click.option("--verbose", is_flag=True, help="Log what happens on stderr.")
@handle_errors
def main(
    model_dir,
    checkpoint,
    data_dir,
    out,
    latency_sizes,
    batch_sizes,
    beams,
    repeats,
    engine_names,
    threads,
    visits,
    perpatient_visits,
    past_visits,
    input_sizes,
    max_run_seconds,
    ddi_tradeoff,
    profile,
    reference,
    quick,
    verbose,
):
    """Measure latency and throughput of cognet's inference engines on the same model and
    visits.

    Latency: requests of 1, 16, 128, 1,024 visits and the default batch, each one call of
    the runtime as a user makes it; p50, p95 and p99 per request and per visit, with the
    requests behind each. Throughput: engines torch-perpatient (the paper's way: one patient
    at a time, no KV cache), torch-batched (cognet's torch reference), ort-cpu (the
    runtime), and on a GPU ort-cuda, ort-tensorrt, torch-cuda (skipped with a reason where
    unavailable), at each batch size. Every engine's recommendations are compared with
    torch-batched's. Only the engines asked run; results files are rewritten as each pass
    ends.

    \b
    Example:
      cognet-bench --out bench                          # builds the demo model first
      cognet-bench --model demo/model --data demo/data --out bench --beams 4
      cognet-bench --model model --engines ort-cpu --out bench   # no torch needed
    """
    setup_logging(verbose)
    sizes = {
        "latency_sizes": latency_sizes,
        "batch_sizes": batch_sizes,
        "beams": beams,
        "repeats": repeats,
        "visits": visits,
        "perpatient_visits": perpatient_visits,
        "past_visits": past_visits,
        "input_sizes": input_sizes,
    }
    if quick:
        sizes = _quick_values(sizes)
    settings = _settings(sizes, engine_names, threads, max_run_seconds, profile, reference, quick)
    # never onto the model, checkpoint or data it reads; one run per --out (a failed run
    # keeps what it measured)
    reads = Reads(models=[model_dir], checkpoints=[checkpoint], datasets=[data_dir])
    guard_outputs("cognet-bench", {"--out": out}, reads, ["--out"])

    if ddi_tradeoff is None:  # torch's own evaluation: only when a torch engine is asked
        ddi_tradeoff = any(e in eng.TORCH_ENGINES for e in settings.engines)
    _run(model_dir, checkpoint, data_dir, out, settings, ddi_tradeoff, quick)


def _run(model_dir, checkpoint, data_dir, out: Path, settings, ddi_tradeoff: bool, quick: bool):
    """Measure (on the demo model when no --model is given), write the results as they
    grow and say the speed ratios."""
    try:
        import torch
    except ImportError:  # a runtime-only install: the torch engines say so when skipped
        torch = None
    if torch is not None:
        torch.set_num_threads(settings.threads)  # also for the demo training: BENCHMARKS.md
    elif model_dir is None:
        raise InputError(
            "no --model: building the demo model needs torch (the [train] extra); on a "
            "runtime-only install, pass --model DIR"
        )
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    model_dir, checkpoint, labelled = _model_and_data(
        model_dir, checkpoint, data_dir, out, quick, notes, int8="ort-cpu-int8" in settings.engines
    )
    ctx = make_context(model_dir, checkpoint, data_dir, out, settings, notes)
    started = time.perf_counter()
    results = run_all(
        ctx,
        settings,
        say=lambda s: click.echo(s, err=True),
        progress=lambda partial: write_all(partial, out, plots=False),
    )
    if ddi_tradeoff:
        results["ddi_tradeoff"] = run_ddi_tradeoff(checkpoint, labelled, out, quick, notes)
    results["seconds"] = round(time.perf_counter() - started, 1)
    paths = write_all(results, out)
    _echo_summary(results, settings)
    click.echo("wrote " + ", ".join(str(p) for p in paths))


def _quick_values(sizes: dict) -> dict:
    """--quick: the QUICK size of every option the command line left at its default."""
    ctx = click.get_current_context()
    return {
        k: QUICK[k] if k in QUICK and ctx.get_parameter_source(k).name == "DEFAULT" else v
        for k, v in sizes.items()
    }


def _settings(sizes: dict, engine_names, threads, max_run_seconds, profile, reference, quick):
    """The run's Settings from the options; a value it refuses is a usage error (exit 2)."""
    names = (
        eng.ENGINES
        if engine_names.strip() == "all"
        else tuple(n.strip() for n in engine_names.split(",") if n.strip())
    )
    try:
        return Settings(
            latency_sizes=_ints(
                re.sub(r"\bdefault\b", str(RUNTIME_BATCH), sizes["latency_sizes"]),
                "--latency-sizes",
            ),
            batch_sizes=_ints(sizes["batch_sizes"], "--batch-sizes"),
            beams=_beams(sizes["beams"]),
            repeats=sizes["repeats"],
            engines=names,
            threads=threads,
            visits=sizes["visits"],
            perpatient_visits=sizes["perpatient_visits"],
            past_visits=_ints(sizes["past_visits"], "--past-visits"),
            input_sizes=_ints(sizes["input_sizes"], "--input-sizes"),
            max_run_s=max_run_seconds,
            profile=profile,
            reference=None if reference == "none" else reference,
            **({"warmup_visits": 4, "past_visits_n": 8, "series_batch_size": 8} if quick else {}),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _model_and_data(
    model_dir, checkpoint, data_dir, out: Path, quick: bool, notes: list, int8: bool = False
):
    """(model folder, torch checkpoint, labelled data): the demo model built under out/demo
    (with its int8 graphs when `int8`) when no --model is given, else the checkpoint whose
    hash matches the model's manifest."""
    labelled = data_dir
    if model_dir is None:
        model_dir, checkpoint, note = demo_model(out / "demo", quick, int8)
        notes.append(note)
        labelled = labelled or out / "demo" / "data"
    elif checkpoint is None:
        checkpoint = find_checkpoint(model_dir)
        if checkpoint is not None:
            notes.append(f"torch checkpoint: {checkpoint} (its hash matches the manifest's)")
    return model_dir, checkpoint, labelled


def _echo_summary(results: dict, settings) -> None:
    """The latency of each request size and the speed ratios on stdout, and a warning on
    stderr when a run differs from the reference engine."""
    for r in results["latency"]:
        click.echo(line(r))
    for beam in settings.beams:
        for base, r in ratios(results, beam).items():
            click.echo(
                f"{eng.decoding_label(beam)}: ort-cpu ({r['engine_mode']}, "
                f"batch {r['engine_batch_size']}) "
                f"{r['ratio']:.1f}x {base} at best batch sizes "
                f"({r['engine_visits_per_s']:.1f} vs {r['baseline_visits_per_s']:.1f} "
                "visits/s)"
            )
    bad = [
        r
        for r in results["runs"] + results["series"]["past_visits"]
        if r["matches_reference"] is False
    ]
    if bad:
        click.echo(
            f"WARNING: {len(bad)} run(s) differ from {settings.reference} (see results.md)",
            err=True,
        )


def run_ddi_tradeoff(checkpoint, data_dir, out: Path, quick: bool, notes: list) -> dict | None:
    """The DDI trade-off of the checkpoint (torch reference, `cognet.evaluation.ddi_tradeoff`) on
    the
    test split of `data_dir`, its plot written to OUT/ddi_tradeoff.png; None (and a note)
    when there is no checkpoint or no labelled data."""
    try:  # torch: lazy, so that --help and the runtime engines run without it
        import torch  # noqa: F401 (the trade-off decodes with it)
    except ImportError:  # a runtime-only install
        notes.append("DDI trade-off skipped: it needs torch (the [train] extra)")
        return None
    if checkpoint is None or data_dir is None:
        notes.append("DDI trade-off skipped: it needs --checkpoint and --data (or the demo)")
        return None
    patients = 30 if quick else TRADEOFF_PATIENTS
    click.echo(f"DDI trade-off on the test split of {data_dir} ({patients} patients)", err=True)
    options = EvalOptions(rounds=2 if quick else 10)
    result = run_tradeoff(checkpoint, data_dir, options, max_patients=patients)
    plot(
        result.rows,
        out / "ddi_tradeoff.png",
        result.recommended,
        title=f"DDI trade-off, test split of {Path(data_dir).name}",
    )
    return {**result.to_json(), "data": str(data_dir), "split": "test"}


def demo_model(root: Path, quick: bool = False, int8: bool = False) -> tuple[Path, Path, str]:
    """The `make demo` model (synthetic data, short training, export, with the int8 graphs
    when `int8`) under root; reused when already there (a reused model without int8 graphs
    skips ort-cpu-int8, with its reason). Returns (model dir, checkpoint dir, a note)."""
    model, ckpt = root / "model", root / "ckpt"
    if (model / "manifest.json").is_file() and (ckpt / "config.json").is_file():
        note = f"reused the demo model in {root} (delete it to rebuild)"
        click.echo(note, err=True)
        return model, ckpt, note
    patients, epochs = (300, 1) if quick else (DEMO_PATIENTS, DEMO_EPOCHS)
    click.echo(
        f"no --model: building the demo model in {root} (synthetic data, {patients} "
        f"patients, {epochs} epoch(s) of training, export)",
        err=True,
    )
    # torch and onnx (the [train] extra): lazy, as only the demo model needs them here
    from cognet.export import ExportOptions, export
    from cognet.training.train import TrainConfig, train

    started = time.perf_counter()
    generate(root / "data", patients=patients, seed=0)
    train(root / "data", ckpt, TrainConfig(epochs=epochs, seed=0))
    export(ckpt, model, ExportOptions(int8=int8))
    note = (
        f"built the demo model in {root} ({patients} synthetic patients, {epochs} "
        f"epoch(s), {time.perf_counter() - started:.0f}s)"
    )
    return model, ckpt, note


def find_checkpoint(model_dir: Path) -> Path | None:
    """MODEL/../ckpt when it is the checkpoint the model was exported from."""
    try:  # torch: lazy, so that --help and the runtime engines run without it
        from cognet.model.checkpoint import checkpoint_hash
    except ImportError:  # a runtime-only install: no torch engine would use it
        return None
    candidate = model_dir.parent / "ckpt"
    if not (candidate / "config.json").is_file():
        return None
    try:
        same = checkpoint_hash(candidate) == load_manifest(model_dir).checkpoint_sha256
    except (OSError, InputError):
        return None
    return candidate if same else None


def make_context(
    model_dir: Path,
    checkpoint: Path | None,
    data_dir: Path | None,
    out: Path,
    settings,
    notes: list[str],
):
    vocab = load_manifest(model_dir).vocabulary()
    need = settings.pool_size
    if data_dir is None:
        table = synthetic_visits(out / "demo" / "pool", need)
        source = "synthetic patients (seed 0) unseen in training"
    else:
        table = dataset_visits(data_dir)
        source = f"{data_dir}/visits.parquet"
    pool = Pool.at_least(table, vocab, need, source)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    return Context(model_dir, checkpoint, pool, work, notes)
