"""Training the set head (`cognet.model.set_head`) on a trained COGNet model's own answers.

The teacher (the members, decoded as one model) computes P(k in S) for every training visit
twice, with its history and without it; each epoch draws anew which visits are read without
their history, at the members' history dropout rate, so that the head learns the no-history
answer (every first visit's) from every visit, as the members did. The head learns by binary
cross-entropy against a mix of the teacher's marginals and the true set:

    target = mix x P_teacher(k in S) + (1 - mix) x [k in true set]

The epoch kept is the one of highest validation Jaccard (expected-Jaccard sets); then its
threshold and set rule are tuned on validation as set decoding's are
(`cognet.training.tuning.choose_set_rule`). Every choice is made on validation data only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cognet.core.decoding import ESTIMATOR, Decoding
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.head_inputs import HEAD_INPUTS, patient_head_arrays
from cognet.core.history import Visit
from cognet.core.vocab import Vocab
from cognet.model.set_head import HeadConfig, SetHead
from cognet.model.torch_decoding import MARGINALS_BATCH, set_marginals_of
from cognet.training.tuning import choose_set_rule, validation_jaccard

JACCARD = "jaccard"  # the epoch's score: expected-Jaccard sets, a rule with no parameter


@dataclass(frozen=True)
class HeadRecipe:
    """How the head is trained (`cognet train --head-*`)."""

    hidden: int = 1024  # width of its one hidden layer
    dropout: float = 0.5
    mix: float = 0.5  # weight of the teacher's marginals in the target (the rest: the true set)
    epochs: int = 60  # at most; the epoch of best validation Jaccard is kept
    patience: int = 8  # epochs without a better validation Jaccard before stopping
    lr: float = 1e-3
    batch_size: int = 256  # visits per step

    def __post_init__(self) -> None:
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"the head's mix must be in [0, 1], not {self.mix}")
        if min(self.hidden, self.epochs, self.patience, self.batch_size) < 1 or self.lr <= 0:
            raise ValueError("the head's hidden, epochs, patience and batch_size must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"the head's dropout must be in [0, 1), not {self.dropout}")


@dataclass(frozen=True)
class TeacherMarginals:
    """P(k in S) of every training visit (patient order) by the teacher, with its history
    and without it (equal for visits without a history)."""

    with_history: np.ndarray  # float32 [V, M]
    without: np.ndarray  # float32 [V, M]


def teacher_marginals(
    model,
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    samples: int,
    max_history: int | None = None,
    progress: Callable | None = None,
) -> TeacherMarginals:
    """The teacher's P(k in S) (set decoding of `samples` samples a visit, this version's
    estimator, no DDI policy) of every visit, with its history and without."""
    probe = Decoding(name="set", samples=samples, threshold=1.0, estimator=ESTIMATOR)
    visits = [v for p in patients for v in p]
    arrays = patient_head_arrays(patients, _pads(vocab), vocab.n_med, max_history)
    has = arrays["has_history"] > 0
    alone = [[v] for v, h in zip(visits, has, strict=True) if h]  # each as a first visit
    bar = progress(total=len(visits) + len(alone), desc="teacher P(k in S)") if progress else None
    step = bar.update if bar is not None else None
    plan = DecodingPlan(probe, vocab.end)
    with_history = set_marginals_of(model, vocab, patients, plan, step)
    without = with_history.copy()
    if alone:  # one visit a patient: twice the patients for about as many visits
        without[has] = set_marginals_of(model, vocab, alone, plan, step, 2 * MARGINALS_BATCH)
    if bar is not None:
        bar.close()
    return TeacherMarginals(with_history, without)


def train_head(
    recipe: HeadRecipe,
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    teacher: TeacherMarginals,
    val_patients: Sequence[Sequence[Visit]],
    seed: int,
    history_dropout: float,
    max_history: int | None = None,
    on_epoch: Callable[[dict], None] | None = None,
) -> tuple[SetHead, Decoding, dict]:
    """The head trained on `patients` against `teacher`'s marginals mixed with the true
    sets: (the head of the best epoch in eval mode, its marginal decoding with threshold and
    rule tuned on validation, the training record)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    pads = _pads(vocab)
    arrays = patient_head_arrays(patients, pads, vocab.n_med, max_history)
    val_arrays = patient_head_arrays(val_patients, pads, vocab.n_med, max_history)
    truth = np.zeros_like(teacher.with_history)
    for i, v in enumerate(v for p in patients for v in p):
        truth[i, list(v.meds or ())] = 1.0
    has = arrays["has_history"] > 0
    cfg = HeadConfig(vocab.n_diag, vocab.n_proc, vocab.n_med, recipe.hidden, recipe.dropout)
    head = SetHead(cfg)
    optim = torch.optim.Adam(head.parameters(), lr=recipe.lr)
    best, best_state, stale, history = None, None, 0, []
    for epoch in range(1, recipe.epochs + 1):
        dropped = has & (rng.random(has.size) < history_dropout)
        inputs = _without_history(arrays, dropped, pads[2])
        soft = np.where(dropped[:, None], teacher.without, teacher.with_history)
        target = recipe.mix * soft + (1.0 - recipe.mix) * truth
        loss = _epoch(head, optim, inputs, target, recipe.batch_size, rng)
        marginals = head.marginals(val_arrays)
        jaccard = validation_jaccard(val_patients, marginals, threshold=None, rule=JACCARD)
        record = {"epoch": epoch, "loss": loss, "val_jaccard": jaccard}
        improved = best is None or jaccard > best["val_jaccard"]
        record["best"] = improved
        history.append(record)
        if on_epoch:
            on_epoch(record)
        if improved:
            best, best_state, stale = record, copy.deepcopy(head.state_dict()), 0
        else:
            stale += 1
            if stale >= recipe.patience:
                break
    assert best_state is not None
    head.load_state_dict(best_state)
    head.eval()
    marginals = head.marginals(val_arrays)
    tau, rule, tuned = choose_set_rule(val_patients, marginals)
    decoding = Decoding(name="marginal", head_threshold=tau, head_rule=rule)
    record = {
        **asdict(recipe),
        "seed": seed,
        "history_dropout": history_dropout,
        "best_epoch": best["epoch"],
        "epochs_run": len(history),
        "val_jaccard": best["val_jaccard"],
        "tuning": tuned,
    }
    return head, decoding, record


