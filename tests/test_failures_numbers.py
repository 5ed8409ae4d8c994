"""Issue 30, never trust a number (`make failures`): every float option and every float of
config.json and manifest.json is finite and in range or refused with exit 2 (NaN passes
every range check, so each is tested with nan, inf and -inf); a JSON boolean is no number;
every JSON file the project writes reads back with a strict parser; a training that
diverges stops with exit 2 and writes no checkpoint; a checkpoint of NaN weights is refused
on load; the export's parity check counts NaN as a mismatch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import make_tiny

from cognet.cli import main as cognet_main
from cognet.core import strict_json
from cognet.export.cli import main as export_main
from cognet.runtime.cli import main as batch_main


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """root/data, root/ckpt, root/model (unvalidated export), root/to_score.parquet.
    Read-only: tests copy what they change."""
    from cognet.export import ExportOptions, export

    root = tmp_path_factory.mktemp("numbers")
    data, ckpt = make_tiny(root, n_patients=30)
    export(ckpt, root / "model", ExportOptions(validate=False))
    visits = pq.read_table(data / "visits.parquet").drop_columns(["split"])
    column = visits["medications"]
    meds = [None] * 5 + column.to_pylist()[5:]
    i = visits.schema.get_field_index("medications")
    pq.write_table(
        visits.set_column(i, "medications", pa.array(meds, column.type)), root / "to_score.parquet"
    )
    return root


def error(result, code: int = 2) -> str:
    """The one line of a failed command (no traceback, no usage block; training's epoch
    lines before it aside)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if not line.startswith("epoch ")]
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def commands(made: Path, tmp: Path) -> dict[str, tuple]:
    data, ckpt, model, inp = made / "data", made / "ckpt", made / "model", made / "to_score.parquet"
    return {
        "score": (
            batch_main,
            [
                "score",
                str(inp),
                "--model",
                str(model),
                "--quiet",
                "--out",
                str(tmp / "o.parquet"),
                "--summary-json",
                str(tmp / "s.json"),
            ],
        ),
        "evaluate": (
            cognet_main,
            [
                "evaluate",
                "--checkpoint",
                str(ckpt),
                "--data",
                str(data),
                "--rounds",
                "1",
                "--json",
                str(tmp / "r.json"),
                "--predictions",
                str(tmp / "p.parquet"),
            ],
        ),
        "explain": (
            batch_main,
            [
                "explain",
                str(inp),
                "--model",
                str(model),
                "--visit-id",
                pq.read_table(inp)["visit_id"][0].as_py(),
            ],
        ),
        "train": (
            cognet_main,
            ["train", "--data", str(data), "--out", str(tmp / "ckpt"), "--epochs", "1", "--quiet"],
        ),
    }


FLOAT_OPTIONS = [
    ("score", "--threshold"),
    ("score", "--ddi-penalty"),
    ("score", "--ddi-max-rate"),
    ("evaluate", "--threshold"),
    ("evaluate", "--ddi-penalty"),
    ("evaluate", "--ddi-max-rate"),
    ("evaluate", "--ddi-target"),
    ("explain", "--ddi-penalty"),
    ("explain", "--ddi-max-rate"),
    ("train", "--lr"),
    ("train", "--ddi-target"),
    ("train", "--aux-loss"),
]


# -- 3. finite numbers everywhere -------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
@pytest.mark.parametrize(("command", "option"), FLOAT_OPTIONS)
def test_a_float_option_that_is_not_a_finite_number_exits_2(made, tmp_path, command, option, value):
    main, argv = commands(made, tmp_path)[command]
    if option == "--ddi-penalty":
        argv = [*argv, "--ddi-mode", "soft"]
    line = error(CliRunner().invoke(main, [*argv, f"{option}={value}"]))
    assert option in line and ("finite" in line or "range" in line), line
    assert os.listdir(tmp_path) == []  # no output, no lock file


def test_the_tradeoff_lists_refuse_nan_too(made, tmp_path):
    main, argv = commands(made, tmp_path)["evaluate"]
    argv = [*argv[:-2], "--ddi-tradeoff", "--penalties", "0,nan"]  # no --predictions
    line = error(CliRunner().invoke(main, argv))
    assert "--penalties" in line and "finite" in line
    assert os.listdir(tmp_path) == []


