"""`cognet train` and `cognet evaluate`."""

from __future__ import annotations

import click

from cognet.core import numbers as strict_json
from cognet.core.clitools import (
    FiniteFloat,
    count_option,
    ddi_options,
    ddi_policy,
    guard_outputs,
    handle_errors,
    progress,
    setup_logging,
)
from cognet.core.decoding import (
    DECODINGS,
    ESTIMATORS,
    SET_RULES,
    Decoding,
    asked_decoding,
    asked_rule,
)
from cognet.core.files import Reads, guarded, write_text
from cognet.core.numbers import finite
from cognet.ddi_tradeoff import DEFAULT_PENALTIES

RECIPE_CHOICES = ("default", "reference")

ABLATION_CHOICES = (
    "none",
    "no-copy",
    "no-visit-score",
    "no-graph",
    "no-diagnoses",
    "no-procedures",
)


# torch's own default (a thread per core) collapses when another process holds a core: on
# the 2-core development machine, with other jobs running, one epoch of 2,000 synthetic
# patients took 4.7-4.9 s with 1 thread and 52-91 s with 2 (7.8 s with 2 threads and
# OMP_WAIT_POLICY=PASSIVE). One thread never collapses; more pay only on an idle machine.
threads_option = count_option(
    "--threads",
    default=1,
    help="torch intra-op threads. The default, 1, stays fast when other jobs share the "
    "machine (2 threads made an epoch 10-18x slower then); raise it on an idle machine.",
)


