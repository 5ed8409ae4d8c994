"""`cognet-batch score`: output files and summary, bad input (exit 2 or rejects, never a
silent drop), the row invariant, resume after kill -9, and a run without torch."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import (
    BEAM_ALONE,
    BEAM_WITH_SET_OPTIONS,
    KILLER,
    NOT_APPLYING,
    last_visits_unknown,
    with_set_decoding,
)

from cognet.runtime.cli import main
from cognet.runtime.outputs import OUTPUT_SCHEMA, REJECTS_SCHEMA

REPO = Path(__file__).resolve().parents[1]


def score(tiny: Path, input_path: Path, out: Path, *args: str):
    result = CliRunner().invoke(
        main,
        [
            "score",
            str(input_path),
            "--model",
            str(tiny / "model"),
            "--out",
            str(out),
            "--quiet",
            *args,
        ],
    )
    return result


def entry_points() -> dict[str, click.Command]:
    """setup.py's console scripts: {name: the click command it runs}."""
    scripts = []
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "console_scripts":
                    scripts = ast.literal_eval(value)
    found = {}
    for script in scripts:
        name, target = (part.strip() for part in script.split("="))
        module, attr = target.split(":")
        found[name] = getattr(importlib.import_module(module), attr)
    return found


def every_command(command: click.Command, path: tuple[str, ...] = ()):
    """(path, command) of a command and, for a group, of every command below it."""
    yield path, command
    if isinstance(command, click.Group):
        with click.Context(command) as ctx:
            for name in command.list_commands(ctx):
                yield from every_command(command.get_command(ctx, name), (*path, name))


def test_help_on_every_command():
    """Every command of every entry point (cognet, cognet-export, cognet-batch, cognet-bench),
    found by walking its click groups: `--help` exits 0 and shows an example."""
    scripts = entry_points()
    assert set(scripts) == {"cognet", "cognet-export", "cognet-batch", "cognet-bench"}
    walked = []
    for script, command in scripts.items():
        for path, _ in every_command(command):
            result = CliRunner().invoke(command, [*path, "--help"])
            assert result.exit_code == 0, (script, path, result.output)
            assert "Example" in result.output, (script, path)
            walked.append((script, *path))
    assert ("cognet-batch",) in walked and ("cognet-batch", "score") in walked
    assert ("cognet-batch", "explain") in walked and ("cognet", "data", "synth") in walked


def test_score_writes_outputs_and_summary(tiny, visits, tmp_path):
    inp = tmp_path / "in.parquet"
    pq.write_table(last_visits_unknown(visits), inp)
    out, summary = tmp_path / "recs.parquet", tmp_path / "summary.json"
    result = score(tiny, inp, out, "--summary-json", str(summary), "--device", "cpu")
    assert result.exit_code == 0, result.output
    recs = pq.read_table(out)
    assert recs.schema == OUTPUT_SCHEMA
    assert pq.read_table(tmp_path / "recs.rejects.parquet").schema == REJECTS_SCHEMA
    assert not (tmp_path / "recs.parquet.parts").exists()
    s = json.loads(summary.read_text())
    n_patients = len(set(visits["patient_id"].to_pylist()))
    assert (s["rows_read"], s["rows_scored"], s["rows_rejected"], s["rows_skipped"]) == (
        visits.num_rows,
        n_patients,
        0,
        visits.num_rows - n_patients,
    )
    assert s["providers"] == ["CPUExecutionProvider"] and s["visits_per_s"] > 0
    assert s["reject_reasons"] == {} and "metrics" not in s
    assert recs.num_rows == n_patients
    out2, summary2 = tmp_path / "recs2.parquet", tmp_path / "summary2.json"
    args = ("--summary-json", str(summary2), "--device", "cpu", "--threads", "2", "--streams", "2")
    assert score(tiny, inp, out2, *args).exit_code == 0
    assert json.loads(summary2.read_text())["options"]["streams"] == 2
    assert pq.read_table(out2).equals(recs)  # two streams: the same rows, in the same order


def test_all_reports_metrics(tiny, visits, tmp_path):
    inp = tmp_path / "in.parquet"
    pq.write_table(visits, inp)
    summary = tmp_path / "s.json"
    result = score(
        tiny, inp, tmp_path / "o.parquet", "--all", "--explain", "--summary-json", str(summary)
    )
    assert result.exit_code == 0, result.output
    s = json.loads(summary.read_text())
    assert s["rows_scored"] == visits.num_rows
    assert s["metrics"]["n_visits"] == visits.num_rows
    assert 0 <= s["metrics"]["jaccard"]["mean"] <= 1
    assert "explanations" in pq.read_table(tmp_path / "o.parquet").column_names


