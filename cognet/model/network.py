"""COGNet: the copy-or-predict medication recommender of Wu et al. (WWW 2022), in PyTorch.

The model is written as the three graphs that the exporter turns into ONNX (see
`cognet.core.graphspec` for their inputs and outputs):

- `encode_visits`: diagnosis, procedure and medication-set encoders (one Transformer
  encoder layer each, no positional encoding: codes are sets) and gated aggregation into
  visit vectors v_d, v_p. Each visit is encoded once and reused as history.
- `decoder_init`: per scored visit, the cross-attention keys/values of its diagnoses and
  procedures, the copy keys of every past medication slot and the visit-level copy weights
  c_j, folded into one additive bias per slot.
- `decoder_step`: one generated position with an explicit self-attention KV cache.

`forward` (teacher forcing, used for training) runs the same init and the same decoder
layer over all positions at once with a causal mask, so training and step-wise decoding
compute the same probabilities.

Copy weights: q_jk * c_j renormalised over all slots equals softmax_jk(a_jk + log c_j)
where q_jk = softmax(a_jk); the init precomputes log c_j per slot so a step needs one
softmax. The scatter onto medication ids is a batched matmul with a one-hot [S, V1] built
once per visit (no ScatterElements in the step graph).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cognet.core.file_schemas import ABLATIONS
from cognet.core.graphspec import NEG, PROB_FLOOR, cache_shapes

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ModelConfig:
    n_diag: int
    n_proc: int
    n_med: int
    dim: int = 64  # s in the paper
    heads: int = 4
    ffn: int = 128  # feed-forward width of the three encoders
    dropout: float = 0.2  # residual (and feed-forward, GCN) dropout
    dec_ffn: int | None = None  # feed-forward width of the decoder (None: ffn)
    emb_dropout: float = 0.0  # on the code and medication embeddings (the authors': 0.3)
    attn_dropout: float = 0.0  # on attention weights (the authors': 0.2)
    shared_gcn: bool = False  # the authors' GCN: one first layer for both graphs, biases
    ablation: str = "none"
    lambda_init: float = 0.1  # E_g = G_e - lambda * G_d; the reference code left it uninitialised

    def __post_init__(self) -> None:
        if self.ablation not in ABLATIONS:
            raise ValueError(f"unknown ablation {self.ablation!r}; choose from {ABLATIONS}")
        if self.dim % self.heads:
            raise ValueError("dim must be divisible by heads")
        if min(self.n_diag, self.n_proc, self.n_med) < 1:
            raise ValueError("every vocabulary needs at least one code")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def out_size(self) -> int:  # medications + END
        return self.n_med + 1

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, obj: dict) -> ModelConfig:
        obj = dict(obj)
        if obj.pop("format_version", None) != FORMAT_VERSION:
            raise ValueError("unsupported model config format version")
        return cls(**obj)


def reorder(past: Tensor, parent: Tensor) -> Tensor:
    """A step's cache [N, B, ...] continued from each row's parent beam (parent [N, B]):
    gathered along B."""
    n, b = parent.shape
    rows = (torch.arange(n, device=parent.device).unsqueeze(1) * b + parent).reshape(-1)
    return past.flatten(0, 1)[rows].view(past.shape)


def _bias(mask: Tensor) -> Tensor:
    """0 where mask is 1, NEG where it is 0."""
    return (1.0 - mask) * NEG


class Attention(nn.Module):
    """Multi-head attention with an additive key bias; queries [N, Q, s], keys [N, K, s].

    No dropout on the attention weights unless `attn_dropout` asks for it (it costs a quarter
    of a CPU training step); both training recipes ask for the authors' 0.2.
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def split(self, x: Tensor) -> Tensor:  # [N, L, s] -> [N, H, L, dh]
        n, length, _ = x.shape
        return x.view(n, length, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, memory: Tensor, bias: Tensor) -> Tensor:
        """bias: [N, 1 or Q, K] additive."""
        q, k, v = self.split(self.q(x)), self.split(self.k(memory)), self.split(self.v(memory))
        att = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias.unsqueeze(1)
        att = self.drop(att.softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(x.shape)  # [N, Q, s]
        return self.out(y)


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, dim)
        )


