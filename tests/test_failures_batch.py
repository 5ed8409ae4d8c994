"""`cognet-batch score`: bad inputs and faults, one test per case, through the CLI.

Never corrupt, never surprise (user guide "Failure behaviour"). With tests/test_failures_memory.py
(one wide visit), tests/test_failures_train.py (the `cognet train` / `evaluate` /
`cognet-export` cases) and tests/test_failures_outputs.py, this is `make failures`.

Sections, one per behaviour of that page's table: one writer per OUT, an OUT that is an
input, checks before work, resume refuses a damaged work folder, swapped
graphs, small things, --keep-columns, the resume signature. An error case asserts the exit
code, one line without a traceback, the message, and that no output is left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import KILLER, last_visits_unknown

from cognet.core.lock import claim, lock_file
from cognet.core.manifest import file_sha256
from cognet.runtime import signature, writer
from cognet.runtime.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def inp(visits, tmp_path) -> Path:
    path = tmp_path / "in.parquet"
    pq.write_table(visits, path)
    return path


def score(tiny: Path, inp: Path | str, out: Path | str, *args: str, model: Path | None = None):
    model = model or tiny / "model"
    argv = ["score", str(inp), "--model", str(model), "--out", str(out), "--quiet", *args]
    return CliRunner().invoke(main, argv)


def error(result, code: int = 2) -> str:
    """The one line of a failed run (no traceback)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def nothing_written(out: Path) -> bool:
    return not any(p.exists() for p in (out, writer.rejects_path(out), writer.work_dir(out)))


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`cognet-batch` in its own process."""
    argv = [sys.executable, "-m", "cognet.runtime.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, **kwargs)


# -- one writer per OUT -------------------------------------------------------------------
PAUSED = """
import pathlib, sys, time
from cognet.runtime import writer
ready, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
write = writer.PartWriter.write
def paused(self, chunk):  # after the first part: say so, then wait for `go`
    write(self, chunk)
    if not ready.exists():
        ready.touch()
        while not go.exists():
            time.sleep(0.05)
