"""The three exported graphs as torch modules, their example inputs and their I/O specs.

The encoder and decoder-init wrappers call `COGNet.encode_visits` and `COGNet.decoder_init`.
The step wrapper (`StepGraph`) computes `COGNet.decoder_step` with its cache as the token
prefix of every row (`graphspec.STEP_CACHE_INPUTS`): the decoder has one layer and no
position embeddings, so the embedding, query, key and value of a token depend on the token
alone, and the step reads them from tables of every token made here (E_g, the medication
graphs' embeddings, included: the graphs are fixed after training, so the two GCNs are not
part of any exported graph). Per step the graph gathers each row's values from the tables
(67 KB each at s = 128, which stay in the CPU's cache) instead of reading, reordering and
rewriting a KV cache that grows with every step; its self-attention scores come from one
more table, of every (query token, key token) pair's scaled score (H floats per pair, 140
KB for 131 medications and 2 heads; up to `SCORE_TABLE_MAX` entries, else q . k per step):
a gather of H floats per prefix token instead of a gather of s floats and a dot product.
`ReferenceStep` is what the step is checked against: the model's own `decoder_step`, fed
the KV cache of the same prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cognet.core.graphspec import (
    ENCODER_INPUTS,
    ENCODER_OUTPUTS,
    ENCODER_PARTS,
    INIT_INPUTS,
    INIT_OUTPUTS,
    STEP_INPUTS,
    STEP_OUTPUTS,
)
from cognet.core.head_inputs import HEAD_INPUTS, HEAD_OUTPUT
from cognet.core.manifest import TensorSpec
from cognet.model.network import COGNet, reorder

# The largest score table (floats: (V1 + 2)^2 x H) a step graph holds: 16 MB, about 1,400
# medications at 2 heads; larger vocabularies compute q . k per step.
SCORE_TABLE_MAX = 1 << 22


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
    """`COGNet.decoder_step` over the token prefix: tokens, parent [N, B], past_tokens
    [N, B, T] -> log_probs, gate, copy_probs, diag_attention, present_tokens [N, B, T + 1]."""

    def __init__(self, model: COGNet):
        super().__init__()
        self.model = model
        attn, h, dh = model.self_attn, model.cfg.heads, model.cfg.head_dim
        with torch.no_grad():
            x = model.med_emb.weight + model.graph_embeddings()  # [V1 + 2, s]: each token's x
            q = attn.q(x).view(-1, h, dh) * (1.0 / math.sqrt(dh))
            # [H, V1 + 2, dh]: a gather along axis 1 gives [H, N, B, T + 1, dh]
            k, v = (f(x).view(-1, h, dh).transpose(0, 1) for f in (attn.k, attn.v))
            tables = {"x_table": x, "v_table": v}
            self.tokens = x.shape[0]
            if self.tokens**2 * h <= SCORE_TABLE_MAX:
                # [(V1 + 2)^2, H]: the scaled score of query token a against key token b at
                # row a (V1 + 2) + b, each a float64 dot product rounded once
                scores = torch.einsum("ahd,hbd->abh", q.double(), k.double())
                tables["score_table"] = scores.reshape(-1, h).float()
            else:
                tables.update(q_table=q, k_table=k)
            for name, table in tables.items():
                self.register_buffer(name, table.detach().contiguous())

    def forward(self, tokens: Tensor, parent: Tensor, past_tokens: Tensor, *memories: Tensor):
        n, b = tokens.shape
        prefix = reorder(past_tokens, parent)
        prefix = torch.cat([prefix, tokens.unsqueeze(-1)], -1)  # [N, B, T + 1]
        if hasattr(self, "score_table"):  # one gather of H scores per prefix token
            pair = tokens.unsqueeze(-1) * self.tokens + prefix  # [N, B, T + 1]
            scores = self.score_table[pair].permute(3, 0, 1, 2).unsqueeze(-2)
        else:
            q = self.q_table[tokens].permute(2, 0, 1, 3).unsqueeze(-2)  # [H, N, B, 1, dh]
            scores = q @ self.k_table[:, prefix].transpose(-1, -2)  # keys [H, N, B, T + 1, dh]
        att = scores.softmax(-1)  # [H, N, B, 1, T + 1]
        value = self.v_table[:, prefix]  # [H, N, B, T + 1, dh]
        y = (att @ value).squeeze(-2).permute(1, 2, 0, 3).reshape(n, b, -1)  # [N, B, s]
        x = self.x_table[tokens]
        out = self.model._finish(x, self.model.self_attn.out(y), memories)
        return (*out, prefix)


class ReferenceStep(nn.Module):
    """The torch model's own step on StepGraph's inputs: `COGNet.decoder_step` fed the KV
    cache of the prefix (`kv_cache`), what the exported step must compute."""

    def __init__(self, model: COGNet):
        super().__init__()
        self.model = model
        with torch.no_grad():
            self.register_buffer("graph_emb", model.graph_embeddings().detach().clone())

    def forward(self, tokens: Tensor, parent: Tensor, past_tokens: Tensor, *memories: Tensor):
        cache = kv_cache(self.model, past_tokens, self.graph_emb)
        out = self.model.decoder_step(
            tokens, parent, *cache, *memories, graph=self.graph_emb, attention=True
        )
        present = torch.cat([reorder(past_tokens, parent), tokens.unsqueeze(-1)], -1)
        return (*out[:4], present)


def kv_cache(model: COGNet, prefix: Tensor, graph: Tensor) -> tuple[Tensor, Tensor]:
    """(past_key, past_value) of `COGNet.decoder_step` after the tokens `prefix` [N, B, T]:
    the step's self-attention keys and values of each token, in its layout
    (`graphspec.cache_shapes`)."""
    attn, (n, b, t) = model.self_attn, prefix.shape
    x = model._embed_tokens(prefix, graph)  # [N, B, T, s]
    shape = (n, b, t, attn.heads, attn.head_dim)
    key = attn.k(x).view(shape).permute(0, 1, 3, 4, 2)  # [N, B, H, dh, T]
    return key.contiguous(), attn.v(x).view(shape).transpose(2, 3).contiguous()


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
        "past_tokens": (i64, ("N", "B", "T")),
        "log_probs": (f32, ("N", "B", v1)),
        "gate": (f32, ("N", "B")),
        "copy_probs": (f32, ("N", "B", "S")),
        "diag_attention": (f32, ("N", h, "B", "Ld")),
        "present_tokens": (i64, ("N", "B", "T+1")),
    }
    return {name: TensorSpec(name, dtype, shape) for name, (dtype, shape) in table.items()}


GRAPH_IO = {
    "encoder": (ENCODER_INPUTS, ENCODER_OUTPUTS),
    "decoder_init": (INIT_INPUTS, INIT_OUTPUTS),
    "decoder_step": (STEP_INPUTS, STEP_OUTPUTS),
    **ENCODER_PARTS,  # cut from the encoder graph (`onnx_export.write_encoder_parts`)
    "head": (HEAD_INPUTS, (HEAD_OUTPUT,)),  # the set head (`cognet.model.set_head`)
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
        # the tokens a row may be fed: medications, END and START (never PAD)
        step = {
            "tokens": torch.randint(0, cfg.n_med + 2, (n, sizes.B), generator=g),
            "parent": torch.randint(0, sizes.B, (n, sizes.B), generator=g),
            "past_tokens": torch.randint(0, cfg.n_med + 2, (n, sizes.B, sizes.T), generator=g),
        }
    return {
        "diagnoses": diagnoses,
        "procedures": procedures,
        "medications": medications,
        **init,
        **memories,
        **step,
    }


# -- the set head ---------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadSizes:
    """One size per dynamic axis of the head's graph (>= 2 for the export, as `Sizes`)."""

    N: int = 3
    Ld: int = 5
    Lp: int = 3
    Ll: int = 4
    Lh: int = 6