class EncoderLayer(nn.Module):
    """Post-LN Transformer encoder layer over a padded code set."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = Attention(cfg.dim, cfg.heads, cfg.attn_dropout)
        self.ffn = FeedForward(cfg.dim, cfg.ffn, cfg.dropout)
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.norm1(x + self.drop(self.attn(x, x, _bias(mask).unsqueeze(1))))
        return self.norm2(x + self.drop(self.ffn(x)))


class GatedAggregation(nn.Module):
    """Visit vector = sum of code encodings weighted by softmax(w . tanh(W x)) over codes."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.score = nn.Linear(dim, 1)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # [N, L, s], [N, L] -> [N, s]
        a = self.score(torch.tanh(self.proj(x))).squeeze(-1) + _bias(mask)
        v = (a.softmax(-1).unsqueeze(-1) * x).sum(1)
        return v * mask.amax(1, keepdim=True)  # a visit with no code has a zero vector


class GCN(nn.Module):
    """Two-layer GCN over a fixed, row-normalised adjacency, with one-hot node features.

    `shared`: the authors' variant, whose first-layer weights come from the caller (one
    matrix for both graphs) and whose layers have biases."""

    def __init__(self, n: int, dim: int, adj: np.ndarray, dropout: float, shared: bool = False):
        super().__init__()
        a = torch.as_tensor(adj, dtype=torch.float32) + torch.eye(n)
        # The graph is data, saved in graphs.npz beside the weights, not in the state dict.
        self.register_buffer("adj", a / a.sum(1, keepdim=True), persistent=False)
        if shared:
            self.b1 = nn.Parameter(torch.zeros(dim))
        else:
            self.w1 = nn.Parameter(torch.empty(n, dim))
        self.w2 = nn.Linear(dim, dim, bias=shared)
        if not shared:  # after w2's initialisation, as before the shared variant existed
            nn.init.xavier_uniform_(self.w1)
        self.drop = nn.Dropout(dropout)

    def forward(self, w1: Tensor | None = None) -> Tensor:  # [n, s]
        h = self.adj @ self.w1 if w1 is None else self.adj @ w1 + self.b1
        return self.adj @ self.w2(self.drop(F.relu(h)))


