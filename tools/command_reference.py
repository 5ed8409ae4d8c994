"""Write or check docs/guide/commands.md, the command reference, from the commands' own --help.

    python tools/command_reference.py --write    # regenerate the page (`make commands`)
    python tools/command_reference.py --check    # exit 1 when the page is stale (`make lint`)

Every console script of setup.py and every subcommand below it, in the order click lists
them, rendered in process from the click objects at a fixed width (WIDTH), so that the page
is the same on every machine; `make lint` runs --check, and tests/test_command_reference.py
holds the page current.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guide" / "commands.md"
# click's own width on a terminal of 80 columns or more (80 less its margin), fixed here so
# that the page is what --help prints there, whatever the terminal that writes the page
WIDTH = 78
WRITE = "make commands"  # runs this script with --write

INTRO = f"""\
# Command reference

Generated from the commands' own `--help` by `{WRITE}` (tools/command_reference.py); do
not edit: change the help text in the code and regenerate. `make lint` and
tests/test_command_reference.py fail when this page is stale.

Every command prints this with `--help` (or `-h`). Exit codes: 0 success, 2 usage or input
error (one line naming the file, column and row, or the option), 1 anything else
([Failure behaviour](failures.md)). How to use them: the [README](../../README.md) and the
guide ([Data](data.md), [Training recipe](training.md), [Set decoding](decoding.md),
[DDI-aware decoding](ddi.md), [Explanations](explanations.md), [GPU](gpu.md),
[Ray](ray.md)).
"""


def console_scripts(root: Path = ROOT) -> list[tuple[str, str]]:
    """setup.py's console_scripts as (program, "module:attribute"), in its order."""
    tree = ast.parse((root / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            scripts = ast.literal_eval(node.value)["console_scripts"]
            return [tuple(s.replace(" ", "").split("=", 1)) for s in scripts]
    raise SystemExit(f"{root / 'setup.py'}: no console_scripts")


def programs(root: Path = ROOT) -> list[tuple[str, click.Command]]:
    """(program, its click command or group) of every console script."""
    found = []
    for name, target in console_scripts(root):
        module, attribute = target.split(":")
        found.append((name, getattr(importlib.import_module(module), attribute)))
    return found


def _contexts(command: click.Command, name: str, parent=None) -> Iterator[click.Context]:
    """The context of `command` and of every visible subcommand below it, depth first, with
    the command's own context settings (its help option names), as its --help would have."""
    settings = {**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    if getattr(command, "_help_option", None) is not None:
        # click (8.1.8+) keeps the help option of the first context that asked: a subcommand
        # invoked alone (in tests) would keep `--help` without its program's `-h`
        command._help_option = None
    ctx = click.Context(command, info_name=name, parent=parent, **settings)
    yield ctx
    if isinstance(command, click.Group):
        for sub in command.list_commands(ctx):
            subcommand = command.get_command(ctx, sub)
            if subcommand is not None and not subcommand.hidden:
                yield from _contexts(subcommand, sub, ctx)


def render(roots: Sequence[tuple[str, click.Command]]) -> str:
    """The page: INTRO, a list of the commands, then each command's --help under its path."""
    contexts = [ctx for name, command in roots for ctx in _contexts(command, name)]
    toc = [
        f"{'  ' * (len(ctx.command_path.split()) - 1)}- [{ctx.command_path}]"
        f"(#{ctx.command_path.replace(' ', '-')})"
        for ctx in contexts
    ]
    sections = [
        f"## {ctx.command_path}\n\n```text\n{ctx.command.get_help(ctx).rstrip()}\n```\n"
        for ctx in contexts
    ]
    return "\n".join([INTRO, *toc, "", *sections])


def stale(page: str, current: str) -> str | None:
    """None when the page is `current`, else what regenerating it would change (a diff)."""
    if page == current:
        return None
    diff = difflib.unified_diff(
        page.splitlines(), current.splitlines(), "commands.md", "--help", lineterm="", n=1
    )
    return "\n".join(list(diff)[:40])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = parser.parse_args(argv)
    current = render(programs())
    if args.write:
        PAGE.write_text(current)
        return 0
    page = PAGE.read_text() if PAGE.exists() else ""
    difference = stale(page, current)
    if difference is None:
        print(f"{PAGE.relative_to(ROOT)}: current")
        return 0
    print(f"{PAGE.relative_to(ROOT)} is stale: run `{WRITE}`\n{difference}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
