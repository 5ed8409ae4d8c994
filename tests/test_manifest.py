"""cognet.manifest: the model-directory format (torch-free) and its integrity checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cognet.core.errors import InputError
from cognet.core.manifest import (
    FORMAT_VERSION,
    GRAPHS,
    MANIFEST_FILE,
    Dims,
    GraphSpec,
    Manifest,
    Special,
    TensorSpec,
    file_sha256,
    load_manifest,
    write_manifest,
)
from cognet.core.vocab import Vocab


def _graph(model_dir: Path, name: str, suffix: str = "") -> GraphSpec:
    path = model_dir / f"{name}{suffix}.onnx"
    path.write_bytes(f"not really onnx: {name}{suffix}".encode())
    tensor = TensorSpec("x", "float32", ("N", 4))
    return GraphSpec(path.name, file_sha256(path), (tensor,), (tensor,))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    vocab = Vocab(("D1", "D2"), ("P1",), ("M1", "M2", "M3"), (3, 1, 2))
    manifest = Manifest(
        opset=18,
        dims=Dims(dim=8, heads=2, head_dim=4, n_diag=2, n_proc=1, n_med=3, out_size=4),
        special=Special(end=3, start=4, med_pad=5, diag_pad=2, proc_pad=1),
        vocab=vocab.to_json(),
        max_len=45,
        beam=4,
        ablation="none",
        ddi_pairs=(("M1", "M3"),),
        graphs={g: _graph(tmp_path, g) for g in GRAPHS},
        variants={"fp16": {g: _graph(tmp_path, g, ".fp16") for g in GRAPHS}},
        checkpoint_sha256="0" * 64,
        versions={"onnx": "x"},
        parity={"passed": True},
    )
    write_manifest(tmp_path, manifest)
    return tmp_path


def _edit(model_dir: Path, **changes) -> None:
    path = model_dir / MANIFEST_FILE
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


def test_round_trip(model_dir: Path):
    m = load_manifest(model_dir)
    assert m.format_version == FORMAT_VERSION and m.model_dir == model_dir
    assert m.vocabulary().medications == ("M1", "M2", "M3")
    assert m.graph_path("decoder_step") == model_dir / "decoder_step.onnx"
    assert m.graph_path("encoder", "fp16") == model_dir / "encoder.fp16.onnx"
    assert m.graph_spec("encoder").inputs[0].shape == ("N", 4)
    assert m.ddi_pairs == (("M1", "M3"),)
    assert Manifest.from_json(m.to_json(), model_dir) == m


def test_unknown_variant_is_an_input_error(model_dir: Path):
    with pytest.raises(InputError, match="no 'int8' variant"):
        load_manifest(model_dir).graph_spec("encoder", "int8")


def test_corrupted_graph_is_refused(model_dir: Path):
    path = model_dir / "decoder_step.onnx"
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(InputError, match=r"decoder_step\.onnx: sha256 does not match"):
        load_manifest(model_dir)
    load_manifest(model_dir, verify=False)  # the caller may skip the hashes


def test_corrupted_variant_graph_is_refused(model_dir: Path):
    (model_dir / "encoder.fp16.onnx").write_bytes(b"changed")
    with pytest.raises(InputError, match=r"encoder\.fp16\.onnx: sha256"):
        load_manifest(model_dir)


def test_missing_graph_is_refused(model_dir: Path):
    (model_dir / "encoder.onnx").unlink()
    with pytest.raises(InputError, match=r"encoder\.onnx: graph file missing"):
        load_manifest(model_dir)


def test_edited_sha_is_refused(model_dir: Path):
    obj = json.loads((model_dir / MANIFEST_FILE).read_text())
    obj["graphs"]["encoder"]["sha256"] = "f" * 64
    (model_dir / MANIFEST_FILE).write_text(json.dumps(obj))
    with pytest.raises(InputError, match="sha256 does not match"):
        load_manifest(model_dir)


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, "1", None])
def test_wrong_format_version_is_refused(model_dir: Path, version):
    _edit(model_dir, format_version=version)
    with pytest.raises(InputError, match="unsupported model format version") as err:
        load_manifest(model_dir)
    assert "\n" not in str(err.value)


def test_malformed_manifest_is_one_line(model_dir: Path):
    _edit(model_dir, dims={"dim": 8})
    with pytest.raises(InputError, match="malformed manifest") as err:
        load_manifest(model_dir)
    assert "\n" not in str(err.value)
    (model_dir / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(InputError, match="unreadable manifest"):
        load_manifest(model_dir)


def test_not_a_model_directory(tmp_path: Path):
    with pytest.raises(InputError, match="not a cognet model directory"):
        load_manifest(tmp_path)


def test_manifest_module_is_torch_free():
    code = (
        "import sys, cognet.core.manifest; "
        "sys.exit(1 if any(m.split('.')[0] in ('torch', 'onnx') for m in sys.modules) "
        "else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
