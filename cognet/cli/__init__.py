"""The `cognet` command line: data preparation, training and evaluation.

Each command is a thin layer over a library function; the commands live beside the
code they drive and are registered here.
"""

from __future__ import annotations

import click

from cognet.cli.data import data
from cognet.cli.evaluate import evaluate
from cognet.cli.train import ensemble, train
from cognet.core.commandline import OneLineGroup


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cognet")
def main() -> None:
    """cognet: train and evaluate COGNet medication recommenders.

    \b
    Example:
      cognet data synth --out data --patients 2000 --seed 0
      cognet train --data data --out ckpt --epochs 5
      cognet evaluate --checkpoint ckpt --data data
    """


main.add_command(data)
main.add_command(train)
main.add_command(ensemble)
main.add_command(evaluate)
