"""`cognet train` and `cognet evaluate`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from cognet.clitools import handle_errors, progress, setup_logging

ABLATION_CHOICES = ("none", "no-copy", "no-visit-score", "no-graph", "no-diagnoses",
                    "no-procedures")


@click.command()
@click.option("--data", "data_dir", required=True, type=click.Path(file_okay=False),
              help="Dataset directory (visits.parquet, ddi.parquet).")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Checkpoint directory to write.")
@click.option("--epochs", default=50, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(1),
              help="Patients per optimisation step.")
@click.option("--patience", default=8, show_default=True, type=click.IntRange(1),
              help="Epochs without a better validation Jaccard before stopping.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@click.option("--ablation", default="none", show_default=True,
              type=click.Choice(ABLATION_CHOICES), help="Paper Table 4 variants.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@handle_errors
def train(data_dir, out, epochs, seed, lr, batch_size, patience, device, ablation, quiet):
    """Train COGNet on the train split, keeping the epoch with the best validation Jaccard.

    \b
    Example:
      cognet train --data data --out ckpt --epochs 20 --seed 0
    """
    import torch

    from cognet.train import TrainConfig, train as run_train

    setup_logging()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = TrainConfig(epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                      patience=patience, ablation=ablation, device=device)

    def on_epoch(r: dict) -> None:
        click.echo(f"epoch {r['epoch']:3d}  loss {r['loss']:.4f}  val jaccard "
                   f"{r['val_jaccard']:.4f}  f1 {r['val_f1']:.4f}  prauc {r['val_prauc']:.4f}  "
                   f"ddi {r['val_ddi']:.4f}  drugs {r['val_avg_drugs']:.1f}  "
                   f"({r['train_s']:.1f}s train, {r['epoch_s']:.1f}s total)"
                   f"{'  *best' if r['best'] else ''}", err=True)

    bar = None if quiet else progress
    best = run_train(data_dir, out, cfg, on_epoch=on_epoch,
                     progress=(lambda **kw: bar(**kw)) if bar else None)
    click.echo(f"best epoch {best['epoch']}: val jaccard {best['val_jaccard']:.4f}; "
               f"checkpoint written to {out}")


@click.command()
@click.option("--checkpoint", "ckpt", type=click.Path(file_okay=False),
              help="Checkpoint directory from `cognet train` (not needed with --baseline).")
@click.option("--data", "data_dir", required=True, type=click.Path(file_okay=False))
@click.option("--split", default="test", show_default=True,
              type=click.Choice(["train", "val", "test"]))
@click.option("--beam", default=4, show_default=True, type=click.IntRange(1),
              help="Beam width; 1 = greedy.")
@click.option("--rounds", default=10, show_default=True, type=click.IntRange(1),
              help="Bootstrap rounds of 80%% of the patients.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the report.")
@click.option("--predictions", type=click.Path(dir_okay=False),
              help="Write every visit's recommendation (cognet-batch score schema).")
@click.option("--baseline", type=click.Choice(["copy-last", "frequent", "lr"]),
              help="Evaluate a simple baseline instead of the checkpoint.")
@click.option("--quiet", is_flag=True)
@handle_errors
def evaluate(ckpt, data_dir, split, beam, rounds, seed, json_out, predictions, baseline, quiet):
    """Evaluate a checkpoint (or a baseline) on a split: Jaccard, F1, PRAUC, DDI, #drugs.

    \b
    Example:
      cognet evaluate --checkpoint ckpt --data data --split test --json report.json
      cognet evaluate --data data --baseline copy-last
    """
    from cognet.evaluate import run_evaluation

    setup_logging()
    if not ckpt and not baseline:
        raise click.UsageError("give --checkpoint, or --baseline for a baseline")
    result = run_evaluation(ckpt, data_dir, split=split, beam=beam, rounds=rounds, seed=seed,
                            predictions=predictions, baseline=baseline, quiet=quiet)
    click.echo(result["table"])
    if json_out:
        Path(json_out).write_text(json.dumps(result["report"], indent=1) + "\n")
