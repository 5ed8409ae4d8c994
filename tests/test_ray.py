"""`cognet-batch score --engine ray` (cognet.runtime.ray_engine) on a local Ray of 2 CPUs:
a small synthetic input split over several Parquet files scores as the local engine scores
the single file (rows, rejects, counts, metrics), and input errors exit 2 with one line.

The Ray tests carry the `ray` marker and skip when Ray is not installed; the others run
everywhere (no Ray needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import last_visits_unknown

from cognet.core.errors import InputError
from cognet.runtime import reader as ray_engine  # listing INPUT moved to the reader
from cognet.runtime.cli import main

COUNTS = (
    "rows_read",
    "rows_scored",
    "rows_rejected",
    "rows_skipped",
    "unknown_codes",
    "codes_given",
    "visits_evaluated",
    "reject_reasons",
)
# Scores and probabilities may differ in the last float32 bits: a visit is decoded in
# another batch (other visits, other padding) than in the local engine.
ATOL = 1e-5


@pytest.fixture(scope="module")
def inputs(tiny, tmp_path_factory) -> Path:
    """`visits.parquet` (248 rows, last visits to score, 5 rejected rows) and `parts/`: the same
    rows in 4 files of row groups of 16 rows, so patients span row groups and files."""
    root = tmp_path_factory.mktemp("ray_inputs")
    table = last_visits_unknown(pq.read_table(tiny / "data" / "visits.parquet"))
    rows = table.to_pylist()
    pids = [r["patient_id"] for r in rows]
    rows[200]["visit_id"] = rows[10]["visit_id"]  # duplicate of another patient, other file
    rows[pids.index("P0005")]["patient_id"] = None  # missing key (a patient's first row)
    rows[31]["visit_seq"] = None  # missing key
    rows[40]["diagnoses"], rows[40]["procedures"] = [], []  # no codes
    rows[41]["diagnoses"], rows[41]["procedures"] = ["NOPE1"], ["NOPE2"]  # unknown only
    rows[42]["diagnoses"] = rows[42]["diagnoses"] + ["NOPE3"]  # kept, one code dropped
    for i in (40, 41, 42, 200):
        rows[i]["medications"] = None  # asked for
    schema = pa.schema([f.with_nullable(True) for f in table.schema])
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, root / "visits.parquet")
    (root / "parts").mkdir()
    for k, lo in enumerate(range(0, table.num_rows, 70)):
        part = table.slice(lo, 70)
        pq.write_table(part, root / "parts" / f"part-{k:03d}.parquet", row_group_size=16)
    return root


def score(tiny: Path, inp: Path | str, out: Path, *args: str):
    argv = ["score", str(inp), "--model", str(tiny / "model"), "--out", str(out), "--quiet"]
    return CliRunner().invoke(main, [*argv, *args])


def error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def same(a, b) -> bool:
    """Equal values, floats within ATOL (nested lists and dicts of them too)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= ATOL
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def by_visit(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: r["visit_id"])


@pytest.mark.ray
@pytest.mark.parametrize(
    ("flags", "source", "workers"),
    [((), "parts/*.parquet", "2"), (("--all", "--explain"), "parts", "1")],
    ids=["glob-2-workers", "dir-all-explain-1-worker"],
)
def test_ray_scores_as_the_local_engine(local_ray, tiny, inputs, tmp_path, flags, source, workers):
    local = score(
        tiny,
        inputs / "visits.parquet",
        tmp_path / "local.parquet",
        *flags,
        "--summary-json",
        str(tmp_path / "local.json"),
    )
    assert local.exit_code == 0, local.output
    ray = score(
        tiny,
        f"{inputs}/{source}",
        tmp_path / "ray",
        *flags,
        "--engine",
        "ray",
        "--num-workers",
        workers,
        "--summary-json",
        str(tmp_path / "ray.json"),
    )
    assert ray.exit_code == 0, ray.output

    got, want = pq.read_table(tmp_path / "ray"), pq.read_table(tmp_path / "local.parquet")
    assert got.schema == want.schema and got.num_rows == want.num_rows > 0
    assert all(same(a, b) for a, b in zip(by_visit(got), by_visit(want), strict=True))
    rejects = pq.read_table(tmp_path / "ray.rejects.parquet")
    assert rejects.schema == pq.read_table(tmp_path / "local.rejects.parquet").schema
    assert by_visit(rejects) == by_visit(pq.read_table(tmp_path / "local.rejects.parquet"))
    no_patient = pq.read_table(inputs / "visits.parquet")["patient_id"].to_pylist().index(None)
    assert {(r["row"], r["reason"]) for r in rejects.to_pylist()} == {
        (200, "duplicate_visit_id"),
        (31, "missing_key"),
        (no_patient, "missing_key"),
        (40, "no_codes"),
        (41, "unknown_codes"),
    }

    s = json.loads((tmp_path / "ray.json").read_text())
    want_s = json.loads((tmp_path / "local.json").read_text())
    assert {k: s[k] for k in COUNTS} == {k: want_s[k] for k in COUNTS}
    assert s["rows_read"] == s["rows_scored"] + s["rows_rejected"] + s["rows_skipped"] == 248
    assert (s["engine"], s["workers"], s["input_files"]) == ("ray", int(workers), 4)
    if "--all" in flags:
        assert same(s["metrics"], want_s["metrics"]) and s["metrics"]["n_visits"] > 0
    else:
        assert s["rows_skipped"] > 0 and "metrics" not in s