class COGNet(nn.Module):
    def __init__(self, cfg: ModelConfig, ehr_adj: np.ndarray, ddi_adj: np.ndarray):
        super().__init__()
        self.cfg = cfg
        s, m = cfg.dim, cfg.n_med
        self.diag_emb = nn.Embedding(cfg.n_diag + 1, s, padding_idx=cfg.n_diag)
        self.proc_emb = nn.Embedding(cfg.n_proc + 1, s, padding_idx=cfg.n_proc)
        self.med_emb = nn.Embedding(m + 3, s, padding_idx=m + 2)  # + END, START, PAD
        self.diag_encoder, self.proc_encoder, self.med_encoder = (
            EncoderLayer(cfg) for _ in range(3)
        )
        self.diag_agg, self.proc_agg = GatedAggregation(s), GatedAggregation(s)
        self.ehr_gcn = GCN(m, s, ehr_adj, cfg.dropout, cfg.shared_gcn)
        self.ddi_gcn = GCN(m, s, ddi_adj, cfg.dropout, cfg.shared_gcn)
        if cfg.shared_gcn:
            self.gcn_w1 = nn.Parameter(nn.init.xavier_uniform_(torch.empty(m, s)))
        self.emb_drop = nn.Dropout(cfg.emb_dropout) if cfg.emb_dropout > 0 else nn.Identity()
        self.ddi_lambda = nn.Parameter(torch.tensor(cfg.lambda_init))
        # decoder layer
        self.self_attn = Attention(s, cfg.heads, cfg.attn_dropout)
        self.cross_d = Attention(s, cfg.heads, cfg.attn_dropout)
        self.cross_p = Attention(s, cfg.heads, cfg.attn_dropout)
        self.ffn = FeedForward(s, cfg.dec_ffn or cfg.ffn, cfg.dropout)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(s) for _ in range(3))
        self.drop = nn.Dropout(cfg.dropout)
        # heads
        self.gen_head = nn.Linear(s, cfg.out_size)  # W_g, b_g
        self.copy_query = nn.Linear(s, s, bias=False)  # W_c
        self.gate_head = nn.Linear(s, 1)  # W_f, b_f

    # -- medication graph ---------------------------------------------------------------
    def ddi_matrix(self) -> Tensor:
        """float 0/1 [M, M]: the DDI pairs the model was built with (the GCN adjacency without
        its self-loops), for DDI-aware decoding."""
        adj = (self.ddi_gcn.adj > 0).float()
        return adj - torch.diag(torch.diag(adj))

    def graph_embeddings(self) -> Tensor:
        """E_g for every medication token, zero for END/START/PAD: [M + 3, s]."""
        w1 = self.gcn_w1 if self.cfg.shared_gcn else None
        e = self.ehr_gcn(w1) - self.ddi_lambda * self.ddi_gcn(w1)
        if self.cfg.ablation == "no-graph":
            e = torch.zeros_like(e)
        return torch.cat([e, e.new_zeros(3, e.shape[1])])

    # -- graph 1: visit encoder -----------------------------------------------------------
    def encode_visits(self, diagnoses: Tensor, procedures: Tensor, medications: Tensor):
        """Ids [N, L*] padded with each kind's PAD -> diag_enc, proc_enc, v_d, v_p, med_enc."""
        cfg = self.cfg
        dmask = (diagnoses != cfg.n_diag).float()
        pmask = (procedures != cfg.n_proc).float()
        mmask = (medications != cfg.n_med + 2).float()
        drop = self.emb_drop
        diag_enc = self.diag_encoder(drop(self.diag_emb(diagnoses)), dmask)
        proc_enc = self.proc_encoder(drop(self.proc_emb(procedures)), pmask)
        med_enc = self.med_encoder(drop(self.med_emb(medications)), mmask)
        return (
            diag_enc,
            proc_enc,
            self.diag_agg(diag_enc, dmask),
            self.proc_agg(proc_enc, pmask),
            med_enc,
        )

    # -- graph 2: decoder init --------------------------------------------------------------
    def _cross_memory(self, attn: Attention, enc: Tensor, mask: Tensor):
        scale = 1.0 / math.sqrt(attn.head_dim)
        key = attn.split(attn.k(enc)).transpose(-1, -2) * scale  # [N, H, dh, L]
        value = attn.split(attn.v(enc))  # [N, H, L, dh]
        return key, value, _bias(mask), mask.amax(1)

    def decoder_init(
        self,
        diag_enc,
        diag_mask,
        proc_enc,
        proc_mask,
        v_d,
        v_p,
        hist_v_d,
        hist_v_p,
        hist_mask,
        slot_enc,
        slot_mask,
        slot_visit,
        slot_med,
    ):
        """Per-visit memories, in the order of `graphspec.MEMORIES`."""
        cfg, s = self.cfg, self.cfg.dim
        use_d, use_p = cfg.ablation != "no-diagnoses", cfg.ablation != "no-procedures"
        kd, vd, bd, fd = self._cross_memory(self.cross_d, diag_enc, diag_mask)
        kp, vp, bp, fp = self._cross_memory(self.cross_p, proc_enc, proc_mask)
        fd, fp = fd * float(use_d), fp * float(use_p)
        # visit-level copy weights c_j over past visits
        sim = torch.zeros_like(hist_mask)
        if use_d:
            sim = sim + (hist_v_d * v_d.unsqueeze(1)).sum(-1)
        if use_p:
            sim = sim + (hist_v_p * v_p.unsqueeze(1)).sum(-1)
        if cfg.ablation == "no-visit-score":
            sim = torch.zeros_like(sim)
        log_c = torch.log_softmax(sim / math.sqrt(s) + _bias(hist_mask), -1)  # [N, J]
        copy_bias = torch.gather(log_c, 1, slot_visit) * slot_mask + _bias(slot_mask)
        copy_key = slot_enc.transpose(1, 2) * (1.0 / math.sqrt(s))  # [N, s, S]
        onehot = F.one_hot(slot_med, cfg.out_size).float() * slot_mask.unsqueeze(-1)
        has_history = slot_mask.amax(1) * float(cfg.ablation != "no-copy")
        return kd, vd, bd, fd, kp, vp, bp, fp, copy_key, copy_bias, onehot, has_history

    # -- the decoder layer, shared by teacher forcing and step-wise decoding ---------------------
    def _embed_tokens(self, tokens: Tensor, graph: Tensor) -> Tensor:
        return self.emb_drop(self.med_emb(tokens)) + F.embedding(tokens, graph)

    @staticmethod
    def _cross(
        attn: Attention, x: Tensor, key: Tensor, value: Tensor, bias: Tensor, flag: Tensor
    ) -> tuple[Tensor, Tensor]:
        """x [N, Q, s] against one visit's memory: key [N, H, dh, L], value [N, H, L, dh].

        Returns the output [N, Q, s] and the attention weights [N, H, Q, L]."""
        n, length, _ = x.shape
        q = attn.q(x).view(n, length, attn.heads, attn.head_dim).transpose(1, 2)  # [N, H, Q, dh]
        att = attn.drop((q @ key + bias.view(n, 1, 1, -1)).softmax(-1))  # [N, H, Q, L]
        y = (att @ value).transpose(1, 2)  # [N, Q, H, dh]
        return attn.out(y.reshape(n, length, -1)) * flag.view(n, 1, 1), att

    def _finish(
        self, x: Tensor, attn_out: Tensor, memories
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Everything after self-attention: x, attn_out [N, Q, s] -> log_probs, gate, copy,
        and the diagnosis cross-attention weights [N, H, Q, Ld]."""
        h, att_d = self._hidden(x, attn_out, memories)
        return (*self._mixture(h, memories), att_d)

    def _hidden(self, x: Tensor, attn_out: Tensor, memories) -> tuple[Tensor, Tensor]:
        """The decoder layer's output h [N, Q, s] and the diagnosis cross-attention weights."""
        kd, vd, bd, fd, kp, vp, bp, fp = memories[:8]
        x = self.norm1(x + self.drop(attn_out))
        cross_d, att_d = self._cross(self.cross_d, x, kd, vd, bd, fd)
        cross_p, _ = self._cross(self.cross_p, x, kp, vp, bp, fp)
        x = self.norm2(x + self.drop(cross_d + cross_p))
        return self.norm3(x + self.drop(self.ffn(x))), att_d  # [N, Q, s]

    def _mixture(self, h: Tensor, memories) -> tuple[Tensor, Tensor, Tensor]:
        """h [N, Q, s] -> the copy-or-predict log_probs [N, Q, V1], gate [N, Q], copy [N, Q, S]."""
        copy_key, copy_bias, onehot, has_history = memories[8:]
        gen = self.gen_head(h).softmax(-1)  # Pr_g [N, Q, V1]
        copy = (self.copy_query(h) @ copy_key + copy_bias.unsqueeze(1)).softmax(-1)  # [N, Q, S]
        gate = 1.0 - (1.0 - torch.sigmoid(self.gate_head(h).squeeze(-1))) * has_history.unsqueeze(1)
        prob = gate.unsqueeze(-1) * gen + (1.0 - gate).unsqueeze(-1) * (copy @ onehot)
        return torch.log(prob.clamp_min(PROB_FLOOR)), gate, copy

    # -- graph 3: one decoder step with a KV cache -------------------------------------------------
    def decoder_step(
        self, tokens, parent, past_key, past_value, *memories, graph=None, attention: bool = False
    ):
        """tokens, parent [N, B] (None: the identity); past_key [N, B, H, dh, T]; past_value
        [N, B, H, T, dh].

        Returns log_probs [N, B, V1], gate [N, B], copy_probs [N, B, S], present_key,
        present_value (T + 1); with `attention` (the exported graph), diag_attention
        [N, H, B, Ld] (the diagnosis cross-attention weights, an existing tensor: exposing it
        adds no node to the graph) comes after copy_probs. `graph` is E_g; computed here when
        not given.
        """
        n, b = tokens.shape
        attn = self.self_attn
        if graph is None:
            graph = self.graph_embeddings()
        if parent is not None:  # None: every row continues itself (set decoding's samples)
            past_key, past_value = reorder(past_key, parent), reorder(past_value, parent)
        x = self._embed_tokens(tokens, graph)  # [N, B, s]
        shape = (n, b, attn.heads, 1, attn.head_dim)
        q = attn.q(x).view(shape) * (1.0 / math.sqrt(attn.head_dim))
        present_key = torch.cat([past_key, attn.k(x).view(shape).transpose(-1, -2)], -1)
        present_value = torch.cat([past_value, attn.v(x).view(shape)], -2)
        att = (q @ present_key).softmax(-1)  # [N, B, H, 1, T + 1]
        y = attn.out((att @ present_value).view(n, b, -1))
        log_probs, gate, copy, diag_attention = self._finish(x, y, memories)
        if attention:
            return log_probs, gate, copy, diag_attention, present_key, present_value
        return log_probs, gate, copy, present_key, present_value

    def empty_cache(self, n: int, b: int, device=None) -> tuple[Tensor, Tensor]:
        """The first step's (past_key, past_value): empty, `graphspec.cache_shapes`."""
        key, value = cache_shapes(n, b, self.cfg.heads, self.cfg.head_dim)
        return torch.zeros(key, device=device), torch.zeros(value, device=device)

    # -- teacher forcing ---------------------------------------------------------------------------
    def decode_teacher_forced(
        self, tokens: Tensor, memories, hidden: bool = False
    ) -> tuple[Tensor, ...]:
        """tokens [N, L] (START then the target prefix) -> log_probs [N, L, V1], gate, copy,
        and with `hidden` the decoder layer's output h [N, L, s] (for training losses)."""
        x = self._embed_tokens(tokens, self.graph_embeddings())
        length = tokens.shape[1]
        causal = torch.full((length, length), NEG, device=tokens.device).triu(1)
        y = self.self_attn(x, x, causal.unsqueeze(0))
        h, _ = self._hidden(x, y, memories)
        out = self._mixture(h, memories)
        return (*out, h) if hidden else out

    def forward(self, batch: dict[str, Tensor], hidden: bool = False):
        """Teacher-forced log-probabilities [N, L, V1] for a batch from `cognet.model.batching`;
        with `hidden`, (log_probs, h [N, L, s])."""
        diag_enc, proc_enc, v_d, v_p, med_enc = self.encode_visits(
            batch["diagnoses"], batch["procedures"], batch["medications"]
        )
        memories = self.decoder_init(
            *history_inputs(batch, diag_enc, proc_enc, v_d, v_p, med_enc, self.cfg)
        )
        out = self.decode_teacher_forced(batch["dec_input"], memories, hidden)
        return (out[0], out[3]) if hidden else out[0]


def history_inputs(batch, diag_enc, proc_enc, v_d, v_p, med_enc, cfg: ModelConfig):
    """Assemble the decoder-init inputs of every target visit from the batch's encodings.

    The batch indexes (see `cognet.model.batching`): `target` [N] visit rows being decoded,
    `hist_index` [N, J] and `slot_visit_row`/`slot_pos` [N, S] point into the encoded visits.
    """
    t = batch["target"]
    flat_med = med_enc.flatten(0, 1)  # [V * Lm, s]
    slot_enc = flat_med[batch["slot_visit_row"] * med_enc.shape[1] + batch["slot_pos"]]
    return (
        diag_enc[t],
        (batch["diagnoses"][t] != cfg.n_diag).float(),
        proc_enc[t],
        (batch["procedures"][t] != cfg.n_proc).float(),
        v_d[t],
        v_p[t],
        v_d[batch["hist_index"]],
        v_p[batch["hist_index"]],
        batch["hist_mask"],
        slot_enc,
        batch["slot_mask"],
        batch["slot_visit"],
        batch["slot_med"],
    )
