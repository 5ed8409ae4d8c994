"""setup.py finds every package (`find_packages` under each folder of PACKAGE_DIR): a wheel
built from the tree holds every module of the tree, and installed on its own it runs
`cognet --help` and `cognet-batch --help`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "cognet": "cognet",
    "export": "cognet/export",
    "runtime": "cognet/runtime",
    "benchmarks": "cognet/benchmarks",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    (found,) = out.glob("cognet-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_the_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {
        f"{installed}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, installed in FOLDERS.items()
        for path in (ROOT / folder).rglob("*.py")
    }
    assert want <= names, sorted(want - names)


@pytest.mark.slow
def test_the_wheel_holds_the_code_names(wheel):
    """setup.py's package_data: the names that explanations print ship in the wheel."""
    assert "cognet/core/code_names.tsv.gz" in zipfile.ZipFile(wheel).namelist()


@pytest.mark.slow
def test_the_installed_wheel_runs_the_commands(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    for module, words in (("cognet.cli", "train"), ("cognet.runtime.cli", "score")):
        code = f"import cognet, sys; assert cognet.__file__.startswith({str(target)!r}); "
        code += f"from {module} import main; main(['--help'])"
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
        )
        assert run.returncode == 0, run.stderr
        assert words in run.stdout
