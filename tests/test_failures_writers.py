"""Issue 30, never lose a finished output (with tests/test_failures_numbers.py and
tests/test_failures_db.py: `make failures`).

One lock per output, whatever the command: every writing command is refused (exit 2, one
line naming the holder's command and pid) while another command holds its output, and the
real race of `cognet-batch score` against `cognet train` on one OUT leaves one refused and
the other's output whole. Whole or absent: each writer stopped by SIGTERM at named points
of its write (COGNET_KILL_AT, `cognet.core.interrupt.kill_point`: the process signals
itself there, no timing) leaves its output as it was or whole, and no temporary name once
the next run has held the lock (kill -9 included).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny import make_tiny

from cognet.benchmarks.cli import main as bench_main
from cognet.cli import main as cognet_main
from cognet.core.files import is_temp
from cognet.core.lock import claim, claimed
from cognet.export.cli import main as export_main
from cognet.runtime import writer
from cognet.runtime.cli import main as batch_main

REPO = Path(__file__).resolve().parents[1]
MAINS = {
    "cognet": "from cognet.cli import main; main()",
    "cognet-batch": "from cognet.runtime.cli import main; main()",
    "cognet-export": "from cognet.export.cli import main; main()",
}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """root/data, root/ckpt, root/model (unvalidated export) and root/to_score.parquet (the
    last visit of each patient without medications). Read-only: tests copy what they
    change."""
    from cognet.export import ExportOptions, export

    root = tmp_path_factory.mktemp("writers")
    data, ckpt = make_tiny(root, n_patients=30)
    export(ckpt, root / "model", ExportOptions(validate=False))
    visits = pq.read_table(data / "visits.parquet").drop_columns(["split"])
    pids = visits["patient_id"].to_pylist()
    last = [i + 1 == len(pids) or pids[i + 1] != p for i, p in enumerate(pids)]
    column = visits["medications"]
    meds = [None if end else m for m, end in zip(column.to_pylist(), last, strict=True)]
    i = visits.schema.get_field_index("medications")
    pq.write_table(
        visits.set_column(i, "medications", pa.array(meds, column.type)), root / "to_score.parquet"
    )
    return root


def error(result, code: int = 2) -> str:
    """The one line of a failed command (no traceback)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def temps(folder: Path) -> list[str]:
    """Temporary names anywhere under `folder` (`cognet.core.files.temp_path`'s)."""
    return sorted(str(p) for p in folder.rglob("*") if is_temp(p.name))


def writers(made: Path, tmp: Path) -> dict[str, tuple]:
    """{name: (main, argv, output)} for every writing command, its output under `tmp`; the
    converters' inputs are empty files: the lock is taken before anything is read."""
    empty = tmp / "inputs"
    empty.mkdir(exist_ok=True)
    for name in ("a.csv", "b.csv", "c.csv", "d.csv", "r.pkl", "v.pkl", "i.pkl"):
        (empty / name).touch()
    (empty / "src").mkdir(exist_ok=True)
    maps = [
        "--ndc-rxnorm",
        str(empty / "a.csv"),
        "--rxnorm-atc",
        str(empty / "b.csv"),
        "--drug-atc",
        str(empty / "c.csv"),
        "--ddi",
        str(empty / "d.csv"),
    ]
    data, ckpt, model = made / "data", made / "ckpt", made / "model"
    out, file = tmp / "out", tmp / "out.parquet"
    evaluate = ["evaluate", "--checkpoint", str(ckpt), "--data", str(data), "--rounds", "1"]
    return {
        "score": (
            batch_main,
            [
                "score",
                str(made / "to_score.parquet"),
                "--model",
                str(model),
                "--out",
                str(file),
                "--quiet",
            ],
            file,
        ),
        "train": (
            cognet_main,
            ["train", "--data", str(data), "--out", str(out), "--epochs", "1", "--quiet"],
            out,
        ),
        "export": (
            export_main,
            ["--checkpoint", str(ckpt), "--out", str(out), "--no-validate"],
            out,
        ),
        "evaluate --predictions": (cognet_main, [*evaluate, "--predictions", str(file)], file),
        "evaluate --json": (
            cognet_main,
            [*evaluate, "--json", str(tmp / "r.json")],
            tmp / "r.json",
        ),
        "data synth": (cognet_main, ["data", "synth", "--out", str(out), "--patients", "20"], out),
        "data benchmark": (
            cognet_main,
            [
                "data",
                "benchmark",
                "--records",
                str(empty / "r.pkl"),
                "--voc",
                str(empty / "v.pkl"),
                "--ddi",
                str(empty / "i.pkl"),
                "--out",
                str(out),
            ],
            out,
        ),
        "data mimic3": (
            cognet_main,
            ["data", "mimic3", "--mimic-dir", str(empty / "src"), *maps, "--out", str(out)],
            out,
        ),
        "data mimic4": (
            cognet_main,
            ["data", "mimic4", "--mimic-dir", str(empty / "src"), *maps, "--out", str(out)],
            out,
        ),
        "data omop": (
            cognet_main,
            ["data", "omop", "--cdm", str(empty / "src"), "--out", str(out)],
            out,
        ),
        "data meds": (
            cognet_main,
            ["data", "meds", "--meds-dir", str(empty / "src"), "--out", str(out)],
            out,
        ),
        "bench": (
            bench_main,
            ["--model", str(model), "--data", str(data), "--out", str(out), "--quick"],
            out,
        ),
    }


