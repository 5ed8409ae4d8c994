"""Simple yardsticks for `cognet evaluate --baseline`: copy-last, frequent and lr (numpy only).

Every baseline sees the same visits as the model: the rows of `split` whose medications are
known (not null); the truth is their medication ids in the vocabulary (unknown codes
dropped). "Training" statistics come from the rows of the train split with known
medications.

- copy-last: the medications of the patient's latest earlier visit with known medications
  (codes outside the vocabulary dropped); a patient's first visit gets the k most frequent
  training medications, k = round(mean number of medications per training visit).
  scores = multi-hot of the prediction.
- frequent: the same k most frequent training medications for every visit; scores = the
  fraction of training visits that prescribe each medication.
- lr: one logistic regression per medication on the multi-hot diagnoses + procedures of the
  visit, all medications at once as a [D + P, M] weight matrix, trained by mini-batch Adam
  with L2 (seeded shuffling, a fixed number of updates, float32). scores = the predicted
  probabilities; the prediction is every medication at or above a threshold picked among
  `LRConfig.thresholds` by mean visit Jaccard on the val split (0.5 when the split has no
  val visit): per-medication probabilities are poorly calibrated for set overlap, and a
  lower threshold typically wins a few Jaccard points. Predicted medications are listed in
  descending probability.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cognet.core.errors import InputError
from cognet.core.metrics import VisitResult
from cognet.core.vocab import Vocab

log = logging.getLogger(__name__)

BASELINES = ("copy-last", "frequent", "lr")
COLUMNS = ("patient_id", "diagnoses", "procedures", "medications", "split")


@dataclass(frozen=True)
class LRConfig:
    steps: int = 600  # Adam updates, whatever the number of visits (~15 epochs of 10k)
    batch_size: int = 256
    lr: float = 1e-2
    l2: float = 1e-3  # coefficient of 0.5 * ||W||^2 added to the mean loss
    thresholds: tuple[float, ...] = (0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)


@dataclass(frozen=True)
class _Visits:
    """Columns of the visits table as python lists, medications encoded once."""

    patient_id: list[str]
    diagnoses: list[list[str]]
    procedures: list[list[str]]
    med_ids: list[list[int] | None]  # None = unknown medications
    split: list[str]

    @classmethod
    def from_table(cls, table: pa.Table, vocab: Vocab) -> _Visits:
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise InputError(f"visits table: missing column {missing[0]!r}")
        meds = [
            None if codes is None else vocab.encode("medications", codes)[0]
            for codes in table.column("medications").to_pylist()
        ]
        return cls(
            [str(p) for p in table.column("patient_id").to_pylist()],
            [c or [] for c in table.column("diagnoses").to_pylist()],
            [c or [] for c in table.column("procedures").to_pylist()],
            meds,
            table.column("split").to_pylist(),
        )

    def rows(self, split: str) -> list[int]:
        """Rows of a split with known medications."""
        return [
            i
            for i, (s, m) in enumerate(zip(self.split, self.med_ids, strict=True))
            if s == split and m is not None
        ]


def run_baseline(
    name: str,
    vocab: Vocab,
    visits_table: pa.Table,
    split: str = "test",
    seed: int = 0,
    lr_config: LRConfig | None = None,
) -> list[VisitResult]:
    """Recommendations of baseline `name` for every visit of `split` with known medications.

    visits_table: patient_id, diagnoses, procedures, medications (list<string>), split;
    rows grouped by patient and sorted by visit_seq. `seed` drives the lr baseline's
    shuffling; copy-last and frequent are deterministic.
    """
    if name not in BASELINES:
        raise InputError(f"unknown baseline {name!r} (choose from {', '.join(BASELINES)})")
    visits = _Visits.from_table(visits_table, vocab)
    train, evaluated = visits.rows("train"), visits.rows(split)
    if not train:
        raise InputError("visits table: column 'split' has no 'train' visit with medications")
    if not evaluated:
        raise InputError(f"visits table: column 'split' has no {split!r} visit with medications")
    if name == "copy-last":
        return _copy_last(visits, vocab, train, evaluated)
    if name == "frequent":
        return _frequent(visits, vocab, train, evaluated)
    return _logistic(
        visits, vocab, train, visits.rows("val"), evaluated, seed, lr_config or LRConfig()
    )


def _result(visits: _Visits, row: int, predicted, scores: np.ndarray) -> VisitResult:
    return VisitResult(
        visits.patient_id[row], tuple(int(i) for i in predicted), tuple(visits.med_ids[row]), scores
    )


def _multi_hot(ids, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.float32)
    out[list(ids)] = 1.0
    return out


# -- copy-last and frequent ---------------------------------------------------------------


def _train_frequency(visits: _Visits, vocab: Vocab, train: list[int]) -> np.ndarray:
    """float [M]: fraction of training visits that prescribe each medication."""
    counts: Counter[int] = Counter()
    for i in train:
        counts.update(visits.med_ids[i])
    freq = np.zeros(vocab.n_med, dtype=np.float64)
    for med, n in counts.items():
        freq[med] = n
    return freq / len(train)


def _most_frequent(freq: np.ndarray, visits: _Visits, train: list[int]) -> list[int]:
    """The k most frequent medications (ties by id), k = round(mean training set size)."""
    k = round(float(np.mean([len(visits.med_ids[i]) for i in train])))
    return [int(i) for i in np.argsort(-freq, kind="stable")[:k]]


def _frequent(visits: _Visits, vocab: Vocab, train: list[int], evaluated: list[int]):
    freq = _train_frequency(visits, vocab, train)
    top = _most_frequent(freq, visits, train)
    scores = freq.astype(np.float32)
    return [_result(visits, i, top, scores) for i in evaluated]


def _copy_last(visits: _Visits, vocab: Vocab, train: list[int], evaluated: list[int]):
    top = _most_frequent(_train_frequency(visits, vocab, train), visits, train)
    wanted = set(evaluated)
    last: dict[str, list[int]] = {}  # patient -> medications of its latest known visit
    out = []
    for i, (patient, meds) in enumerate(zip(visits.patient_id, visits.med_ids, strict=True)):
        if i in wanted:
            predicted = last.get(patient, top)
            out.append(_result(visits, i, predicted, _multi_hot(predicted, vocab.n_med)))
        if meds is not None:
            last[patient] = meds
    return out


# -- logistic regression -------------------------------------------------------------------


def _features(visits: _Visits, vocab: Vocab, rows: list[int]) -> np.ndarray:
    """float32 [len(rows), D + P]: multi-hot diagnoses then procedures (unknown dropped)."""
    x = np.zeros((len(rows), vocab.n_diag + vocab.n_proc), dtype=np.float32)
    for r, i in enumerate(rows):
        x[r, vocab.encode("diagnoses", visits.diagnoses[i])[0]] = 1.0
        x[r, [vocab.n_diag + j for j in vocab.encode("procedures", visits.procedures[i])[0]]] = 1.0
    return x


def _labels(visits: _Visits, vocab: Vocab, rows: list[int]) -> np.ndarray:
    return np.stack([_multi_hot(visits.med_ids[i], vocab.n_med) for i in rows])


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free


def _batches(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Endless mini-batches of row indices, reshuffled every epoch."""
    while True:
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            yield order[start : start + batch_size]


