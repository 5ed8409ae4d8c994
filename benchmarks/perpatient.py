"""The `torch-perpatient` baseline: COGNet served the way the paper's public code serves it.

The reference code (`src/recommend.py`, `test_recommend_batch`, and its `src/beam.py`)
decodes one patient at a time (batch size 1, the patient's visits decoded together), keeps a
Python `Beam` object per visit, and at every step re-runs the decoder over the WHOLE
generated prefix of every hypothesis of every visit (no KV cache), finished hypotheses
included, keeping only the last position; a visit's beam is done when all its hypotheses
have finished (or after `max_len` steps). This module does the same with cognet's model:
the prefix goes through `COGNet.decode_teacher_forced`, so the cost per step grows with the
prefix length (O(T^2) decoder work per hypothesis) and there is one small torch call per
step and patient.

The selection rules are those of docs/INTERNALS.md "Beam search" (and `cognet.decode`), so
the recommendations equal `torch-batched`'s up to float rounding: B hypotheses per visit,
hypothesis 0 at score 0 and the others at -inf; medications already in a hypothesis get
-inf; a finished hypothesis proposes only END at its frozen score; the B best candidates are
taken in stable descending order of the flat index b * V1 + v; the answer is hypothesis 0.
Running on until every hypothesis has finished (the reference code's rule) instead of
stopping when hypothesis 0 has cannot change that answer: once hypothesis 0 has finished,
no other candidate can score higher (log-probabilities are <= 0) and ties keep the smaller
flat index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cognet.batching import make_batch
from cognet.decode import MAX_LEN
from cognet.history import Visit
from cognet.model import COGNet, history_inputs

NEG_INF = np.float32(-np.inf)


@dataclass
class Hypothesis:
    tokens: list[int]  # START, then the chosen tokens (END included once chosen)
    score: np.float32  # sum of log-probabilities (float32, like the torch reference)
    finished: bool = False


class Beam:
    """The hypotheses of one visit, advanced one step at a time."""

    def __init__(self, size: int, start: int, end: int, max_len: int):
        self.end, self.max_len = end, max_len
        self.hyps = [
            Hypothesis([start], np.float32(0.0 if b == 0 else NEG_INF)) for b in range(size)
        ]
        self.steps = 0

    @property
    def done(self) -> bool:
        return all(h.finished for h in self.hyps) or self.steps >= self.max_len

    def advance(self, log_probs: np.ndarray) -> None:
        """log_probs: float32 [B, V1], the next-token distribution of every hypothesis."""
        cand = np.full(log_probs.shape, NEG_INF, np.float32)
        for b, h in enumerate(self.hyps):
            if h.finished:
                cand[b, self.end] = h.score
            else:
                cand[b] = h.score + log_probs[b]
                cand[b, h.tokens[1:]] = NEG_INF  # no medication twice
        v1 = cand.shape[1]
        flat = cand.reshape(-1)
        new = []
        for i in np.argsort(-flat, kind="stable")[: len(self.hyps)].tolist():
            parent, token = divmod(i, v1)
            h = self.hyps[parent]
            # a finished hypothesis goes on with END tokens, so all prefixes keep one length
            new.append(
                Hypothesis(
                    [*h.tokens, token if not h.finished else self.end],
                    flat[i],
                    h.finished or token == self.end,
                )
            )
        self.hyps = new
        self.steps += 1

    def best(self) -> tuple[int, ...]:
        """Medications of hypothesis 0 in generation order (END excluded)."""
        return tuple(t for t in self.hyps[0].tokens[1:] if t != self.end)


@torch.no_grad()
def decode_patient(
    model: COGNet,
    visits: Sequence[Visit],
    vocab,
    targets: Sequence[int],
    beam: int,
    max_len: int = MAX_LEN,
) -> list[tuple[int, ...]]:
    """Recommendations for the visits `targets` (indices into `visits`) of one patient."""
    batch = make_batch([list(visits)], vocab, targets=False)
    rows = torch.as_tensor(list(targets))
    batch = dict(batch, target=batch["target"][rows])
    for k in (
        "hist_index",
        "hist_mask",
        "slot_visit_row",
        "slot_pos",
        "slot_visit",
        "slot_med",
        "slot_mask",
    ):
        batch[k] = batch[k][rows]
    enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
    memories = model.decoder_init(*history_inputs(batch, *enc, model.cfg))
    beams = [Beam(beam, vocab.start, vocab.end, max_len) for _ in targets]
    while not all(b.done for b in beams):
        # every hypothesis of every visit of the patient, finished ones included
        prefix = torch.tensor([h.tokens for b in beams for h in b.hyps])  # [V * B, t + 1]
        mem = tuple(m.repeat_interleave(beam, 0) for m in memories)
        log_probs = model.decode_teacher_forced(prefix, mem)[0][:, -1].numpy()  # [V * B, V1]
        for v, b in enumerate(beams):
            if b.done:  # like the reference's Beam.advance: pad with END, keep the lengths
                for h in b.hyps:
                    h.tokens.append(vocab.end)
            else:
                b.advance(log_probs[v * beam : (v + 1) * beam])
    return [b.best() for b in beams]


def decode_perpatient(
    model: COGNet, patients: Sequence[Sequence[Visit]], vocab, beam: int, max_len: int = MAX_LEN
) -> list[tuple[int, ...]]:
    """The last visit of each patient (the one to score), one patient at a time."""
    model.eval()
    return [decode_patient(model, p, vocab, [len(p) - 1], beam, max_len)[0] for p in patients]
