"""Which selector decodes a batch: beam search or set decoding, with the selection in numpy
on the host (`beam.BeamSelector`, `cognet.core.decoding.sampling.SetSampler`) or in the exported
search graphs where the decoder runs (`device_selectors.BeamGraphSelector`,
`device_selectors.SetGraphSampler`); every one runs the one loop of `cognet.core.decoding.driver`.

An ensemble (`cognet.core.decoding.ensemble.EnsembleSession`) decodes by the rules of that
module: set decoding averages its members' P(k in S), each member's sampled on the host or
in the search graphs; beam search decodes the token-level mixture, selected on the host, or
in the search graphs when the model has the mixture graph that mixes the members' steps
where they ran (models exported before it select on the host)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import Decoding
from cognet.core.decoding.beam import BeamConfig, BeamResult, beam_search
from cognet.core.decoding.draws import visit_keys
from cognet.core.decoding.driver import Visits
from cognet.core.decoding.ensemble import (
    EnsembleSession,
    decode_ensemble_sets,
    ensemble_marginals,
)
from cognet.core.decoding.sampling import (
    SetConfig,
    SetResult,
    decode_sets,
    set_marginals,
    set_result,
)
from cognet.runtime import device_selectors


def decoding_configs(
    decoding: Decoding, end: int, ddi: DDIPolicy, compact_at: float
) -> tuple[BeamConfig, SetConfig | None]:
    """The driver configurations of a decoding: beam search's (always: its beam width and
    length are reported), and the set decoding's when `decoding` is a set decoding (the
    marginal decoding's: its set rules, and the samples its explanations draw)."""
    beam = BeamConfig.of(decoding, end, ddi, compact_at)
    if decoding.name == "beam":
        return beam, None
    return beam, SetConfig.of(decoding, end, ddi, compact_at)


def decode(
    session: Any,
    memories: Any,
    cfg: BeamConfig | SetConfig,
    visit_ids: Sequence[str],
    on_device: bool = False,
    prauc: bool = False,
    explain: bool = False,
    ddi_adj: np.ndarray | None = None,
    attention: bool = False,
) -> BeamResult | SetResult:
    """Beam search or set decoding (by `cfg`) of the visits named `visit_ids` (their random
    streams), whose memories come from `session.init`. Both results carry the same fields.

    on_device: select in the search graphs of `session.search` (`--selection device`), but
    for explanations and beam search's PRAUC scores, which the numpy selectors give."""
    keys = visit_keys(visit_ids) if isinstance(cfg, SetConfig) else None
    asked = {"prauc": prauc, "explain": explain, "attention": attention, "ddi_adj": ddi_adj}
    visits = Visits(len(visit_ids), keys=keys, **asked)
    graphs = on_device and not explain
    ensemble = isinstance(session, EnsembleSession)
    if isinstance(cfg, SetConfig):
        marginals = device_selectors.set_marginals if graphs else set_marginals
        if ensemble:
            return decode_ensemble_sets(session.members, memories, cfg, visits, marginals)
        return decode_sets(session, memories, cfg, visits, marginals)
    if graphs and not prauc and (not ensemble or session.search is not None):
        return device_selectors.beam_search(session, memories, cfg, visits)
    return beam_search(session, memories, cfg, visits)


def explained_marginal_sets(
    session: Any,
    memories: Any,
    marginals: np.ndarray,
    cfg: SetConfig,
    visit_ids: Sequence[str],
    ddi_adj: np.ndarray | None = None,
    attention: bool = False,
) -> SetResult:
    """The marginal decoding's sets, read from the head's `marginals` [n, M], explained by
    COGNet's own set decoding of the same visits (its samples, drawn as `decode` draws them,
    on the host): each medication's gate, copy share and attention are the means over the
    steps at which samples emitted it; `emitted` says which were (the others have none)."""
    keys = visit_keys(visit_ids)
    visits = Visits(len(keys), keys=keys, explain=True, attention=attention, ddi_adj=ddi_adj)
    if isinstance(session, EnsembleSession):
        _, sums, steps = ensemble_marginals(session.members, memories, cfg, visits)
    else:
        _, sums, steps = set_marginals(session, memories, cfg, visits)
    sums = sums or {}
    result = set_result(marginals, steps, cfg, ddi_adj, sums)
    count = sums.get("count", np.zeros(marginals.shape))
    result.emitted = [count[i, m] > 0 for i, m in enumerate(result.meds)]
    return result