def with_target(folder: Path, file: str, value: str) -> Path:
    """A copy of a checkpoint or model whose ddi_target entry holds `value` (raw JSON text)
    as its policy's penalty, target and threshold in turn (`value` replaces `0.25`)."""
    path = folder / file
    obj = json.loads(path.read_text())
    obj["ddi_target"] = {
        "target": 0.1,
        "threshold": 0.3,
        "val_jaccard": 0.4,
        "val_ddi": 0.05,
        "policy": {"mode": "soft", "penalty": 0.25, "max_rate": None},
    }
    text = json.dumps(obj).replace('"penalty": 0.25', f'"penalty": {value}')
    path.write_text(text)
    return folder


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", "true", '"0.5"'])
def test_a_config_or_manifest_number_that_is_not_finite_is_refused(made, tmp_path, value):
    ckpt = with_target(
        Path(shutil.copytree(made / "ckpt", tmp_path / "ckpt")), "config.json", value
    )
    model = with_target(
        Path(shutil.copytree(made / "model", tmp_path / "model")), "manifest.json", value
    )
    data, inp, out = made / "data", made / "to_score.parquet", tmp_path / "o.parquet"
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data", str(data), "--rounds", "1"]
    line = error(CliRunner().invoke(cognet_main, argv))
    assert f"{ckpt / 'config.json'}:" in line, line
    line = error(CliRunner().invoke(export_main, ["--checkpoint", str(ckpt), "--out", str(out)]))
    assert f"{ckpt / 'config.json'}:" in line, line
    argv = ["score", str(inp), "--model", str(model), "--out", str(out), "--quiet"]
    line = error(CliRunner().invoke(batch_main, argv))
    assert f"{model / 'manifest.json'}:" in line, line
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "model"]


def test_every_json_file_written_is_strict_json(made, tmp_path):
    """Read back with a parser that refuses NaN and Infinity."""
    main, argv = commands(made, tmp_path)["score"]
    assert CliRunner().invoke(main, [*argv, "--all", "--explain"]).exit_code == 0
    main, argv = commands(made, tmp_path)["evaluate"]
    assert CliRunner().invoke(main, argv).exit_code == 0
    written = [tmp_path / "s.json", tmp_path / "r.json"]
    written += [made / "ckpt" / "config.json", made / "model" / "manifest.json"]
    for path in written:
        strict_json.loads(path.read_text())
    stats = CliRunner().invoke(cognet_main, ["data", "stats", str(made / "data"), "--json"])
    strict_json.loads(stats.output)
    # what the writers do with a value that is not finite (a metric of no visit): null
    assert strict_json.dumps({"a": math.nan, "b": [np.float32("inf"), 1.5]}) == (
        '{"a": null, "b": [null, 1.5]}'
    )
    with pytest.raises(ValueError, match="NaN is not a number JSON allows"):
        strict_json.loads('{"a": NaN}')


# -- 4. no model of NaNs ----------------------------------------------------------------------
def test_a_diverging_training_exits_2_and_writes_no_checkpoint(made, tmp_path, monkeypatch):
    import torch

    from cognet.training import train as training

    real = training.train_epoch

    def diverging(model, *args, **kwargs):  # the second epoch's update blows a weight up
        loss = real(model, *args, **kwargs)
        if diverging.calls:
            with torch.no_grad():
                next(model.parameters()).fill_(math.inf)
        diverging.calls += 1
        return loss

    diverging.calls = 0
    monkeypatch.setattr(training, "train_epoch", diverging)
    out = tmp_path / "ckpt"
    shutil.copytree(made / "ckpt", out)  # an earlier checkpoint: kept as it was
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = ["train", "--data", str(made / "data"), "--out", str(out), "--epochs", "3", "--quiet"]
    line = error(CliRunner().invoke(cognet_main, argv))
    assert line.startswith("Error: epoch 2: training diverged (weight ") and "--lr" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_huge_learning_rate_stops_with_exit_2(made, tmp_path):
    argv = [
        "train",
        "--data",
        str(made / "data"),
        "--out",
        str(tmp_path / "c"),
        "--lr",
        "1e30",
        "--epochs",
        "2",
        "--quiet",
    ]
    line = error(CliRunner().invoke(cognet_main, argv))
    assert "training diverged" in line and "Try a smaller --lr (this run: 1e+30)" in line
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_of_nan_weights_is_refused_by_evaluate_and_export(made, tmp_path):
    from safetensors.torch import load_file, save_file

    from cognet.model.checkpoint_checks import file_hashes

    ckpt = Path(shutil.copytree(made / "ckpt", tmp_path / "ckpt"))
    weights = load_file(ckpt / "model.safetensors")
    name = sorted(weights)[0]
    weights[name][...] = math.nan
    save_file(weights, ckpt / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    config["sha256"] = file_hashes({n: ckpt / n for n in config["sha256"]})  # a consistent lie
    (ckpt / "config.json").write_text(json.dumps(config))
    want = f"{ckpt / 'model.safetensors'}: {name} holds values that are not finite numbers"
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data", str(made / "data"), "--rounds", "1"]
    assert want in error(CliRunner().invoke(cognet_main, argv))
    argv = ["--checkpoint", str(ckpt), "--out", str(tmp_path / "m")]
    assert want in error(CliRunner().invoke(export_main, argv))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_the_parity_check_counts_nan_as_a_mismatch():
    from cognet.export.validate import max_abs_diff

    nan, inf = np.float32("nan"), np.float32("inf")
    assert max_abs_diff(np.array([nan, 1.0]), np.array([nan, 1.0])) == math.inf
    assert max_abs_diff(np.array([1.0]), np.array([inf])) == math.inf
    assert max_abs_diff(np.array([-inf, 1.0]), np.array([-inf, 1.5])) == 0.5  # masked alike
    assert max_abs_diff(np.zeros(0), np.zeros(0)) == 0.0