def loud(tiny: Path, input_path: Path, out: Path, *args: str):
    """`score` without --quiet: what the console shows (stdout and stderr)."""
    return CliRunner().invoke(
        main, ["score", str(input_path), "--model", str(tiny / "model"), "--out", str(out), *args]
    )


def test_a_file_with_every_medication_says_how_to_score_it(tiny, visits, tmp_path):
    inp = tmp_path / "labelled.parquet"
    pq.write_table(visits, inp)
    result = loud(tiny, inp, tmp_path / "o.parquet")
    assert result.exit_code == 0, result.output
    assert f"scored 0 of {visits.num_rows} visits" in result.output
    assert "--all scores every visit" in result.output
    result = loud(tiny, inp, tmp_path / "o2.parquet", "--all")
    assert result.exit_code == 0 and "--all scores every visit" not in result.output


def test_all_prints_metrics_of_first_and_later_visits(tiny, visits, tmp_path):
    inp = tmp_path / "in.parquet"
    pq.write_table(visits, inp)
    summary = tmp_path / "s.json"
    result = loud(tiny, inp, tmp_path / "o.parquet", "--all", "--summary-json", str(summary))
    assert result.exit_code == 0, result.output
    m = json.loads(summary.read_text())["metrics"]
    shown = f"Jaccard {m['jaccard']['mean']:.4f} ± {m['jaccard']['std']:.4f}"
    assert shown in result.output and "PRAUC" in result.output and "DDI rate" in result.output
    first, later = m["by_history"]["first"], m["by_history"]["later"]
    n_patients = len(set(visits["patient_id"].to_pylist()))
    # every patient's first visit has no history; the tiny data's visits all have medications
    assert (first["n_visits"], first["n_patients"]) == (n_patients, n_patients)
    assert first["n_visits"] + later["n_visits"] == m["n_visits"] == visits.num_rows
    assert f"first visits (no history): Jaccard {first['jaccard']:.4f}" in result.output
    assert f"later visits: Jaccard {later['jaccard']:.4f}" in result.output


def test_split_scores_one_split_with_the_others_as_history(tiny, visits, tmp_path):
    inp = tmp_path / "in.parquet"
    pq.write_table(visits, inp)
    summary, out = tmp_path / "s.json", tmp_path / "o.parquet"
    args = ("--all", "--split", "test", "--summary-json", str(summary))
    assert score(tiny, inp, out, *args).exit_code == 0
    s = json.loads(summary.read_text())
    test_ids = {
        v
        for v, sp in zip(visits["visit_id"].to_pylist(), visits["split"].to_pylist(), strict=True)
        if sp == "test"
    }
    assert set(pq.read_table(out)["visit_id"].to_pylist()) == test_ids
    assert s["metrics"]["n_visits"] == len(test_ids) == s["rows_scored"]
    assert s["rows_skipped"] == visits.num_rows - len(test_ids)
    # a split without rows, a file without a split column: one line, exit 2
    assert "no row of split 'test'" in _error(
        score(
            tiny,
            _written(visits.filter(pa.compute.equal(visits["split"], "train")), tmp_path),
            out,
            "--all",
            "--split",
            "test",
        )
    )
    bare = tmp_path / "bare.parquet"
    pq.write_table(visits.drop_columns(["split"]), bare)
    line = _error(score(tiny, bare, tmp_path / "o3.parquet", "--split", "val"))
    assert "column 'split'" in line and "--split" in line


def _written(table: pa.Table, tmp_path: Path) -> Path:
    path = tmp_path / "written.parquet"
    pq.write_table(table, path)
    return path


def test_input_the_model_hardly_knows_warns_or_fails(tiny, visits, tmp_path):
    rows = last_visits_unknown(visits).to_pylist()
    for r in rows[: len(rows) // 2]:  # half the patients coded otherwise: unknown codes only
        r["diagnoses"], r["procedures"] = ["X" + c for c in r["diagnoses"]], ["X0"]
    inp = _written(pa.Table.from_pylist(rows, schema=visits.schema), tmp_path)
    result = loud(tiny, inp, tmp_path / "o.parquet")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("Warning: ")]
    assert len(warnings) == 2
    assert "of the visits to score were rejected" in warnings[0]
    assert "of the codes of the visits used are unknown to the model" in warnings[1]
    out = tmp_path / "strict.parquet"
    line = _error(score(tiny, inp, out, "--max-unknown-share", "0.1"))
    assert "--max-unknown-share 0.1" in line and "rejected" in line
    assert not out.exists() and not list(tmp_path.glob("strict.parquet*"))
    clean = _written(last_visits_unknown(visits), tmp_path)
    result = loud(tiny, clean, tmp_path / "c.parquet", "--max-unknown-share", "0.1")
    assert result.exit_code == 0 and "Warning" not in result.output


