"""Dataset statistics (cognet.stats) on a hand-computed dataset and on synthetic data."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from cognet.cli.data import data
from cognet.core.dataset import read_dataset, write_ddi, write_visits
from cognet.data.stats import compute_stats, format_stats


def write_dataset(root, rows, pairs):
    """rows: (patient, seq, diagnoses, procedures, medications) tuples."""
    columns = {
        "patient_id": [r[0] for r in rows],
        "visit_id": [f"{r[0]}{r[1]}" for r in rows],
        "visit_seq": [r[1] for r in rows],
        "diagnoses": [r[2] for r in rows],
        "procedures": [r[3] for r in rows],
        "medications": pa.array([r[4] for r in rows], pa.list_(pa.string())),
    }
    write_visits(root / "visits.parquet", pa.table(columns))
    write_ddi(root / "ddi.parquet", pairs)
    return root


HAND = [
    ("A", 0, ["d1", "d2"], [], ["m1", "m2"]),
    ("A", 1, ["d1", "d3"], [], ["m1", "m3"]),
    ("A", 2, ["d4"], ["p1"], ["m2", "m3", "m4"]),
    ("B", 0, ["d1"], [], ["m1"]),
]


def test_hand_computed_statistics(tmp_path):
    stats = compute_stats(read_dataset(write_dataset(tmp_path, HAND, [("m1", "m3"), ("m2", "m4")])))
    expected = {
        "patients": 2,
        "visits": 4,
        "diagnosis_codes": 4,
        "procedure_codes": 1,
        "medication_codes": 4,
        "visits_per_patient_mean": 2.0,
        "visits_per_patient_max": 3,
        "single_visit_patients": 0.5,
        "patients_3plus_visits": 0.5,
        "diagnoses_per_visit_mean": 1.5,
        "diagnoses_per_visit_max": 2,
        "procedures_per_visit_mean": 0.25,
        "procedures_per_visit_max": 1,
        "medications_per_visit_mean": 2.0,
        "medications_per_visit_max": 3,
        "medications_per_visit_min": 1,
        "ddi_pairs": 2,
        # interacting pairs: (m1, m3) in A1, (m2, m4) in A2; all pairs: 1 + 1 + 3 + 0
        "ddi_rate": 2 / 5,
        # non-first visits A1 and A2
        "med_in_previous_visit": (1 / 2 + 1 / 3) / 2,
        "med_in_history_mean": (1 / 2 + 2 / 3) / 2,
        "med_in_history_median": (1 / 2 + 2 / 3) / 2,
        "jaccard_previous_visit": (1 / 3 + 1 / 4) / 2,
        "diagnoses_in_previous_visit": (1 / 2 + 0) / 2,
        "top10_medication_share": 1.0,
        "medications_covering_80pct": 3,  # counts 3, 2, 2, 1 of 8
    }
    assert {k: stats[k] for k in expected} == pytest.approx(expected)
    assert stats["visits_train"] + stats["visits_val"] + stats["visits_test"] == 4


def test_unknown_medications_are_skipped(tmp_path):
    rows = [
        ("A", 0, ["d1"], [], ["m1", "m2"]),
        ("A", 1, ["d1"], [], None),
        ("A", 2, ["d2"], [], ["m1"]),
    ]
    stats = compute_stats(read_dataset(write_dataset(tmp_path, rows, [])))
    assert stats["visits_unknown_medications"] == 1
    assert stats["medications_per_visit_mean"] == 1.5
    assert stats["med_in_previous_visit"] == 1.0  # visit 2 compares with visit 0
    assert stats["diagnoses_in_previous_visit"] == pytest.approx(0.5)  # 1.0 then 0.0
    assert "visits with unknown medications" in format_stats(stats)


def test_format_stats_table(tiny_dataset):
    text = format_stats(compute_stats(read_dataset(tiny_dataset)))
    assert text.splitlines()[0].split() == ["Item", "Value"]
    for label in (
        "# patients",
        "# diagnosis / procedure / medication codes",
        "# DDI pairs",
        "ground-truth DDI rate",
        "Jaccard with the previous visit's medications",
    ):
        assert label in text


def test_cli_stats_json_and_table(tiny_dataset):
    result = CliRunner().invoke(data, ["stats", str(tiny_dataset), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == pytest.approx(compute_stats(read_dataset(tiny_dataset)))
    result = CliRunner().invoke(data, ["stats", str(tiny_dataset)])
    assert result.exit_code == 0 and "# patients" in result.output


# -- the synthetic generator meets the paper's statistics (issue 2, point 6) -------------------

# Targets at the paper's 6,350 patients; at 1,500 the vocabularies and maxima are smaller.
TARGETS = {
    "visits_per_patient_mean": 2.37,
    "single_visit_patients": 0.14,
    "patients_3plus_visits": 0.26,
    "diagnoses_per_visit_mean": 13.6,
    "procedures_per_visit_mean": 4.5,
    "medications_per_visit_mean": 19.2,
    "top10_medication_share": 0.40,
    "medications_covering_80pct": 34,
    "ddi_rate": 0.09,
    "med_in_previous_visit": 0.64,
    "med_in_history_mean": 0.71,
    "med_in_history_median": 0.73,
    "jaccard_previous_visit": 0.45,
    "diagnoses_in_previous_visit": 0.32,
}


def test_synthetic_statistics_near_targets(small_dataset):
    stats = compute_stats(read_dataset(small_dataset))
    ratios = {k: stats[k] / v for k, v in TARGETS.items()}
    assert all(0.8 <= r <= 1.2 for r in ratios.values()), ratios
    assert stats["ddi_pairs"] == 448
    assert stats["medication_codes"] >= 125
    assert stats["diagnosis_codes"] > 1000 and stats["procedure_codes"] > 600
    assert stats["medications_per_visit_min"] >= 1 and stats["medications_per_visit_max"] <= 53
    assert stats["diagnoses_per_visit_max"] <= 39 and stats["procedures_per_visit_max"] <= 32


def _patient_mean(scores: dict[str, list[float]]) -> float:
    return float(np.mean([np.mean(v) for v in scores.values()]))


def test_copy_last_visit_helps_but_does_not_solve(small_dataset):
    """Copy the previous visit (first visit: the k commonest training medications)."""
    visits = read_dataset(small_dataset).visits
    pid, split = visits["patient_id"].to_pylist(), visits["split"].to_pylist()
    meds = visits["medications"].to_pylist()
    counts = Counter(m for ms, s in zip(meds, split, strict=True) if s == "train" for m in ms)
    k = round(np.mean([len(m) for m in meds]))
    frequent = {m for m, _ in counts.most_common(k)}
    scores: dict[str, list[float]] = {}
    for i in range(len(pid)):
        if split[i] == "test":
            guess = set(meds[i - 1]) if i and pid[i - 1] == pid[i] else frequent
            truth = set(meds[i])
            scores.setdefault(pid[i], []).append(len(guess & truth) / len(guess | truth))
    assert 0.35 <= _patient_mean(scores) <= 0.50
