"""`cognet train`: a checkpoint from a dataset directory; `cognet ensemble`: one checkpoint
from networks trained apart."""

from __future__ import annotations

from dataclasses import replace

import click

from cognet.core.commandline import (
    FiniteFloat,
    count_option,
    handle_errors,
    setup_logging,
)
from cognet.core.ddi import DDITarget
from cognet.core.decoding import (
    Decoding,
)
from cognet.core.file_schemas import HEAD_FILE
from cognet.core.files import Reads, guarded
from cognet.core.progress import progress
from cognet.model.checkpoint_checks import FILES
from cognet.training.ddi_target import describe

RECIPE_CHOICES = ("default", "reference")

ABLATION_CHOICES = (
    "none",
    "no-copy",
    "no-visit-score",
    "no-graph",
    "no-diagnoses",
    "no-procedures",
)


# torch's own default (a thread per core) collapses when another process holds a core
# (BENCHMARKS.md "What was tried"): one thread never collapses; more pay only on an idle machine.
threads_option = count_option(
    "--threads",
    default=1,
    help="torch intra-op threads. The default, 1, stays fast when other jobs share the "
    "machine, where more threads wait for each other; raise it on an idle machine.",
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
    help='default: what won on validation (user guide "Training recipe"); reference: the '
    "authors' architecture and regularisation, 200 epochs (cap with --epochs), beam search. "
    "The options below change the recipe's values.",
)
@count_option("--epochs", help="At most (default: 36; reference: 200).")
@count_option(
    "--members",
    help="Networks trained apart (member i with seed --seed + 1000 i) and decoded as one "
    "model: twice the training and scoring cost for 2 (default: 2; reference: 1).",
)
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
    "--history-dropout",
    type=FiniteFloat(0, 1, max_open=True),
    help="Share of training visits with a history decoded without it, as first visits are "
    "(drawn anew each epoch; default: 0.6; reference: 0).",
)
@click.option(
    "--aux-loss",
    type=FiniteFloat(0),
    help="Weight of an auxiliary multi-label loss (a training signal only: at each decoder "
    "position, the medications still to come; 0: off).",
)
@click.option(
    "--ddi-loss",
    type=FiniteFloat(0),
    help="Weight of a DDI term in the loss: the expected number of interacting pairs each "
    "decoding step adds (needs the dataset's ddi.parquet; 0: off).",
)
@click.option(
    "--ddi-loss-target",
    type=FiniteFloat(0, 1),
    help="With --ddi-loss: weigh the DDI term per batch as SafeDrug does, 0 while the "
    "batch's predicted DDI rate is at or under this, the whole --ddi-loss at 0.05 above.",
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
    help="After training, choose the DDI policy and set rule (soft penalty, per-set cap, "
    "pair price, threshold; with the set head, over its output: the set rules only) "
    "together on validation for the best Jaccard at a DDI rate <= this; evaluation and "
    "scoring of that decoding use them unless a --ddi-mode is given.",
)
@click.option(
    "--teacher",
    type=click.Path(exists=True, file_okay=False),
    help="Train only the set head, on this checkpoint's networks (written by cognet train "
    "or cognet ensemble on the same --data): the checkpoint with a head, as cognet train "
    "writes it after its members. The networks' options do not apply with it.",
)
@click.option(
    "--head/--no-head",
    default=True,
    show_default=True,
    help="After the networks, train the set head that the one-pass decoding (marginal, the "
    "checkpoint's default with it; set decoding without) reads: it learns the networks' own "
    "P(k in S).",
)
@click.option(
    "--head-mix",
    type=FiniteFloat(0, 1),
    help="The set head's target: this share of the networks' P(k in S), the rest the "
    "true set (default: 0.5).",
)
@count_option("--head-hidden", help="Width of the set head's hidden layer (default: 1024).")
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
def train(
    data_dir,
    out,
    recipe,
    epochs,
    members,
    seed,
    lr,
    batch_size,
    patience,
    scheduled_sampling,
    history_dropout,
    aux_loss,
    ddi_loss,
    ddi_loss_target,
    lr_decay,
    dim,
    emb_dropout,
    attn_dropout,
    device,
    ddi_target,
    teacher,
    head,
    head_mix,
    head_hidden,
    ablation,
    threads,
    quiet,
):
    """Train COGNet on the train split, then the set head that reads its answer in one pass
    (the marginal decoding, the checkpoint's default); choose the weights, the thresholds
    and set rules on the validation split.

    \b
    Example:
      cognet train --data data --out ckpt --seed 0 --threads 1
      cognet train --data data --out ckpt-ref --recipe reference --epochs 30
      cognet train --data data --out ckpt-safe --ddi-target 0.06
      cognet train --data data --out ckpt-head --teacher ckpt
    """
    # torch (the [train] extra): lazy, so that `cognet --help` runs without it
    import torch

    from cognet.training import train as training
    from cognet.training.members import attach_head

    setup_logging()
    torch.set_num_threads(threads)
    # the changes to the recipe's TrainConfig, field by field (None: the recipe's value;
    # dim, emb_dropout, attn_dropout and ablation are its network's, a ModelConfig's)
    changes = {
        "epochs": epochs,
        "members": members,
        "seed": seed,
        "lr": lr,
        "batch_size": batch_size,
        "patience": patience,
        "scheduled_sampling": scheduled_sampling,
        "history_dropout": history_dropout,
        "aux_loss": aux_loss,
        "ddi_loss": ddi_loss,
        "ddi_loss_target": ddi_loss_target,
        "lr_decay": lr_decay,
        "dim": dim,
        "emb_dropout": emb_dropout,
        "attn_dropout": attn_dropout,
        "device": device,
        "ddi_target": ddi_target,
        "ablation": ablation,
    }
    shape = {"mix": head_mix, "hidden": head_hidden}
    if teacher is not None:
        _teacher_alone(changes, head, recipe)
    try:
        cfg = training.TrainConfig.from_recipe(recipe, **changes)
        if head:
            cfg = replace(cfg, head=_head(cfg.head, shape))
        else:  # no head to read the marginals from: set decoding is the default then
            cfg = replace(
                cfg, head=None, decoding=None if cfg.decoding == "marginal" else cfg.decoding
            )
    except (TypeError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None

    def on_epoch(r: dict) -> None:
        greedy = (
            f"  greedy jaccard {r['val_jaccard']:.4f}  f1 {r['val_f1']:.4f}  prauc "
            f"{r['val_prauc']:.4f}  drugs {r['val_avg_drugs']:.1f}"
            if "val_jaccard" in r
            else ""
        )
        member = f"  member {r['member']}" if "member" in r else ""  # every line opens "epoch"
        click.echo(
            f"epoch {r['epoch']:3d}{member}  loss {r['loss']:.4f}  "
            f"val nll {r['val_nll']:.4f}{greedy}  "
            f"({r['train_s']:.1f}s train, {r['epoch_s']:.1f}s total)"
            f"{'  *best' if r['best'] else ''}",
            err=True,
        )

    bar = None if quiet else progress
    # one run per --out, never onto the dataset it reads (cognet.core.files.guarded)
    written = {"--out": (*FILES, HEAD_FILE, "train_log.jsonl")}
    bars = (lambda **kw: bar(**kw)) if bar else None
    reads = Reads(datasets=[data_dir], checkpoints=[teacher])
    with guarded("cognet train", {"--out": out}, reads, written) as stage:
        if teacher is not None:
            done = attach_head(teacher, data_dir, stage["--out"], cfg.head, cfg.decoding, bars)
            label = Decoding.from_json(done["decoding"]).label
            click.echo(f"set head trained on {teacher}; decoding: {label}; written to {out}")
            return
        best = training.train(data_dir, stage["--out"], cfg, on_epoch=on_epoch, progress=bars)
    kept = _members_label(best["members"])
    click.echo(
        f"weights: {kept}; decoding: "
        f"{Decoding.from_json(best['decoding']).label}; checkpoint written to {out}"
    )
    if best.get("ddi_target"):
        click.echo(describe(DDITarget.from_json(best["ddi_target"])))


@click.command()
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option(
    "--data",
    "data_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The dataset the checkpoints were trained on (its validation split tunes the decoding).",
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Checkpoint to write.")
@threads_option
@handle_errors
def ensemble(checkpoints, data_dir, out, threads):
    """Combine checkpoints trained apart on one dataset with one recipe (seeds aside) into
    one ensemble checkpoint; its decoding is tuned on the validation split, as `cognet
    train --members N` tunes it (whose member i is the run of seed --seed + 1000 i).

    \b
    Example:
      cognet train --data data --out ckpt_a --seed 0 --members 1
      cognet train --data data --out ckpt_b --seed 1000 --members 1
      cognet ensemble ckpt_a ckpt_b --data data --out ckpt
    """
    # torch (the [train] extra): lazy, so that `cognet --help` runs without it
    import torch

    from cognet.training.members import combine

    setup_logging()
    torch.set_num_threads(threads)
    written = {"--out": (*FILES, HEAD_FILE, "train_log.jsonl")}
    reads = Reads(datasets=[data_dir], checkpoints=list(checkpoints))
    with guarded("cognet ensemble", {"--out": out}, reads, written) as stage:
        done = combine(checkpoints, data_dir, stage["--out"])
    click.echo(
        f"{len(checkpoints)} members; decoding: {Decoding.from_json(done['decoding']).label}; "
        f"checkpoint written to {out}"
    )


def _teacher_alone(changes: dict, head: bool, recipe: str) -> None:
    """A usage error naming the first option given (in the command line's order) that
    --teacher, which trains the set head alone, does not take: an option of the networks
    (`changes`, but --seed: the teacher's is used), --no-head or --recipe."""
    given = [k for k, v in changes.items() if v not in (None, False, 0.0, "none", "cpu")]
    given = [k for k in given if k != "seed"]  # the teacher's seed is used
    order = list(click.get_current_context().params)  # click: those given first, in order
    given.sort(key=order.index)
    if given or not head or recipe != "default":
        what = given[0] if given else ("no-head" if not head else "recipe")
        raise click.UsageError(
            f"--teacher trains the set head only: --{what.replace('_', '-')} does not apply"
        )


def _head(recipe, shape: dict):
    """The recipe's set head with the --head-* options given."""
    from cognet.training.set_head import HeadRecipe  # torch: lazy, as in `train`

    return replace(recipe or HeadRecipe(), **{k: v for k, v in shape.items() if v is not None})


def _members_label(members: list[dict]) -> str:
    """How each network's weights were chosen, each named by its member number (as the
    epoch lines name them) when there are several."""
    if len(members) == 1:
        return _weights_label(members[0])
    return "; ".join(f"member {i}: {_weights_label(w)}" for i, w in enumerate(members))


def _weights_label(chosen: dict) -> str:
    """How one network's weights were chosen: "epoch 7 (val nll 1.2345)" or "epochs 5-9
    averaged (...)"."""
    epochs = chosen["epochs"]
    kept = f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}-{epochs[-1]} averaged"
    return f"{kept} (val nll {chosen['val_nll']:.4f})"
