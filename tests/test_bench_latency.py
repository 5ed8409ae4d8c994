"""cognet-bench's latency series (`cognet.benchmarks.latency`) and what a run reports: the
requests behind each percentile and the "not enough" mark, a bounded count of requests per
size, the real number of passes, only the engines asked, and the results files on disk as
the run goes (a run stopped early keeps what it measured)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cognet.benchmarks import harness, latency
from cognet.benchmarks.cli import main
from cognet.benchmarks.report import markdown


@pytest.mark.parametrize(
    ("n", "short"),
    [(12, ["p50", "p95", "p99"]), (20, ["p99"]), (99, ["p99"]), (100, [])],
)
def test_a_percentile_says_how_many_requests_are_behind_it(n, short):
    ps = latency.percentiles([float(i) for i in range(1, n + 1)])
    assert {q: p["n"] for q, p in ps.items()} == dict.fromkeys(("p50", "p95", "p99"), n)
    assert [q for q, p in ps.items() if not p["enough"]] == short
    for q in ("p50", "p95", "p99"):
        text = latency.shown(ps[q])
        assert text.endswith(f"(n={n}, not enough)") == (q in short), text


class FakePool:
    """`len` patients; batch(lo, hi) returns the slice asked, as the pool's do."""

    def __init__(self, n: int):
        self.n, self.asked = n, []

    def __len__(self) -> int:
        return self.n

    def batch(self, lo: int, hi: int):
        self.asked.append((lo, hi))
        return type("Batch", (), {"table": (lo, hi)})()


class FakeScorer:
    """Each call advances a fake clock by `cost` seconds a visit."""

    def __init__(self, cost: float):
        self.cost, self.now, self.calls = cost, 0.0, []

    def clock(self) -> float:
        return self.now

    def score_table(self, table):
        lo, hi = table
        self.calls.append(hi - lo)
        self.now += self.cost * (hi - lo)
        return iter([type("Chunk", (), {"recommendations": type("T", (), {"num_rows": hi - lo})})])


def test_requests_stop_at_the_target_count_or_where_the_budget_runs_out():
    pool, scorer = FakePool(64), FakeScorer(0.01)
    seconds = latency.measure(scorer, pool, 16, 1e9, 4, clock=scorer.clock)
    assert len(seconds) == latency.TARGET_REQUESTS
    assert scorer.calls == [4] + [16] * latency.TARGET_REQUESTS  # one warm-up, untimed
    assert pool.asked[1:5] == [(0, 16), (16, 32), (32, 48), (48, 64)]  # a new slice each
    assert pool.asked[5] == (0, 16)
    # 10 s a request, 25 s of budget: the third would end past it; the first always runs
    slow = FakeScorer(10.0)
    assert latency.measure(slow, FakePool(4), 1, 25.0, 1, clock=slow.clock) == [10.0, 10.0]
    assert latency.measure(slow, FakePool(4), 1, 1.0, 1, clock=slow.clock) == [10.0]


def test_a_size_reports_per_request_and_per_visit_with_their_counts():
    r = latency.record("ort-cpu", "set", 256, 16, [0.1] * 30 + [0.3] * 2)
    assert r["requests"] == 32 and r["cut_by_budget"] is True
    assert r["per_request_ms"]["p50"] == {"ms": pytest.approx(100.0), "n": 32, "enough": True}
    assert r["per_visit_ms"]["p50"]["ms"] == pytest.approx(100.0 / 16)
    assert r["per_request_ms"]["p99"]["enough"] is False
    assert r["visits_per_s"] == pytest.approx(16 * 32 / 3.6)
    line = latency.line(r)
    assert "requests of 16 visit(s), 32 timed" in line and "(n=32, not enough)" in line


def test_the_default_batch_joins_the_sizes_asked_once():
    from cognet.benchmarks.settings import RUNTIME_BATCH, Settings

    settings = Settings(latency_sizes=(1, 16, 256, RUNTIME_BATCH))
    assert latency.request_sizes(settings, 256) == (1, 16, 256)
    assert latency.request_sizes(Settings(latency_sizes=()), 256) == ()


@pytest.fixture(scope="module")
def ort_only(tiny, tmp_path_factory):
    """`--engines ort-cpu --reference none`, stopped (Ctrl-C) when the runs are done."""
    out = tmp_path_factory.mktemp("bench_ort") / "out"
    argv = ["--quick", "--model", tiny / "model", "--data", tiny / "data", "--out", out]
    argv += ["--engines", "ort-cpu", "--reference", "none", "--repeats", "3"]
    with pytest.MonkeyPatch.context() as mp:

        def stop(*args, **kwargs):
            raise KeyboardInterrupt

        mp.setattr(harness, "past_visits_series", stop)
        result = CliRunner().invoke(main, [str(a) for a in argv])
    return result, out


def test_a_run_stopped_early_keeps_what_it_measured(ort_only):
    result, out = ort_only
    assert result.exit_code == 130, result.output
    results = json.loads((out / "results.json").read_text())
    assert [r["visits"] for r in results["latency"]] == [1, 8]
    assert {(r["beam"], r["batch_size"]) for r in results["runs"]} == {
        (1, 1),
        (1, 8),
        (4, 1),
        (4, 8),
    }
    assert (
        "## Latency: requests of N visits through the runtime" in (out / "results.md").read_text()
    )


def test_only_the_engines_asked_run(ort_only):
    _, out = ort_only
    results = json.loads((out / "results.json").read_text())
    assert set(results["engines"]) == {"ort-cpu"}  # no torch reference, no trade-off
    assert {r["engine"] for r in results["runs"]} == {"ort-cpu"}
    assert "ddi_tradeoff" not in results
    assert "lists not checked (--reference none)" in results["notes"]


def test_the_correctness_reference_is_named_when_it_runs_unasked(tiny, tmp_path):
    argv = ["--quick", "--model", tiny / "model", "--checkpoint", tiny / "ckpt", "--data"]
    argv += [tiny / "data"]
    argv += ["--out", tmp_path / "out", "--engines", "ort-cpu", "--input-sizes", ""]
    argv += ["--past-visits", "", "--no-profile", "--latency-sizes", ""]
    result = CliRunner().invoke(main, [str(a) for a in argv])
    assert result.exit_code == 0, result.output
    assert "loaded torch-batched in" in result.output and "as the correctness reference" in (
        result.output
    )
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["engines"]["torch-batched"]["status"] == "correctness reference"
    assert {r["engine"] for r in results["runs"]} == {"ort-cpu"}
    assert all(r["matches_reference"] is True for r in results["runs"])
    assert "ddi_tradeoff" not in results  # torch's own evaluation: no torch engine asked
    assert (
        "| torch-batched | correctness reference |" in (tmp_path / "out" / "results.md").read_text()
    )


def test_results_md_gives_the_passes_that_ran_and_marks_short_percentiles(ort_only):
    _, out = ort_only
    results = json.loads((out / "results.json").read_text())
    for run in results["runs"]:
        run.update(repeats=1, latency_samples=12)  # the budget stopped each after one pass
    text = markdown(results)
    assert "up to 3 repeat(s)" in text
    table = text.split("## Throughput and latency")[1].split("## Engines")[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ort-cpu |")]
    assert rows and all(row[4].strip() == "1" for row in rows)  # the passes column
    assert all(row[7].strip().endswith("(n=12, not enough)") for row in rows)  # batch p50
    results["latency"][0]["per_request_ms"] = latency.percentiles([5.0] * 12)
    assert "| 5.0 (n=12, not enough) |" in markdown(results)
