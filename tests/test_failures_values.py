"""Issue 30, values checked for what they are (`make failures`): ATC-3 codes by their form,
a code prefix that matches nothing refused with the counts, graph names as strings ending in
.onnx (no NUL byte), a DDI target or policy on data without DDI pairs refused naming the
file. Each case: exit 2, one line naming the file, no output left.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from cohort import make_cohort, write_mappings, write_meds
from tiny import make_tiny

from cognet.cli import main as cognet_main
from cognet.core.atc import atc3, is_atc
from cognet.runtime.cli import main as batch_main


def error(result) -> str:
    """The one line of a failed command (no traceback)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


# -- 6. ATC-3 codes by their form ---------------------------------------------------------------
def test_atc_codes_are_checked_by_their_form():
    for code in ("A10B", "A10BA", "A10BA02", "N02B"):
        assert is_atc(code) and atc3(code) == code[:4]
    for code in ("ZZZZZZZZ", "hello world", "hell", "a10b", "A1OB", "A10BA0", "", None, 5):
        assert not is_atc(code) and atc3(code) is None


@pytest.fixture(scope="module")
def meds(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("meds")
    return write_meds(make_cohort(), root / "meds"), write_mappings(root / "maps")


@pytest.mark.parametrize("bad", ["ZZZZZZZZ", "hello world", "A1"])
def test_a_medication_map_that_is_not_atc_is_refused_by_row(meds, tmp_path, bad):
    meds_dir, maps = meds
    mapping = tmp_path / "map.csv"
    lines = maps["medication_map"].read_text().splitlines()
    lines.append(f"MEDICATION//START//extra,{bad}")  # the second row of data
    mapping.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    argv = ["data", "meds", "--meds-dir", meds_dir, "--out", out, "--medication-map", mapping]
    line = error(CliRunner().invoke(cognet_main, list(map(str, argv))))
    assert f"{mapping}: column 'atc3', line 3: {bad!r} is not an ATC code" in line, line
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["map.csv"]


@pytest.mark.parametrize("option", ["--diagnosis", "--procedure"])
def test_a_code_prefix_that_matches_nothing_is_refused_with_the_counts(meds, tmp_path, option):
    meds_dir, maps = meds
    out = tmp_path / "out"
    argv = [
        "data",
        "meds",
        "--meds-dir",
        meds_dir,
        "--out",
        out,
        option,
        "DIAGNOSIS//ICD99//",
        "--medication-map",
        maps["medication_map"],
    ]
    line = error(CliRunner().invoke(cognet_main, list(map(str, argv))))
    assert f"{meds_dir}: no event code starts with {option} 'DIAGNOSIS//ICD99//'; events:" in line
    assert "admissions:" in line and "rows ->" in line  # the counts of every step
    assert os.listdir(tmp_path) == []


# -- 6 and 10. graph names: strings ending in .onnx, no NUL byte ---------------------------------
@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """root/data, root/ckpt, root/model, root/to_score.parquet, root/bare (a dataset
    without DDI pairs) and root/bare_model (a model of a checkpoint without them)."""
    from cognet.export import ExportOptions, export

    root = tmp_path_factory.mktemp("values")
    data, ckpt = make_tiny(root, n_patients=30)
    export(ckpt, root / "model", ExportOptions(validate=False))
    visits = pq.read_table(data / "visits.parquet").drop_columns(["split"])
    pq.write_table(visits, root / "to_score.parquet")
    bare = root / "bare"
    bare.mkdir()
    shutil.copy(data / "visits.parquet", bare / "visits.parquet")
    ddi = pq.read_table(data / "ddi.parquet")
    pq.write_table(ddi.slice(0, 0), bare / "ddi.parquet")
    config = json.loads((ckpt / "config.json").read_text())
    shutil.copytree(ckpt, root / "bare_ckpt")
    config["ddi_pairs"] = []
    (root / "bare_ckpt" / "config.json").write_text(json.dumps(config))
    export(root / "bare_ckpt", root / "bare_model", ExportOptions(validate=False))
    return root


@pytest.mark.parametrize("name", [5, "encoder.onnx\u0000x", "encoder.txt", ["encoder.onnx"]])
def test_a_graph_name_that_is_not_an_onnx_file_name_exits_2(made, tmp_path, name):
    model = Path(shutil.copytree(made / "model", tmp_path / "model"))
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["graphs"]["encoder"]["file"] = name
    (model / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "o.parquet"
    argv = ["score", str(made / "to_score.parquet"), "--model", str(model), "--out", str(out)]
    line = error(CliRunner().invoke(batch_main, argv))
    assert f"{model / 'manifest.json'}:" in line, line
    assert sorted(os.listdir(tmp_path)) == ["model"]


# -- 9. an empty DDI table is said ----------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["--ddi-target", "0.05"],
        ["--ddi-mode", "hard"],
        ["--ddi-max-rate", "0.1"],
        ["--ddi-tradeoff"],
    ],
)
def test_evaluate_with_a_ddi_policy_on_data_without_pairs_exits_2(made, tmp_path, args):
    report = tmp_path / "r.json"
    argv = [
        "evaluate",
        "--checkpoint",
        str(made / "ckpt"),
        "--data",
        str(made / "bare"),
        "--rounds",
        "1",
        "--json",
        str(report),
        *args,
    ]
    line = error(CliRunner().invoke(cognet_main, argv))
    assert f"{made / 'bare' / 'ddi.parquet'}: no DDI pair (drug_a, drug_b) to act on" in line
    assert os.listdir(tmp_path) == []


def test_train_with_a_ddi_target_on_data_without_pairs_exits_2(made, tmp_path):
    argv = [
        "train",
        "--data",
        str(made / "bare"),
        "--out",
        str(tmp_path / "c"),
        "--ddi-target",
        "0.05",
        "--epochs",
        "1",
        "--quiet",
    ]
    line = error(CliRunner().invoke(cognet_main, argv))
    assert f"{made / 'bare' / 'ddi.parquet'}: no DDI pair" in line and "--ddi-target" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args", [["--ddi-mode", "soft"], ["--ddi-max-rate", "0.2"]])
def test_score_and_explain_with_a_ddi_policy_on_a_model_without_pairs_exit_2(made, tmp_path, args):
    model, inp = made / "bare_model", made / "to_score.parquet"
    out = tmp_path / "o.parquet"
    argv = ["score", str(inp), "--model", str(model), "--out", str(out), *args]
    line = error(CliRunner().invoke(batch_main, argv))
    assert f"{model / 'manifest.json'}: no DDI pair (drug_a, drug_b) to act on" in line
    visit = pq.read_table(inp)["visit_id"][0].as_py()
    argv = ["explain", str(inp), "--model", str(model), "--visit-id", visit, *args]
    assert "no DDI pair" in error(CliRunner().invoke(batch_main, argv))
    assert os.listdir(tmp_path) == []
    # without a policy the model scores as ever
    result = CliRunner().invoke(batch_main, argv[:-2])
    assert result.exit_code == 0, result.output