def _pads(vocab: Vocab) -> tuple[int, int, int]:
    """The head's PAD ids: each vocabulary's size (`cognet.model.set_head`)."""
    return vocab.n_diag, vocab.n_proc, vocab.n_med


def _without_history(arrays: dict, dropped: np.ndarray, med_pad: int) -> dict:
    """`arrays` with the history of the visits `dropped` removed."""
    out = dict(arrays)
    for key in ("last_meds", "past_meds"):
        out[key] = np.where(dropped[:, None], med_pad, arrays[key])
    out["has_history"] = np.where(dropped, 0.0, arrays["has_history"]).astype(np.float32)
    return out


def _epoch(head: SetHead, optim, arrays: dict, target: np.ndarray, batch: int, rng) -> float:
    """One shuffled pass of binary cross-entropy against the soft targets; mean loss."""
    head.train()
    order = rng.permutation(len(target))
    tensors = [torch.from_numpy(np.ascontiguousarray(arrays[k])) for k in HEAD_INPUTS]
    goal = torch.from_numpy(np.ascontiguousarray(target, np.float32))
    total, count = 0.0, 0
    for i in range(0, order.size, batch):
        rows = torch.from_numpy(order[i : i + batch])
        logits = head.logits(*(t[rows] for t in tensors))
        loss = F.binary_cross_entropy_with_logits(logits, goal[rows])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        total, count = total + float(loss.detach()), count + 1
    return total / max(count, 1)
