"""The three exported graphs as torch modules, their example inputs and their I/O specs.

Each wrapper calls exactly one of `COGNet.encode_visits`, `COGNet.decoder_init`,
`COGNet.decoder_step`, so the ONNX graphs compute what the torch reference computes. The
step wrapper holds E_g (`COGNet.graph_embeddings()`) as a constant: the medication graphs
are fixed after training, so the two GCNs are not part of any exported graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cognet.core.graphspec import (
    ENCODER_INPUTS,
    ENCODER_OUTPUTS,
    INIT_INPUTS,
    INIT_OUTPUTS,
    STEP_INPUTS,
    STEP_OUTPUTS,
)
from cognet.core.manifest import TensorSpec
from cognet.model.network import COGNet


class EncoderGraph(nn.Module):
    def __init__(self, model: COGNet):
        super().__init__()
        self.model = model

    def forward(self, diagnoses: Tensor, procedures: Tensor, medications: Tensor):
        return self.model.encode_visits(diagnoses, procedures, medications)


class InitGraph(nn.Module):
    def __init__(self, model: COGNet):
        super().__init__()
        self.model = model

    def forward(self, *inputs: Tensor):
        return self.model.decoder_init(*inputs)


class StepGraph(nn.Module):
    def __init__(self, model: COGNet):
        super().__init__()
        self.model = model
        with torch.no_grad():
            self.register_buffer("graph_emb", model.graph_embeddings().detach().clone())

    def forward(
        self,
        tokens: Tensor,
        parent: Tensor,
        past_key: Tensor,
        past_value: Tensor,
        *memories: Tensor,
    ):
        return self.model.decoder_step(
            tokens, parent, past_key, past_value, *memories, graph=self.graph_emb, attention=True
        )


@dataclass(frozen=True)
class Sizes:
    """One size per dynamic axis. Export needs >= 2 everywhere: a size-1 (or 0) example
    axis is specialised to a constant by the exporter."""

    N: int = 3
    B: int = 2
    T: int = 2
    Ld: int = 5
    Lp: int = 3
    Lm: int = 4
    J: int = 2
    S: int = 6


def tensor_specs(model: COGNet) -> dict[str, TensorSpec]:
    """Every graph tensor by name, with symbolic axis names (fixed sizes as ints)."""
    cfg = model.cfg
    s, h, dh, v1 = cfg.dim, cfg.heads, cfg.head_dim, cfg.out_size
    i64, f32 = "int64", "float32"
    table = {
        "diagnoses": (i64, ("N", "Ld")),
        "procedures": (i64, ("N", "Lp")),
        "medications": (i64, ("N", "Lm")),
        "diag_enc": (f32, ("N", "Ld", s)),
        "proc_enc": (f32, ("N", "Lp", s)),
        "v_d": (f32, ("N", s)),
        "v_p": (f32, ("N", s)),
        "med_enc": (f32, ("N", "Lm", s)),
        "diag_mask": (f32, ("N", "Ld")),
        "proc_mask": (f32, ("N", "Lp")),
        "hist_v_d": (f32, ("N", "J", s)),
        "hist_v_p": (f32, ("N", "J", s)),
        "hist_mask": (f32, ("N", "J")),
        "slot_enc": (f32, ("N", "S", s)),
        "slot_mask": (f32, ("N", "S")),
        "slot_visit": (i64, ("N", "S")),
        "slot_med": (i64, ("N", "S")),
        "cross_key_d": (f32, ("N", h, dh, "Ld")),
        "cross_value_d": (f32, ("N", h, "Ld", dh)),
        "cross_bias_d": (f32, ("N", "Ld")),
        "cross_flag_d": (f32, ("N",)),
        "cross_key_p": (f32, ("N", h, dh, "Lp")),
        "cross_value_p": (f32, ("N", h, "Lp", dh)),
        "cross_bias_p": (f32, ("N", "Lp")),
        "cross_flag_p": (f32, ("N",)),
        "copy_key": (f32, ("N", s, "S")),
        "copy_bias": (f32, ("N", "S")),
        "copy_onehot": (f32, ("N", "S", v1)),
        "has_history": (f32, ("N",)),
        "tokens": (i64, ("N", "B")),
        "parent": (i64, ("N", "B")),
        "past_key": (f32, ("N", "B", h, dh, "T")),
        "past_value": (f32, ("N", "B", h, "T", dh)),
        "log_probs": (f32, ("N", "B", v1)),
        "gate": (f32, ("N", "B")),
        "copy_probs": (f32, ("N", "B", "S")),
        "diag_attention": (f32, ("N", h, "B", "Ld")),
        "present_key": (f32, ("N", "B", h, dh, "T+1")),
        "present_value": (f32, ("N", "B", h, "T+1", dh)),
    }
    return {name: TensorSpec(name, dtype, shape) for name, (dtype, shape) in table.items()}


GRAPH_IO = {
    "encoder": (ENCODER_INPUTS, ENCODER_OUTPUTS),
    "decoder_init": (INIT_INPUTS, INIT_OUTPUTS),
    "decoder_step": (STEP_INPUTS, STEP_OUTPUTS),
}
WRAPPERS = {"encoder": EncoderGraph, "decoder_init": InitGraph, "decoder_step": StepGraph}


def example_inputs(model: COGNet, sizes: Sizes, seed: int = 0) -> dict[str, Tensor]:
    """Random but valid values for every graph input (shared by export and validation).

    Id inputs keep at least one real code per row and pad the rest; masks match the ids.
    """
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    n = sizes.N

    def ids(length: int, vocab: int, pad: int, min_len: int = 1) -> Tensor:
        x = torch.randint(0, vocab, (n, length), generator=g)
        keep = torch.randint(min_len, length + 1, (n, 1), generator=g)
        return torch.where(torch.arange(length) < keep, x, torch.full_like(x, pad))

    def mask(length: int, min_len: int) -> Tensor:
        keep = torch.randint(min_len, length + 1, (n, 1), generator=g)
        return (torch.arange(length) < keep).float()

    def normal(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g)

    with torch.no_grad():
        diagnoses = ids(sizes.Ld, cfg.n_diag, cfg.n_diag, 0)
        procedures = ids(sizes.Lp, cfg.n_proc, cfg.n_proc)
        medications = ids(sizes.Lm, cfg.n_med, cfg.n_med + 2)
        enc = model.encode_visits(diagnoses, procedures, medications)
        enc = dict(zip(ENCODER_OUTPUTS, enc, strict=True))
        hist_mask = mask(sizes.J, 0)
        slot_mask = mask(sizes.S, 0) * hist_mask.amax(1, keepdim=True)
        slot_visit = torch.randint(0, sizes.J, (n, sizes.S), generator=g)
        last_visit = hist_mask.sum(1, keepdim=True).long().clamp_min(1) - 1
        slot_visit = torch.minimum(slot_visit, last_visit)
        init = {
            "diag_enc": enc["diag_enc"],
            "diag_mask": (diagnoses != cfg.n_diag).float(),
            "proc_enc": enc["proc_enc"],
            "proc_mask": (procedures != cfg.n_proc).float(),
            "v_d": enc["v_d"],
            "v_p": enc["v_p"],
            "hist_v_d": normal(n, sizes.J, cfg.dim) * hist_mask.unsqueeze(-1),
            "hist_v_p": normal(n, sizes.J, cfg.dim) * hist_mask.unsqueeze(-1),
            "hist_mask": hist_mask,
            "slot_enc": normal(n, sizes.S, cfg.dim),
            "slot_mask": slot_mask,
            "slot_visit": slot_visit * slot_mask.long(),
            "slot_med": torch.randint(0, cfg.n_med, (n, sizes.S), generator=g) * slot_mask.long(),
        }
        memories = model.decoder_init(*(init[k] for k in INIT_INPUTS))
        memories = dict(zip(INIT_OUTPUTS, memories, strict=True))
        shape_k = (n, sizes.B, cfg.heads, cfg.head_dim, sizes.T)
        shape_v = (n, sizes.B, cfg.heads, sizes.T, cfg.head_dim)
        step = {
            "tokens": torch.randint(0, cfg.n_med + 2, (n, sizes.B), generator=g),
            "parent": torch.randint(0, sizes.B, (n, sizes.B), generator=g),
            "past_key": normal(*shape_k),
            "past_value": normal(*shape_v),
        }
    return {
        "diagnoses": diagnoses,
        "procedures": procedures,
        "medications": medications,
        **init,
        **memories,
        **step,
    }
