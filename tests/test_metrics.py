"""Metrics against hand-computed examples (cognet.metrics)."""

import subprocess
import sys

import numpy as np
import pytest

from cognet.core import metrics
from cognet.core.metrics import VisitResult

M = 6


def ddi(*pairs: tuple[int, int]) -> np.ndarray:
    adj = np.zeros((M, M), dtype=bool)
    for a, b in pairs:
        adj[a, b] = adj[b, a] = True
    return adj


NO_DDI = ddi()


# -- per-visit set metrics ------------------------------------------------------------------


def test_set_metrics_hand_computed():
    pred, truth = (0, 1, 2), (1, 2, 3, 4)
    assert metrics.jaccard(pred, truth) == pytest.approx(2 / 5)
    assert metrics.precision(pred, truth) == pytest.approx(2 / 3)
    assert metrics.recall(pred, truth) == pytest.approx(2 / 4)
    assert metrics.f1(pred, truth) == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))


def test_set_metrics_ignore_order_and_duplicates():
    assert metrics.jaccard((2, 1, 1), (1, 2)) == 1.0
    assert metrics.f1((3, 0), (0, 3)) == 1.0


def test_empty_prediction_scores_zero():
    for fn in (metrics.jaccard, metrics.precision, metrics.recall, metrics.f1):
        assert fn((), (1, 2)) == 0.0


def test_prediction_for_empty_truth_scores_zero():
    for fn in (metrics.jaccard, metrics.precision, metrics.recall, metrics.f1):
        assert fn((1,), ()) == 0.0


def test_both_empty_is_a_correct_abstention():
    for fn in (metrics.jaccard, metrics.precision, metrics.recall, metrics.f1):
        assert fn((), ()) == 1.0


def test_single_drug_sets():
    assert metrics.jaccard((3,), (3,)) == 1.0
    assert metrics.f1((3,), (4,)) == 0.0
    assert metrics.ddi_pairs_count((3,), ddi((3, 3))) == (0, 0)


def test_disjoint_sets_f1_is_zero():
    assert metrics.f1((0, 1), (2, 3)) == 0.0
    assert metrics.jaccard((0, 1), (2, 3)) == 0.0


# -- average precision ------------------------------------------------------------------------


def test_average_precision_distinct_scores():
    # ranks: +, -, +, -  -> P@1 = 1 (R 0.5), P@3 = 2/3 (R 1)
    ap = metrics.average_precision(np.array([0.9, 0.7, 0.5, 0.1]), np.array([1, 0, 1, 0]))
    assert ap == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)


def test_average_precision_ties_form_one_threshold():
    # one threshold holding both: precision 1/2 at recall 1 (not 1.0 as a sort would give)
    assert metrics.average_precision(np.array([0.5, 0.5]), np.array([1, 0])) == 0.5
    # thresholds 0.8 (P 0, R 0), 0.5 (P 2/4, R 2/3), 0.2 (P 3/5, R 1)
    ap = metrics.average_precision(np.array([0.8, 0.5, 0.5, 0.5, 0.2]), np.array([0, 1, 0, 1, 1]))
    assert ap == pytest.approx(2 / 3 * 0.5 + 1 / 3 * 0.6)


def test_average_precision_edge_cases():
    assert metrics.average_precision(np.array([0.3, 0.1]), np.array([0, 0])) == 0.0
    assert metrics.average_precision(np.zeros(4), np.array([0, 1, 0, 1])) == 0.5
    assert metrics.average_precision(np.array([0.2, 0.9]), np.array([False, True])) == 1.0
    with pytest.raises(ValueError, match="shape"):
        metrics.average_precision(np.zeros(3), np.zeros(4))


# -- DDI ---------------------------------------------------------------------------------------


def test_ddi_pairs_count_either_direction():
    adj = np.zeros((M, M), dtype=bool)
    adj[0, 1] = True  # one direction only
    adj[3, 2] = True
    assert metrics.ddi_pairs_count((0, 1, 2, 3), adj) == (2, 6)
    assert metrics.ddi_pairs_count((1, 0), adj) == (1, 1)
    assert metrics.ddi_pairs_count((), adj) == (0, 0)


def test_ddi_rate_is_pooled_over_visits():
    adj = ddi((0, 1))
    sets = [(0, 1), (2, 3, 4, 5), (0,)]
    # pooled: 1 / (1 + 6) -- a per-visit mean would be (1 + 0) / 2
    assert metrics.ddi_rate_of_sets(sets, adj) == pytest.approx(1 / 7)
    assert metrics.ddi_rate_of_sets([(0,), ()], adj) == 0.0


# -- summaries ----------------------------------------------------------------------------------


def results_two_patients() -> list[VisitResult]:
    return [
        # patient a: visit jaccards 1 and 0 -> patient mean 0.5
        VisitResult("a", (0, 1), (0, 1)),
        VisitResult("a", (2,), (3,)),
        # patient b: one visit, jaccard 1/3
        VisitResult("b", (0, 1, 2), (2,)),
    ]


