"""Files written by the version before the set head (commit 219bdc2: a two-network
checkpoint whose default is set decoding, its model directory, and what that version's
`cognet evaluate` and `cognet-batch score` wrote from them; tests/fixtures/version_before)
load and score as they did then: the same predictions, byte for byte as tables, through
this version's evaluate, runtime and exporter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from cognet.cli import main as cognet_main
from cognet.export.cli import main as export_main
from cognet.runtime.cli import main as batch_main

BEFORE = Path(__file__).parent / "fixtures" / "version_before"


@pytest.fixture(scope="module")
def before(tmp_path_factory) -> Path:
    """A copy of the fixture: no run writes next to the files it reads."""
    root = tmp_path_factory.mktemp("before")
    for name in ("ckpt", "model", "data", "outputs"):
        shutil.copytree(BEFORE / name, root / name)
    return root


def _score(model: Path, data: Path, out: Path) -> dict:
    summary = out.with_suffix(".json")
    args = ["score", str(data / "visits.parquet"), "--model", str(model), "--out", str(out)]
    args += ["--all", "--threads", "1", "--quiet", "--summary-json", str(summary)]
    res = CliRunner().invoke(batch_main, args)
    assert res.exit_code == 0, res.output
    return json.loads(summary.read_text())


def test_checkpoint_of_the_version_before_evaluates_as_it_did(before, tmp_path):
    preds, report = tmp_path / "preds.parquet", tmp_path / "eval.json"
    args = ["evaluate", "--checkpoint", str(before / "ckpt"), "--data", str(before / "data")]
    args += ["--split", "test", "--rounds", "1", "--quiet", "--predictions", str(preds)]
    res = CliRunner().invoke(cognet_main, [*args, "--json", str(report)])
    assert res.exit_code == 0, res.output
    assert pq.read_table(preds).equals(pq.read_table(before / "outputs" / "eval_preds.parquet"))
    then = json.loads((before / "outputs" / "eval.json").read_text())
    now = json.loads(report.read_text())
    for key in ("model", "decoding", "jaccard", "f1", "prauc", "ddi", "avg_drugs"):
        assert now[key] == then[key], key
    assert now["decoding"]["name"] == "set"  # no head: its own decoding, as before


def test_model_directory_of_the_version_before_scores_as_it_did(before, tmp_path):
    summary = _score(before / "model", before / "data", tmp_path / "recs.parquet")
    then = pq.read_table(before / "outputs" / "recs.parquet")
    assert pq.read_table(tmp_path / "recs.parquet").equals(then)
    old = json.loads((before / "outputs" / "summary.json").read_text())
    for key in ("rows_read", "rows_scored", "decoding", "ddi"):
        assert summary[key] == old[key], key
    # every metric it reported, the same (this version adds first and later visits apart)
    assert {k: summary["metrics"][k] for k in old["metrics"]} == old["metrics"]


@pytest.mark.slow
def test_checkpoint_of_the_version_before_exports_and_scores_as_it_did(before, tmp_path):
    model = tmp_path / "model"
    res = CliRunner().invoke(
        export_main, ["--checkpoint", str(before / "ckpt"), "--out", str(model)]
    )
    assert res.exit_code == 0, res.output
    assert not (model / "head.onnx").exists()
    _score(model, before / "data", tmp_path / "recs.parquet")
    then = pq.read_table(before / "outputs" / "recs.parquet")
    assert pq.read_table(tmp_path / "recs.parquet").equals(then)