def test_bad_rows_are_rejected_with_reasons(tiny, visits, tmp_path):
    rows = visits.slice(0, 12).to_pylist()
    for r in rows:
        r["medications"] = None
    rows[1]["patient_id"] = None  # missing key (and it cannot be ordered)
    rows[3]["visit_id"] = rows[2]["visit_id"]  # duplicate
    rows[4]["diagnoses"], rows[4]["procedures"] = [], []  # no codes
    rows[5]["diagnoses"], rows[5]["procedures"] = ["NOPE1"], ["NOPE2", None]  # unknown only
    rows[6]["diagnoses"] = rows[6]["diagnoses"] + ["NOPE3", ""]  # kept, 2 codes dropped
    rows[7]["visit_seq"] = None
    table = pa.Table.from_pylist(rows, schema=visits.schema)
    inp = tmp_path / "bad.parquet"
    pq.write_table(table.append_column("extra", pa.array(range(12))), inp)
    summary = tmp_path / "s.json"
    result = score(tiny, inp, tmp_path / "o.parquet", "--summary-json", str(summary))
    assert result.exit_code == 0, result.output
    rejects = pq.read_table(tmp_path / "o.rejects.parquet").to_pylist()
    assert {(r["row"], r["reason"]) for r in rejects} == {
        (1, "missing_key"),
        (3, "duplicate_visit_id"),
        (4, "no_codes"),
        (5, "unknown_codes"),
        (7, "missing_key"),
    }
    s = json.loads(summary.read_text())
    assert s["rows_scored"] + s["rows_rejected"] + s["rows_skipped"] == s["rows_read"] == 12
    assert (s["rows_scored"], s["rows_rejected"]) == (7, 5)
    assert s["reject_reasons"] == {
        "duplicate_visit_id": 1,
        "missing_key": 2,
        "no_codes": 1,
        "unknown_codes": 1,
    }
    assert s["unknown_codes"] == 2
    scored = set(pq.read_table(tmp_path / "o.parquet")["visit_id"].to_pylist())
    assert rows[6]["visit_id"] in scored and rows[2]["visit_id"] in scored


def _error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    return lines[0]


def test_bad_files_exit_2_with_one_line(tiny, visits, tmp_path):
    out = tmp_path / "o.parquet"
    assert "file not found" in _error(score(tiny, tmp_path / "nope.parquet", out))
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    assert "not a readable Parquet file" in _error(score(tiny, garbage, out))
    missing = tmp_path / "missing.parquet"
    pq.write_table(visits.drop_columns(["procedures"]), missing)
    assert "'procedures'" in _error(score(tiny, missing, out))
    typed = tmp_path / "typed.parquet"
    pq.write_table(visits.set_column(2, "visit_seq", pa.array(["x"] * visits.num_rows)), typed)
    assert "'visit_seq'" in _error(score(tiny, typed, out))
    assert not out.exists()


def test_misordered_rows_name_the_row_and_sort_fixes_them(tiny, visits, tmp_path):
    n = visits.num_rows
    swapped = visits.take(pa.array([1, 0, *range(2, n)]))  # visit_seq 1 before 0
    inp = tmp_path / "swapped.parquet"
    pq.write_table(swapped, inp)
    msg = _error(score(tiny, inp, tmp_path / "o.parquet", "--all"))
    assert "row 1" in msg and "visit_seq" in msg and "--sort" in msg
    p0 = visits["patient_id"].to_pylist().count("P0000")
    split = visits.take(pa.array([*range(p0, p0 + 2), *range(p0), *range(p0 + 2, n)]))
    pq.write_table(split, inp)  # P0001's first rows, then P0000, then the rest of P0001
    msg = _error(score(tiny, inp, tmp_path / "o.parquet", "--all"))
    assert f"row {p0 + 2}" in msg and "contiguous" in msg
    result = score(tiny, inp, tmp_path / "sorted.parquet", "--all", "--sort")
    assert result.exit_code == 0, result.output
    pq.write_table(visits, inp)
    score(tiny, inp, tmp_path / "plain.parquet", "--all")
    got = pq.read_table(tmp_path / "sorted.parquet").to_pylist()
    want = {r["visit_id"]: r for r in pq.read_table(tmp_path / "plain.parquet").to_pylist()}
    assert len(got) == n and all(r == want[r["visit_id"]] for r in got)