def test_summarize_averages_per_patient_then_over_patients():
    s = metrics.summarize(results_two_patients(), ddi((0, 1)))
    assert s["jaccard"] == pytest.approx((0.5 + 1 / 3) / 2)  # a visit mean would be 4/9
    assert s["precision"] == pytest.approx(((1 + 0) / 2 + 1 / 3) / 2)
    assert s["recall"] == pytest.approx(((1 + 0) / 2 + 1) / 2)
    assert s["f1"] == pytest.approx(((1 + 0) / 2 + 0.5) / 2)
    assert s["avg_drugs"] == pytest.approx(((2 + 1) / 2 + 3) / 2)
    # pooled DDI: pair (0,1) interacts in a's first and b's visit; pairs 1 + 0 + 3
    assert s["ddi"] == pytest.approx(2 / 4)


def test_summarize_prauc_from_scores_or_binary_prediction():
    scores = np.array([0.9, 0.1, 0.8, 0.0, 0.0, 0.0])
    with_scores = metrics.summarize([VisitResult("p", (0,), (0, 2), scores)], NO_DDI)
    assert with_scores["prauc"] == 1.0
    binary = metrics.summarize([VisitResult("p", (0,), (0, 2))], NO_DDI)
    # thresholds: {0} (P 1, R 1/2) then all six (P 2/6, R 1)
    assert binary["prauc"] == pytest.approx(0.5 * 1 + 0.5 * 2 / 6)


def test_summarize_empty_prediction_visit():
    s = metrics.summarize([VisitResult("p", (), (1, 2))], NO_DDI)
    assert s["jaccard"] == s["f1"] == s["avg_drugs"] == s["ddi"] == 0.0
    assert s["prauc"] == pytest.approx(2 / M)  # every medication tied at score 0


def test_summarize_rejects_bad_input():
    with pytest.raises(ValueError, match="no visit"):
        metrics.summarize([], NO_DDI)
    with pytest.raises(ValueError, match="out of range"):
        metrics.summarize([VisitResult("p", (M,), (0,))], NO_DDI)
    with pytest.raises(ValueError, match="scores shape"):
        metrics.summarize([VisitResult("p", (0,), (0,), np.zeros(M + 1))], NO_DDI)


# -- bootstrap ------------------------------------------------------------------------------------


def many_results(n_patients: int = 30) -> list[VisitResult]:
    rng = np.random.default_rng(7)
    out = []
    for p in range(n_patients):
        for _ in range(rng.integers(1, 4)):
            pred = tuple(rng.choice(M, size=rng.integers(0, 4), replace=False).tolist())
            truth = tuple(rng.choice(M, size=rng.integers(1, 4), replace=False).tolist())
            out.append(VisitResult(f"p{p}", pred, truth, rng.random(M)))
    return out


def test_bootstrap_single_full_round_equals_summary():
    results, adj = many_results(), ddi((0, 1), (2, 5))
    report = metrics.bootstrap_report(results, adj, rounds=1, fraction=1.0)
    summary = metrics.summarize(results, adj)
    for key in metrics.METRICS:
        assert report[key] == {"mean": summary[key], "std": 0.0}
    assert report["n_patients"] == 30
    assert report["n_visits"] == len(results)
    assert report["rounds"] == 1


def test_bootstrap_is_seeded():
    results, adj = many_results(), ddi((0, 1), (2, 5))
    a = metrics.bootstrap_report(results, adj, seed=3)
    assert a == metrics.bootstrap_report(results, adj, seed=3)
    assert a != metrics.bootstrap_report(results, adj, seed=4)
    assert a["rounds"] == 10
    assert set(a) == {*metrics.METRICS, "n_patients", "n_visits", "rounds"}
    assert all(a[k]["std"] > 0 for k in metrics.METRICS)


def test_bootstrap_round_draws_patients_without_replacement():
    # jaccards 0, 1, 0, 1: three distinct patients always average 1/3 or 2/3
    # (drawn with replacement, a quarter of the rounds would be 0 or 1).
    results = [VisitResult(f"p{i}", (0,), (0,) if i % 2 else (1,)) for i in range(4)]
    for seed in range(20):
        report = metrics.bootstrap_report(results, NO_DDI, rounds=1, fraction=0.75, seed=seed)
        mean = report["jaccard"]["mean"]
        assert min(abs(mean - 1 / 3), abs(mean - 2 / 3)) < 1e-12


def test_bootstrap_rejects_bad_arguments():
    with pytest.raises(ValueError):
        metrics.bootstrap_report(many_results(), NO_DDI, rounds=0)
    with pytest.raises(ValueError):
        metrics.bootstrap_report(many_results(), NO_DDI, fraction=1.5)


# -- table ----------------------------------------------------------------------------------


def test_format_table_rows_and_columns():
    results, adj = many_results(), ddi((0, 1))
    table = metrics.format_table(
        {
            "COGNet": metrics.bootstrap_report(results, adj),
            "copy-last": metrics.summarize(results, adj),
        }
    )
    lines = table.splitlines()
    assert lines[0].split() == ["Model", "Jaccard", "F1", "PRAUC", "DDI", "Avg", "#Drugs"]
    assert set(lines[1]) == {"-"}
    assert lines[2].startswith("COGNet") and lines[2].count("±") == 5
    assert lines[3].startswith("copy-last") and "±" not in lines[3]
    assert len(lines) == 4


def test_metrics_module_is_torch_free():
    code = "import sys, cognet.core.metrics; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
