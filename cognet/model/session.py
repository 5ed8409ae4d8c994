"""The torch model as a decoder session of the one decoding loop
(`cognet.core.decoding.driver.DecoderSession`): memories and the KV cache stay torch tensors
on the model's device; step outputs come back as numpy arrays."""

from __future__ import annotations

import numpy as np
import torch

from cognet.model.network import COGNet


class TorchSession:
    """`cognet.core.decoding.driver.DecoderSession` over the torch model: memories and the KV cache
    stay
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
