"""The training losses: the teacher-forced pass (with scheduled sampling when asked), the
auxiliary multi-label loss and the DDI term. `cognet.training.train.batch_loss` adds them up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cognet.core.vocab import Vocab
from cognet.model.batching import IGNORE
from cognet.model.network import COGNet, history_inputs


def aux_loss(aux_head: torch.nn.Linear, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The auxiliary multi-label loss: at every decoder position t (START, each medication,
    END), binary cross-entropy of `aux_head(h_t)` (one logit per medication) against the set
    of medications still to come at t (at START the whole set, at END none), summed over
    medications, averaged over positions. A training signal for the shared network only: the
    head is not part of the model, and recommendations stay the copy-or-predict mixture.

    hidden [N, L, s] (decoder outputs, teacher-forced); target [N, L] (`dec_target`).
    """
    n_med = aux_head.out_features
    valid = target != IGNORE
    is_med = valid & (target < n_med)
    onehot = F.one_hot(torch.where(is_med, target, 0), n_med).float() * is_med.unsqueeze(-1)
    remaining = onehot.flip(1).cumsum(1).flip(1).clamp_max(1.0)  # [N, L, M]
    logits = aux_head(hidden[valid])
    bce = F.binary_cross_entropy_with_logits(logits, remaining[valid], reduction="sum")
    return bce / valid.sum().clamp_min(1)


def ddi_loss(
    log_probs: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor, ddi: torch.Tensor
) -> torch.Tensor:
    """The DDI term: the expected number of interacting pairs that each decoding step adds.
    At every position t with a target, the sum over medications j of P_t(j) times the number
    of medications among the decoder's inputs up to t (the true prefix) that interact with
    j; averaged over positions. It lowers the probability of a medication that interacts
    with one already recommended, the way SafeDrug's DDI loss lowers that of interacting
    pairs, for a model that recommends one medication at a time.

    log_probs [N, L, V1]; inputs [N, L] (`dec_input`: START, medications, PAD); target [N, L]
    (`dec_target`); ddi [M, M] 0/1, symmetric.
    """
    return ddi_terms(log_probs, inputs, target, ddi)[0]


def ddi_terms(
    log_probs: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor, ddi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`ddi_loss`, the batch's predicted DDI rate): the expected interacting pairs the
    steps add over the expected pairs they add (each step's medication against the prefix),
    detached. The rate is what SafeDrug's ramp compares with its target."""
    n_med = ddi.shape[0]
    is_med = inputs < n_med
    onehot = F.one_hot(torch.where(is_med, inputs, 0), n_med).to(ddi.dtype)
    prefix = (onehot * is_med.unsqueeze(-1)).cumsum(1)  # [N, L, M]: fed at positions <= t
    interacting = prefix @ ddi  # [N, L, M]: prefix medications interacting with each one
    valid = target != IGNORE
    p = log_probs[..., :n_med].exp()
    expected = (p * interacting).sum(-1)
    with torch.no_grad():
        pairs = (p * (prefix.sum(-1, keepdim=True) - prefix)).sum(-1)  # j against the others
        rate = expected[valid].sum() / pairs[valid].sum().clamp_min(1e-12)
    return expected[valid].sum() / valid.sum().clamp_min(1), rate


def ramp(rate: torch.Tensor, target: float, width: float) -> float:
    """SafeDrug's weight of the DDI term for a batch: 0 while the batch's predicted DDI rate
    is at or under the target, rising linearly to 1 at `width` above it."""
    return float(((rate - target) / width).clamp(0.0, 1.0))


def teacher_forced(
    model: COGNet, batch: dict, vocab: Vocab, share: float, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probabilities [N, L, V1] of a training batch and the decoder
    outputs h [N, L, s].

    With `share` > 0 (scheduled sampling), that share of the decoder's input medications
    (after START) is replaced by the model's own prediction for that position from a first
    teacher-forced pass without gradient, so training sees prefixes holding the model's
    mistakes, as decoding does; the targets stay the true medications. The visits are
    encoded once for both passes.
    """
    if share <= 0:
        return model(batch, hidden=True)
    enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
    memories = model.decoder_init(*history_inputs(batch, *enc, model.cfg))
    inputs = batch["dec_input"]
    with torch.no_grad():
        predicted = model.decode_teacher_forced(inputs, memories)[0].argmax(-1)  # [N, L]
    mixed = mix_inputs(inputs, predicted, share, vocab.n_med, gen)
    out = model.decode_teacher_forced(mixed, memories, hidden=True)
    return out[0], out[3]


def mix_inputs(
    inputs: torch.Tensor,
    predicted: torch.Tensor,
    share: float,
    n_med: int,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """Decoder inputs [N, L] (START, medications, PAD) with each medication after START
    replaced, with probability `share`, by predicted[:, t - 1] (the model's prediction for
    position t) when that is a medication; START, END and PAD stay."""
    shifted = torch.cat([inputs[:, :1], predicted[:, :-1]], 1)
    swap = torch.rand(inputs.shape, generator=gen).to(inputs.device) < share
    swap &= (inputs < n_med) & (shifted < n_med)
    swap[:, 0] = False
    return torch.where(swap, shifted, inputs)