writer.PartWriter.write = paused
from cognet.runtime.cli import main
main(sys.argv[3:])
"""


def test_a_second_run_on_the_same_out_is_refused(tiny, inp, tmp_path):
    out, ready, go = tmp_path / "o.parquet", tmp_path / "ready", tmp_path / "go"
    args = [
        "score",
        str(inp),
        "--model",
        str(tiny / "model"),
        "--all",
        "--batch-size",
        "2",
        "--quiet",
        "--out",
    ]
    first = subprocess.Popen(
        [sys.executable, "-c", PAUSED, str(ready), str(go), *args, str(out)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):
            if ready.exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), first.stderr.read() if first.poll() is not None else "timeout"
        progress = (writer.work_dir(out) / writer.MARKER).read_bytes()
        for extra in (["--beam", "1"], ["--resume"]):
            second = cli(*args, str(out), *extra)
            assert second.returncode == 2, second.stderr
            assert "Traceback" not in second.stderr
            assert f"is being written by cognet-batch score (pid {first.pid})" in second.stderr
            assert (writer.work_dir(out) / writer.MARKER).read_bytes() == progress  # untouched
        go.touch()
        assert first.wait(timeout=120) == 0, first.stderr.read()
    finally:
        go.touch()
        if first.poll() is None:
            first.kill()
    full = tmp_path / "full.parquet"
    assert score(tiny, inp, full, "--all", "--batch-size", "2").exit_code == 0
    assert pq.read_table(out).equals(pq.read_table(full))  # beam 4 throughout, no mix
    assert not writer.work_dir(out).exists()  # the lock went with the run
    assert score(tiny, inp, out, "--beam", "1").exit_code == 0  # and the next run may write


def test_the_lock_is_released_by_a_crash(tiny, inp, tmp_path):
    out = tmp_path / "o.parquet"
    code = KILLER.replace("{func}", "write_json").replace("{after}", "1")
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            code.replace("{before}", "False"),
            "score",
            str(inp),
            "--model",
            str(tiny / "model"),
            "--batch-size",
            "2",
            "--all",
            "--quiet",
            "--out",
            str(out),
        ],
        capture_output=True,
        cwd=REPO,
    )
    assert killed.returncode == -9  # kill -9 while holding the lock
    assert lock_file(out).exists()  # the file stays, the lock does not
    result = score(tiny, inp, out, "--batch-size", "2", "--all", "--resume")
    assert result.exit_code == 0, result.output
    assert not writer.work_dir(out).exists()


# -- an output that is an input -----------------------------------------------------------
def test_out_equal_to_input_is_refused_before_reading(tiny, inp, tmp_path):
    before = inp.read_bytes()
    alias = tmp_path / "alias.parquet"
    alias.symlink_to(inp)
    for out in (inp, tmp_path / "sub" / ".." / "in.parquet", alias):
        line = error(score(tiny, inp, out, model=tmp_path / "no-model"))  # no model read
        assert f"is the input file {inp}" in line
    line = error(score(tiny, inp, tmp_path / "s.parquet", "--summary-json", str(inp)))
    assert "--summary-json" in line and "input file" in line
    assert inp.read_bytes() == before
    assert nothing_written(tmp_path / "s.parquet") and not writer.work_dir(inp).exists()


def test_codes_are_sets_and_a_visit_above_the_cap_is_rejected(tiny, visits, tmp_path):
    rows = last_visits_unknown(visits).to_pylist()
    target = next(i for i, r in enumerate(rows) if r["medications"] is None)
    n = len(set(rows[target]["diagnoses"]))
    pq.write_table(pa.Table.from_pylist(rows, visits.schema), tmp_path / "plain.parquet")
    rows[target]["diagnoses"] = rows[target]["diagnoses"] * 3  # duplicates collapse
    pq.write_table(pa.Table.from_pylist(rows, visits.schema), tmp_path / "dup.parquet")
    cap = max(n, len(set(rows[target]["procedures"])), 8)
    for name in ("plain", "dup"):
        args = ("--max-codes-per-visit", str(cap))
        assert (
            score(
                tiny, tmp_path / f"{name}.parquet", tmp_path / f"{name}-o.parquet", *args
            ).exit_code
            == 0
        )
    assert pq.read_table(tmp_path / "dup-o.parquet").equals(
        pq.read_table(tmp_path / "plain-o.parquet")
    )
    # a cap below the visit's codes: rejected, with its reason, and counted
    small = max(len(set(r["diagnoses"])) for r in rows if r["medications"] is None) - 1
    s = tmp_path / "s.json"
    result = score(
        tiny,
        tmp_path / "dup.parquet",
        tmp_path / "cap.parquet",
        "--max-codes-per-visit",
        str(small),
        "--summary-json",
        str(s),
    )
    assert result.exit_code == 0, result.output
    reasons = json.loads(s.read_text())["reject_reasons"]
    assert reasons.get("too_many_codes", 0) >= 1
    rejected = pq.read_table(tmp_path / "cap.rejects.parquet").to_pylist()
    assert {r["reason"] for r in rejected} == {"too_many_codes"}


# -- checks before work -------------------------------------------------------------------
def test_output_problems_exit_2_before_any_work(tiny, inp, tmp_path):
    no_model = tmp_path / "no-model"  # never opened: every check comes first
    folder = tmp_path / "folder.parquet"
    folder.mkdir()
    assert "is a directory; --out names the Parquet file" in error(
        score(tiny, inp, folder, model=no_model)
    )
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file where a folder should be")
    line = error(score(tiny, inp, blocker / "o.parquet", model=no_model))
    assert f"{blocker / 'o.parquet'}: cannot write there ({blocker} is not a directory)" in line
    out = tmp_path / "o.parquet"
    line = error(
        score(tiny, inp, out, "--summary-json", str(tmp_path / "nope" / "s.json"), model=no_model)
    )
    assert f"--summary-json folder {tmp_path / 'nope'} does not exist" in line
    result = score(tiny, inp, out, "--summary-json", str(folder), model=no_model)
    assert result.exit_code == 2 and "is a directory" in result.output  # click's usage error
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        assert "is not writable" in error(score(tiny, inp, locked / "o.parquet", model=no_model))
    assert nothing_written(out) and nothing_written(blocker / "o.parquet")


# -- resume refuses a damaged work folder -------------------------------------------------
def interrupted(tiny: Path, inp: Path, out: Path, *args: str) -> list[str]:
    """Run score with `args` and kill -9 it after its 3rd committed part; returns the args."""
    argv = [
        "score",
        str(inp),
        "--model",
        str(tiny / "model"),
        "--batch-size",
        "2",
        "--quiet",
        "--out",
        str(out),
        *args,
    ]
    code = KILLER.replace("{func}", "write_json").replace("{after}", "3")
    killed = subprocess.run(
        [sys.executable, "-c", code.replace("{before}", "False"), *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert killed.returncode == -9, killed.stderr
    return argv


def test_a_tampered_progress_file_or_a_lost_part_is_named(tiny, inp, tmp_path):
    out = tmp_path / "o.parquet"
    argv = interrupted(tiny, inp, out, "--all")
    work = writer.work_dir(out)
    marker = work / writer.MARKER
    good = marker.read_text()
    for bad in (good[: len(good) // 2], "[]", good.replace('"parts"', '"partz"')):
        marker.write_text(bad)
        line = error(CliRunner().invoke(main, [*argv, "--resume"]))
        assert f"{marker}: cannot resume: unreadable progress file" in line
        assert f"(delete {work}/ or run without --resume)" in line
    marker.write_text(good)
    (work / "part-000001.rejects.parquet").unlink()
    line = error(CliRunner().invoke(main, [*argv, "--resume"]))
    assert "cannot resume: part-000001.rejects.parquet is missing or changed" in line
    assert not out.exists() and marker.read_text() == good  # refused before any work
    assert CliRunner().invoke(main, argv).exit_code == 0  # without --resume: a fresh run
    assert pq.read_table(out).num_rows == pq.read_metadata(inp).num_rows


# -- swapped graphs -----------------------------------------------------------------------
def test_swapped_graphs_are_refused_by_name(tiny, inp, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    a, b = model / "encoder.onnx", model / "decoder_init.onnx"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    manifest = json.loads((model / "manifest.json").read_text())
    for spec in manifest["graphs"].values():  # the hashes entered again: they match
        spec["sha256"] = file_sha256(model / spec["file"])
    (model / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "o.parquet"
    line = error(score(tiny, inp, out, model=model))
    assert f"{a}: not the encoder graph" in line and "re-export the model" in line
    assert nothing_written(out)


# -- small things -------------------------------------------------------------------------
def test_a_failed_run_leaves_no_work_folder(tiny, visits, tmp_path):
    rows = visits.to_pylist()
    rows[1]["visit_seq"] = rows[0]["visit_seq"]  # a repeated visit_seq, found while scoring
    pq.write_table(pa.Table.from_pylist(rows, visits.schema), tmp_path / "dup.parquet")
    out = tmp_path / "o.parquet"
    line = error(score(tiny, tmp_path / "dup.parquet", out, "--sort"))
    assert "twice; a patient's visit_seq values must be unique" in line
    assert "--sort" not in line  # --sort was given, and it would not help
    assert nothing_written(out)
    line = error(score(tiny, tmp_path / "dup.parquet", out))
    assert "twice" in line and "--sort" not in line
    assert "not a cognet model directory" in error(
        score(tiny, tmp_path / "dup.parquet", out, model=tmp_path)
    )
    assert nothing_written(out)


def test_a_directory_input_is_named_as_one(tiny, visits, tmp_path):
    (tmp_path / "visits").mkdir()
    pq.write_table(visits, tmp_path / "visits" / "a.parquet")
    line = error(score(tiny, tmp_path / "visits", tmp_path / "o.parquet"))
    assert "is a directory; the local engine reads one Parquet file (--engine ray" in line
    line = error(score(tiny, str(tmp_path / "visits" / "*.parquet"), tmp_path / "o.parquet"))
    assert "a glob?" in line and "--engine ray expands globs" in line


# -- --keep-columns ----------------------------------------------------------------------
def with_extras(visits: pa.Table) -> pa.Table:
    n = visits.num_rows
    dates = pa.array([f"2024-01-{i % 28 + 1:02d}" for i in range(n)])
    return (
        last_visits_unknown(visits)
        .append_column("admit_date", dates)
        .append_column("ward", pa.array([f"W{i % 3}" for i in range(n)]))
    )


def test_keep_columns_carries_input_columns(tiny, visits, tmp_path):
    table = with_extras(visits)
    pq.write_table(table, tmp_path / "in.parquet")
    by_id = {r["visit_id"]: r for r in table.to_pylist()}
    result = score(
        tiny,
        tmp_path / "in.parquet",
        tmp_path / "k.parquet",
        "--keep-columns",
        "admit_date,visit_seq",
    )
    assert result.exit_code == 0, result.output
    got = pq.read_table(tmp_path / "k.parquet")
    assert got.column_names[-2:] == ["admit_date", "visit_seq"]
    assert got.schema.field("visit_seq").type == table.schema.field("visit_seq").type
    for row in got.to_pylist():
        want = by_id[row["visit_id"]]
        assert (row["admit_date"], row["visit_seq"]) == (want["admit_date"], want["visit_seq"])
    assert (
        score(
            tiny, tmp_path / "in.parquet", tmp_path / "a.parquet", "--sort", "--keep-all-columns"
        ).exit_code
        == 0
    )
    every = pq.read_table(tmp_path / "a.parquet")
    assert every.column_names[-6:] == [
        "visit_seq",
        "diagnoses",
        "procedures",
        "split",
        "admit_date",
        "ward",
    ]
    assert every.select(got.column_names).equals(got)
    assert "'nope': no such column to keep" in error(
        score(tiny, tmp_path / "in.parquet", tmp_path / "x.parquet", "--keep-columns", "nope")
    )
    assert "the output has a column 'medications' already" in error(
        score(
            tiny, tmp_path / "in.parquet", tmp_path / "x.parquet", "--keep-columns", "medications"
        )
    )
    assert nothing_written(tmp_path / "x.parquet")


# -- the resume signature ----------------------------------------------------------------
def test_resume_refuses_every_option_that_changes_the_output(tiny, inp, tmp_path):
    assert {
        "decoding",
        "beam",
        "ddi",
        "max_history_visits",
        "variant",
        "max_codes_per_visit",
        "keep_columns",
    } <= set(signature.output_fields())
    assert not {"threads", "batch_size", "device"} & set(signature.output_fields())
    out = tmp_path / "o.parquet"
    argv = interrupted(tiny, inp, out, "--all", "--explain")
    other_model = tmp_path / "model"
    shutil.copytree(tiny / "model", other_model)
    manifest = json.loads((other_model / "manifest.json").read_text())
    manifest["ddi_pairs"] = manifest["ddi_pairs"][1:]  # another model: one DDI pair less
    (other_model / "manifest.json").write_text(json.dumps(manifest))
    changes = {
        "beam": ["--beam", "1"],
        "ddi": ["--ddi-mode", "soft"],
        "max_history_visits": ["--max-history-visits", "1"],
        "max_codes_per_visit": ["--max-codes-per-visit", "30"],
        "keep_columns": ["--keep-columns", "visit_seq"],
        "sort": ["--sort"],
        "model": ["--model", str(other_model)],
    }
    for what, extra in changes.items():
        line = error(CliRunner().invoke(main, [*argv, "--resume", *extra]))
        assert f"cannot resume: {what} differ from the interrupted run" in line, what
    for flag in ("--all", "--explain"):  # dropped
        rest = [a for a in argv if a != flag]
        line = error(CliRunner().invoke(main, [*rest, "--resume"]))
        assert f"cannot resume: {flag[2:]} differ" in line
    os.utime(inp, ns=(time.time_ns(), time.time_ns()))  # the input changed (its time)
    line = error(CliRunner().invoke(main, [*argv, "--resume"]))
    assert "cannot resume: input_mtime_ns differ" in line
    os.utime(inp, ns=(0, 0))
    shutil.rmtree(writer.work_dir(out))
    argv = interrupted(tiny, inp, out, "--all", "--explain")
    result = CliRunner().invoke(main, [*argv, "--resume", "--threads", "1"])  # speed only
    assert result.exit_code == 0, result.output
    full = tmp_path / "full.parquet"
    assert (
        CliRunner().invoke(main, [str(full) if a == str(out) else a for a in argv]).exit_code == 0
    )
    assert pq.read_table(out).equals(pq.read_table(full))


# -- the Ray engine: 1, 2, 4 and 11 ----------------------------------------------------------
@pytest.mark.ray
def test_ray_engine_keeps_the_same_promises(local_ray, tiny, visits, tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    table = with_extras(visits)
    pq.write_table(table.slice(0, 120), parts / "a.parquet")
    pq.write_table(table.slice(120), parts / "b.parquet")
    ray = ("--engine", "ray", "--num-workers", "1")
    # 2: OUT inside the input directory, matched by the glob, or holding the input
    line = error(score(tiny, parts, parts / "recs", *ray))
    assert f"{parts / 'recs'}: --out is inside the input directory {parts}" in line
    line = error(score(tiny, f"{parts}/*", parts / "recs.parquet", *ray))
    assert "--out is matched by the input glob" in line
    line = error(score(tiny, parts / "a.parquet", tmp_path, *ray))
    assert "--out holds the input file" in line
    assert not (parts / "recs").exists() and sorted(p.name for p in parts.iterdir()) == [
        "a.parquet",
        "b.parquet",
    ]
    # 1: a run holding OUT's lock (here: this process) keeps the Ray engine out
    out = tmp_path / "recs"
    with claim(out, "cognet train"):
        line = error(score(tiny, parts, out, *ray))
        assert f"{out}: is being written by cognet train (pid {os.getpid()})" in line
    assert nothing_written(out)
    # 11: the kept columns, as the local engine keeps them
    keep = ("--keep-columns", "admit_date,ward")
    assert score(tiny, parts, out, *ray, *keep).exit_code == 0
    pq.write_table(table, tmp_path / "in.parquet")
    assert score(tiny, tmp_path / "in.parquet", tmp_path / "local.parquet", *keep).exit_code == 0
    got = sorted(
        pq.read_table(out).select(["visit_id", "admit_date", "ward"]).to_pylist(),
        key=lambda r: r["visit_id"],
    )
    want = pq.read_table(tmp_path / "local.parquet").select(["visit_id", "admit_date", "ward"])
    assert got == sorted(want.to_pylist(), key=lambda r: r["visit_id"]) and len(got) > 0
    assert not writer.work_dir(out).exists()
