"""Issue 59, rule 3: the manifest's input and output names and shapes are each graph's own,
compared before any work (`make failures`): a manifest naming a tensor otherwise than its
graph, and a graph of another width whose manifest entry (sha256 and shapes) was edited to
fit it, exit 2 naming the graph, before any visit is scored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import make_tiny

from cognet.core.manifest import file_sha256
from cognet.runtime import writer
from cognet.runtime.cli import main


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """A model of width 32 (the tiny model's is 16), exported unvalidated."""
    from cognet.export import ExportOptions, export

    root = tmp_path_factory.mktemp("wide")
    _, ckpt = make_tiny(root, n_patients=30, dim=32, heads=2)
    export(ckpt, root / "model", ExportOptions(validate=False))
    return root / "model"


def copy_model(tiny: Path, tmp_path: Path) -> tuple[Path, dict]:
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    return model, json.loads((model / "manifest.json").read_text())


def refused(tiny: Path, visits, model: Path, manifest: dict, tmp_path: Path) -> str:
    (model / "manifest.json").write_text(json.dumps(manifest))
    pq.write_table(visits, tmp_path / "in.parquet")
    out = tmp_path / "o.parquet"
    argv = ["score", str(tmp_path / "in.parquet"), "--model", str(model), "--out", str(out)]
    result = CliRunner().invoke(main, [*argv, "--quiet", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert not out.exists() and not writer.work_dir(out).exists()  # before any work
    return lines[0]


@pytest.mark.parametrize("kind", ["inputs", "outputs"])
def test_a_manifest_naming_a_tensor_otherwise_is_refused(tiny, visits, tmp_path, kind):
    model, manifest = copy_model(tiny, tmp_path)
    tensor = manifest["graphs"]["decoder_init"][kind][1]
    was, tensor["name"] = tensor["name"], "renamed"
    line = refused(tiny, visits, model, manifest, tmp_path)
    assert f"{model / 'decoder_init.onnx'}: the manifest names {kind} of the decoder_init" in line
    assert f"(renamed; the graph has {was})" in line, line


def test_a_graph_of_another_width_with_its_entry_edited_is_refused(tiny, wide, visits, tmp_path):
    model, manifest = copy_model(tiny, tmp_path)
    shutil.copy(wide / "encoder.onnx", model / "encoder.onnx")
    other = json.loads((wide / "manifest.json").read_text())
    manifest["graphs"]["encoder"] = other["graphs"]["encoder"]  # names, shapes and sha256
    assert manifest["graphs"]["encoder"]["sha256"] == file_sha256(model / "encoder.onnx")
    line = refused(tiny, visits, model, manifest, tmp_path)
    assert f"{model / 'decoder_init.onnx'}: input diag_enc axis 2 is 16, 32 in " in line, line
    assert f"{model / 'encoder.onnx'}: graphs of two models" in line
