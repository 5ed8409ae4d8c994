"""Issue 48 items 6, 7 and 8 (ensembles), `make failures`: every JSON field of a checkpoint
(config.json, vocab.json) and of a manifest is checked by type and value when read
(`cognet.core.file_schemas`): a field of the wrong JSON type or out of its set exits 2 from
every command that reads it, with one line naming the file and the field, and nothing
written; the exporter never writes a manifest the runtime refuses; files of earlier
versions still load; `cognet ensemble` refuses one run given twice, whatever the path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import make_tiny, random_checkpoint

from cognet.cli import main as cognet_main
from cognet.core.errors import InputError
from cognet.core.manifest import load_manifest, write_manifest
from cognet.export.cli import main as export_main
from cognet.runtime.cli import main as batch_main

BAD = {"str": "x", "null": None, "[1]": [1], "[null]": [None], "number": 5, "object": {"a": 1}}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """root/data, root/ckpt and root/second (one network each), root/ens (both) and
    root/model (the ensemble's export, unvalidated: member_graphs and an fp16 variant).
    Read-only: tests copy what they change."""
    from cognet.export import ExportOptions, export
    from cognet.model import checkpoint
    from cognet.model.ensemble import Ensemble

    root = tmp_path_factory.mktemp("fields")
    data, first = make_tiny(root, n_patients=30)
    second = random_checkpoint(data, root / "second", seed=1)
    (a, vocab, config), (b, _, _) = checkpoint.load(first), checkpoint.load(second)
    graphs = np.load(first / "graphs.npz")
    pairs = [tuple(p) for p in config["ddi_pairs"]]
    ens = Ensemble([a, b])
    both = checkpoint.Graphs(graphs["ehr"], graphs["ddi"], pairs)
    checkpoint.save(root / "ens", ens, vocab, both, {"seed": 0})
    export(root / "ens", root / "model", ExportOptions(validate=False, fp16=True))
    return root


def error(result) -> str:
    """The one line of a command that exited 2 (no traceback)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def edit(file: Path, where: tuple, value) -> None:
    """Set the field at `where` (keys and list indices) of a JSON file to `value`."""
    obj = json.loads(file.read_text())
    parent = obj
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    file.write_text(json.dumps(obj))


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# -- item 6: manifest fields of the wrong JSON type -------------------------------------------
# (where in manifest.json, the field the error names, the values of BAD of the field's type:
# a value the field may hold, or one refused by a check that ties fields together)
MANIFEST_FIELDS = [
    (("graphs",), "graphs", ()),
    (("variants",), "variants", ()),
    (("member_graphs",), "member_graphs", ()),
    (("member_graphs", 0), "member_graphs.1", ()),
    (("member_graphs", 0, "graphs"), "member_graphs.1.graphs", ()),
    (("member_graphs", 0, "variants"), "member_graphs.1.variants", ()),
    (("member_graphs", 0, "graphs", "encoder"), "member_graphs.1.graphs.encoder", ()),
    (("variants", "fp16"), "variants.fp16", ()),
    (("graphs", "encoder", "file"), "graphs.encoder.file", ()),
    (("graphs", "encoder", "inputs"), "graphs.encoder.inputs", ()),
    (
        ("graphs", "decoder_step", "outputs", 0, "shape"),
        "graphs.decoder_step.outputs.0.shape",
        ("[1]",),
    ),
    (("search",), "search", ()),
    (("dims",), "dims", ()),
    (("special", "end"), "special.end", ()),
    (("vocab",), "vocab", ()),
    (("vocab", "medications"), "vocab.medications", ()),
    (("vocab", "med_frequency"), "vocab.med_frequency", ("[1]",)),
    (("ddi_pairs",), "ddi_pairs", ()),
    (("versions",), "versions", ()),
    (("ablation",), "ablation", ()),
    (("decoding",), "decoding", ("null",)),
    (("ddi_target",), "ddi_target", ("null",)),
    (("tensorrt",), "tensorrt", ("null",)),
    (("parity",), "parity", ("null", "object")),
    (("members",), "members", ("number",)),
    (("max_len",), "max_len", ("number",)),
    (("checkpoint_sha256",), "checkpoint_sha256", ()),
]


def _score(model: Path, made: Path, tmp: Path, command: str) -> list[str]:
    inp = made / "data" / "visits.parquet"
    if command == "explain":
        visit = pq.read_table(inp)["visit_id"][0].as_py()
        return ["explain", str(inp), "--model", str(model), "--visit-id", visit]
    return ["score", str(inp), "--model", str(model), "--out", str(tmp / "o.parquet"), "--quiet"]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(("where", "named", "valid"), MANIFEST_FIELDS, ids=lambda x: str(x))
def test_a_manifest_field_of_the_wrong_type_exits_2_naming_it(
    made, tmp_path, where, named, valid, value
):
    if value in valid:
        pytest.skip(f"{value} is of the type of {named}")
    model = Path(shutil.copytree(made / "model", tmp_path / "model"))
    edit(model / "manifest.json", where, BAD[value])
    before = listing(model)
    for command in ("score", "explain"):
        line = error(CliRunner().invoke(batch_main, _score(model, made, tmp_path, command)))
        assert line.startswith(f"Error: {model / 'manifest.json'}: field '{named}"), line
    assert listing(model) == before and sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.parametrize(
    ("where", "value", "named"),
    [
        (("decoding",), {"name": "set", "thresold": 0.3}, "decoding.thresold"),  # misspelt
        (("surprise",), 1, "surprise"),
        (("dims", "width"), 8, "dims.width"),
        (("graphs", "encoder", "inputs", 0, "dtype"), "float8", "graphs.encoder.inputs.0.dtype"),
        (("graphs", "encoder", "inputs", 0, "dtype"), "int", "graphs.encoder.inputs.0.dtype"),
        (("variants", "int4"), {}, "variants.int4"),
        (("graphs", "encoder", "sha256"), "f" * 63, "graphs.encoder.sha256"),
        (("vocab", "medications", 1), "M00X", "vocab.medications"),  # a code twice
        (("ablation",), "no-cop", "ablation"),
    ],
    ids=str,
)
def test_an_unknown_field_or_value_of_a_manifest_is_refused(made, tmp_path, where, value, named):
    model = Path(shutil.copytree(made / "model", tmp_path / "model"))
    edit(model / "manifest.json", where, value)
    line = error(CliRunner().invoke(batch_main, _score(model, made, tmp_path, "score")))
    assert line.startswith(f"Error: {model / 'manifest.json'}: field '{named}'"), line
    assert sorted(os.listdir(tmp_path)) == ["model"]


# -- item 7: a checkpoint's fields, read by value -----------------------------------------------
# (file, where, value, the field the error names)
CHECKPOINT_FIELDS = [
    ("config.json", ("decoding",), "x", "decoding"),
    ("config.json", ("decoding",), [1], "decoding"),
    ("config.json", ("decoding",), "beam", "decoding"),
    ("config.json", ("decoding",), {"name": "x"}, "decoding"),
    ("config.json", ("decoding",), {"name": ["beam"]}, "decoding"),
    ("config.json", ("decoding",), {"nam": "set"}, "decoding.nam"),
    ("config.json", ("ddi_target",), "x", "ddi_target"),
    ("config.json", ("ddi_target",), [1], "ddi_target"),
    ("config.json", ("model",), "x", "model"),
    ("config.json", ("model", "ablation"), "no", "model.ablation"),
    ("config.json", ("model", "ablation"), ["none"], "model.ablation"),
    ("config.json", ("model", "shared_gcn"), 1, "model.shared_gcn"),
    ("config.json", ("model", "dropout"), "0.2", "model.dropout"),
    ("config.json", ("model", "dec_ffn"), [1], "model.dec_ffn"),
    ("config.json", ("model", "width"), 8, "model.width"),
    ("config.json", ("train",), "x", "train"),
    ("config.json", ("train", "decoding"), "x", "train.decoding"),
    ("config.json", ("ddi_pairs",), "x", "ddi_pairs"),
    ("config.json", ("ddi_pairs",), [["M00X"]], "ddi_pairs.0"),
    ("config.json", ("sha256",), "x", "sha256"),
    ("config.json", ("sha256", "vocab.json"), 5, "sha256.vocab.json"),
    ("config.json", ("surprise",), True, "surprise"),
    ("vocab.json", ("medications",), "M00XM01X", "medications"),
    ("vocab.json", ("diagnoses", 0), 7, "diagnoses.0"),
    ("vocab.json", ("diagnoses", 1), None, "diagnoses.1"),
    ("vocab.json", ("med_frequency", 0), "3", "med_frequency.0"),
    ("vocab.json", ("med_frequency", 0), 2.5, "med_frequency.0"),
    ("vocab.json", ("procedures",), {"a": 1}, "procedures"),
    ("vocab.json", ("extra",), 1, "extra"),
]


def _resealed(ckpt: Path) -> None:
    """config.json's sha256 record made to fit the files again (a consistent lie)."""
    from cognet.model.checkpoint_checks import file_hashes

    config = json.loads((ckpt / "config.json").read_text())
    config["sha256"] = file_hashes({n: ckpt / n for n in config["sha256"]})
    (ckpt / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("file", "where", "value", "named"), CHECKPOINT_FIELDS, ids=str)
def test_a_checkpoint_field_of_the_wrong_type_or_value_exits_2(
    made, tmp_path, file, where, value, named
):
    ckpt = Path(shutil.copytree(made / "ckpt", tmp_path / "ckpt"))
    edit(ckpt / file, where, value)
    if file == "vocab.json":
        _resealed(ckpt)
    before = listing(ckpt)
    want = f"Error: {ckpt / file}: field '{named}"
    data = made / "data"
    argv = [
        "evaluate",
        "--checkpoint",
        str(ckpt),
        "--data",
        str(data),
        "--rounds",
        "1",
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert error(CliRunner().invoke(cognet_main, argv)).startswith(want)
    argv = ["--checkpoint", str(ckpt), "--out", str(tmp_path / "m")]
    assert error(CliRunner().invoke(export_main, argv)).startswith(want)
    argv = [
        "ensemble",
        str(ckpt),
        str(made / "second"),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "e"),
    ]
    assert error(CliRunner().invoke(cognet_main, argv)).startswith(want)
    assert listing(ckpt) == before and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_stored_decoding_is_never_read_as_a_substring():
    from cognet.core.decoding import Decoding

    for bad in ("x", "name", [1], ["name"], 5):
        with pytest.raises(TypeError, match="a decoding is an object"):
            Decoding.from_json(bad)
    assert Decoding.from_json(None) == Decoding() == Decoding.from_json({})


# -- the exporter writes no manifest the runtime would refuse --------------------------------
def test_the_exporter_checks_the_manifest_before_writing_it(made, tmp_path, monkeypatch):
    from cognet.export import pipeline

    monkeypatch.setattr(pipeline, "_versions", lambda: {"torch": 2.5})  # not a string
    out = tmp_path / "m"
    line = error(
        CliRunner().invoke(export_main, ["--checkpoint", str(made / "ckpt"), "--out", str(out)])
    )
    assert f"{out / 'manifest.json'}: field 'versions.torch'" in line, line
    assert not out.exists()


def test_write_manifest_refuses_what_load_manifest_would(made, tmp_path):
    manifest = load_manifest(made / "model", verify=False)
    bad = dataclasses.replace(manifest, ablation="no-cop")
    with pytest.raises(InputError, match=r"manifest.json: field 'ablation': 'no-cop' is not one"):
        write_manifest(tmp_path, bad)
    assert os.listdir(tmp_path) == []


# -- files written by earlier versions keep loading -------------------------------------------
def test_a_checkpoint_and_a_model_of_the_first_format_still_load(made, tmp_path):
    """config.json before the hashes, the members, the stored decoding and DDI target, and
    the model fields added since (decoder width, dropouts, shared GCN); a manifest before
    the decoding, search graphs, DDI target, encoder parts and members."""
    from cognet.model import checkpoint

    ckpt = Path(shutil.copytree(made / "ckpt", tmp_path / "ckpt"))
    config = json.loads((ckpt / "config.json").read_text())
    for key in ("sha256", "members", "decoding", "ddi_target"):
        config.pop(key, None)
    for key in ("dec_ffn", "emb_dropout", "attn_dropout", "shared_gcn"):
        config["model"].pop(key)
    (ckpt / "config.json").write_text(json.dumps(config))
    model, vocab, _ = checkpoint.load(ckpt)
    assert model.cfg.shared_gcn is False and vocab.n_med == model.cfg.n_med

    single = tmp_path / "single"
    assert (
        CliRunner()
        .invoke(export_main, ["--checkpoint", str(ckpt), "--out", str(single), "--no-validate"])
        .exit_code
        == 0
    )
    manifest = json.loads((single / "manifest.json").read_text())
    old = {
        k: manifest[k]
        for k in (
            "format_version",
            "opset",
            "dims",
            "special",
            "vocab",
            "max_len",
            "beam",
            "ablation",
            "ddi_pairs",
            "checkpoint_sha256",
            "versions",
            "parity",
            "tensorrt",
            "variants",
        )
    }
    old["graphs"] = {g: manifest["graphs"][g] for g in ("encoder", "decoder_init", "decoder_step")}
    (single / "manifest.json").write_text(json.dumps(old))
    loaded = load_manifest(single)
    assert loaded.decoding is None and loaded.search == {} and loaded.members == 1
    argv = _score(single, made, tmp_path, "score")
    assert CliRunner().invoke(batch_main, argv).exit_code == 0


def test_the_schemas_declare_every_field_of_the_dataclasses():
    from cognet.core.file_schemas import MODEL_FIELDS, TRAIN
    from cognet.model.network import ModelConfig
    from cognet.training.train import TrainConfig

    assert set(MODEL_FIELDS) == {f.name for f in dataclasses.fields(ModelConfig)}
    assert {f.name for f in dataclasses.fields(TrainConfig)} <= set(TRAIN.fields)
    from cognet.core.file_schemas import HEAD_CONFIG, HEAD_RECIPE
    from cognet.model.set_head import HeadConfig
    from cognet.training.set_head import HeadRecipe

    assert set(HEAD_RECIPE.fields) == {f.name for f in dataclasses.fields(HeadRecipe)}
    assert set(HEAD_CONFIG.fields) - {"format_version"} == {
        f.name for f in dataclasses.fields(HeadConfig)
    }


# -- item 8: an ensemble of one run given twice -----------------------------------------------
def test_an_ensemble_refuses_one_run_given_twice_whatever_the_path(made, tmp_path):
    data = made / "data"
    run = tmp_path / "a"
    argv = [
        "train",
        "--data",
        str(data),
        "--out",
        str(run),
        "--epochs",
        "1",
        "--dim",
        "16",
        "--threads",
        "1",
        "--members",
        "1",
        "--quiet",
    ]
    assert CliRunner().invoke(cognet_main, argv).exit_code == 0
    (tmp_path / "link").symlink_to(run)
    shutil.copytree(run, tmp_path / "copy")
    out = tmp_path / "o"
    for other in (run, tmp_path / "link", tmp_path / "copy"):
        argv = ["ensemble", str(run), str(other), "--data", str(data), "--out", str(out)]
        line = error(CliRunner().invoke(cognet_main, argv))
        assert f"{other}: the same weights as {run}" in line, line
        assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["a", "copy", "link"]
