"""`cognet evaluate`: a checkpoint (or a baseline) on one split, or the DDI trade-off."""

from __future__ import annotations

import click

from cognet.cli.train import threads_option
from cognet.core import strict_json
from cognet.core.commandline import (
    FiniteFloat,
    count_option,
    decoding_options,
    guard_outputs,
    handle_errors,
    setup_logging,
)
from cognet.core.files import Reads, write_text
from cognet.core.strict_json import finite
from cognet.evaluation.ddi_tradeoff import DEFAULT_PENALTIES, policies, run_tradeoff
from cognet.evaluation.ddi_tradeoff import plot as plot_tradeoff
from cognet.evaluation.options import EvalOptions


@click.command()
@click.option(
    "--checkpoint",
    "ckpt",
    type=click.Path(file_okay=False),
    help="Checkpoint directory from `cognet train` (not needed with --baseline).",
)
@click.option(
    "--data",
    "data_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Dataset directory (visits.parquet, ddi.parquet).",
)
@click.option(
    "--split",
    default="test",
    show_default=True,
    type=click.Choice(["train", "val", "test"]),
    help="The split to evaluate.",
)
@count_option("--rounds", default=10, help="Bootstrap rounds of 80% of the patients.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Seed of the bootstrap rounds (and of the lr baseline).",
)
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
@click.option(
    "--ddi-target",
    type=FiniteFloat(0, 1),
    help="Choose the DDI policy and set rule (soft penalty, per-set cap, pair price, "
    "threshold; for the marginal decoding the set rules only) on the validation split for "
    "the best Jaccard at a DDI rate <= this, then evaluate --split with them.",
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
    "--pair-prices",
    default="",
    help="--ddi-tradeoff: also off at these DDI pair prices (set decoding), comma-separated.",
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
@decoding_options
@threads_option
@click.option("--quiet", is_flag=True, help="No progress bar nor --ddi-tradeoff progress lines.")
@handle_errors
def evaluate(
    ckpt,
    data_dir,
    split,
    request,
    rounds,
    seed,
    json_out,
    predictions,
    baseline,
    ddi_target,
    ddi_tradeoff,
    penalties,
    max_rates,
    pair_prices,
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
    # torch (the [train] extra): lazy, so that `cognet --help` runs without it
    import torch

    from cognet.evaluation.evaluate import run_evaluation

    setup_logging()
    torch.set_num_threads(threads)
    if not ckpt:
        if not baseline:
            raise click.UsageError("give --checkpoint, or --baseline for a baseline")
        if ddi_tradeoff or request.ddi is not None or ddi_target is not None:
            raise click.UsageError("the DDI options decode a --checkpoint, not a --baseline")
    policy = request.ddi
    if ddi_target is not None and (policy is not None or ddi_tradeoff or request.name == "beam"):
        raise click.UsageError(
            "--ddi-target chooses the policy of set decoding: drop --ddi-mode, --ddi-penalty, "
            "--ddi-max-rate, --ddi-tradeoff and --decoding beam"
        )
    points = _marks(marks)
    if marks and not plot_out:
        raise click.UsageError("--mark goes with --plot")
    outputs = {"--json": json_out, "--predictions": predictions, "--plot": plot_out}
    guard_outputs("cognet evaluate", outputs, Reads(datasets=[data_dir], checkpoints=[ckpt]))
    options = EvalOptions(
        split=split,
        request=request,
        rounds=rounds,
        seed=seed,
        baseline=baseline,
        predictions=predictions,
        quiet=quiet,
        ddi_target=ddi_target,
    )
    if ddi_tradeoff:
        if policy is not None or predictions:
            raise click.UsageError(
                "--ddi-tradeoff runs every policy: drop --ddi-mode, "
                "--ddi-penalty, --ddi-max-rate and --predictions"
            )
        levels = (penalties, max_rates, pair_prices)
        _tradeoff(ckpt, data_dir, options, levels, (plot_out, points), json_out)
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


def _tradeoff(ckpt, data_dir, options, levels, plot, json_out) -> None:
    """--ddi-tradeoff; options: `cognet.evaluation.options.EvalOptions` (no policy asked);
    levels: the --penalties, --max-rates and --pair-prices texts; plot: the --plot path (or
    None) and the --mark points."""
    pens = _floats(levels[0], "--penalties")
    caps = _floats(levels[1], "--max-rates")
    prices = _floats(levels[2], "--pair-prices")
    if any(p < 0 for p in pens) or any(not 0 <= r <= 1 for r in (*caps, *prices)):
        raise click.UsageError("penalties must be >= 0, max rates and pair prices in [0, 1]")

    def done(row) -> None:
        if not options.quiet:
            click.echo(
                f"{row.policy.label}: jaccard {row.mean('jaccard'):.4f}, ddi "
                f"{row.mean('ddi'):.4f} ({row.seconds:.1f}s)",
                err=True,
            )

    policy_list = policies(pens, caps, prices)
    result = run_tradeoff(ckpt, data_dir, options, policy_list, on_policy=done)
    click.echo(result.table)
    plot_out, points = plot
    if plot_out:
        plot_tradeoff(result.rows, plot_out, result.recommended, marks=points)
        click.echo(f"plot written to {plot_out}", err=True)
    if json_out:
        write_text(json_out, strict_json.dumps(result.to_json(), indent=1) + "\n")
