"""Issue 59, `--resume` trusts nothing it reads back (`make failures`).

progress.json is read like every other input: each field by type and range, one line
naming the file and the field, exit 2 (`cannot resume: ...`); part names are fixed by their
position (nothing outside `OUT.parts/` is read), and each part file proves its place (its
Parquet metadata) and its bytes (the sha256 progress.json records). A resume that cannot
prove its parts are the ones it wrote refuses; after a kill at each named point of the
write, a resume gives the uninterrupted run's files byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import KILLER

from cognet.runtime import writer
from cognet.runtime.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tiny, visits, tmp_path_factory) -> dict:
    """An input, the argv that scores it in 2-visit batches with --all (parts of 32 rows),
    the uninterrupted run's OUT and rejects bytes, and a work folder left by kill -9 after
    the 3rd committed part (copy it before changing it)."""
    root = tmp_path_factory.mktemp("resume")
    inp = root / "in.parquet"
    pq.write_table(visits, inp)
    full = root / "full.parquet"
    base = ["score", str(inp), "--model", str(tiny / "model"), "--batch-size", "2", "--all"]
    summary = ["--summary-json", str(root / "full.json")]
    result = CliRunner().invoke(main, [*base, "--quiet", "--out", str(full), *summary])
    assert result.exit_code == 0, result.output
    killed = root / "killed.parquet"
    assert killed_after(base, killed, "write_json", 3, before=False) == -9
    return {
        "base": base,
        "rows": visits.num_rows,
        "want": (full.read_bytes(), writer.rejects_path(full).read_bytes()),
        "summary": json.loads((root / "full.json").read_text()),
        "killed": writer.work_dir(killed),
    }


def killed_after(base: list[str], out: Path, func: str, n: int, before: bool, env=None) -> int:
    """Run score on OUT, SIGKILLed at the n-th call of `writer.<func>` (before or after it)."""
    code = KILLER.replace("{func}", func).replace("{after}", str(n))
    argv = [sys.executable, "-c", code.replace("{before}", str(before)), *base]
    done = subprocess.run(
        [*argv, "--quiet", "--out", str(out)], capture_output=True, text=True, cwd=REPO, env=env
    )
    return done.returncode


def resume(run: dict, out: Path, *extra: str):
    return CliRunner().invoke(
        main, [*run["base"], "--quiet", "--out", str(out), "--resume", *extra]
    )


def error(result) -> str:
    """The one line of a run refused with exit 2 (no traceback)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def damaged(run: dict, tmp_path: Path) -> tuple[Path, Path, dict]:
    """A copy of the killed run's work folder for OUT under tmp_path: (OUT, the marker, its
    state)."""
    out = tmp_path / "o.parquet"
    shutil.copytree(run["killed"], writer.work_dir(out))
    marker = writer.work_dir(out) / writer.MARKER
    return out, marker, json.loads(marker.read_text())


def refused(run: dict, out: Path, marker: Path, *expected: str) -> str:
    """Resume, assert it refuses naming the marker and each `expected`, before any work."""
    before = marker.read_bytes()
    line = error(resume(run, out))
    assert f"{marker}: cannot resume: " in line, line
    assert line.endswith(f"(delete {marker.parent}/ or run without --resume)"), line
    for text in expected:
        assert text in line, line
    assert not out.exists() and marker.read_bytes() == before  # nothing done
    return line


def deep(n: int) -> str:
    return "[" * n + "]" * n


