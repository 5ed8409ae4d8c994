"""The README's runnable command blocks run as written, and the README stays a front door.

A runnable block is a fenced block whose info string is ``bash runnable``: a command that
needs nothing but this install (no hospital data, database, GPU or Ray cluster). The test
runs every such block with bash, in README order, in one empty folder, with the installed
commands first on PATH, so later blocks read what earlier ones wrote (data -> ckpt -> model
-> recommendations). To stay fast it shrinks what a user runs at full size, by these
substitutions and nothing else (`SHRINK`):

- `cognet data synth`: `--patients N` becomes `--patients 60`;
- `cognet train`: `--epochs 1` is added;
- `cognet-bench`: `--quick`, two engines (torch-batched, ort-cpu), beam 4, one batch size
  (8), and no DDI trade-off, profile, history or end-to-end series are added.

It takes about 45 s on 2 idle cores (twice that when other jobs hold them).

Then it checks what the blocks printed and wrote.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 350
MARKER = "bash runnable"
BLOCK = re.compile(r"^```([^\n`]*)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
# command prefix -> (pattern, replacement); a replacement of None appends the pattern
SHRINK: dict[str, list[tuple[str, str | None]]] = {
    "cognet data synth": [(r"--patients \d+", "--patients 60")],
    "cognet train": [("--epochs 1", None)],
    "cognet-bench": [
        (
            "--quick --engines torch-batched,ort-cpu --beams 4 --batch-sizes 8"
            " --no-ddi-tradeoff --no-profile --past-visits '' --input-sizes ''",
            None,
        )
    ],
}
# every command a runnable block must show once at least (so none is unmarked by mistake)
RUNNABLE_COMMANDS = (
    "cognet data synth",
    "cognet data stats",
    "cognet train",
    "cognet evaluate",
    "cognet-export",
    "cognet-batch score",
    "cognet-batch explain",
    "cognet-bench",
)


def blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block of a Markdown text."""
    return [(info.strip(), body) for info, body in BLOCK.findall(text)]


def runnable_blocks() -> list[str]:
    return [body for info, body in blocks(README.read_text()) if info == MARKER]


def commands(block: str) -> list[str]:
    """The block's commands, each on one line (continuation lines joined)."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def shrink(command: str) -> str:
    for prefix, rules in SHRINK.items():
        if command.startswith(prefix + " "):
            for pattern, replacement in rules:
                if replacement is None:
                    command = f"{command} {pattern}"
                else:
                    assert re.search(pattern, command), f"README: {command!r} lacks {pattern}"
                    command = re.sub(pattern, replacement, command)
    return command


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"
    assert "## Python API" in lines  # tests/test_python_api.py runs its example


def test_every_runnable_command_is_marked():
    shown = [c for block in runnable_blocks() for c in commands(block)]
    for name in RUNNABLE_COMMANDS:
        assert any(c.startswith(name + " ") for c in shown), f"no `{MARKER}` block runs {name}"


def test_links_resolve():
    """Every relative link of the README and the user guide names a file that exists."""
    for page in [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: link to missing {target}"


@pytest.mark.slow
def test_runnable_blocks_run(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    printed = []
    for block in runnable_blocks():
        script = "set -euo pipefail\n" + "\n".join(shrink(c) for c in commands(block)) + "\n"
        done = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"README block failed:\n{script}\n{done.stderr[-3000:]}"
        printed.append(done.stdout)
    out = "\n".join(printed)

    visits = pq.read_table(tmp_path / "data" / "visits.parquet")
    assert len({p for p in visits["patient_id"].to_pylist()}) == 60
    assert "Jaccard" in out and "first visits" in out  # evaluate's table and its split
    report = json.loads((tmp_path / "report.json").read_text())
    assert report and (tmp_path / "preds.parquet").exists()
    assert (tmp_path / "ckpt" / "config.json").exists()
    assert (tmp_path / "model" / "manifest.json").exists()

    recs = pq.read_table(tmp_path / "recs.parquet")
    assert recs.num_rows == visits.num_rows  # --all: every visit
    assert "explanations" in recs.column_names
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["options"]
    assert "P0000014-2" in out  # explain printed the visit it was asked about

    bench = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert bench and (tmp_path / "bench" / "results.md").exists()
