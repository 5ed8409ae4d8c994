"""Issue 23, never destroy what the user has, through the commands (with
tests/test_failures_batch.py and tests/test_failures_train.py: `make failures`).

One section per class of the issue: an output on an input, file references that leave their
directory, a graph of another model, untrusted config.json and manifest.json values, careful
writers, one writer per output, explanations' copy share, one rule per consistency point.
An error case asserts the exit code, one line naming the file or field, and that the file
that must stay intact is byte-identical afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import make_tiny

from cognet.cli import main as cognet_main
from cognet.core.dataset import PREDICTIONS_SCHEMA
from cognet.core.lock import claim
from cognet.core.manifest import file_sha256
from cognet.export.cli import main as export_main
from cognet.runtime.cli import main as batch_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """root/data, root/ckpt, root/model (unvalidated export), root/to_score.parquet (each
    patient's last visit without medications) and root/other/model, a model of another
    width (dim 32) for the swapped-graph case. Read-only: tests copy what they change."""
    from cognet.export import ExportOptions, export

    root = tmp_path_factory.mktemp("outputs")
    data, ckpt = make_tiny(root, n_patients=30)
    export(ckpt, root / "model", ExportOptions(validate=False))
    _, other = make_tiny(root / "other", n_patients=30, dim=32, heads=2)
    export(other, root / "other" / "model", ExportOptions(validate=False))
    visits = pq.read_table(data / "visits.parquet").drop_columns(["split"])
    pids = visits["patient_id"].to_pylist()
    last = [i + 1 == len(pids) or pids[i + 1] != p for i, p in enumerate(pids)]
    column = visits["medications"]
    meds = [None if end else m for m, end in zip(column.to_pylist(), last, strict=True)]
    i = visits.schema.get_field_index("medications")
    visits = visits.set_column(i, "medications", pa.array(meds, column.type))
    pq.write_table(visits, root / "to_score.parquet")
    return root


def error(result, code: int = 2) -> str:
    """The one line of a failed command (no traceback)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def snapshot(*folders: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for f in folders for p in sorted(f.rglob("*")) if p.is_file()}


def evaluate(ckpt: Path, data: Path, *args: str):
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data", str(data), "--rounds", "1"]
    return CliRunner().invoke(cognet_main, [*argv, "--quiet", *args])


def score(model: Path, inp: Path, out: Path, *args: str):
    argv = ["score", str(inp), "--model", str(model), "--out", str(out), "--quiet"]
    return CliRunner().invoke(batch_main, [*argv, *args])


# -- 1. an output on an input ----------------------------------------------------------------
ONTO_INPUTS = {
    "evaluate --json onto the dataset": ("evaluate", "--json", "data/visits.parquet"),
    "evaluate --predictions onto the checkpoint": ("evaluate", "--predictions", "ckpt/config.json"),
    "score --out onto the model": ("score", "--out", "model/manifest.json"),
    "score --summary-json onto the model": ("score", "--summary-json", "model/manifest.json"),
    "train --out onto the dataset": ("train", "--out", "data"),
    "export --out onto the checkpoint": ("export", "--out", "ckpt"),
}


@pytest.mark.parametrize("case", ONTO_INPUTS)
def test_an_output_on_an_input_is_refused_before_any_work(made, tmp_path, case):
    command, option, target = ONTO_INPUTS[case]
    root = tmp_path / "copy"  # the run's inputs, in a copy of the fixture
    for name in ("data", "ckpt", "model"):
        shutil.copytree(made / name, root / name)
    before = snapshot(root)
    onto = str(root / target)
    if command == "evaluate":
        result = evaluate(root / "ckpt", root / "data", option, onto)
    elif command == "score":
        out = onto if option == "--out" else str(tmp_path / "o.parquet")
        extra = [option, onto] if option != "--out" else []
        result = score(root / "model", made / "to_score.parquet", Path(out), *extra)
    elif command == "train":
        argv = ["train", "--data", str(root / "data"), "--out", onto, "--epochs", "1", "--quiet"]
        result = CliRunner().invoke(cognet_main, argv)
    else:
        result = CliRunner().invoke(
            export_main, ["--checkpoint", str(root / "ckpt"), "--out", onto]
        )
    line = error(result)
    assert option in line and str(root / target) in line, line
    assert snapshot(root) == before  # every input byte-identical, nothing added
    assert not (tmp_path / "o.parquet").exists()


def test_an_output_through_a_symlink_onto_an_input_is_refused(made, tmp_path):
    link = tmp_path / "report.json"
    link.symlink_to(made / "data" / "visits.parquet")
    before = (made / "data" / "visits.parquet").read_bytes()
    line = error(evaluate(made / "ckpt", made / "data", "--json", str(link)))
    assert "--json would overwrite a file of the dataset" in line and "visits.parquet" in line
    assert (made / "data" / "visits.parquet").read_bytes() == before


def test_a_new_file_beside_a_dataset_stays_allowed(made, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(made / "data", data)
    result = evaluate(made / "ckpt", data, "--json", str(data / "report.json"))
    assert result.exit_code == 0, result.output
    assert json.loads((data / "report.json").read_text())["n_visits"] > 0


def test_a_converter_output_inside_the_folder_it_lists_is_refused(tmp_path):
    cdm = tmp_path / "cdm"
    cdm.mkdir()
    (cdm / "person.csv").write_text("person_id\n1\n")
    argv = ["data", "omop", "--cdm", str(cdm), "--out", str(cdm / "out")]
    line = error(CliRunner().invoke(cognet_main, argv))
    assert f"--out is inside the input folder {cdm}" in line
    assert sorted(p.name for p in cdm.iterdir()) == ["person.csv"]


# -- 2. file references that leave their directory --------------------------------------------
@pytest.mark.parametrize("name", ["../other/model/encoder.onnx", "/etc/passwd", "sub/encoder.onnx"])
def test_a_manifest_path_outside_the_model_is_refused_before_opening(made, tmp_path, name):
    model = tmp_path / "model"
    shutil.copytree(made / "model", model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["graphs"]["encoder"]["file"] = name
    (model / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(model)
    line = error(score(model, made / "to_score.parquet", tmp_path / "o.parquet"))
    assert "manifest.json: field 'graphs.encoder.file'" in line and repr(name) in line, line
    assert "sha256" not in line  # refused before it was opened and hashed
    assert snapshot(model) == before and not (tmp_path / "o.parquet").exists()


def test_a_checkpoint_file_linked_outside_is_refused(made, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(made / "ckpt", ckpt)
    outside = tmp_path / "elsewhere.json"
    shutil.move(ckpt / "vocab.json", outside)
    (ckpt / "vocab.json").symlink_to(outside)
    line = error(evaluate(ckpt, made / "data"))
    assert "vocab.json" in line and "leads outside" in line, line


# -- 3. a graph of another model ------------------------------------------------------------
def test_a_graph_of_another_model_is_refused_naming_the_axis(made, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(made / "model", model)
    shutil.copy(made / "other" / "model" / "decoder_step.onnx", model / "decoder_step.onnx")
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["graphs"]["decoder_step"]["sha256"] = file_sha256(model / "decoder_step.onnx")
    (model / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(model)
    line = error(score(model, made / "to_score.parquet", tmp_path / "o.parquet"))
    assert "decoder_step.onnx" in line and " axis " in line and "(dims." in line, line
    assert snapshot(model) == before and not (tmp_path / "o.parquet").exists()


# -- 4. config.json and manifest.json values -------------------------------------------------
def _edit(path: Path, change) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


CONFIGS = {
    "heads 0": (lambda c: c["model"].update(heads=0), "field 'model.heads'"),
    "dim 1e7": (lambda c: c["model"].update(dim=1e7), "field 'model.dim'"),
    "dim 10,000,000": (lambda c: c["model"].update(dim=10_000_000), "field 'model.dim'"),
    "samples 1e9": (
        lambda c: c.update(decoding={"name": "set", "samples": 1e9, "threshold": 0.3}),
        "field 'decoding': samples must be an integer",
    ),
    "threshold 7.5": (
        lambda c: c.update(decoding={"name": "set", "threshold": 7.5}),
        "field 'decoding'",
    ),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_an_untrusted_config_value_is_named_by_evaluate_and_export(made, tmp_path, case):
    change, message = CONFIGS[case]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(made / "ckpt", ckpt)
    _edit(ckpt / "config.json", change)
    before = snapshot(ckpt)
    line = error(evaluate(ckpt, made / "data"))
    assert f"{ckpt / 'config.json'}: {message}" in line, line
    # the exporter never writes a model that the runtime would refuse
    out = tmp_path / "model"
    line = error(CliRunner().invoke(export_main, ["--checkpoint", str(ckpt), "--out", str(out)]))
    assert message in line and not out.exists()
    assert snapshot(ckpt) == before


MANIFESTS = {
    "heads 0": (lambda m: m["dims"].update(heads=0), "field 'dims.heads'"),
    "dim 1e7": (lambda m: m["dims"].update(dim=1e7), "field 'dims.dim'"),
    "samples 1e9": (
        lambda m: m.update(decoding={"name": "set", "samples": 10**9, "threshold": 0.3}),
        "malformed decoding (samples must be an integer in [1, 1024]",
    ),
    "threshold 7.5": (
        lambda m: m.update(decoding={"name": "set", "threshold": 7.5}),
        "malformed decoding",
    ),
    "special id": (lambda m: m["special"].update(end=3), "field 'special.end'"),
}


@pytest.mark.parametrize("case", MANIFESTS)
def test_an_untrusted_manifest_value_is_named_by_the_runtime(made, tmp_path, case):
    change, message = MANIFESTS[case]
    model = tmp_path / "model"
    shutil.copytree(made / "model", model)
    _edit(model / "manifest.json", change)
    before = snapshot(model)
    line = error(score(model, made / "to_score.parquet", tmp_path / "o.parquet"))
    assert f"{model / 'manifest.json'}: {message}" in line, line
    assert snapshot(model) == before and not (tmp_path / "o.parquet").exists()


# -- 5. careful writers ------------------------------------------------------------------------
def _unshare(script: str) -> subprocess.CompletedProcess:
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare -rm is not allowed here")
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=REPO
    )


def _cli(module: str) -> str:
    return f"{sys.executable} -c 'from {module} import main; main()'"


def _errors(done: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if line.startswith("Error")]


def test_a_read_only_folder_is_refused_before_the_work(made, tmp_path):
    """export, evaluate --json and data synth onto a read-only file system (a private
    mount): exit 2 naming the path before any work (evaluate prints no table)."""
    disk = tmp_path / "ro"
    disk.mkdir()
    runs = {
        "export": f"{_cli('cognet.export.cli')} --checkpoint {made}/ckpt --out {disk}/model",
        "evaluate": f"{_cli('cognet.cli')} evaluate --checkpoint {made}/ckpt --data "
        f"{made}/data --rounds 1 --quiet --json {disk}/r.json",
        "synth": f"{_cli('cognet.cli')} data synth --out {disk}/data --patients 20",
    }
    for name, command in runs.items():
        script = f"mount -t tmpfs -o ro tmpfs {disk} && {command}"
        done = _unshare(script)
        assert done.returncode == 2, (name, done.stderr)
        lines = _errors(done)
        assert len(lines) == 1 and str(disk) in lines[0] and "not writable" in lines[0], lines
        assert done.stdout == "", (name, done.stdout)  # nothing ran


@pytest.mark.parametrize("command", ["export", "synth"])
def test_a_full_disk_names_the_file_and_leaves_nothing(made, tmp_path, command):
    disk = tmp_path / "disk"
    disk.mkdir()
    run = {
        "export": f"{_cli('cognet.export.cli')} --checkpoint {made}/ckpt --out {disk}/model "
        "--no-validate",
        "synth": f"{_cli('cognet.cli')} data synth --out {disk}/data --patients 400",
    }[command]
    mount = f"mount -t tmpfs -o size=24k tmpfs {disk}"
    done = _unshare(f"{mount} && {{ {run}; rc=$?; ls -A {disk}; exit $rc; }}")
    assert done.returncode == 1, done.stderr
    lines = _errors(done)
    assert len(lines) == 1 and f"Error: {disk}/" in lines[0], lines
    assert "no space left on device" in lines[0]
    assert done.stdout.strip() == ""  # no partial file, no temporary file, no half dataset


# -- 6. one writer per output ----------------------------------------------------------------
def test_a_second_export_on_the_same_out_is_refused(made, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(made / "model", out)
    before = snapshot(out)
    with claim(out, "cognet-export"):  # a first export, still running
        argv = ["--checkpoint", str(made / "ckpt"), "--out", str(out)]
        line = error(CliRunner().invoke(export_main, argv))
    assert f"{out}: is being written by cognet-export (pid {os.getpid()})" in line
    assert str(out) in line and snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the lock went with it


def test_a_second_train_on_the_same_out_is_refused(made, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(made / "ckpt", out)  # what the first run has written so far
    before = snapshot(out)
    with claim(out, "cognet train"):
        argv = ["train", "--data", str(made / "data"), "--out", str(out), "--epochs", "1"]
        line = error(CliRunner().invoke(cognet_main, [*argv, "--quiet"]))
    assert f"{out}: is being written by cognet train (pid {os.getpid()})" in line
    assert snapshot(out) == before


# -- 8. explanations ---------------------------------------------------------------------------
@pytest.mark.parametrize("decoding", [{"decoding": "beam"}, {"decoding": "set", "threshold": 0.2}])
def test_a_medication_in_no_past_visit_is_copied_0_percent(made, decoding):
    """The copy share is (1 - w_g) Pr_c[k] / Pr[k]: 0 for a medication that no past visit
    holds (the gate weight 1 - w_g was shown before), in (0, 1] for one copied."""
    from cognet.runtime import ScoreOptions, Scorer

    table = pq.read_table(made / "to_score.parquet")
    past: dict[str, set] = {}
    for r in table.to_pylist():
        if r["medications"] is not None:
            past.setdefault(r["patient_id"], set()).update(r["medications"])
    chunks = Scorer(made / "model", ScoreOptions.of(device="cpu", **decoding)).score_table(
        table, explain=True
    )
    recs = [r for c in chunks for r in c.recommendations.to_pylist()]
    unsourced = copied = 0
    for r in recs:
        history = past.get(r["patient_id"], set())
        for med, ex in zip(r["medications"], r["explanations"], strict=True):
            if med not in history:
                assert ex["copy_share"] == 0.0 and ex["source_visit"] is None, (r, med)
                unsourced += bool(history)
            else:
                assert 0.0 <= ex["copy_share"] <= 1.0
                copied += ex["copy_share"] > 0
    assert unsourced and copied  # both kinds were seen, among visits with a history


# -- 9. consistency ----------------------------------------------------------------------------
def test_a_null_diagnoses_list_is_no_codes_for_every_command(made, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(made / "data", data)
    visits = pq.read_table(data / "visits.parquet")
    diagnoses = visits["diagnoses"].to_pylist()
    diagnoses[1] = None
    column = pa.array(diagnoses, visits["diagnoses"].type)
    i = visits.schema.get_field_index("diagnoses")
    pq.write_table(visits.set_column(i, "diagnoses", column), data / "visits.parquet")
    assert CliRunner().invoke(cognet_main, ["data", "stats", str(data)]).exit_code == 0
    result = evaluate(made / "ckpt", data)
    assert result.exit_code == 0, result.output
    scored = score(made / "model", data / "visits.parquet", tmp_path / "o.parquet", "--all")
    assert scored.exit_code == 0, scored.output
    rejects = pq.read_table(tmp_path / "o.rejects.parquet")
    assert rejects.num_rows == 0


def test_evaluate_predictions_have_the_scoring_schema(made, tmp_path):
    out = tmp_path / "p.parquet"
    assert evaluate(made / "ckpt", made / "data", "--predictions", str(out)).exit_code == 0
    table = pq.read_table(out)
    assert table.schema.equals(PREDICTIONS_SCHEMA)
    meds, probs = table["medications"].to_pylist(), table["probabilities"].to_pylist()
    assert len(meds) > 0 and any(meds)
    for m, p in zip(meds, probs, strict=True):
        assert len(m) == len(p) and all(0 < x <= 1 for x in p)


def test_ddi_max_rate_help_speaks_of_sets():
    for main, argv in ((cognet_main, ["evaluate", "--help"]), (batch_main, ["score", "--help"])):
        text = " ".join(CliRunner().invoke(main, argv).output.split())
        assert "set decoding drops a medication" in text