@pytest.mark.parametrize(
    "func,after,before",
    [
        ("write_json", 3, False),  # killed right after committing the 3rd part
        ("write_json", 3, True),  # killed with part 3's files written but not committed
        ("write_parquet", 4, False),  # killed between a part's recommendations and rejects
    ],
)
def test_resume_after_kill_equals_an_uninterrupted_run(tiny, visits, tmp_path, func, after, before):
    inp = tmp_path / "in.parquet"
    pq.write_table(visits, inp)
    args = [
        "score",
        str(inp),
        "--model",
        str(tiny / "model"),
        "--all",
        "--explain",
        "--batch-size",
        "2",
        "--quiet",
    ]
    full = tmp_path / "full.parquet"
    assert CliRunner().invoke(main, [*args, "--out", str(full)]).exit_code == 0
    out = tmp_path / "out.parquet"
    code = (
        KILLER.replace("{func}", func)
        .replace("{after}", str(after))
        .replace("{before}", str(before))
    )
    killed = subprocess.run(
        [sys.executable, "-c", code, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert killed.returncode == -9, killed.stderr
    assert not out.exists() and (tmp_path / "out.parquet.parts" / "progress.json").is_file()
    summary = tmp_path / "s.json"
    result = CliRunner().invoke(
        main, [*args, "--out", str(out), "--resume", "--summary-json", str(summary)]
    )
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).equals(pq.read_table(full))
    assert pq.read_table(tmp_path / "out.rejects.parquet").equals(
        pq.read_table(tmp_path / "full.rejects.parquet")
    )
    s = json.loads(summary.read_text())
    assert s["resumed_rows"] > 0 and s["rows_scored"] == s["rows_read"] == visits.num_rows


def test_resume_refuses_other_options(tiny, visits, tmp_path):
    inp = tmp_path / "in.parquet"
    pq.write_table(visits, inp)
    parts = tmp_path / "o.parquet.parts"
    parts.mkdir()
    (parts / "progress.json").write_text(
        json.dumps({"format_version": 1, "signature": {"beam": 3}, "parts": []})
    )
    assert "cannot resume" in _error(score(tiny, inp, tmp_path / "o.parquet", "--resume"))


def test_runs_without_torch(tiny, visits, tmp_path):
    inp = tmp_path / "in.parquet"
    pq.write_table(last_visits_unknown(visits), inp)
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
        "import cognet.runtime\n"
        "from cognet.runtime.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "finally:\n"
        "    assert sys.modules['torch'] is None\n"
    )
    env = dict(os.environ, COGNET_DEBUG="1")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "score",
            str(inp),
            "--model",
            str(tiny / "model"),
            "--out",
            str(tmp_path / "o.parquet"),
            "--explain",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert pq.read_table(tmp_path / "o.parquet").num_rows > 0


@pytest.mark.parametrize("args,name,beam", BEAM_ALONE)
def test_beam_alone_asks_for_beam_search(tiny, visits, tmp_path, args, name, beam):
    model = with_set_decoding(tiny / "model", tmp_path, "manifest.json")
    inp = tmp_path / "in.parquet"
    pq.write_table(last_visits_unknown(visits), inp)
    out, summary = tmp_path / "out.parquet", tmp_path / "s.json"
    argv = ["score", str(inp), "--model", str(model), "--out", str(out), "--quiet"]
    result = CliRunner().invoke(main, [*argv, "--summary-json", str(summary), *args])
    assert result.exit_code == 0, result.output
    decoding = json.loads(summary.read_text())["decoding"]
    assert (decoding["name"], decoding["beam"]) == (name, beam)
    scores = pq.read_table(out)["score"].to_pylist()
    # beam search: sums of log-probabilities; set decoding: mean P(in set) of the set
    assert all(s <= 0 for s in scores) if name == "beam" else all(0 <= s <= 1 for s in scores)


@pytest.mark.parametrize("args,named", BEAM_WITH_SET_OPTIONS)
def test_beam_with_set_options_is_a_usage_error(tiny, visits, tmp_path, args, named):
    inp, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(last_visits_unknown(visits), inp)
    result = score(tiny, inp, out, *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "Traceback" not in result.output and "--beam is for beam search" in lines[-1]
    assert named in lines[-1]
    assert not out.exists() and not (tmp_path / "out.parquet.parts").exists()


@pytest.mark.parametrize("args,line", NOT_APPLYING)
def test_score_refuses_options_of_another_decoding(tiny, visits, tmp_path, args, line):
    inp, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(last_visits_unknown(visits), inp)
    result = score(tiny, inp, out, *args)
    assert result.exit_code == 2, result.output
    lines = [text for text in result.output.splitlines() if text.strip()]
    assert "Traceback" not in result.output and lines[-1].endswith(line), lines
    assert not out.exists() and not (tmp_path / "out.parquet.parts").exists()
