"""The set head exported: its graph in the model directory and the manifest, its parity with
the torch head at several shapes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import pyarrow.parquet as pq
import pytest
import torch
from tiny import make_tiny, random_checkpoint

from cognet.core.errors import InputError
from cognet.core.head_inputs import HEAD_INPUTS, HEAD_OUTPUT, patient_head_arrays
from cognet.core.history import patients_from_table
from cognet.core.manifest import Manifest, file_sha256, load_manifest
from cognet.export import export
from cognet.export.graphs import HeadSizes, head_example
from cognet.export.validate import HEAD_ATOL, HEAD_CASES
from cognet.model import checkpoint

ALLOWLIST = Path(__file__).parents[1] / "export" / "onnx_ops_allowlist.txt"


class Headed(NamedTuple):
    data: Path
    ckpt: Path  # with a set head
    plain: Path  # the same networks, without a head
    model: Path  # `ckpt` exported (validated)
    plain_model: Path  # `plain` exported
    manifest: Manifest


@pytest.fixture(scope="module")
def headed(tmp_path_factory) -> Headed:
    """A tiny random model with a random set head, and the same model without it, exported."""
    root = tmp_path_factory.mktemp("headed")
    data, plain = make_tiny(root, n_patients=120)
    ckpt = random_checkpoint(data, root / "ckpt_head", head=True)
    manifest = export(ckpt, root / "model")
    export(plain, root / "plain_model", validate=False)
    return Headed(data, ckpt, plain, root / "model", root / "plain_model", manifest)


@pytest.fixture(scope="module")
def head(headed):
    _, _, config = checkpoint.load(headed.ckpt)
    return checkpoint.load_head(headed.ckpt, config)


@pytest.fixture(scope="module")
def session(headed) -> ort.InferenceSession:
    return ort.InferenceSession(str(headed.model / "head.onnx"), providers=["CPUExecutionProvider"])


# -- export -------------------------------------------------------------------------------------
def test_export_lists_the_head_graph_in_the_manifest(headed, head):
    spec = load_manifest(headed.model).head
    assert spec == headed.manifest.head
    assert spec.file == "head.onnx"
    assert spec.sha256 == file_sha256(headed.model / "head.onnx")
    assert spec.input_names == HEAD_INPUTS and spec.output_names == (HEAD_OUTPUT,)
    shapes = {t.name: t.shape for t in (*spec.inputs, *spec.outputs)}
    assert shapes == {
        "diagnoses": ("N", "Ld"),
        "procedures": ("N", "Lp"),
        "last_meds": ("N", "Ll"),
        "past_meds": ("N", "Lh"),
        "has_history": ("N",),
        "marginals": ("N", head.cfg.n_med),
    }
    proto = onnx.load(str(headed.model / "head.onnx"))
    assert proto.opset_import[0].version == headed.manifest.opset == 18
    parity = headed.manifest.parity["head"]
    assert parity["passed"] and set(parity["cases"]) == set(HEAD_CASES)
    assert parity["max_abs_diff"] <= HEAD_ATOL


def test_head_operators_are_in_the_allowlist(headed):
    allowed = {
        line.strip() for line in ALLOWLIST.read_text().splitlines() if line and line[0] != "#"
    }
    ops = {n.op_type for n in onnx.load(str(headed.model / "head.onnx")).graph.node}
    assert ops <= allowed, ops - allowed
    assert ops <= set(headed.manifest.parity["ops"])


CASES = {
    "one_visit": (HeadSizes(N=1, Ld=6, Lp=3, Ll=5, Lh=9), 0.0),
    "one_first_visit": (HeadSizes(N=1, Ld=1, Lp=1, Ll=1, Lh=1), 1.0),
    "seven": (HeadSizes(N=7, Ld=9, Lp=4, Ll=6, Lh=15), 0.4),
    "sixty_four_long_lists": (HeadSizes(N=64, Ld=80, Lp=40, Ll=60, Lh=400), 0.25),
    "sixty_four_empty": (HeadSizes(N=64, Ld=1, Lp=1, Ll=1, Lh=1), 1.0),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_head_graph_matches_torch(head, session, case):
    """Long and empty code lists, visits with and without history: within HEAD_ATOL."""
    sizes, empty = CASES[case]
    inputs = head_example(head.cfg, sizes, seed=3, empty=empty)
    if empty == 1.0:
        assert (inputs["has_history"] == 0).all()
    else:
        assert inputs["has_history"].min() == 0 or sizes.N < 7 or empty == 0
    with torch.no_grad():
        want = head(*(inputs[k] for k in HEAD_INPUTS)).numpy()
    (got,) = session.run([HEAD_OUTPUT], {k: inputs[k].numpy() for k in HEAD_INPUTS})
    assert got.shape == (sizes.N, head.cfg.n_med)
    assert np.abs(got - want).max() <= HEAD_ATOL


def test_head_graph_matches_torch_on_real_visits(headed, head, session):
    """The arrays of real visits (`patient_head_arrays`), histories included."""
    _, vocab, _ = checkpoint.load(headed.ckpt)
    patients = list(patients_from_table(pq.read_table(headed.data / "visits.parquet"), vocab))
    arrays = patient_head_arrays(patients, (vocab.n_diag, vocab.n_proc, vocab.n_med), vocab.n_med)
    assert 0 < arrays["has_history"].sum() < arrays["has_history"].size
    (got,) = session.run([HEAD_OUTPUT], arrays)
    assert np.abs(got - head.marginals(arrays)).max() <= HEAD_ATOL


def test_checkpoint_without_head_exports_as_before(headed):
    """No head.onnx, no `head` field; the rest of the manifest and every graph file are those
    of the same networks exported with a head."""
    plain = json.loads((headed.plain_model / "manifest.json").read_text())
    with_head = json.loads((headed.model / "manifest.json").read_text())
    assert not (headed.plain_model / "head.onnx").exists() and "head" not in plain
    assert load_manifest(headed.plain_model).head is None
    differ = {"head", "checkpoint_sha256", "parity"}  # parity: not run for `plain`
    assert {k: v for k, v in plain.items() if k not in differ} == {
        k: v for k, v in with_head.items() if k not in differ
    }
    assert set(with_head) - set(plain) == {"head"}


def test_reexport_without_head_removes_the_head_graph(headed, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(headed.model, out)
    export(headed.plain, out, validate=False)
    assert not (out / "head.onnx").exists()
    assert load_manifest(out).head is None


def test_corrupted_head_graph_is_refused(headed, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(headed.model, out)
    with open(out / "head.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(InputError, match="head.onnx: sha256 does not match"):
        load_manifest(out)


def test_head_of_another_vocabulary_is_refused(headed, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(headed.model, out)
    obj = json.loads((out / "manifest.json").read_text())
    obj["head"]["outputs"][0]["shape"] = ["N", 3]
    (out / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(InputError, match="field 'head.outputs'"):
        load_manifest(out)