def train_logistic(
    x: np.ndarray,
    y: np.ndarray,
    config: LRConfig,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Fit every medication's logistic regression at once with mini-batch Adam.

    x: float32 [N, F] multi-hot features; y: float32 [N, M] multi-hot labels.
    Returns (weights [F, M], bias [M]). Bias starts at the prevalence logits, weights at 0.
    """
    prior = np.clip(y.mean(axis=0), 1e-4, 1 - 1e-4)
    params = [
        np.zeros((x.shape[1], y.shape[1]), np.float32),
        np.log(prior / (1 - prior)).astype(np.float32),
    ]
    moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    batches = _batches(len(x), config.batch_size, np.random.default_rng(seed))
    for step in range(1, config.steps + 1):
        batch = next(batches)
        xb, yb = x[batch], y[batch]
        w, b = params
        g = (_sigmoid(xb @ w + b) - yb) / len(batch)  # d mean-BCE / d logits, [B, M]
        grads = [xb.T @ g + config.l2 * w, g.sum(axis=0)]
        step_size = float(config.lr * np.sqrt(1 - beta2**step) / (1 - beta1**step))
        for p, grad, (m1, m2) in zip(params, grads, moments, strict=True):
            m1 *= beta1
            m1 += (1 - beta1) * grad
            m2 *= beta2
            m2 += (1 - beta2) * grad * grad
            p -= step_size * m1 / (np.sqrt(m2) + eps)
    return params[0], params[1]


def _mean_jaccard(prob: np.ndarray, truth: np.ndarray, threshold: float) -> float:
    """Mean per-visit Jaccard of thresholded probabilities (both empty -> 1, as metrics)."""
    pred = prob >= threshold
    t = truth > 0
    inter = (pred & t).sum(axis=1)
    union = (pred | t).sum(axis=1)
    return float(np.mean(np.where(union == 0, 1.0, inter / np.maximum(union, 1))))


def _logistic(visits, vocab, train, val, evaluated, seed: int, config: LRConfig):
    w, b = train_logistic(
        _features(visits, vocab, train), _labels(visits, vocab, train), config, seed
    )
    threshold = 0.5
    if val:
        prob = _sigmoid(_features(visits, vocab, val) @ w + b)
        truth = _labels(visits, vocab, val)
        threshold = max(config.thresholds, key=lambda t: _mean_jaccard(prob, truth, t))
    log.info("lr baseline: threshold %.2f", threshold)
    prob = _sigmoid(_features(visits, vocab, evaluated) @ w + b)
    out = []
    for r, i in enumerate(evaluated):
        p = prob[r]
        ranked = np.argsort(-p, kind="stable")
        predicted = ranked[p[ranked] >= threshold]
        out.append(_result(visits, i, predicted, p))
    return out