COMMANDS = [
    "score",
    "train",
    "export",
    "evaluate --predictions",
    "evaluate --json",
    "data synth",
    "data benchmark",
    "data mimic3",
    "data mimic4",
    "data omop",
    "data meds",
    "bench",
]


# -- 1. one lock per output, shared by every command ---------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("holder", ["cognet train", "cognet-batch score"])
def test_every_writer_is_refused_while_another_command_holds_its_output(
    made, tmp_path, command, holder
):
    main, argv, out = writers(made, tmp_path)[command]
    before = set(os.listdir(tmp_path))
    with claim(out, holder):  # a run of another command, still writing `out`
        line = error(CliRunner().invoke(main, argv))
    assert f"{out}: is being written by {holder} (pid {os.getpid()})" in line
    assert not out.exists() and set(os.listdir(tmp_path)) == before  # nothing made, no lock


def stopped(proc: subprocess.Popen, timeout: float = 180) -> None:
    """Wait until `proc` has stopped itself (COGNET_KILL_AT=POINT:STOP)."""
    stat = Path(f"/proc/{proc.pid}/stat")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()[1]
        if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {proc.pid} never reached its stop point")


def start(program: str, argv: list[str], point: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "COGNET_KILL_AT": point or ""}
    return subprocess.Popen(
        [sys.executable, "-c", MAINS[program], *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_score_against_train_on_one_out_refuses_one_and_keeps_the_other_whole(made, tmp_path):
    from cognet.model import checkpoint

    out = tmp_path / "R"
    cmds = writers(made, tmp_path)
    score_argv = [*cmds["score"][1][:-3], "--out", str(out), "--quiet"]
    # train first, stopped with its checkpoint complete but not yet moved in: score is refused
    train = start(
        "cognet", [*cmds["train"][1][:3], "--out", str(out), "--epochs", "1"], "staged:STOP"
    )
    try:
        stopped(train)
        line = error(CliRunner().invoke(batch_main, score_argv))
        assert f"{out}: is being written by cognet train (pid {train.pid})" in line
    finally:
        code, err = finish(train)
    assert code == 0, err
    checkpoint.load(out)  # whole, and nothing of score's beside it
    assert sorted(os.listdir(tmp_path)) == ["R", "inputs"]
    # score first, stopped at its first part (OUT not yet written): train is refused, and so
    # is evaluate --predictions onto the same file
    shutil.rmtree(out)
    score = start("cognet-batch", score_argv[:-1], "replace:STOP")
    try:
        stopped(score)
        for argv in (
            cmds["train"][1][:3] + ["--out", str(out)],
            cmds["evaluate --predictions"][1][:-1] + [str(out)],
        ):
            line = error(CliRunner().invoke(cognet_main, argv))
            assert f"{out}: is being written by cognet-batch score (pid {score.pid})" in line
    finally:
        code, err = finish(score)
    assert code == 0, err
    assert pq.read_table(out).num_rows == 30  # every visit of to_score.parquet
    pq.read_table(tmp_path / "R.rejects.parquet")
    assert sorted(os.listdir(tmp_path)) == ["R", "R.rejects.parquet", "inputs"]


# -- 5. whole or absent: SIGTERM at named points of each write -----------------------------------
def old_output(made: Path, command: str, out: Path) -> None:
    """An earlier run's output at `out`, for the new run to replace."""
    source = {"data synth": made / "data", "train": made / "ckpt", "export": made / "model"}
    if command in source:
        shutil.copytree(source[command], out)
    else:
        out.write_bytes(b"an earlier run's output")


KILLS = [
    *[("data synth", p) for p in ("replace", "staged", "aside")],
    *[("train", p) for p in ("staged", "aside")],
    *[("export", p) for p in ("replace", "staged")],
    *[("score", p) for p in ("replace", "merged")],
    ("evaluate --predictions", "replace"),
]
PROGRAMS = {"score": "cognet-batch", "export": "cognet-export"}


@pytest.mark.parametrize(("command", "point"), KILLS)
def test_sigterm_at_each_point_leaves_the_output_as_it_was_or_whole(made, tmp_path, command, point):
    _, argv, out = writers(made, tmp_path)[command]
    old_output(made, command, out)
    before = snapshot(out)
    run = start(PROGRAMS.get(command, "cognet"), argv, point)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 143, err
    assert err.strip().splitlines()[-1] == "Terminated" and "Traceback" not in err, err
    now = snapshot(out)
    if now != before:  # the new output, whole: a folder swapped in, or score's OUT merged
        assert point in ("aside", "merged"), now.keys()
        whole = {"data synth": {"visits.parquet", "ddi.parquet"}, "train": {"config.json"}}
        if command == "score":  # its parts stay for --resume, which writes the rejects file
            assert pq.read_table(out).num_rows == 30
            result = CliRunner().invoke(batch_main, [*argv, "--resume"])
            assert result.exit_code == 0 and pq.read_table(out).num_rows == 30, result.output
        else:
            assert whole[command] <= set(now), now.keys()
    assert temps(tmp_path) == [] and not list(tmp_path.glob(".*.lock"))


@pytest.mark.parametrize(
    ("command", "point"), [("data synth", "staged"), ("train", "staged"), ("score", "replace")]
)
def test_sigint_cleans_up_as_sigterm_does(made, tmp_path, command, point):
    _, argv, out = writers(made, tmp_path)[command]
    old_output(made, command, out)
    before = snapshot(out)
    run = start(PROGRAMS.get(command, "cognet"), argv, f"{point}:INT")
    _, err = run.communicate(timeout=300)
    assert run.returncode == 130, err
    assert err.strip().splitlines()[-1] == "Interrupted" and "Traceback" not in err, err
    assert snapshot(out) == before
    assert temps(tmp_path) == [] and not list(tmp_path.glob(".*.lock"))


@pytest.mark.parametrize(
    ("command", "point"), [("data synth", "staged"), ("score", "replace"), ("data synth", "aside")]
)
def test_kill_9_leaves_only_temporary_names_that_the_next_run_removes(
    made, tmp_path, command, point
):
    main, argv, out = writers(made, tmp_path)[command]
    old_output(made, command, out)
    before = snapshot(out)
    run = start(PROGRAMS.get(command, "cognet"), argv, f"{point}:KILL")
    run.communicate(timeout=300)
    assert run.returncode == -signal.SIGKILL
    assert temps(tmp_path), "kill -9 runs no clean-up"
    if point != "aside":
        assert snapshot(out) == before  # never a half output
    locked = writer.outputs(out) if command == "score" else [out]
    with claimed(locked, "a test"):  # the next run holding the locks removes them
        pass
    assert temps(tmp_path) == []
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert temps(tmp_path) == [] and not list(tmp_path.glob(".*.lock"))
