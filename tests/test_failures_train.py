"""Issue 14, `cognet train`, `cognet evaluate` and `cognet-export`: damaged checkpoints, empty
splits, a full disk and the thread default, one test per case, through the CLI (with
tests/test_failures_batch.py: the issue's runnable script, `make failures`).

Sections: a damaged checkpoint, empty splits and a full disk, the thread defaults.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cognet.cli import main
from cognet.export.cli import main as export_main

REPO = Path(__file__).resolve().parents[1]


def error(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def evaluate(ckpt: Path, data: Path, *args: str):
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data", str(data), "--rounds", "1"]
    return CliRunner().invoke(main, [*argv, "--quiet", *args])


def export(ckpt: Path, out: Path):
    return CliRunner().invoke(export_main, ["--checkpoint", str(ckpt), "--out", str(out)])


# -- a damaged checkpoint -----------------------------------------------------------------
def damaged(ckpt: Path, where: Path, how) -> Path:
    bad = where / f"bad-{how.__name__}"
    shutil.copytree(ckpt, bad)
    how(bad)
    return bad


def no_model_entry(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    del config["model"]
    (path / "config.json").write_text(json.dumps(config))


def truncated_weights(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def five_codes_cut(path: Path) -> None:
    vocab = json.loads((path / "vocab.json").read_text())
    vocab["diagnoses"] = vocab["diagnoses"][5:]
    (path / "vocab.json").write_text(json.dumps(vocab))


def unhashed(path: Path) -> None:  # a checkpoint saved before the hashes, then cut
    five_codes_cut(path)
    config = json.loads((path / "config.json").read_text())
    del config["sha256"]
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "how,message",
    [
        (no_model_entry, "config.json: field 'model': missing or not an object"),
        (truncated_weights, "model.safetensors: sha256 differs from the one config.json recorded"),
        (five_codes_cut, "vocab.json: sha256 differs from the one config.json recorded"),
        (unhashed, "vocab.json: 35 diagnoses, but the model was built for 40"),
    ],
)
def test_a_damaged_checkpoint_is_named_by_evaluate_and_export(tiny, tmp_path, how, message):
    data, ckpt = tiny / "data", tiny / "ckpt"
    bad = damaged(ckpt, tmp_path, how)
    assert message in error(evaluate(bad, data, "--json", str(tmp_path / "r.json")))
    assert message in error(export(bad, tmp_path / "model"))  # the same loader
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "model").exists()


def test_truncated_weights_without_a_hash_are_named_too(tiny, tmp_path):
    data, ckpt = tiny / "data", tiny / "ckpt"

    def cut_unhashed(path: Path) -> None:
        truncated_weights(path)
        config = json.loads((path / "config.json").read_text())
        del config["sha256"]
        (path / "config.json").write_text(json.dumps(config))

    bad = damaged(ckpt, tmp_path, cut_unhashed)
    assert "model.safetensors: unreadable weights" in error(evaluate(bad, data))


# -- empty splits, a full disk ------------------------------------------------------------
def without_split(data: Path, split: str, where: Path) -> Path:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out = where / f"no-{split}"
    out.mkdir()
    visits = pq.read_table(data / "visits.parquet")
    pq.write_table(visits.filter(pc.not_equal(visits["split"], split)), out / "visits.parquet")
    shutil.copy(data / "ddi.parquet", out / "ddi.parquet")
    return out


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_empty_split_exits_2_before_training(tiny, tmp_path, split):
    data = tiny / "data"
    out = tmp_path / "ckpt"
    argv = ["train", "--data", str(without_split(data, split, tmp_path)), "--out", str(out)]
    line = error(CliRunner().invoke(main, [*argv, "--epochs", "1", "--quiet"]))
    assert f"the {split} split has no visit with known medications" in line
    assert not out.exists()


def test_a_full_disk_names_the_file(tiny, tmp_path):
    """`cognet train` onto a 16 KB tmpfs (its own mount namespace: `unshare`, no root needed
    where user namespaces are allowed): the kernel's ENOSPC, named with the file, and no
    partial checkpoint left."""
    data = tiny / "data"
    disk = tmp_path / "disk"
    disk.mkdir()
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare -rm is not allowed here")
    train = (
        f"{sys.executable} -c 'from cognet.cli import main; main()' train --data {data} "
        f"--out {disk}/ckpt --epochs 1 --quiet"
    )
    mount = f"mount -t tmpfs -o size=16k tmpfs {disk}"
    script = f"{mount} && {{ {train}; rc=$?; ls -A {disk}; exit $rc; }}"
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],  # ls: what the failed run left on that disk
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"Error: {disk}/ckpt/") and "no space left on device" in lines[0]
    assert "requested and" not in lines[0]
    assert done.stdout.strip() == ""  # no partial checkpoint left behind


# -- thread defaults ---------------------------------------------------------------------
def test_train_and_evaluate_default_to_one_thread(tiny, tmp_path):
    data, ckpt = tiny / "data", tiny / "ckpt"
    for command in ("train", "evaluate"):
        text = CliRunner().invoke(main, [command, "--help"]).output
        assert "--threads" in text and "default: 1" in text
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert evaluate(ckpt, data).exit_code == 0
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        argv = ["train", "--data", str(data), "--out", str(tmp_path / "c"), "--epochs", "1"]
        assert CliRunner().invoke(main, [*argv, "--quiet"]).exit_code == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
