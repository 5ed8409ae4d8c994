"""The `cognet-export` command: a checkpoint -> a model directory for `cognet-batch`."""

from __future__ import annotations

import sys

import click

from cognet.core.commandline import OneLineCommand, handle_errors, setup_logging
from cognet.core.errors import ParityError
from cognet.core.files import Reads, guarded
from cognet.core.progress import progress
from cognet.core.tensorrt import CACHE_DIR


@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--checkpoint",
    "checkpoint",
    required=True,
    metavar="CKPT",
    help="Checkpoint directory written by `cognet train`.",
)
@click.option("--out", required=True, metavar="MODEL", help="Model directory to write.")
@click.option(
    "--validate/--no-validate",
    default=True,
    show_default=True,
    help="Check ONNX Runtime against torch (outputs and decoding) before writing the manifest.",
)
@click.option("--fp16", is_flag=True, help="Also write float16 graphs (validated too).")
@click.option(
    "--int8",
    is_flag=True,
    help="Also write int8 graphs for the CPU (MatMul weights quantized; validated too).",
)
@click.option(
    "--tensorrt", is_flag=True, help="Also build TensorRT engines (needs TensorRT and a GPU)."
)
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
@handle_errors
def main(
    checkpoint: str,
    out: str,
    validate: bool,
    fp16: bool,
    int8: bool,
    tensorrt: bool,
    verbose: bool,
) -> None:
    """Export a trained COGNet checkpoint to ONNX graphs plus manifest.json.

    Exit codes: 0 ok; 1 parity failure (report in MODEL/parity_report.json) or other
    error; 2 bad checkpoint, usage error, or --tensorrt without TensorRT/GPU.

    \b
    Example:
      cognet-export --checkpoint ckpt --out model
      cognet-export --checkpoint ckpt --out model --fp16
      cognet-export --checkpoint ckpt --out model --int8
    """
    # torch and onnx (the [train] extra), through the pipeline: lazy, so that --help runs
    # without them
    from cognet.export.pipeline import MODEL_FILES, REPORT_FILE, ExportOptions, export

    setup_logging(verbose)
    # never onto the checkpoint, one run per MODEL, checked before the work; the model is
    # built aside and moved into place whole (cognet.core.files.guarded); a parity failure
    # moves in its graphs and report, without a manifest
    reads = Reads(checkpoints=[checkpoint])
    written = {"--out": ("manifest.json", REPORT_FILE, CACHE_DIR, *MODEL_FILES)}
    with guarded("cognet-export", {"--out": out}, reads, written) as stage:
        built = stage["--out"]
        try:
            options = ExportOptions(validate=validate, fp16=fp16, int8=int8, tensorrt=tensorrt)
            manifest = export(checkpoint, built, options, progress=progress)
        except ParityError as exc:
            stage.commit()
            click.echo(f"Error: {str(exc).replace(str(built), out)}", err=True)
            sys.exit(1)
    target = manifest.default_target()
    if target is not None:  # the policy scoring uses when none is asked
        click.echo(
            f"default DDI policy: {target.policy.label}, {target.rule_label} "
            f"(DDI target {target.target:g})"
        )
    parity = manifest.parity
    if parity is None:
        click.echo(f"exported {out} (not validated)")
        return
    decoding = parity["decoding"]
    line = (
        f"exported {out}: float32 max abs diff {parity['float32']['max_abs_diff']:.2g}, "
        f"greedy lists identical {decoding['beam1']['identical']}/{decoding['beam1']['visits']}, "
        f"beam-4 lists identical {decoding['beam4']['identical']}/"
        f"{decoding['beam4']['visits']}"
    )
    sets = parity.get("sets")
    if sets is not None:  # the model's own decoding, reported (a tie may flip a set)
        line += (
            f", sets of its decoding ({sets['decoding']}) identical "
            f"{sets['identical']}/{sets['visits']}"
        )
    if "float16" in parity:
        line += (
            f"; float16 max diff {parity['float16']['max_abs_diff']:.2g}, "
            f"top-1 agreement {parity['float16']['top1_agreement']:.3f}"
        )
    if "int8" in parity:
        int8_parity = parity["int8"]
        line += (
            f"; int8 max probability diff {int8_parity['probs_max_abs_diff']:.2g}, "
            f"top-1 agreement {int8_parity['top1_agreement']:.3f}, beam-4 lists identical "
            f"{int8_parity['decoding']['beam4']['identical']}/"
            f"{int8_parity['decoding']['beam4']['visits']}"
        )
    click.echo(line)
