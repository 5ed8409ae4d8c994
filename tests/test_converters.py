"""Every converter of `cognet data` keeps one convention (cognet/cli/data.py): a `Report`
printed and written to OUT/summary.json (each converter's own test reads that file), -v /
--verbose, and an --out that says so."""

from __future__ import annotations

import click
import pytest

from cognet.cli.data import data

CONVERTERS = ("benchmark", "meds", "mimic3", "mimic4", "omop")


def options(name: str) -> dict[str, click.Option]:
    command = data.commands[name]
    return {o: p for p in command.params if isinstance(p, click.Option) for o in p.opts}


def test_every_dataset_writer_but_synth_is_a_converter():
    assert set(data.commands) - set(CONVERTERS) == {"synth", "stats"}


@pytest.mark.parametrize("name", CONVERTERS)
def test_converter_offers_verbose_and_names_its_summary(name):
    found = options(name)
    assert found["-v"] is found["--verbose"] and found["-v"].is_flag
    assert "summary.json" in found["--out"].help
    assert "OUT/summary.json" in data.commands[name].help
