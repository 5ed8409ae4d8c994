"""The test oracle of beam search: the plain torch loop that cognet's torch reference was
before every decoding ran through one driver (`cognet.core.decoding.driver`). It starts,
steps, selects, finishes and traces back on its own, and compacts at every finish, so the
parity tests compare the driver and its selectors with an independent implementation of
the rules of docs/DESIGN.md "Beam search" and `cognet.core.ddi`."""

from __future__ import annotations

import torch

from cognet.core.ddi import RATE_TOLERANCE, DDIPolicy
from cognet.core.decoding import BEAM, MAX_LEN
from cognet.model.batching import select_rows
from cognet.model.network import COGNet, history_inputs
from cognet.model.torch_decoding import Decoded


def _select(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-visit gather along the beam axis: x [n, B, ...], index [n, B]."""
    view = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return x.gather(1, view)


def ddi_rate_of_beams(used: torch.Tensor, ddi: torch.Tensor) -> torch.Tensor:
    """DDI rate of every beam's medication set: used [n, B, M] bool, ddi [M, M] 0/1."""
    m = used.float()
    pairs = ((m @ ddi) * m).sum(-1) / 2
    k = m.sum(-1)
    total = k * (k - 1) / 2
    return torch.where(total > 0, pairs / total.clamp_min(1), torch.zeros_like(total))


@torch.no_grad()
def beam_search(
    model: COGNet,
    batch: dict[str, torch.Tensor],
    beam: int = BEAM,
    max_len: int = MAX_LEN,
    rows: torch.Tensor | None = None,
    ddi: DDIPolicy = DDIPolicy(),
) -> list[Decoded]:
    """Decode the visits `rows` (default: every `target`) of a batch from `make_batch`."""
    model.eval()
    ddi_adj = model.ddi_matrix()
    cfg = model.cfg
    if rows is not None:
        batch = select_rows(batch, rows)
    dev = next(model.parameters()).device
    batch = {k: v.to(dev) for k, v in batch.items()}
    enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
    memories = model.decoder_init(*history_inputs(batch, *enc, cfg))
    graph = model.graph_embeddings()
    n, b, v1, end = len(batch["target"]), beam, cfg.out_size, cfg.n_med
    neg_inf = float("-inf")

    alive = torch.arange(n, device=dev)  # visits still decoding, in memory order
    scores = torch.full((n, b), neg_inf, device=dev)
    scores[:, 0] = 0.0
    finished = torch.zeros(n, b, dtype=torch.bool, device=dev)
    tokens = torch.full((n, b), cfg.n_med + 1, device=dev)  # START
    parent = torch.arange(b, device=dev).repeat(n, 1)
    past_key, past_value = model.empty_cache(n, b, device=dev)
    seqs = torch.full((n, b, max_len), -1, device=dev)
    emit_prob = torch.zeros(n, b, max_len, device=dev)
    used = torch.zeros(n, b, v1, dtype=torch.bool, device=dev)
    prob_sum = torch.zeros(n, b, v1, device=dev)
    steps = torch.zeros(n, b, device=dev)
    results: dict[int, Decoded] = {}

    def record(local: torch.Tensor) -> None:
        choice = torch.zeros(len(alive), dtype=torch.long, device=dev)
        if ddi.max_rate is not None:
            rate = ddi_rate_of_beams(used[..., : cfg.n_med], ddi_adj)
            ok = (rate <= ddi.max_rate + RATE_TOLERANCE) & (scores > float("-inf"))
            lowest = torch.sort(
                rate.masked_fill(scores == float("-inf"), 2.0), dim=1, stable=True
            ).indices[:, 0]
            choice = torch.where(ok.any(1), ok.float().argmax(1), lowest)
        for i in local.tolist():
            c = int(choice[i])
            length = int((seqs[i, c] >= 0).sum())
            toks = seqs[i, c, :length].tolist()
            meds = tuple(t for t in toks if t != end)
            probs = emit_prob[i, c, :length].tolist()
            mean = (prob_sum[i, c, : cfg.n_med] / steps[i, c].clamp_min(1)).cpu().numpy().copy()
            med_probs = tuple(p for t, p in zip(toks, probs, strict=True) if t != end)
            mean[list(meds)] = med_probs
            results[int(alive[i])] = Decoded(meds, float(scores[i, c]), med_probs, mean)

    for t in range(max_len):
        log_probs, _, _, past_key, past_value = model.decoder_step(
            tokens, parent, past_key, past_value, *memories, graph=graph
        )
        raw = log_probs
        logp = raw.masked_fill(used, neg_inf)
        if ddi.mode != "off":
            clashes = used[..., : cfg.n_med].float() @ ddi_adj  # [n, B, M] interacting pairs
            meds = logp[..., : cfg.n_med]
            meds = (
                meds.masked_fill(clashes > 0, neg_inf)
                if ddi.mode == "hard"
                else meds - ddi.penalty * clashes
            )
            logp = torch.cat([meds, logp[..., cfg.n_med :]], -1)
        frozen = torch.full_like(logp, neg_inf)
        frozen[..., end] = 0.0
        logp = torch.where(finished.unsqueeze(-1), frozen, logp)
        cand = (scores.unsqueeze(-1) + logp).view(len(alive), b * v1)
        order = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :b]
        scores = cand.gather(1, order)
        parent, tokens = order // v1, order % v1
        was_finished = _select(finished, parent)
        live = ~was_finished
        raw = _select(raw, parent)
        seqs = _select(seqs, parent)
        seqs[:, :, t] = torch.where(live, tokens, -1)
        emit_prob = _select(emit_prob, parent)
        emit_prob[:, :, t] = raw.gather(2, tokens.unsqueeze(-1)).squeeze(-1).exp() * live
        used = _select(used, parent)
        used.scatter_(2, tokens.unsqueeze(-1), True)
        prob_sum = _select(prob_sum, parent) + raw.exp() * live.unsqueeze(-1)
        steps = _select(steps, parent) + live.float()
        finished = was_finished | (tokens == end)

        # the best hypothesis is final once beam 0 is finished; choosing by DDI rate needs all
        done = finished.all(1) if ddi.max_rate is not None else finished[:, 0]
        if t == max_len - 1:
            done = torch.ones(len(alive), dtype=torch.bool, device=dev)
        if bool(done.any()):
            record(done.nonzero().squeeze(1))
            keep = (~done).nonzero().squeeze(1)
            if len(keep) == 0:
                break
            alive = alive[keep]
            scores, finished, tokens, parent = (x[keep] for x in (scores, finished, tokens, parent))
            past_key, past_value, seqs, emit_prob, used, prob_sum, steps = (
                x[keep] for x in (past_key, past_value, seqs, emit_prob, used, prob_sum, steps)
            )
            memories = tuple(m[keep] for m in memories)
    return [results[i] for i in range(n)]
