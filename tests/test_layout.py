"""The layering of DESIGN.md §1 and the tree-wide rules (no test module
imports another; every DESIGN.md citation resolves; no import circle) of
tools/check_layout.py, run by `make lint`: the tree keeps them, and the check fails on a tree
that breaks any of them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "check_layout.py"
_spec = importlib.util.spec_from_file_location("check_layout", SCRIPT)
check_layout = sys.modules["check_layout"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_layout)

SETUP = """from setuptools import setup

PACKAGE_DIR = {
    "cognet": "cognet",
    "cognet.export": "export",
    "cognet.runtime": "runtime",
    "cognet.benchmarks": "benchmarks",
}
setup(name="cognet", package_dir=PACKAGE_DIR)
"""
# a small tree that keeps every rule: file -> source
CLEAN = {
    "cognet/__init__.py": "",
    "cognet/core/__init__.py": "",
    "cognet/core/errors.py": "class InputError(ValueError):\n    pass\n",
    "cognet/core/vocab.py": "from cognet.core.errors import InputError\n",
    "cognet/core/commandline.py": "import click\n\nfrom cognet.core import vocab\n",
    "cognet/data/__init__.py": "",
    "cognet/data/synth.py": "import numpy as np\n\nfrom cognet.core import vocab\n",
    "cognet/model/__init__.py": "",
    "cognet/model/network.py": "import torch\n\nfrom cognet.core.vocab import InputError\n",
    "cognet/training/__init__.py": "",
    "cognet/training/train.py": "from cognet.model import network\nfrom cognet.data import synth\n",
    "cognet/evaluation/__init__.py": "",
    "cognet/evaluation/evaluate.py": "from cognet.training import train\n",
    "cognet/cli/__init__.py": "from cognet.evaluation import evaluate\n",
    "export/__init__.py": "",
    "export/pipeline.py": (
        "import torch\n\nfrom cognet.model import network\n\n\n"
        "def validate():\n    from cognet.runtime import scorer\n"
    ),
    "runtime/__init__.py": "",
    "runtime/scorer.py": (
        "import onnxruntime\n\nfrom cognet.core import vocab\nfrom . import reader\n"
    ),
    "runtime/reader.py": "import pyarrow\n",
    "runtime/cli.py": "import click\n\nfrom cognet.core.commandline import handle_errors\n",
    "benchmarks/__init__.py": "",
    "benchmarks/engines.py": "from cognet.model import network\nfrom cognet.runtime import x\n",
}


def write_tree(root: Path, changes: dict[str, str]) -> Path:
    (root / "setup.py").write_text(SETUP)
    for name, text in {**CLEAN, **changes}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_tree_keeps_the_layering():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_clean_tree_passes(tmp_path):
    assert check_layout.violations(write_tree(tmp_path, {})) == []


@pytest.mark.parametrize(
    "file,source,rule",
    [
        ("runtime/scorer.py", "import torch\n", "runtime: cognet.runtime imports torch"),
        ("runtime/beam.py", "def f():\n    import torch.nn\n", "runtime: cognet.runtime"),
        (
            "runtime/scorer.py",
            "from cognet.model import network\n",
            "runtime: cognet.runtime.scorer",
        ),
        ("runtime/scorer.py", "from cognet.data import synth\n", "runtime: "),
        ("cognet/core/vocab.py", "import torch\n", "core: cognet.core imports torch"),
        ("cognet/core/vocab.py", "from cognet.training import train\n", "core: cognet.core.vocab"),
        ("cognet/core/vocab.py", "from ..runtime import scorer\n", "no-runtime: "),
        ("cognet/core/vocab.py", "import click\n", "click: cognet.core imports click"),
        (
            "cognet/core/vocab.py",
            "from cognet.core import commandline\n",
            "core: cognet.core.vocab imports cognet.core.commandline",
        ),
        ("cognet/evaluation/evaluate.py", "def f():\n    import click\n", "click: "),
        (
            "cognet/core/commandline.py",
            "from cognet.model import network\n",
            "commandline: cognet.core.commandline",
        ),
        (
            "cognet/core/commandline.py",
            "import torch\n",
            "commandline: cognet.core.commandline imports torch",
        ),
        ("cognet/data/synth.py", "import torch\n", "data: cognet.data imports torch"),
        ("cognet/data/synth.py", "from cognet.model.network import x\n", "data: cognet.data.synth"),
        ("cognet/training/train.py", "def f():\n    from cognet.runtime import x\n", "no-runtime"),
        ("cognet/model/network.py", "from cognet.training import train\n", "model: cognet.model"),
        ("cognet/training/train.py", "from cognet.cli import x\n", "training: cognet.training"),
        ("cognet/evaluation/evaluate.py", "from cognet.cli import x\n", "evaluation: "),
        ("export/pipeline.py", "from cognet.runtime.scorer import x\n", "at module level"),
        ("cognet/model/network.py", "from cognet.benchmarks import engines\n", "benchmarks-on-top"),
        (
            "cognet/model/network.py",
            "import cognet.export.pipeline\n",
            "model: cognet.model.network",
        ),
        ("runtime/reader.py", "from cognet.runtime import scorer\n", "import-cycle: "),
        ("cognet/core/errors.py", "def f():\n    from cognet.core import vocab\n", "import-cycle"),
    ],
)
def test_the_check_fails_when_a_rule_is_broken(tmp_path, file, source, rule):
    root = write_tree(tmp_path, {file: source})
    found = check_layout.violations(root)
    assert found and rule in found[0] and found[0].startswith(file), found
    # an import against the layering may also close a circle: that is the only other finding
    assert all("import-cycle" in line for line in found[1:]), found
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True
    )
    assert result.returncode == 1 and rule in result.stdout


# -- the rules over the whole tree (TREE_RULES) ---------------------------------------------
DESIGN = "# design\n\n## 1. Layout\n\ntext\n\n## 2. Dataset contract\n\n### 2.1 not a section\n"


@pytest.mark.parametrize(
    "source",
    [
        "from test_b import helper\n",
        "import test_b\n",
        "def test_x():\n    from test_b import helper\n",  # lazy imports count too
        "from tests.test_b import helper\n",
        "from tests import test_b\n",
    ],
)
def test_a_test_module_importing_another_is_refused(tmp_path, source):
    root = write_tree(tmp_path, {"tests/test_a.py": source, "tests/test_b.py": "helper = 1\n"})
    found = check_layout.violations(root)
    assert len(found) == 1 and found[0].startswith("tests/test_a.py:"), found
    assert "test-imports: imports test module" in found[0] and "test_b" in found[0]


def test_tests_may_import_helper_modules_and_conftest(tmp_path):
    changes = {
        "tests/test_a.py": "from tiny import make\nimport conftest\nimport pytest\n",
        "tests/tiny.py": "from test_b import x\n",  # a helper module is no test module
        "tests/conftest.py": "",
        "tests/test_b.py": "x = 1\n",
    }
    assert check_layout.violations(write_tree(tmp_path, changes)) == []


@pytest.mark.parametrize(
    "file,text,bad",
    [
        ("README.md", "see DESIGN.md §3\n", ["§3"]),
        ("cognet/core/vocab.py", '"""As DESIGN.md §2 and §7 say."""\n', ["§7"]),
        ("Makefile", "# the layering of DESIGN.md §1, \u00a79\n", ["\u00a79"]),
        ("docs/guide/how-it-works.md", "(DESIGN §4: metrics)\n", ["§4"]),
        ("docs/guide/how-it-works.md", "docs/DESIGN.md §2 and DESIGN.md §1\n", []),
        ("README.md", "the section 2.1 of DESIGN.md; § alone\n", []),
    ],
)
def test_every_design_citation_names_a_heading(tmp_path, file, text, bad):
    root = write_tree(tmp_path, {"docs/DESIGN.md": DESIGN, file: text})
    found = check_layout.violations(root)
    assert [f.split("cites ")[1].split(":")[0] for f in found] == bad, found
    assert all(f.startswith(f"{file}:1: design-citations: ") for f in found)


def test_citations_without_the_design_document_are_refused(tmp_path):
    root = write_tree(tmp_path, {"README.md": "intro\n\nsee DESIGN.md §1\n"})
    found = check_layout.violations(root)
    assert len(found) == 1 and found[0].startswith("README.md:3: design-citations: ")
    assert "no docs/DESIGN.md" in found[0]


def test_hidden_and_build_folders_are_not_read(tmp_path):
    changes = {
        ".venv/lib/x.py": "# DESIGN.md \u00a79\n",
        "build/lib/y.py": "# DESIGN.md \u00a79\n",
        "docs/DESIGN.md": DESIGN,
    }
    assert check_layout.violations(write_tree(tmp_path, changes)) == []


DRIVER = "def run(cfg, done, live):\n    if live.size < cfg.compact_at * done.size:\n        pass\n"


def test_the_compaction_rule_lives_in_the_driver_only(tmp_path):
    for name in ("once", "twice", "lost"):
        (tmp_path / name).mkdir()
    home = "cognet/core/decoding/driver.py"
    root = write_tree(tmp_path / "once", {home: DRIVER, "cognet/core/decoding/__init__.py": ""})
    assert check_layout.violations(root) == []
    copied = {home: DRIVER, "runtime/beam.py": DRIVER}
    found = check_layout.violations(write_tree(tmp_path / "twice", copied))
    assert len(found) == 1 and found[0].startswith("runtime/beam.py:2: compaction-once")
    lost = {home: "def run():\n    pass\n"}
    found = check_layout.violations(write_tree(tmp_path / "lost", lost))
    assert len(found) == 1 and "lost its compaction rule" in found[0]
