"""`SetHead`: a visit's P(k in S) for every medication in one pass, learnt from a COGNet
model's own set marginals (`cognet.training.set_head`).

Set decoding reads its answer from P(k in S), the probability that COGNet's decoding emits
k (`cognet.core.decoding.sampling`); estimating it takes K members x 16 samples of ~21
decoder steps a visit. The head is a two-layer network on the visit's codes and its
history's medications (`cognet.core.head_inputs`) that outputs those marginals directly:

    h = relu(sum E_d[diagnoses] + sum E_p[procedures] + sum E_l[last_meds]
             + sum E_h[past_meds] + has_history * w_h + b)        # (N, hidden)
    P = sigmoid(W dropout(h) + c)                                  # (N, M)

The sums of embedding rows are the first layer applied to multi-hot vectors, computed on
the ids (each PAD id has a zero row), so a visit costs its code count, not the vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cognet.core.head_inputs import HEAD_INPUTS

FORMAT_VERSION = 1


@dataclass(frozen=True)
class HeadConfig:
    n_diag: int
    n_proc: int
    n_med: int
    hidden: int = 1024
    dropout: float = 0.5

    def __post_init__(self) -> None:
        for key in ("n_diag", "n_proc", "n_med", "hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, not {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {self.dropout}")

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, obj: dict) -> HeadConfig:
        obj = dict(obj)
        if obj.pop("format_version", None) != FORMAT_VERSION:
            raise ValueError("unsupported set head config format version")
        return cls(**obj)


class SetHead(nn.Module):
    """P(k in S) [N, M] of visits given as the arrays of `cognet.core.head_inputs`."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        # one row per id and a zero row for PAD (= the vocabulary size)
        self.diagnoses = nn.Embedding(cfg.n_diag + 1, h, padding_idx=cfg.n_diag)
        self.procedures = nn.Embedding(cfg.n_proc + 1, h, padding_idx=cfg.n_proc)
        self.last_meds = nn.Embedding(cfg.n_med + 1, h, padding_idx=cfg.n_med)
        self.past_meds = nn.Embedding(cfg.n_med + 1, h, padding_idx=cfg.n_med)
        self.history = nn.Parameter(torch.zeros(h))
        self.bias = nn.Parameter(torch.zeros(h))
        self.dropout = nn.Dropout(cfg.dropout)
        self.out = nn.Linear(h, cfg.n_med)
        for table in (self.diagnoses, self.procedures, self.last_meds, self.past_meds):
            nn.init.normal_(table.weight, std=0.02)
            with torch.no_grad():
                table.weight[table.padding_idx].zero_()

    def logits(
        self,
        diagnoses: Tensor,
        procedures: Tensor,
        last_meds: Tensor,
        past_meds: Tensor,
        has_history: Tensor,
    ) -> Tensor:
        """The logits [N, M] as torch computes them (training, `marginals`): each kind's rows
        summed by one embedding_bag, no [N, L, hidden] gather to build and scatter back."""
        return self._logits(_bag_sum, diagnoses, procedures, last_meds, past_meds, has_history)

    def forward(self, diagnoses, procedures, last_meds, past_meds, has_history) -> Tensor:
        """P(k in S) [N, M] as the exported graph computes it: the rows gathered, then summed
        (the same sums as `logits`, in another order: ONNX's embedding_bag is a loop)."""
        ids = (diagnoses, procedures, last_meds, past_meds)
        return torch.sigmoid(self._logits(_gather_sum, *ids, has_history))

    def _logits(self, summed, diagnoses, procedures, last_meds, past_meds, has_history) -> Tensor:
        tables = (self.diagnoses, self.procedures, self.last_meds, self.past_meds)
        ids = (diagnoses, procedures, last_meds, past_meds)
        d, p, last, past = (summed(t, i) for t, i in zip(tables, ids, strict=True))
        h = d + p + last + past + has_history.unsqueeze(1) * self.history + self.bias  # (N, hidden)
        return self.out(self.dropout(torch.relu(h)))  # (N, M)

    @torch.no_grad()
    def marginals(self, arrays: dict[str, np.ndarray], chunk: int = 4096) -> np.ndarray:
        """float64 [N, M] P(k in S) of the arrays of `cognet.core.head_inputs` (eval mode)."""
        self.eval()
        n = len(arrays["has_history"])
        out = np.zeros((n, self.cfg.n_med), np.float64)
        for i in range(0, n, chunk):
            rows = slice(i, i + chunk)
            part = [torch.from_numpy(np.ascontiguousarray(arrays[k][rows])) for k in HEAD_INPUTS]
            out[rows] = torch.sigmoid(self.logits(*part)).double().numpy()
        return out


def _gather_sum(table: nn.Embedding, ids: Tensor) -> Tensor:
    """The sum over each row of `ids` [N, L] of `table`'s rows (PAD's is zero): (N, hidden)."""
    return table(ids).sum(1)


def _bag_sum(table: nn.Embedding, ids: Tensor) -> Tensor:
    """`_gather_sum` by one embedding_bag: the same sums, summed in another order."""
    return F.embedding_bag(ids, table.weight, mode="sum", padding_idx=table.padding_idx)
