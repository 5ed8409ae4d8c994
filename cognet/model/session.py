"""The torch model as a decoder session of the one decoding loop
(`cognet.core.decoding.driver.DecoderSession`): memories and the KV cache stay torch tensors
on the model's device; step outputs come back as numpy arrays."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from cognet.core.graphspec import INIT_INPUTS, KV_STEP_OUTPUTS, STEP_HEADS
from cognet.model.network import COGNet, history_inputs

# what `step` can return: every step output of the exported decoder step but its cache
STEP_OUTPUTS = STEP_HEADS


class TorchSession:
    """`DecoderSession` over a `COGNet` in torch (no search graphs: selection on the host)."""

    step_outputs = STEP_OUTPUTS
    search = None
    prefix_cache = False  # the KV cache; the reference steps every row

    def __init__(self, model: COGNet):
        self.model = model
        self.device = next(model.parameters()).device
        with torch.no_grad():
            self.graph = model.graph_embeddings()

    @torch.no_grad()
    def init(self, inputs: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
        """Memories from the decoder-init inputs as numpy arrays (`graphspec.INIT_INPUTS`)."""
        feeds = (torch.from_numpy(np.ascontiguousarray(inputs[k])) for k in INIT_INPUTS)
        return tuple(self.model.decoder_init(*(x.to(self.device) for x in feeds)))

    @torch.no_grad()
    def memories(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Memories of the target visits of a `make_batch` batch (encoded here, on the
        model's device)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        enc = self.model.encode_visits(
            batch["diagnoses"], batch["procedures"], batch["medications"]
        )
        return tuple(self.model.decoder_init(*history_inputs(batch, *enc, self.model.cfg)))

    def empty_cache(self, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.empty_cache(n, width, device=self.device)

    @torch.no_grad()
    def step(
        self,
        tokens: np.ndarray,
        parent: np.ndarray,
        cache: tuple[torch.Tensor, torch.Tensor],
        memories: tuple[torch.Tensor, ...],
        outputs: Sequence[str],
    ) -> tuple[dict[str, np.ndarray], tuple[torch.Tensor, torch.Tensor]]:
        tok = torch.from_numpy(tokens).to(self.device)
        same = (parent == np.arange(parent.shape[1])).all()  # no row changes beams: no gather
        par = None if same else torch.from_numpy(parent).to(self.device)
        out = self.model.decoder_step(tok, par, *cache, *memories, graph=self.graph, attention=True)
        got = dict(zip(KV_STEP_OUTPUTS, out, strict=True))
        cache = (got["present_key"], got["present_value"])
        return {k: got[k].float().cpu().numpy() for k in outputs}, cache

    def take(self, value: tuple[torch.Tensor, ...], rows: np.ndarray) -> tuple[torch.Tensor, ...]:
        index = torch.from_numpy(rows).to(self.device)
        return tuple(x[index] for x in value)