def head_specs(n_med: int) -> dict[str, TensorSpec]:
    """The head graph's tensors (`cognet.core.head_inputs`) with symbolic axis names."""
    i64, f32 = "int64", "float32"
    table = {
        "diagnoses": (i64, ("N", "Ld")),
        "procedures": (i64, ("N", "Lp")),
        "last_meds": (i64, ("N", "Ll")),
        "past_meds": (i64, ("N", "Lh")),
        "has_history": (f32, ("N",)),
        HEAD_OUTPUT: (f32, ("N", n_med)),
    }
    return {name: TensorSpec(name, dtype, shape) for name, (dtype, shape) in table.items()}


def head_example(cfg, sizes: HeadSizes, seed: int = 0, empty: float = 0.2) -> dict[str, Tensor]:
    """Random but valid head inputs (`cognet.core.head_inputs`: ids padded with each kind's
    PAD, rows of no code at all PAD only): each list is empty in about `empty` of the rows,
    and a visit without history has no history medication."""
    g = torch.Generator().manual_seed(seed)
    n = sizes.N
    has = (torch.rand(n, generator=g) >= empty).float()

    def ids(length: int, vocab: int, keep_rows: Tensor | None = None) -> Tensor:
        x = torch.randint(0, vocab, (n, length), generator=g)
        keep = torch.randint(1, length + 1, (n, 1), generator=g)
        keep = keep * (torch.rand(n, 1, generator=g) >= empty)  # some lists empty
        if keep_rows is not None:
            keep = keep * keep_rows.long().unsqueeze(1)
        return torch.where(torch.arange(length) < keep, x, torch.full_like(x, vocab))

    return {
        "diagnoses": ids(sizes.Ld, cfg.n_diag),
        "procedures": ids(sizes.Lp, cfg.n_proc),
        "last_meds": ids(sizes.Ll, cfg.n_med, has),
        "past_meds": ids(sizes.Lh, cfg.n_med, has),
        "has_history": has,
    }
