"""A runtime-only install (`pip install -e ".[cpu]"`: no torch, onnx, onnxscript, safetensors,
matplotlib), imitated by a subprocess in which importing them fails: every command's `--help`
prints without a traceback, and a command that needs training's packages exits 2 with one
line naming the extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what `.[cpu]` does not install (setup.py's extras)
ABSENT = ("torch", "onnx", "onnxscript", "safetensors", "matplotlib")
MAINS = {
    "cognet": "cognet.cli",
    "cognet-export": "cognet.export.cli",
    "cognet-batch": "cognet.runtime.cli",
    "cognet-bench": "cognet.benchmarks.cli",
}


def runtime_only(program: str, *args: object) -> subprocess.CompletedProcess:
    """`program ARGS` in a process where importing any of ABSENT fails, as it does there."""
    code = (
        f"import sys\nfor m in {ABSENT!r}: sys.modules[m] = None\n"  # `import m` now fails
        f"from {MAINS[program]} import main\nmain(sys.argv[1:], prog_name={program!r})\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,  # catches a hang only
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("cognet", "--help"),
        ("cognet", "train", "--help"),
        ("cognet", "evaluate", "--help"),
        ("cognet-export", "--help"),
        ("cognet-batch", "score", "--help"),
        ("cognet-bench", "--help"),
    ],
)
def test_help_prints_without_a_traceback(argv):
    done = runtime_only(*argv)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout and "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize(
    ("argv", "module"),
    [
        (("cognet", "train", "--data", "{tiny}/data", "--out", "{tmp}/ckpt"), "torch"),
        (("cognet", "evaluate", "--checkpoint", "{tiny}/ckpt", "--data", "{tiny}/data"), "torch"),
        # the export pipeline imports torch before onnx: both are the [train] extra's
        (("cognet-export", "--checkpoint", "{tiny}/ckpt", "--out", "{tmp}/model"), "torch"),
    ],
)
def test_a_command_that_needs_training_packages_names_the_extra(tiny, tmp_path, argv, module):
    args = [a.format(tiny=tiny, tmp=tmp_path) for a in argv]
    done = runtime_only(*args)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    command = " ".join(argv[:2]) if argv[0] == "cognet" else argv[0]
    assert lines == [
        f"Error: {command} needs {module}, which is not installed: install the [train] "
        'extra, pip install -e ".[train]" (README, Installing)'
    ], done.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "model").exists()


def test_the_bench_runs_the_runtime_engines_without_torch(tiny, tmp_path):
    out = tmp_path / "out"
    argv = ["--quick", "--model", tiny / "model", "--data", tiny / "data", "--out", out]
    done = runtime_only("cognet-bench", *argv, "--no-profile", "--input-sizes", "")
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "results.json").read_text())
    for name in ("torch-perpatient", "torch-batched", "torch-cuda"):
        assert results["engines"][name] == {
            "status": "skipped",
            "reason": "torch is not installed (the [train] extra)",
        }
    assert {r["engine"] for r in results["runs"]} >= {"ort-cpu"}
    assert [r["visits"] for r in results["latency"]] == [1, 8]
    notes = results["notes"]
    assert any(
        n.startswith("lists not checked: the correctness reference torch-batched") for n in notes
    )
    assert any(n.startswith("plots skipped: matplotlib is not installed") for n in notes)
    assert "DDI trade-off skipped: it needs torch (the [train] extra)" in notes
    assert not (out / "latency.png").exists() and results["ddi_tradeoff"] is None
    assert "latency ort-cpu" in done.stdout


def test_the_bench_without_a_model_says_it_needs_torch_to_build_one(tmp_path):
    done = runtime_only("cognet-bench", "--quick", "--out", tmp_path / "out")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: no --model: building the demo model needs torch (the [train] extra); on a "
        "runtime-only install, pass --model DIR"
    ]
