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

The `Beam` keeps the reference's bookkeeping, whose cost is part of what users pay today:
torch tensors of back-pointers and chosen tokens per step, every hypothesis rebuilt by
walking the back-pointers (one `.item()` per position) whenever the decoder needs the
prefixes, the candidates of a step sorted and scanned one by one (a membership test of the
candidate against the hypothesis tensor, skipping repeats), and the whole next-token
distribution of every chosen candidate kept as a Python list (the reference keeps it for
PRAUC). Measured on the 2-core machine this bookkeeping, not the decoder, is most of the
time per step (BENCHMARKS.md).

The selection rules are those of docs/DESIGN.md "Beam search" (and
`cognet.model.torch_decoding`), so the recommendations equal `torch-batched`'s up to float
rounding: B hypotheses per visit, hypothesis 0 at score 0 and the others at -inf;
medications already in a hypothesis are skipped; a finished hypothesis proposes only END at
its frozen score; the B best candidates are taken in stable descending order of the flat
index b * V1 + v; the answer is hypothesis 0. Running on until every hypothesis has finished
(the reference code's rule) instead of stopping when hypothesis 0 has cannot change that
answer: once hypothesis 0 has finished, no other candidate can score higher
(log-probabilities are <= 0) and ties keep the smaller flat index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cognet.core.decoding import MAX_LEN
from cognet.core.history import Visit
from cognet.model.batching import make_batch, select_rows
from cognet.model.network import COGNet, history_inputs


class Beam:
    """The hypotheses of one visit, advanced one step at a time (reference-style state)."""

    def __init__(self, size: int, start: int, end: int, max_len: int):
        self.size, self.start, self.end, self.max_len = size, start, end, max_len
        self.scores = torch.full((size,), float("-inf"))
        self.scores[0] = 0.0
        self.finished = [False] * size
        self.prev_ks: list[torch.Tensor] = []  # back-pointer of each hypothesis, per step
        self.next_ys = [torch.full((size,), start, dtype=torch.long)]  # chosen token, per step
        self.prob_list: list[list[list[float]]] = []  # distribution behind each choice

    @property
    def steps(self) -> int:
        return len(self.prev_ks)

    @property
    def done(self) -> bool:
        return all(self.finished) or self.steps >= self.max_len

    def hypothesis(self, k: int) -> list[int]:
        """Tokens of hypothesis k after START, rebuilt by walking the back-pointers."""
        tokens = []
        for j in range(self.steps - 1, -1, -1):
            tokens.append(self.next_ys[j + 1][k].item())
            k = self.prev_ks[j][k].item()
        return tokens[::-1]

    def current_state(self) -> torch.Tensor:
        """[B, steps + 1]: START and the tokens of every hypothesis."""
        if not self.prev_ks:
            return self.next_ys[0].unsqueeze(1)
        return torch.tensor([[self.start, *self.hypothesis(k)] for k in range(self.size)])

    def advance(self, log_probs: torch.Tensor) -> None:
        """log_probs: float32 [B, V1], the next-token distribution of every hypothesis."""
        current = self.current_state()
        cand = torch.full(log_probs.shape, float("-inf"))
        for b in range(self.size):
            if self.finished[b]:
                cand[b, self.end] = self.scores[b]
            else:
                cand[b] = self.scores[b] + log_probs[b]
        v1 = cand.shape[1]
        ordered, ids = torch.sort(cand.view(-1), descending=True, stable=True)
        scores, parents, words, finished, probs = [], [], [], [], []
        i = 0
        while len(scores) < self.size:
            score, flat = ordered[i], ids[i]
            i += 1
            parent = flat // v1
            word = flat - parent * v1
            done = self.finished[parent]
            if not done and word in current[parent]:  # no medication twice
                continue
            scores.append(score)
            parents.append(parent)
            words.append(word)
            finished.append(done or word.item() == self.end)
            probs.append(log_probs[parent].tolist())
        self.scores = torch.stack(scores)
        self.prev_ks.append(torch.stack(parents))
        self.next_ys.append(torch.stack(words))
        self.finished = finished
        self.prob_list.append(probs)

    def pad(self) -> None:
        """A finished visit keeps its hypotheses and adds END, so all prefixes keep one
        length (the reference's `Beam.advance` on a done beam)."""
        self.prev_ks.append(torch.arange(self.size))
        self.next_ys.append(torch.full((self.size,), self.end, dtype=torch.long))

    def best(self) -> tuple[int, ...]:
        """Medications of hypothesis 0 in generation order (END excluded)."""
        return tuple(t for t in self.hypothesis(0) if t != self.end)


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
    batch = select_rows(batch, torch.as_tensor(list(targets)))
    enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
    memories = model.decoder_init(*history_inputs(batch, *enc, model.cfg))
    beams = [Beam(beam, vocab.start, vocab.end, max_len) for _ in targets]
    while not all(b.done for b in beams):
        # every hypothesis of every visit of the patient, finished ones included
        prefix = torch.cat([b.current_state() for b in beams])  # [V * B, t + 1]
        mem = tuple(m.repeat_interleave(beam, 0) for m in memories)
        log_probs = model.decode_teacher_forced(prefix, mem)[0][:, -1]  # [V * B, V1]
        for v, b in enumerate(beams):
            if b.done:
                b.pad()
            else:
                b.advance(log_probs[v * beam : (v + 1) * beam])
    return [b.best() for b in beams]


def decode_perpatient(
    model: COGNet, patients: Sequence[Sequence[Visit]], vocab, beam: int, max_len: int = MAX_LEN
) -> list[tuple[int, ...]]:
    """The last visit of each patient (the one to score), one patient at a time.

    Like the reference, which has no way to decode one visit of a patient alone, every visit
    of the patient is decoded (the earlier ones with their own history) and the last one's
    recommendation is kept."""
    model.eval()
    return [decode_patient(model, p, vocab, range(len(p)), beam, max_len)[-1] for p in patients]
