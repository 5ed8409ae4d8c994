"""Decoding with the torch model: beam search and set decoding of `make_batch` batches, the
marginal decoding (the set head's one pass, then the set rules), and `decode_patients` over
whole patients (what evaluation, tuning and the benchmarks call).

A `DecodingPlan` (`cognet.core.decoding.plan`) says what runs; beam search and set decoding
go through the runtime's dispatch (`cognet.core.decoding.plan.decode`) into the one
decoding loop (`cognet.core.decoding.driver.run`) with the host selectors the runtime uses
(`cognet.core.decoding.beam.BeamSelector`, `cognet.core.decoding.sampling.SetSampler`) over
`TorchSession`, the torch model's KV-cached decoder step; so torch and the runtime differ
only by their float32 rounding. The rules: docs/DESIGN.md "Beam search" and "Set decoding",
`cognet.core.ddi` for the DDI policies, `cognet.core.decoding.defaults` for the defaults
(beam 4, max length 45). An `Ensemble` decodes by the rules of
`cognet.core.decoding.ensemble`, over one `TorchSession` per member (an `EnsembleSession`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import BEAM, MAX_LEN, Decoding
from cognet.core.decoding.ensemble import EnsembleSession, ensemble_marginals
from cognet.core.decoding.plan import DecodingPlan, decode
from cognet.core.head_inputs import patient_head_arrays
from cognet.core.history import Visit
from cognet.core.vocab import Vocab
from cognet.model.batching import make_batch, select_rows
from cognet.model.ensemble import Ensemble, members_of
from cognet.model.network import COGNet
from cognet.model.session import TorchSession
from cognet.model.set_head import SetHead

# patients a batch of `set_marginals_of`: fewer than `decode_patients`' 128, as the decoding
# alone runs faster on one core at this size
# (docs/benchmarks/history/2026-12-07-set-head-training-cost.md)
MARGINALS_BATCH = 32


@dataclass(frozen=True)
class Decoded:
    """One visit's answer."""

    meds: tuple[int, ...]  # beam search: generation order; set: decreasing P(k in S)
    score: float  # beam search: sum of log-probabilities, END included; set: mean P of the set
    med_probs: tuple[float, ...]  # each medication's probability (at its step; or P(k in S))
    scores: np.ndarray  # [M] PRAUC scores (DESIGN.md §4)


@torch.no_grad()
def beam_search(
    model: COGNet | Ensemble,
    batch: dict[str, torch.Tensor],
    beam: int = BEAM,
    max_len: int = MAX_LEN,
    rows: torch.Tensor | None = None,
    ddi: DDIPolicy = DDIPolicy(),
) -> list[Decoded]:
    """Beam search (greedy: beam 1) of the visits `rows` (default: every `target`) of a
    `make_batch` batch, with the PRAUC scores."""
    if rows is not None:
        batch = select_rows(batch, rows)
    plan = DecodingPlan(Decoding("beam", beam=beam, max_len=max_len), model.cfg.n_med, ddi=ddi)
    # beam search draws nothing: the visits' ids are not read, only their number
    return _decode(model, batch, _for_model(model, plan), [""] * len(batch["target"]))


@torch.no_grad()
def set_decode(
    model: COGNet | Ensemble,
    batch: dict[str, torch.Tensor],
    visit_ids: Sequence[str],
    decoding: Decoding,
    rows: torch.Tensor | None = None,
    ddi: DDIPolicy = DDIPolicy(),
) -> list[Decoded]:
    """The set of each visit `rows` (default: every `target`) of a `make_batch` batch;
    `visit_ids` name those visits (their random streams)."""
    if rows is not None:
        batch = select_rows(batch, rows)
    n = len(batch["target"])
    if n != len(visit_ids):
        raise ValueError(f"{n} visits to decode but {len(visit_ids)} visit ids")
    plan = DecodingPlan(decoding, model.cfg.n_med, ddi=ddi)
    return _decode(model, batch, _for_model(model, plan), visit_ids)


def decode_patients(
    model: COGNet | Ensemble,
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    plan: DecodingPlan | None = None,
    on_batch: Callable[[int], None] | None = None,
    batch_patients: int = 128,
    head: SetHead | None = None,
) -> list[Decoded]:
    """Decode every visit of `patients` (history: the earlier visits' true medications) by
    `plan` (its decoding and DDI policy; default: the paper's beam search, beam 4, DDI off;
    its DDI adjacency: the model's unless it names one); the marginal decoding reads the set
    head `head`."""
    plan = _for_model(model, DecodingPlan(Decoding(), vocab.end) if plan is None else plan)
    if plan.decoding.name == "marginal":
        return marginal_decode(head, model, vocab, patients, plan, on_batch)
    out: list[Decoded] = []
    for i in range(0, len(patients), batch_patients):
        chunk = patients[i : i + batch_patients]
        batch = make_batch(chunk, vocab, targets=False)
        out.extend(_decode(model, batch, plan, [v.visit_id for p in chunk for v in p]))
        if on_batch:
            on_batch(sum(map(len, chunk)))
    return out


