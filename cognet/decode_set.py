"""Set decoding in torch: the shared driver of `cognet.core.sampling` over the torch model's
own KV-cached decoder step (the reference that the runtime's set decoding is tested against:
the two run the same numpy driver, so they differ only by float32 rounding)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cognet.batching import select_rows
from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import Decoding
from cognet.core.sampling import SetConfig, decode_sets, visit_keys
from cognet.decode import Decoded
from cognet.model import COGNet, history_inputs


class TorchSession:
    """`cognet.core.driver.DecoderSession` over the torch model: memories and the KV cache stay
    torch tensors on the model's device; step outputs come back as numpy arrays."""

    def __init__(self, model: COGNet):
        self.model = model
        self.device = next(model.parameters()).device
        with torch.no_grad():
            self.graph = model.graph_embeddings()

    def empty_cache(self, n: int, beam: int):
        return self.model.empty_cache(n, beam, device=self.device)

    @torch.no_grad()
    def step(self, tokens, parent, cache, memories, outputs):
        tok = torch.from_numpy(tokens).to(self.device)
        par = torch.from_numpy(parent).to(self.device)
        lp, gate, copy, att, key, value = self.model.decoder_step(
            tok, par, *cache, *memories, graph=self.graph, attention=True
        )
        got = {"log_probs": lp, "gate": gate, "copy_probs": copy, "diag_attention": att}
        return {k: got[k].float().cpu().numpy() for k in outputs}, (key, value)

    def take(self, value, rows: np.ndarray):
        index = torch.from_numpy(rows).to(self.device)
        return tuple(x[index] for x in value)


@torch.no_grad()
def set_decode(
    model: COGNet,
    batch: dict[str, torch.Tensor],
    visit_ids: Sequence[str],
    decoding: Decoding,
    rows: torch.Tensor | None = None,
    ddi: DDIPolicy = DDIPolicy(),
) -> list[Decoded]:
    """The set of each visit `rows` (default: every `target`) of a `make_batch` batch;
    `visit_ids` name those visits (their random streams)."""
    model.eval()
    if rows is not None:
        batch = select_rows(batch, rows)
    dev = next(model.parameters()).device
    batch = {k: v.to(dev) for k, v in batch.items()}
    enc = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
    memories = tuple(model.decoder_init(*history_inputs(batch, *enc, model.cfg)))
    n, end = len(batch["target"]), model.cfg.n_med
    if n != len(visit_ids):
        raise ValueError(f"{n} visits to decode but {len(visit_ids)} visit ids")
    cfg = SetConfig.of(decoding, end, ddi)
    adj = model.ddi_matrix().cpu().numpy() > 0
    res = decode_sets(TorchSession(model), memories, n, cfg, visit_keys(visit_ids), adj)
    return [
        Decoded(
            tuple(int(m) for m in res.meds[i]),
            float(res.score[i]),
            tuple(float(p) for p in res.med_probs[i]),
            res.prauc_scores[i],
        )
        for i in range(n)
    ]
