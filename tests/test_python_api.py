"""The Python API: the README's example runs as written, without torch, on a tiny model;
what `cognet.runtime` exports; `Scorer` as a context manager and its one options value."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tiny import last_visits_unknown

import cognet.runtime
from cognet.core.errors import InputError
from cognet.runtime import DecodingRequest, ScoreOptions, Scorer

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


def test_the_runtime_exports_what_a_caller_passes_the_scorer():
    from cognet.core.ddi import DDIPolicy as CoreDDIPolicy
    from cognet.core.decoding.request import DecodingRequest as CoreRequest
    from cognet.runtime import DDIPolicy, Scorer
    from cognet.runtime.scorer import Scorer as RuntimeScorer

    assert DDIPolicy is CoreDDIPolicy and DecodingRequest is CoreRequest
    assert Scorer is RuntimeScorer
    assert {"DDIPolicy", "DecodingRequest", "Scorer"} <= set(cognet.runtime.__all__)


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cognet-batch")]


def _scored(scorer: Scorer, visits) -> int:
    return sum(c.recommendations.num_rows for c in scorer.score_table(visits, score_all=True))


def test_with_scorer_stops_its_threads(tiny):
    """Two streams decode on a pool of two threads; the end of the `with` block stops and
    joins them, and closing again does nothing."""
    visits = pq.read_table(tiny / "data" / "visits.parquet")
    before = set(_pool_threads())
    with Scorer(
        tiny / "model", ScoreOptions.of(device="cpu", threads=2, streams=2, batch_size=8)
    ) as scorer:
        rows = _scored(scorer, visits)
        assert rows > 0 and set(_pool_threads()) - before  # the streams ran on the pool
    assert scorer._pool is None
    assert set(_pool_threads()) <= before
    scorer.close()  # idempotent
    assert _scored(scorer, visits) == rows  # a closed scorer decodes on this thread


def test_scorer_takes_one_options_value(tiny):
    """`Scorer(model, options)` is the one form: `ScoreOptions.of` builds the options from
    keywords (ScoreOptions' fields and its request's), the scorer takes none of them."""
    assert list(inspect.signature(Scorer).parameters) == ["model", "options"]
    options = ScoreOptions(device="cpu", request=DecodingRequest(beam=1), batch_size=8)
    by_options = Scorer(tiny / "model", options)
    by_keywords = Scorer(tiny / "model", ScoreOptions.of(device="cpu", beam=1, batch_size=8))
    assert by_keywords.options == by_options.options
    assert by_keywords.settings() == by_options.settings()
    assert Scorer(tiny / "model").options == ScoreOptions()
    with pytest.raises(TypeError):
        Scorer(tiny / "model", options, beam=2)
    with pytest.raises(TypeError, match="ScoreOptions.of"):
        Scorer(tiny / "model", {"device": "cpu"})
    with pytest.raises(InputError, match="beam"):
        Scorer(tiny / "model", ScoreOptions.of(device="cpu", beam=0))