@torch.no_grad()
def set_marginals_of(
    model: COGNet | Ensemble,
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    plan: DecodingPlan,
    on_batch: Callable[[int], None] | None = None,
    batch_patients: int = MARGINALS_BATCH,
) -> np.ndarray:
    """float32 [V, M]: P(k in S) of every visit of `patients` (patient order) under the
    plan's set decoding, the members' mean; what `decode_patients` gives as `Decoded.scores`,
    without reading sets or PRAUC scores from it (the set head's teacher)."""
    if plan.sets is None:
        raise ValueError(f"P(k in S) comes from set decoding, not {plan.decoding.name}")
    model.eval()
    sessions = [TorchSession(m) for m in members_of(model)]
    out = []
    for i in range(0, len(patients), batch_patients):
        chunk = patients[i : i + batch_patients]
        batch = make_batch(chunk, vocab, targets=False)
        memories = [s.memories(batch) for s in sessions]
        visits = plan.visits([v.visit_id for p in chunk for v in p])
        mean, _, _ = ensemble_marginals(sessions, memories, plan.sets, visits)
        out.append(mean.astype(np.float32))
        if on_batch:
            on_batch(sum(map(len, chunk)))
    return np.concatenate(out) if out else np.zeros((0, vocab.n_med), np.float32)


def marginal_decode(
    head: SetHead | None,
    model: COGNet | Ensemble,
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    plan: DecodingPlan,
    on_batch: Callable[[int], None] | None = None,
) -> list[Decoded]:
    """The marginal decoding of every visit of `patients`: the set rules of the plan's
    decoding (`Decoding.selection`) and DDI policy read from the set head's P(k in S)."""
    if head is None:
        raise ValueError("the marginal decoding reads a set head: this checkpoint has none")
    pads = (vocab.n_diag, vocab.n_proc, vocab.n_med)
    marginals = head.marginals(patient_head_arrays(patients, pads, vocab.n_med))
    out = _decoded(_for_model(model, plan).read_sets(marginals), len(marginals))
    if on_batch:
        on_batch(len(out))
    return out


def reselect(
    model: COGNet | Ensemble, decoded: Sequence[Decoded], decoding: Decoding, ddi: DDIPolicy
) -> list[Decoded]:
    """The answers of set decoding `decoding` under `ddi` read from the P(k in S) of answers
    `decoded` (`Decoded.scores`) without decoding again: right when `ddi` acts on the set
    only (a cap, a pair price) beyond the step policy (mode, penalty) those answers were
    decoded with, which alone changes P(k in S)."""
    marginals = np.stack([d.scores for d in decoded])
    plan = DecodingPlan(decoding, model.cfg.n_med, ddi=ddi)
    return _decoded(_for_model(model, plan).read_sets(marginals), len(decoded))


@torch.no_grad()
def _decode(
    model: COGNet | Ensemble,
    batch: dict[str, torch.Tensor],
    plan: DecodingPlan,
    visit_ids: Sequence[str],
) -> list[Decoded]:
    """The plan's decoding of every target of a `make_batch` batch by the one dispatch
    (`cognet.core.decoding.plan.decode`) over a `TorchSession` of the network, or an
    `EnsembleSession` over one per member."""
    model.eval()
    sessions = [TorchSession(m) for m in members_of(model)]
    memories = tuple(s.memories(batch) for s in sessions)
    if len(sessions) == 1:
        result = decode(sessions[0], memories[0], plan, visit_ids)
    else:
        result = decode(EnsembleSession(sessions), memories, plan, visit_ids)
    return _decoded(result, len(visit_ids))


def _for_model(model: COGNet | Ensemble, plan: DecodingPlan) -> DecodingPlan:
    """The plan as torch runs it on `model`: with the PRAUC scores (`Decoded.scores`), no
    explanations, and the model's DDI pairs unless the plan names its own."""
    if plan.end != model.cfg.n_med:
        raise ValueError(f"a plan for {plan.end} medications, a model of {model.cfg.n_med}")
    adj = _ddi_adjacency(model) if plan.ddi_adj is None else plan.ddi_adj
    return replace(plan, prauc=True, explain=False, ddi_adj=adj)


def _ddi_adjacency(model: COGNet | Ensemble) -> np.ndarray:
    """bool [M, M]: the model's DDI pairs."""
    return model.ddi_matrix().cpu().numpy() > 0


def _decoded(res, n: int) -> list[Decoded]:
    """`Decoded` answers from a `BeamResult` or `SetResult` of n visits."""
    return [
        Decoded(
            tuple(int(m) for m in res.meds[i]),
            float(res.score[i]),
            tuple(float(p) for p in res.med_probs[i]),
            res.prauc_scores[i],
        )
        for i in range(n)
    ]
