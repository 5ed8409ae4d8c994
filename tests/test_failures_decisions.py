"""Issue 59, item 9: what was decided where the written promises said nothing, one test
each (docs/guide/failures.md "Decided: what the rules above left open"): a JSON key given
twice is refused; vocabulary codes are opaque strings (no form check), printed escaped; DDI
pairs naming a medication outside the vocabulary are kept and ignored (training writes the
dataset's pairs, whose medications include those seen only outside the train split); every
error line shows control and bidi characters escaped; `--resume` with another
`--batch-size` is refused, the batch size setting the parts' rows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner
from tiny import KILLER

from cognet.cli import main as cognet_main
from cognet.runtime import writer
from cognet.runtime.cli import main as batch_main

REPO = Path(__file__).resolve().parents[1]
RLO = "\u202e"  # right-to-left override: reorders what a terminal shows after it


def error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def score(model: Path, inp: Path, out: Path, *extra: str):
    argv = ["score", str(inp), "--model", str(model), "--out", str(out), "--quiet", *extra]
    return CliRunner().invoke(batch_main, argv)


def test_a_json_key_given_twice_is_refused(tiny, visits, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    text = (model / "manifest.json").read_text()
    (model / "manifest.json").write_text(text.replace("{", '{"beam": 1, ', 1))
    pq.write_table(visits, tmp_path / "in.parquet")
    line = error(score(model, tmp_path / "in.parquet", tmp_path / "o.parquet"))
    assert f"{model / 'manifest.json'}" in line and "the key 'beam' is given twice" in line
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny / "ckpt", ckpt)
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text.replace("{", '{"format_version": 0, ', 1))
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data", str(tiny / "data"), "--quiet"]
    line = error(CliRunner().invoke(cognet_main, argv))
    assert f"{ckpt / 'config.json'}" in line and "the key 'format_version' is given twice" in line


def test_codes_are_opaque_strings(tiny, visits, tmp_path):
    """A diagnosis code holding U+202E is a code like any other: matched exactly."""
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    manifest = json.loads((model / "manifest.json").read_text())
    old = manifest["vocab"]["diagnoses"][0]
    manifest["vocab"]["diagnoses"][0] = new = f"{old}{RLO}"
    (model / "manifest.json").write_text(json.dumps(manifest))
    rows = visits.to_pylist()
    for row in rows:
        row["diagnoses"] = [new if c == old else c for c in row["diagnoses"] or []]
        row["medications"] = None
    pq.write_table(pa.Table.from_pylist(rows, schema=visits.schema), tmp_path / "in.parquet")
    out = tmp_path / "o.parquet"
    result = score(model, tmp_path / "in.parquet", out, "--summary-json", str(tmp_path / "s.json"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "s.json").read_text())["unknown_codes"] == 0


def test_an_error_line_shows_control_and_bidi_characters_escaped(tiny, visits, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["graphs"]["encoder"]["file"] = f"enc\x1b[31m{RLO}oder.onnx"
    (model / "manifest.json").write_text(json.dumps(manifest))
    pq.write_table(visits, tmp_path / "in.parquet")
    line = error(score(model, tmp_path / "in.parquet", tmp_path / "o.parquet"))
    assert "\\x1b[31m\\u202eoder.onnx" in line, line
    assert "\x1b" not in line and RLO not in line


def test_ddi_pairs_naming_a_medication_outside_the_vocabulary_are_ignored(tiny, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny / "ckpt", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    known = json.loads((ckpt / "vocab.json").read_text())["medications"][0]
    config["ddi_pairs"].append([known, "Z99Z"])  # a medication of val/test visits only
    (ckpt / "config.json").write_text(json.dumps(config))
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data", str(tiny / "data"), "--rounds", "1"]
    result = CliRunner().invoke(cognet_main, [*argv, "--quiet"])
    assert result.exit_code == 0, result.output


def test_resume_with_another_batch_size_is_refused(tiny, visits, tmp_path):
    inp, out = tmp_path / "in.parquet", tmp_path / "o.parquet"
    pq.write_table(visits, inp)
    argv = ["score", str(inp), "--model", str(tiny / "model"), "--quiet", "--out", str(out)]
    code = KILLER.replace("{func}", "write_json").replace("{after}", "1")
    killed = subprocess.run(
        [sys.executable, "-c", code.replace("{before}", "False"), *argv, "--batch-size", "2"],
        capture_output=True,
        cwd=REPO,
    )
    assert killed.returncode == -9
    line = error(CliRunner().invoke(batch_main, [*argv, "--batch-size", "3", "--resume"]))
    assert (
        "cannot resume: chunk_targets (the input rows per part: --batch-size x 16) differ" in line
    )
    result = CliRunner().invoke(batch_main, [*argv, "--batch-size", "2", "--resume"])
    assert result.exit_code == 0, result.output
    assert not writer.work_dir(out).exists()
