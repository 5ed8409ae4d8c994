"""cognet/core/files.py: the one atomic-write helper, file references and output guards."""

from __future__ import annotations

import contextlib
import os

import pytest

from cognet.core.errors import InputError, OutputError
from cognet.core.files import (
    Reads,
    atomic_path,
    check_outputs,
    commit_dir,
    confined,
    guarded,
    is_temp,
    write_text,
)


def test_atomic_write_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        assert is_temp(tmp.name) and tmp.parent == tmp_path
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["a.json"]
    write_text(target, "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["a.json"]


def test_a_write_error_names_the_target(tmp_path):
    with pytest.raises(OutputError, match=f"{tmp_path / 'gone' / 'a.json'}: "):
        write_text(tmp_path / "gone" / "a.json", "x")


def test_commit_dir_swaps_a_folder_whole(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    new = tmp_path / "staged"
    new.mkdir()
    (new / "new.txt").write_text("new")
    commit_dir(new, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert os.listdir(tmp_path / "out") == ["new.txt"]


@pytest.mark.parametrize("name", ["../x.onnx", "/etc/passwd", "a/b.onnx", "..", "", 7])
def test_confined_refuses_what_is_not_a_plain_name(tmp_path, name):
    with pytest.raises(InputError, match="manifest.json: field"):
        confined(tmp_path, name, "manifest.json: field 'graphs.encoder.file'")


def test_confined_follows_symlinks(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "elsewhere.onnx").write_bytes(b"x")
    (tmp_path / "model" / "encoder.onnx").symlink_to(tmp_path / "elsewhere.onnx")
    with pytest.raises(InputError, match="leads outside"):
        confined(tmp_path / "model", "encoder.onnx", "m")
    (tmp_path / "model" / "inside.onnx").symlink_to("encoder.onnx")
    (tmp_path / "model" / "encoder.onnx").unlink()
    (tmp_path / "model" / "encoder.onnx").write_bytes(b"y")
    assert confined(tmp_path / "model", "inside.onnx", "m").read_bytes() == b"y"


def test_outputs_are_checked_against_what_the_run_reads(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "visits.parquet").write_bytes(b"v")
    reads = Reads(datasets=[data], folders=[tmp_path / "cdm"])
    with pytest.raises(InputError, match="--json would overwrite a file of the dataset"):
        check_outputs({"--json": data / "visits.parquet"}, reads)
    with pytest.raises(InputError, match="--out is inside the input folder"):
        check_outputs({"--out": tmp_path / "cdm" / "x"}, reads, ["--out"])
    with pytest.raises(InputError, match="--plot and --json name the same path"):
        check_outputs({"--json": tmp_path / "r", "--plot": tmp_path / "r"}, reads)
    with pytest.raises(InputError, match="does not exist"):
        check_outputs({"--json": tmp_path / "no" / "r.json"}, reads)
    check_outputs({"--json": data / "report.json"}, reads)  # beside a dataset: allowed
    # a folder output: each file the run writes there counts as an output too
    ddi = tmp_path / "out" / "ddi.parquet"
    ddi.parent.mkdir()
    ddi.write_bytes(b"d")
    folders = {"--out": ("visits.parquet", "ddi.parquet")}
    with pytest.raises(InputError, match=f"{ddi}: --out would overwrite the input file"):
        check_outputs({"--out": tmp_path / "out"}, Reads(files=[ddi]), folders)


def test_a_folder_output_is_built_aside_and_moved_in_whole(tmp_path):
    out, names = tmp_path / "out", {"--out": ("a.parquet", "b.parquet")}
    out.mkdir()
    (out / "a.parquet").write_text("old")
    with pytest.raises(RuntimeError), guarded("t", {"--out": out}, Reads(), names) as stage:
        assert stage["--out"] != out and stage["--out"].parent == tmp_path
        stage["--out"].mkdir()
        (stage["--out"] / "a.parquet").write_text("half")
        raise RuntimeError("disk full")
    assert os.listdir(out) == ["a.parquet"] and (out / "a.parquet").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing staged, no lock file left
    for end in (None, 0):  # success: the block ends, or exits with code 0
        with contextlib.suppress(SystemExit), guarded("t", {"--out": out}, Reads(), names) as stage:
            stage["--out"].mkdir()
            (stage["--out"] / "b.parquet").write_text("new")
            if end is not None:
                raise SystemExit(end)
        assert os.listdir(out) == ["b.parquet"] and sorted(os.listdir(tmp_path)) == ["out"]
    with pytest.raises(SystemExit), guarded("t", {"--out": tmp_path / "new"}, Reads(), names) as s:
        s["--out"].mkdir()
        raise SystemExit(2)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    # a folder holding anything else is never replaced: refused before the block runs
    (out / "kept.txt").write_text("kept")
    with pytest.raises(InputError, match=r"does not write \(kept.txt\)"):
        with guarded("t", {"--out": out}, Reads(), names):
            raise AssertionError("ran")
    assert sorted(os.listdir(out)) == ["b.parquet", "kept.txt"]
    # a folder output of unknown contents (the benchmark's) is locked, never cleaned
    with pytest.raises(RuntimeError), guarded("t", {"--out": out}, Reads(), ["--out"]):
        (out / "half.txt").write_text("half")
        raise RuntimeError("disk full")
    assert sorted(os.listdir(out)) == ["b.parquet", "half.txt", "kept.txt"]