# {damage: (change of the state, or the file's text, what the refusal names)}
DAMAGES = {
    "a count as a string": (lambda s: s["parts"][0].update(rows_scored="3"), "parts.0.rows_scored"),
    "a null count": (lambda s: s["parts"][1].update(rows_skipped=None), "parts.1.rows_skipped"),
    "a list for the reasons": (
        lambda s: s["parts"][0].update(reject_reasons=[]),
        "parts.0.reject_reasons",
    ),
    "a mapping for the parts": (lambda s: s.update(parts={}), "field 'parts'"),
    "a list for a part": (lambda s: s["parts"].__setitem__(1, [1]), "field 'parts.1'"),
    "an end of 1e30": (lambda s: s["parts"][2].update(end=1e30), "parts.2.end"),
    "an end of 67.5": (lambda s: s["parts"][2].update(end=67.5), "parts.2.end"),
    "an end past the input": (lambda s: s["parts"][2].update(end=10**6), "parts.2.end"),
    "counts that do not add up": (lambda s: s["parts"][0].update(rows_scored=0), "parts.0"),
    "a boolean version": (lambda s: s.update(format_version=True), "another version"),
    "a signature that is a list": (lambda s: s.update(signature=[]), "field 'signature'"),
    "an unknown field": (lambda s: s["parts"][0].update(extra=1), "field 'parts.0'"),
    "a part out of order": (lambda s: s["parts"].reverse(), "parts.0.name"),
    "a part named ../victim": (
        lambda s: s["parts"][0].update(name="../victim"),
        "field 'parts.0.name': '../victim' is not 'part-000000'",
    ),
    "a file outside OUT.parts/": (
        lambda s: s["parts"][0]["files"].update({"../victim.parquet": {"bytes": 1}}),
        "parts.0.files",
    ),
    "a size that is a string": (
        lambda s: s["parts"][1]["files"]["part-000001.parquet"].update(bytes="9"),
        "parts.1.files.part-000001.parquet",
    ),
    "a missing part": (lambda s: s["parts"].pop(0), "parts.0.name"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_field_is_named(run, tmp_path, damage):
    out, marker, state = damaged(run, tmp_path)
    change, named = DAMAGES[damage]
    change(state)
    marker.write_text(json.dumps(state))
    refused(run, out, marker, named)


@pytest.mark.parametrize(
    "text, named",
    [
        (lambda t: t.replace('"signature"', '"signature": ' + deep(100_000) + ', "x"', 1), "64"),
        (
            lambda t: t.replace(
                '{"format_version": ', '{"format_version": 0, "format_version": ', 1
            ),
            "twice",
        ),
        (lambda t: t[: len(t) // 2], "unreadable progress file"),
        (lambda t: "\xff" + t, "unreadable progress file"),
    ],
    ids=["nested 100,000 deep", "a key twice", "cut short", "not UTF-8"],
)
def test_an_unreadable_progress_file_is_refused(run, tmp_path, text, named):
    out, marker, state = damaged(run, tmp_path)
    marker.write_text(text(json.dumps(state)), encoding="latin-1")
    refused(run, out, marker, named)


def test_a_part_renamed_into_another_place_is_refused(run, tmp_path):
    """The last part's files renamed as the first's, progress.json made to fit them (counts,
    sizes, sha256): the files name the place they were written for."""
    out, marker, state = damaged(run, tmp_path)
    work, first, last = marker.parent, state["parts"][0], state["parts"][-1]
    for name in last["files"]:
        (work / name).replace(work / name.replace(last["name"], first["name"]))
    for key in ("rows_scored", "rows_rejected", "reject_reasons", "visits_evaluated"):
        first[key] = last[key]
    rows = first["end"] - first["start"]
    first["rows_skipped"] = rows - first["rows_scored"] - first["rows_rejected"]
    assert first["rows_skipped"] >= 0  # the forgery adds up
    first["files"] = {f.replace(last["name"], first["name"]): r for f, r in last["files"].items()}
    state["parts"].pop()
    marker.write_text(json.dumps(state))
    refused(run, out, marker, "part-000000.parquet was written as", "parts renamed?")


def test_a_changed_or_linked_part_file_is_refused(run, tmp_path):
    out, marker, _ = damaged(run, tmp_path)
    part = marker.parent / "part-000001.rejects.parquet"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, the size unchanged
    part.write_bytes(bytes(data))
    refused(run, out, marker, "part-000001.rejects.parquet is missing or changed")
    shutil.copy(run["killed"] / part.name, tmp_path / "elsewhere.parquet")
    part.unlink()
    part.symlink_to(tmp_path / "elsewhere.parquet")  # the same bytes, through a link
    refused(run, out, marker, "part-000001.rejects.parquet is missing or changed")


def test_a_sound_copy_resumes_to_the_uninterrupted_output(run, tmp_path):
    out, _, _ = damaged(run, tmp_path)
    result = resume(run, out, "--summary-json", str(tmp_path / "s.json"))
    assert result.exit_code == 0, result.output
    assert (out.read_bytes(), writer.rejects_path(out).read_bytes()) == run["want"]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["resumed_rows"] > 0 and summary["metrics"] == run["summary"]["metrics"]
    for key in ("rows_scored", "rows_rejected", "rows_skipped", "visits_evaluated"):
        assert summary[key] == run["summary"][key], key


# Named points of the write: (func of writer, nth call, before it?) or (COGNET_KILL_AT, None)
KILLS = {
    "before the first marker": ("write_json", 1, True),
    "after the first marker": ("write_json", 1, False),
    "part files written, marker not": ("write_json", 4, True),
    "a part's recommendations written, its rejects not": ("write_parquet", 7, False),
    "a part file complete under its temporary name": ("replace:KILL", None, None),
    "OUT in place, its rejects file not": ("merged:KILL", None, None),
}


@pytest.mark.parametrize("point", KILLS, ids=list(KILLS))
def test_a_resume_after_a_kill_equals_the_uninterrupted_run(run, tmp_path, point):
    out = tmp_path / "o.parquet"
    func, n, before = KILLS[point]
    if n is None:  # a kill_point of the writers (cognet.core.interrupt)
        env = {**os.environ, "COGNET_KILL_AT": func}
        argv = [sys.executable, "-m", "cognet.runtime.cli", *run["base"], "--quiet"]
        code = subprocess.run([*argv, "--out", str(out)], env=env, capture_output=True).returncode
    else:
        code = killed_after(run["base"], out, func, n, before)
    assert code == -9
    result = resume(run, out)
    assert result.exit_code == 0, result.output
    assert (out.read_bytes(), writer.rejects_path(out).read_bytes()) == run["want"]
    assert not writer.work_dir(out).exists()
