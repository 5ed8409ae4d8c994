"""What `cognet train` chooses on the validation split after the epochs: which weights to
keep (one epoch, or the average of the last epochs' weights), the set decoding's threshold
and its set rule. Every choice here is made on validation data only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from cognet.core.decoding import ESTIMATOR, Decoding
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.decoding.set_rules import select_sets
from cognet.core.history import Visit
from cognet.core.vocab import Vocab
from cognet.model.batching import IGNORE, make_batch
from cognet.model.network import COGNet
from cognet.model.torch_decoding import set_marginals_of

# Thresholds tried on P(k in S) (0.15 .. 0.60): the best on validation is kept.
THRESHOLDS = tuple(round(x, 3) for x in np.arange(0.15, 0.601, 0.025))


@torch.no_grad()
def validation_nll(
    model: COGNet, vocab: Vocab, patients: Sequence[Sequence[Visit]], chunk: int = 64
) -> float:
    """Teacher-forced negative log-likelihood per target token (END included)."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(patients), chunk):
        batch = make_batch(patients[i : i + chunk], vocab)
        batch = {k: v.to(device) for k, v in batch.items()}
        target = batch["dec_target"]
        log_probs = model(batch)
        total += float(
            F.nll_loss(
                log_probs.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum"
            )
        )
        count += int((target != IGNORE).sum())
    return total / max(count, 1)


def average_states(states: Sequence[dict]) -> dict:
    """The element-wise mean of state dicts (floating tensors; others from the last)."""
    out = {}
    for key, last in states[-1].items():
        if last.is_floating_point():
            out[key] = sum(s[key] for s in states) / len(states)
        else:
            out[key] = last.clone()
    return out


def choose_average(
    model: COGNet,
    snapshots: dict[int, dict],
    sizes: Sequence[int],
    ends: Sequence[int],
    nll,
) -> tuple[dict | None, dict | None]:
    """The weights of lowest validation NLL among the averages of every window of `sizes`
    consecutive epochs ending at one of `ends` (size 1: that epoch alone). `nll(model)`
    scores the model in place. Returns (state, {"epochs": [...], "val_nll": ...}), or
    (None, None) when no window fits in `snapshots`."""
    best_state, best_info = None, None
    for end in ends:
        for size in sorted(set(sizes)):
            epochs = list(range(end - size + 1, end + 1))
            if not all(e in snapshots for e in epochs):
                continue
            state = average_states([snapshots[e] for e in epochs])
            model.load_state_dict(state)
            score = nll(model)
            if best_info is None or score < best_info["val_nll"]:
                best_state, best_info = state, {"epochs": epochs, "val_nll": score}
    return best_state, best_info


def validation_jaccard(patients: Sequence[Sequence[Visit]], marginals: np.ndarray, **rule) -> float:
    """Patient-averaged Jaccard (`cognet evaluate`'s) of the sets `select_sets(marginals,
    **rule)` reads, against the visits' medications, on multi-hot rows."""
    n, m = marginals.shape
    picked = np.zeros((n, m), bool)
    truth = np.zeros((n, m), bool)
    visits = [v for p in patients for v in p]
    for i, (v, s) in enumerate(zip(visits, select_sets(marginals, **rule), strict=True)):
        picked[i, s] = True
        truth[i, list(v.meds or ())] = True
    union = (picked | truth).sum(1)
    per_visit = np.where(union > 0, (picked & truth).sum(1) / np.maximum(union, 1), 1.0)
    lengths = np.array([len(p) for p in patients if p])
    per_patient = np.add.reduceat(per_visit, np.cumsum(lengths) - lengths) / lengths
    return float(per_patient.mean())


def tune_threshold(
    patients: Sequence[Sequence[Visit]],
    marginals: np.ndarray,
    thresholds: Sequence[float] = THRESHOLDS,
) -> tuple[float, dict[float, float]]:
    """The threshold on P(k in S) of highest patient-averaged validation Jaccard (ties: the
    lower), and the Jaccard of each one tried."""
    scores = {tau: validation_jaccard(patients, marginals, threshold=tau) for tau in thresholds}
    best = max(scores, key=lambda t: (scores[t], -t))
    return best, scores


def choose_set_rule(
    patients: Sequence[Sequence[Visit]], marginals: np.ndarray
) -> tuple[float, str, dict]:
    """The tuned threshold (`tune_threshold`) and the set rule of higher validation Jaccard
    (`cognet.core.decoding.SET_RULES`: that threshold, or expected-Jaccard sets; ties: the
    threshold), with the Jaccard of each."""
    tau, scores = tune_threshold(patients, marginals)
    expected = validation_jaccard(patients, marginals, threshold=tau, rule="jaccard")
    rule = "jaccard" if expected > scores[tau] else "threshold"
    return tau, rule, {"val_jaccard_by_threshold": scores, "val_jaccard_jaccard_rule": expected}


def set_decoding_for(
    model: COGNet,
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    samples: int,
    on_batch=None,
) -> tuple[Decoding, dict]:
    """The set decoding of `samples` samples (drawn by this version's estimator) with the
    threshold and the set rule chosen on `patients` (`choose_set_rule`); on_batch(visits)
    after each batch decoded."""
    probe = Decoding(name="set", samples=samples, threshold=1.0, estimator=ESTIMATOR)
    marginals = set_marginals_of(model, vocab, patients, DecodingPlan(probe, vocab.end), on_batch)
    tau, rule, info = choose_set_rule(patients, marginals)
    return probe.with_changes(threshold=tau, rule=rule), info
