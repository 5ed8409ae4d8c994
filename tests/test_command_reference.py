"""docs/guide/commands.md is every command's --help (tools/command_reference.py): the page is
current, and the check fails once an option is added without regenerating it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "command_reference", ROOT / "tools" / "command_reference.py"
)
reference = sys.modules["command_reference"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)


@pytest.fixture(scope="module")
def programs():
    return reference.programs()


def test_the_page_is_current(programs):
    difference = reference.stale(reference.PAGE.read_text(), reference.render(programs))
    assert difference is None, f"run `{reference.WRITE}`:\n{difference}"


def test_every_console_script_and_subcommand_has_its_section(programs):
    assert [name for name, _ in programs] == [
        "cognet",
        "cognet-export",
        "cognet-batch",
        "cognet-bench",
    ]
    page = reference.render(programs)
    for path in (
        "cognet data mimic3",
        "cognet data benchmark",
        "cognet train",
        "cognet-batch score",
        "cognet-batch explain",
        "cognet-bench",
    ):
        assert f"\n## {path}\n\n```text\nUsage: {path} [OPTIONS]" in page


def test_a_section_is_what_the_installed_command_prints(programs):
    """In process, as the page is made, and by the console script in an 80-column terminal."""
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run(
        [Path(sys.executable).parent / "cognet-batch", "score", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    page = reference.PAGE.read_text()
    section = page.split("\n## cognet-batch score\n\n```text\n", 1)[1].split("\n```\n", 1)[0]
    assert done.stdout == section + "\n"


def test_every_option_of_every_command_is_on_the_page(programs):
    page = reference.PAGE.read_text()
    for name, command in programs:
        for ctx in reference._contexts(command, name):
            section = page.split(f"\n## {ctx.command_path}\n", 1)[1].split("\n## ", 1)[0]
            for param in ctx.command.params:
                if isinstance(param, click.Option) and not param.hidden:
                    for flag in param.opts + param.secondary_opts:
                        assert flag in section, f"{ctx.command_path} {flag}"


def test_an_option_added_without_regenerating_makes_the_page_stale(programs, monkeypatch):
    train = dict(programs)["cognet"].commands["train"]
    monkeypatch.setattr(train, "params", [*train.params, click.Option(["--new-knob"], help="A.")])
    difference = reference.stale(reference.PAGE.read_text(), reference.render(programs))
    assert difference is not None and "+  --new-knob" in difference
    assert reference.main(["--check"]) == 1


def test_the_rendering_is_fixed_width_and_tracks_a_throwaway_command(monkeypatch):
    @click.group()
    def tool():
        """A throwaway program."""

    @tool.command()
    @click.option("--size", type=int, default=3, show_default=True, help="How big. " * 30)
    def make(size):
        """Make something."""

    before = reference.render([("tool", tool)])
    monkeypatch.setenv("COLUMNS", "40")  # the terminal's width does not matter
    assert reference.render([("tool", tool)]) == before
    helps = [block.split("\n```")[0] for block in before.split("```text\n")[1:]]
    widest = max(len(line) for text in helps for line in text.splitlines())
    assert 70 < widest <= reference.WIDTH  # wrapped at WIDTH, not at the terminal's 40
    assert "- [tool make](#tool-make)" in before and "\n## tool make\n" in before
    make.params.append(click.Option(["--colour"], help="Which colour."))
    after = reference.render([("tool", tool)])
    assert reference.stale(before, after) is not None
    assert "+  --colour" in reference.stale(before, after)
    assert reference.stale(after, after) is None
