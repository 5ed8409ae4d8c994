"""The README's "Python API" example runs as written, without torch, on a tiny model."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from tiny import last_visits_unknown

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The first ```python block of the README's "## Python API" section."""
    section = README.read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "README: no python block under '## Python API'"
    return blocks[0]


def test_readme_example_runs_without_torch(tiny, tmp_path):
    visits = last_visits_unknown(pq.read_table(tiny / "data" / "visits.parquet"))
    pq.write_table(visits, tmp_path / "visits.parquet")
    (tmp_path / "model").symlink_to(tiny / "model")
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
        + readme_example()
        + "results.to_parquet('results.parquet')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    to_score = [v["visit_id"] for v in visits.to_pylist() if v["medications"] is None]
    printed = [line.split(" ", 1) for line in done.stdout.splitlines()]
    assert [visit_id for visit_id, _ in printed] == to_score
    results = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert [r["visit_id"] for r in results] == visits["visit_id"].to_pylist()
    scored = {r["visit_id"]: r for r in results}
    for visit_id, rest in printed:  # "['M01X', ...] -1.234": the same lists both ways
        medications, score = rest.rsplit(" ", 1)
        assert ast.literal_eval(medications) == scored[visit_id]["medications"]
        assert float(score) < 0
    assert any(scored[v]["medications"] for v in to_score)
