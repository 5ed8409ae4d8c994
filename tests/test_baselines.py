"""Baselines on tiny hand-made visit tables (cognet.evaluation.baselines)."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from cognet.core import metrics
from cognet.core.errors import InputError
from cognet.core.vocab import Vocab
from cognet.evaluation.baselines import LRConfig, run_baseline, train_logistic

CODES = pa.list_(pa.string())


def make_table(rows: list[tuple]) -> pa.Table:
    """rows: (patient_id, diagnoses, procedures, medications or None, split), in visit order."""
    seq: dict[str, int] = {}
    visit_seq = []
    for r in rows:
        visit_seq.append(seq.setdefault(r[0], 0))
        seq[r[0]] += 1
    return pa.table(
        {
            "patient_id": pa.array([r[0] for r in rows], pa.string()),
            "visit_id": pa.array(
                [f"{r[0]}-{s}" for r, s in zip(rows, visit_seq, strict=True)], pa.string()
            ),
            "visit_seq": pa.array(visit_seq, pa.int32()),
            "diagnoses": pa.array([r[1] for r in rows], CODES),
            "procedures": pa.array([r[2] for r in rows], CODES),
            "medications": pa.array([r[3] for r in rows], CODES),
            "split": pa.array([r[4] for r in rows], pa.string()),
        }
    )


def train_vocab(table: pa.Table) -> Vocab:
    rows = table.filter(pa.compute.equal(table.column("split"), "train")).to_pylist()
    return Vocab.build(
        [r["diagnoses"] for r in rows],
        [r["procedures"] for r in rows],
        [r["medications"] for r in rows],
    )


# Training medication counts: A 3, B 3, C 1, D 1 over 3 visits of 8 medications -> k = 3;
# A and B lead, C wins the tie with D by id.
TRAIN = [
    ("t1", ["d1"], ["p1"], ["A", "B", "C"], "train"),
    ("t1", ["d2"], [], ["A", "B"], "train"),
    ("t2", ["d1", "d2"], ["p1"], ["A", "B", "D"], "train"),
]
TEST = [
    ("x", ["d1"], [], ["C"], "test"),
    ("x", ["d2"], [], None, "test"),  # unknown medications: not evaluated, not copied
    ("x", ["d1"], [], ["D", "A"], "test"),
    ("x", ["d9"], [], ["ZZZ", "B"], "test"),  # ZZZ is unknown to the vocabulary
    ("y", ["d1"], [], ["B"], "test"),
]
TABLE = make_table(TRAIN + TEST)
VOCAB = train_vocab(TABLE)
A, B, C, D = (VOCAB.medications.index(m) for m in "ABCD")


def test_copy_last_copies_the_latest_known_visit():
    results = run_baseline("copy-last", VOCAB, TABLE)
    assert [r.patient_id for r in results] == ["x", "x", "x", "y"]
    assert [r.predicted for r in results] == [(A, B, C), (C,), (D, A), (A, B, C)]
    assert [r.truth for r in results] == [(C,), (D, A), (B,), (B,)]
    np.testing.assert_array_equal(results[1].scores, [0, 0, 1, 0])


def test_copy_last_known_jaccard():
    s = metrics.summarize(run_baseline("copy-last", VOCAB, TABLE), np.zeros((4, 4), bool))
    # x: 1/3, 0, 0 -> 1/9; y: 1/3
    assert s["jaccard"] == pytest.approx((1 / 9 + 1 / 3) / 2)


def test_frequent_predicts_the_top_k_training_medications():
    results = run_baseline("frequent", VOCAB, TABLE)
    assert len(results) == 4
    assert all(r.predicted == (A, B, C) for r in results)
    np.testing.assert_allclose(results[0].scores, [3 / 3, 3 / 3, 1 / 3, 1 / 3])


def test_baselines_evaluate_the_requested_split():
    table = make_table(TRAIN + [("v", ["d1"], [], ["A"], "val"), *TEST])
    results = run_baseline("frequent", VOCAB, table, split="val")
    assert [r.patient_id for r in results] == ["v"]


def learnable_table(n_patients: int, seed: int) -> pa.Table:
    """Diagnosis dK always comes with medication mK; noise diagnoses and procedures."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_patients):
        split = "train" if p < 0.6 * n_patients else "val" if p < 0.8 * n_patients else "test"
        for _ in range(rng.integers(1, 4)):
            ks = rng.choice(8, size=rng.integers(1, 4), replace=False)
            noise = rng.choice(20, size=3, replace=False)
            rows.append(
                (
                    f"p{p}",
                    [f"d{k}" for k in ks] + [f"n{j}" for j in noise],
                    [f"q{j}" for j in rng.choice(5, size=2, replace=False)],
                    [f"m{k}" for k in ks],
                    split,
                )
            )
    return make_table(rows)


def test_lr_learns_a_trivial_mapping():
    table = learnable_table(400, seed=0)
    vocab = train_vocab(table)
    results = run_baseline("lr", vocab, table)
    s = metrics.summarize(results, np.zeros((vocab.n_med, vocab.n_med), bool))
    assert s["jaccard"] > 0.95
    assert s["prauc"] > 0.95
    r = results[0]
    assert r.scores.shape == (vocab.n_med,)
    # predicted medications come in descending probability
    assert list(r.scores[list(r.predicted)]) == sorted(r.scores[list(r.predicted)], reverse=True)


def test_lr_is_deterministic():
    table = learnable_table(40, seed=1)
    vocab = train_vocab(table)
    config = LRConfig(steps=20)
    a = run_baseline("lr", vocab, table, seed=5, lr_config=config)
    b = run_baseline("lr", vocab, table, seed=5, lr_config=config)
    assert [r.predicted for r in a] == [r.predicted for r in b]
    for ra, rb in zip(a, b, strict=True):
        np.testing.assert_array_equal(ra.scores, rb.scores)


def test_train_logistic_shapes_and_prior_start():
    x = np.zeros((4, 3), np.float32)
    y = np.array([[1, 0], [1, 0], [1, 1], [0, 0]], np.float32)
    w, b = train_logistic(x, y, LRConfig(steps=0))
    assert w.shape == (3, 2) and w.dtype == np.float32
    np.testing.assert_allclose(1 / (1 + np.exp(-b)), [0.75, 0.25], rtol=1e-5)


@pytest.mark.parametrize(
    "name, table, split, match",
    [
        ("best", TABLE, "test", "unknown baseline"),
        ("frequent", TABLE.drop_columns(["split"]), "test", "missing column 'split'"),
        ("frequent", TABLE, "val", "no 'val' visit"),
        ("frequent", make_table(TEST), "test", "no 'train' visit"),
    ],
)
def test_input_errors(name, table, split, match):
    with pytest.raises(InputError, match=match):
        run_baseline(name, VOCAB, table, split=split)


def test_baselines_module_is_torch_free():
    code = "import sys, cognet.evaluation.baselines; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
