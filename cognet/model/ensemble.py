"""`Ensemble`: K COGNet networks of one architecture, trained apart (seeds
`cognet.core.decoding.ensemble.member_seed`), decoded as one model by the rules of
`cognet.core.decoding.ensemble` (set decoding: the mean of the members' P(k in S); beam
search: their token-level mixture). A checkpoint of several members stores them in one
model.safetensors under `members.<i>.` (`cognet.model.checkpoint`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cognet.model.network import COGNet, ModelConfig


class Ensemble(torch.nn.Module):
    """Member networks of the same configuration and graphs (what `members_of` returns for
    one network too)."""

    def __init__(self, members: Sequence[COGNet]):
        super().__init__()
        if len(members) < 2:
            raise ValueError("an ensemble needs at least two members")
        if any(m.cfg != members[0].cfg for m in members):
            raise ValueError("the members of an ensemble must share their configuration")
        self.members = torch.nn.ModuleList(members)

    @property
    def cfg(self) -> ModelConfig:
        return self.members[0].cfg

    def ddi_matrix(self) -> torch.Tensor:
        return self.members[0].ddi_matrix()


def members_of(model: COGNet | Ensemble) -> list[COGNet]:
    """The networks of a model: an ensemble's members, or the one network."""
    return list(model.members) if isinstance(model, Ensemble) else [model]