@click.command()
@click.option(
    "--data",
    "data_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Dataset directory (visits.parquet, ddi.parquet).",
)
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Checkpoint directory to write."
)
@click.option(
    "--recipe",
    type=click.Choice(RECIPE_CHOICES),
    default="default",
    show_default=True,
    help='default: what won on validation (README "Training recipe"); reference: the '
    "authors' architecture and regularisation, 200 epochs (cap with --epochs), beam search. "
    "The options below change the recipe's values.",
)
@count_option("--epochs", help="At most (default: 36; reference: 200).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--lr", type=FiniteFloat(0, min_open=True), help="Adam learning rate (default: 1e-3)."
)
@count_option("--batch-size", help="Patients per optimisation step (default: 16).")
@count_option(
    "--patience",
    help="Epochs without a better validation score before stopping (default: 4; reference: none).",
)
@click.option(
    "--scheduled-sampling",
    default=0.0,
    show_default=True,
    type=FiniteFloat(0, 1),
    help="Share of the decoder's input medications replaced by the model's own "
    "prediction during training (exposure to its mistakes).",
)
@click.option(
    "--aux-loss",
    type=FiniteFloat(0),
    help="Weight of an auxiliary multi-label loss (a training signal only: at each decoder "
    "position, the medications still to come; 0: off).",
)
@click.option(
    "--lr-decay",
    type=FiniteFloat(0, 1, min_open=True),
    help="Multiply the learning rate by this after every epoch (default: 1, constant).",
)
@count_option("--dim", help="Embedding size (default: 128; reference: 64).")
@click.option(
    "--emb-dropout",
    type=FiniteFloat(0, 1, max_open=True),
    help="Dropout on the code and medication embeddings (default and reference: 0.3).",
)
@click.option(
    "--attn-dropout",
    type=FiniteFloat(0, 1, max_open=True),
    help="Dropout on attention weights (default and reference: 0.2).",
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@click.option(
    "--ddi-target",
    type=FiniteFloat(0, 1),
    help="After training, choose the soft DDI penalty, a per-set DDI cap and the set "
    "threshold together on validation for the best Jaccard at a DDI rate <= this; "
    "evaluation and scoring use them unless a --ddi-mode is given.",
)
@click.option(
    "--ablation",
    default="none",
    show_default=True,
    type=click.Choice(ABLATION_CHOICES),
    help="Paper Table 4 variants.",
)
@threads_option
@click.option("--quiet", is_flag=True, help="No progress bar.")
@handle_errors
def train(data_dir, out, threads, quiet, recipe, **config):
    """Train COGNet on the train split; choose the weights and the set decoding's threshold
    on the validation split.

    \b
    Example:
      cognet train --data data --out ckpt --seed 0 --threads 1
      cognet train --data data --out ckpt-ref --recipe reference --epochs 30
      cognet train --data data --out ckpt-safe --ddi-target 0.06
    """
    import torch

    from cognet.train import TrainConfig
    from cognet.train import train as run_train

    setup_logging()
    torch.set_num_threads(threads)
    try:  # the other options are TrainConfig's fields
        cfg = TrainConfig.from_recipe(recipe, **config)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    def on_epoch(r: dict) -> None:
        greedy = (
            f"  greedy jaccard {r['val_jaccard']:.4f}  f1 {r['val_f1']:.4f}  prauc "
            f"{r['val_prauc']:.4f}  drugs {r['val_avg_drugs']:.1f}"
            if "val_jaccard" in r
            else ""
        )
        click.echo(
            f"epoch {r['epoch']:3d}  loss {r['loss']:.4f}  val nll {r['val_nll']:.4f}{greedy}  "
            f"({r['train_s']:.1f}s train, {r['epoch_s']:.1f}s total)"
            f"{'  *best' if r['best'] else ''}",
            err=True,
        )

    bar = None if quiet else progress
    # one run per --out, never onto the dataset it reads (cognet.core.files.guarded)
    from cognet.checkpoint import FILES

    written = {"--out": (*FILES, "train_log.jsonl")}
    with guarded("cognet train", {"--out": out}, Reads(datasets=[data_dir]), written) as stage:
        best = run_train(
            data_dir,
            stage["--out"],
            cfg,
            on_epoch=on_epoch,
            progress=(lambda **kw: bar(**kw)) if bar else None,
        )
    weights = best["weights"]["epochs"]
    kept = (
        f"epoch {weights[0]}"
        if len(weights) == 1
        else f"epochs {weights[0]}-{weights[-1]} averaged"
    )
    click.echo(
        f"weights: {kept} (val nll {best['weights']['val_nll']:.4f}); decoding: "
        f"{Decoding.from_json(best['decoding']).label}; checkpoint written to {out}"
    )
    if best.get("ddi_target"):
        from cognet.core.ddi import DDITarget
        from cognet.ddi_target import describe

        click.echo(describe(DDITarget.from_json(best["ddi_target"])))


@click.command()
@click.option(
    "--checkpoint",
    "ckpt",
    type=click.Path(file_okay=False),
    help="Checkpoint directory from `cognet train` (not needed with --baseline).",
)
@click.option("--data", "data_dir", required=True, type=click.Path(file_okay=False))
@click.option(
    "--split", default="test", show_default=True, type=click.Choice(["train", "val", "test"])
)
@click.option(
    "--decoding",
    type=click.Choice(DECODINGS),
    help="set: the model's best set (samples, tuned threshold); beam: the paper's beam "
    "search. Default: the checkpoint's own.",
)
@count_option(
    "--beam",
    help="Beam width of --decoding beam (default 4); 1 = greedy. Alone, it asks for beam "
    "search; with --samples or --threshold, a usage error.",
)
@count_option("--samples", help="Samples per visit of --decoding set (default: the model's).")
@click.option(
    "--threshold",
    type=FiniteFloat(0, 1, min_open=True),
    help="Threshold on P(medication in set) of --decoding set (default: the model's).",
)
@click.option(
    "--estimator",
    type=click.Choice(ESTIMATORS),
    help="How --decoding set draws its samples (default: the model's; plain for models "
    "from before the estimators).",
)
@click.option(
    "--set-rule",
    type=click.Choice(SET_RULES),
    help="How --decoding set reads the set from P(medication in set): threshold, or the "
    "set of highest expected Jaccard (default: the model's; threshold when --threshold is "
    "given, and for models from before the rules).",
)
@count_option("--rounds", default=10, help="Bootstrap rounds of 80%% of the patients.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the report.")
@click.option(
    "--predictions",
    type=click.Path(dir_okay=False),
    help="Write every visit's recommendation (cognet-batch score schema).",
)
@click.option(
    "--baseline",
    type=click.Choice(["copy-last", "frequent", "lr"]),
    help="Evaluate a simple baseline instead of the checkpoint.",
)
@ddi_options
@click.option(
    "--ddi-target",
    type=FiniteFloat(0, 1),
    help="Choose the soft DDI penalty, a per-set DDI cap and the set threshold on the "
    "validation split for the best Jaccard at a DDI rate <= this, then evaluate --split "
    "with them.",
)
@click.option(
    "--ddi-tradeoff",
    is_flag=True,
    help="Report every DDI policy (off, hard, soft at each of --penalties) as a "
    "table instead of one.",
)
@click.option(
    "--penalties",
    default=",".join(f"{p:g}" for p in DEFAULT_PENALTIES),
    show_default=True,
    help="--ddi-tradeoff: the soft penalties, comma-separated.",
)
@click.option(
    "--max-rates",
    default="",
    help="--ddi-tradeoff: also off capped at these DDI rates, comma-separated.",
)
@click.option(
    "--plot",
    "plot_out",
    type=click.Path(dir_okay=False),
    help="--ddi-tradeoff: write Jaccard vs DDI rate as a PNG.",
)
@click.option(
    "--mark",
    "marks",
    multiple=True,
    metavar="NAME=JACCARD@DDI",
    help="--plot: also mark this point, e.g. SafeDrug=0.5213@0.0589 (repeatable).",
)
@threads_option
@click.option("--quiet", is_flag=True)
@handle_errors
def evaluate(
    ckpt,
    data_dir,
    split,
    decoding,
    beam,
    samples,
    threshold,
    estimator,
    set_rule,
    rounds,
    seed,
    json_out,
    predictions,
    baseline,
    ddi_mode,
    ddi_penalty,
    ddi_max_rate,
    ddi_target,
    ddi_tradeoff,
    penalties,
    max_rates,
    plot_out,
    marks,
    threads,
    quiet,
):
    """Evaluate a checkpoint (or a baseline) on a split: Jaccard, F1, PRAUC, DDI, #drugs.

    \b
    Example:
      cognet evaluate --checkpoint ckpt --data data --split test --json report.json
      cognet evaluate --data data --baseline copy-last
      cognet evaluate --checkpoint ckpt --data data --ddi-mode soft --ddi-penalty 1
      cognet evaluate --checkpoint ckpt --data data --ddi-tradeoff --plot tradeoff.png
      cognet evaluate --checkpoint ckpt --data data --ddi-target 0.06
    """
    import torch

    from cognet.evaluate import EvalOptions, run_evaluation

    setup_logging()
    torch.set_num_threads(threads)
    if not ckpt:
        if not baseline:
            raise click.UsageError("give --checkpoint, or --baseline for a baseline")
        if ddi_tradeoff or ddi_mode or ddi_max_rate is not None or ddi_target is not None:
            raise click.UsageError("the DDI options decode a --checkpoint, not a --baseline")
    policy = ddi_policy(ddi_mode, ddi_penalty, ddi_max_rate)
    if ddi_target is not None and (policy is not None or ddi_tradeoff or decoding == "beam"):
        raise click.UsageError(
            "--ddi-target chooses the policy of set decoding: drop --ddi-mode, --ddi-penalty, "
            "--ddi-max-rate, --ddi-tradeoff and --decoding beam"
        )
    points = _marks(marks)
    if marks and not plot_out:
        raise click.UsageError("--mark goes with --plot")
    outputs = {"--json": json_out, "--predictions": predictions, "--plot": plot_out}
    guard_outputs("cognet evaluate", outputs, Reads(datasets=[data_dir], checkpoints=[ckpt]))
    try:  # --beam alone asks for beam search; with --samples or --threshold it is refused
        decoding = asked_decoding(decoding, beam, samples, threshold, flag="--")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    changes = {"name": decoding, "beam": beam, "samples": samples, "threshold": threshold,
               "estimator": estimator, "rule": asked_rule(set_rule, threshold)}  # fmt: skip
    options = EvalOptions(
        split=split, decoding=changes, ddi=policy, rounds=rounds, seed=seed,
        baseline=baseline, predictions=predictions, quiet=quiet, ddi_target=ddi_target,
    )  # fmt: skip
    if ddi_tradeoff:
        if policy is not None or predictions:
            raise click.UsageError(
                "--ddi-tradeoff runs every policy: drop --ddi-mode, "
                "--ddi-penalty, --ddi-max-rate and --predictions"
            )
        _tradeoff(ckpt, data_dir, options, penalties, max_rates, (plot_out, points), json_out)
        return
    if plot_out or marks:
        raise click.UsageError("--plot and --mark go with --ddi-tradeoff")
    result = run_evaluation(ckpt, data_dir, options)
    click.echo(result["table"])
    if json_out:
        write_text(json_out, strict_json.dumps(result["report"], indent=1) + "\n")


def _floats(text: str, option: str) -> tuple[float, ...]:
    try:
        return tuple(finite(float(t), "each value") for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated finite numbers, got {text!r}", param_hint=option
        ) from None


def _marks(marks: tuple[str, ...]) -> list[tuple[str, float, float]]:
    """--mark NAME=JACCARD@DDI values as (name, jaccard, ddi); a UsageError naming the bad one."""
    points = []
    for text in marks:
        name, _, point = text.partition("=")
        jaccard, _, ddi = point.partition("@")
        try:
            values = float(jaccard), float(ddi)
        except ValueError:
            values = None
        if not name.strip() or values is None or not all(0 <= v <= 1 for v in values):
            raise click.UsageError(
                f"--mark {text!r}: expected NAME=JACCARD@DDI with both in [0, 1], "
                "e.g. SafeDrug=0.5213@0.0589"
            )
        points.append((name.strip(), *values))
    return points


def _tradeoff(ckpt, data_dir, options, penalties, max_rates, plot, json_out) -> None:
    """--ddi-tradeoff; options: `cognet.evaluate.EvalOptions` (no policy asked); plot: the
    --plot path (or None) and the --mark points."""
    from cognet import ddi_tradeoff

    pens, caps = _floats(penalties, "--penalties"), _floats(max_rates, "--max-rates")
    if any(p < 0 for p in pens) or any(not 0 <= r <= 1 for r in caps):
        raise click.UsageError("penalties must be >= 0 and max rates in [0, 1]")

    def done(row) -> None:
        if not options.quiet:
            click.echo(
                f"{row.policy.label}: jaccard {row.mean('jaccard'):.4f}, ddi "
                f"{row.mean('ddi'):.4f} ({row.seconds:.1f}s)",
                err=True,
            )

    policy_list = ddi_tradeoff.policies(pens, caps)
    result = ddi_tradeoff.run_tradeoff(ckpt, data_dir, options, policy_list, on_policy=done)
    click.echo(result.table)
    plot_out, points = plot
    if plot_out:
        ddi_tradeoff.plot(result.rows, plot_out, result.recommended, marks=points)
        click.echo(f"plot written to {plot_out}", err=True)
    if json_out:
        write_text(json_out, strict_json.dumps(result.to_json(), indent=1) + "\n")