@pytest.mark.ray
def test_ray_input_errors_exit_2_with_one_line(local_ray, tiny, inputs, tmp_path):
    (tmp_path / "empty").mkdir()
    assert "no Parquet file found" in error_line(
        score(tiny, tmp_path / "empty", tmp_path / "o", "--engine", "ray")
    )
    parts = tmp_path / "parts"
    parts.mkdir()
    table = pq.read_table(inputs / "visits.parquet")
    pq.write_table(table.slice(0, 100), parts / "a.parquet")
    pq.write_table(table.slice(100).drop_columns(["procedures"]), parts / "b.parquet")
    line = error_line(score(tiny, parts, tmp_path / "o", "--engine", "ray"))
    assert "b.parquet" in line and "'procedures'" in line
    # patient P0000's visit_seq 1 again, in a second file: named by file and row
    pq.write_table(table.slice(100), parts / "b.parquet")
    pq.write_table(table.slice(1, 1), parts / "c.parquet")
    line = error_line(score(tiny, parts, tmp_path / "o", "--engine", "ray"))
    assert "c.parquet: column 'visit_seq', row 0" in line and "twice" in line
    assert not (tmp_path / "o").exists()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("not an output")
    line = error_line(score(tiny, inputs / "visits.parquet", tmp_path / "notes", "--engine", "ray"))
    assert "README.txt" in line and "another --out" in line


@pytest.mark.ray
def test_ray_empty_input_writes_empty_outputs(local_ray, tiny, inputs, tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(inputs / "visits.parquet").slice(0, 0), empty)
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.parquet").write_bytes(b"an earlier output, replaced")
    result = score(tiny, empty, out, "--engine", "ray", "--summary-json", str(tmp_path / "s.json"))
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).num_rows == 0 and not (out / "old.parquet").exists()
    assert pq.read_table(tmp_path / "o.rejects.parquet").num_rows == 0
    assert json.loads((tmp_path / "s.json").read_text())["rows_read"] == 0


def test_without_ray_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = score(tmp_path, tmp_path / "in.parquet", tmp_path / "o", "--engine", "ray")
    assert error_line(result) == "Error: --engine ray needs Ray: pip install 'cognet[ray]'"
    result = score(tmp_path, tmp_path / "in.parquet", tmp_path / "o", "--engine", "ray", "--resume")
    assert "--resume is for --engine local" in error_line(result)


def test_input_files_in_name_order(tmp_path):
    for name in (
        "b/2.parquet",
        "b/10.parquet",
        "a.parquet",
        "_tmp/x.parquet",
        ".x.parquet",
        "notes.txt",
    ):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    names = [Path(p).relative_to(tmp_path).as_posix() for p in ray_engine.list_files(str(tmp_path))]
    assert names == ["a.parquet", "b/10.parquet", "b/2.parquet"]
    glob = ray_engine.list_files(f"{tmp_path}/b/*.parquet")
    assert [Path(p).name for p in glob] == ["10.parquet", "2.parquet"]
    assert ray_engine.list_files(str(tmp_path / "a.parquet")) == [str(tmp_path / "a.parquet")]
    with pytest.raises(InputError, match="no Parquet file found"):
        ray_engine.list_files(str(tmp_path / "_tmp" / "*.txt"))
    with pytest.raises(InputError, match="file not found"):
        ray_engine.list_files(str(tmp_path / "nope"))
