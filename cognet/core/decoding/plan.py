"""`DecodingPlan`: a decoding request resolved once into what runs, and `decode`, the one
dispatch that runs it on a batch (torch-free).

A caller's `DecodingRequest` meets the model's stored `Decoding` and DDI target in
`DecodingPlan.of` (by `DecodingRequest.resolve`, the one rule); the plan then holds
everything that decides what a batch's decoding does: the decoding and the DDI policy, the
driver configurations derived from them (`BeamConfig`, and `SetConfig` for the set and
marginal decodings), where candidate selection runs (host or device), what is returned
beside the answers (PRAUC scores, explanations, attention) and the DDI adjacency. The
runtime's `Scorer`, `cognet evaluate` and the torch decodings build one; none decides again.

`decode` picks the decoding of a batch from the plan and the session alone: beam search or
set decoding, one network or an `EnsembleSession`, the numpy selectors or, where the plan
selects on the device, the runtime's search graphs (`DeviceSelection`: core imports no
runtime, so the runtime hands them in), and the marginal decoding's explained sets.
Explanations and beam search's PRAUC scores always take the numpy selectors (the graphs do
not return the step outputs they need); DESIGN.md §8 ("One plan, one dispatch").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from cognet.core.ddi import DDIPolicy, DDITarget
from cognet.core.decoding.beam import BeamConfig, BeamResult, beam_search
from cognet.core.decoding.defaults import Decoding
from cognet.core.decoding.draws import visit_keys
from cognet.core.decoding.driver import COMPACT_AT, DecoderSession, DeviceDecoderSession, Visits
from cognet.core.decoding.ensemble import (
    EnsembleSession,
    decode_ensemble_sets,
    ensemble_marginals,
)
from cognet.core.decoding.request import DecodingRequest
from cognet.core.decoding.sampling import (
    SetConfig,
    SetResult,
    decode_sets,
    set_marginals,
    set_result,
)

SELECTIONS = ("host", "device")  # where candidate selection runs (`--selection`, resolved)


@dataclass(frozen=True)
class DecodingPlan:
    """What a decoding runs, resolved once. `beam` (always: its width and length are
    reported) and `sets` (the set and marginal decodings': the marginal one's set rules, and
    the samples its explanations draw; None for beam search) are derived on creation."""

    decoding: Decoding
    end: int  # END id (= number of medications M)
    _: KW_ONLY
    ddi: DDIPolicy = DDIPolicy()
    compact_at: float = COMPACT_AT
    selection: str = "host"  # one of SELECTIONS
    prauc: bool = False  # beam search: the PRAUC scores too (set decoding's are its P(k in S))
    explain: bool = False  # the gates, copy distributions and shares too
    attention: bool = False  # with `explain`: the diagnosis attention (`diag_attention`)
    # bool [M, M]: the model's DDI pairs (an active policy needs them)
    ddi_adj: np.ndarray | None = field(default=None, compare=False, repr=False)
    beam: BeamConfig = field(init=False)
    sets: SetConfig | None = field(init=False)

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"selection must be one of {', '.join(SELECTIONS)}, not {self.selection!r}"
            )
        object.__setattr__(
            self, "beam", BeamConfig.of(self.decoding, self.end, self.ddi, self.compact_at)
        )
        sets = None
        if self.decoding.name != "beam":
            sets = SetConfig.of(self.decoding, self.end, self.ddi, self.compact_at)
        object.__setattr__(self, "sets", sets)

    @classmethod
    def of(
        cls,
        request: DecodingRequest,
        stored: Decoding,
        target: DDITarget | None = None,
        *,
        end: int,
        compact_at: float = COMPACT_AT,
        selection: str = "host",
        attention: bool = False,
        ddi_adj: np.ndarray | None = None,
    ) -> DecodingPlan:
        """The plan of `request` on a model whose stored decoding is `stored` and whose DDI
        target is `target` (`DecodingRequest.resolve`: ValueError when the request does not
        apply); PRAUC scores and explanations are asked per call (`asking`)."""
        decoding, ddi = request.resolve(stored, target)
        return cls(
            decoding,
            end,
            ddi=ddi,
            compact_at=compact_at,
            selection=selection,
            attention=attention,
            ddi_adj=ddi_adj,
        )

    @property
    def on_device(self) -> bool:
        """Candidate selection runs in the search graphs, where the decoder step ran."""
        return self.selection == "device"

    def asking(self, prauc: bool, explain: bool) -> DecodingPlan:
        """This plan, returning PRAUC scores and explanations as asked."""
        if (prauc, explain) == (self.prauc, self.explain):
            return self
        return replace(self, prauc=prauc, explain=explain)

    def visits(self, visit_ids: Sequence[str]) -> Visits:
        """The `Visits` of one call over the visits named `visit_ids` (the set decodings'
        random streams; beam search reads only their number)."""
        keys = visit_keys(visit_ids) if self.sets is not None else None
        return Visits(
            len(visit_ids),
            keys=keys,
            prauc=self.prauc,
            explain=self.explain,
            attention=self.attention,
            ddi_adj=self.ddi_adj,
        )

    def read_sets(self, marginals: np.ndarray, steps: int = 0) -> SetResult:
        """The sets of P(k in S) [n, M] read by the plan's set rules and DDI policy (the
        marginal decoding's, from its head; or set decoding's again, under another policy)."""
        if self.sets is None:
            raise ValueError("beam search reads no set from P(k in S)")
        return set_result(marginals, steps, self.sets, self.ddi_adj)


class DeviceSelection(Protocol):
    """The selectors in the search graphs (`cognet.runtime.device_selectors`, whose
    functions these are), for a plan that selects on the device."""

    def beam_search(
        self, session: DeviceDecoderSession, memories: Any, cfg: BeamConfig, visits: Visits
    ) -> BeamResult: ...

    def set_marginals(
        self, session: DeviceDecoderSession, memories: Any, cfg: SetConfig, visits: Visits
    ) -> tuple[np.ndarray, dict | None, int]: ...


def decode(
    session: DecoderSession,
    memories: Any,
    plan: DecodingPlan,
    visit_ids: Sequence[str],
    device: DeviceSelection | None = None,
    marginals: np.ndarray | None = None,
) -> BeamResult | SetResult:
    """The plan's decoding of the visits named `visit_ids`, whose memories come from
    `session.init` (an `EnsembleSession`: its members' tuple). Both results carry the same
    fields.

    device: the search graphs' selectors, for a plan that selects on the device (but for
    explanations and beam search's PRAUC scores). marginals: the marginal decoding's P(k in
    S) [n, M] from its head, whose sets are explained by COGNet's own set decoding of the
    same visits (`explained_sets`)."""
    visits = plan.visits(visit_ids)
    if plan.decoding.name == "marginal":
        if marginals is None:
            raise ValueError("the marginal decoding reads its head's P(k in S): give marginals")
        return explained_sets(session, memories, plan, visits, marginals)
    graphs = plan.on_device and not plan.explain
    if graphs and device is None:
        raise ValueError("a plan that selects on the device needs the device selectors")
    ensemble = isinstance(session, EnsembleSession)
    if plan.sets is not None:
        found = device.set_marginals if graphs else set_marginals
        if ensemble:
            return decode_ensemble_sets(session.members, memories, plan.sets, visits, found)
        return decode_sets(session, memories, plan.sets, visits, found)
    # an ensemble selects its beams on the device where the mixture graph mixes its steps
    if graphs and not plan.prauc and (not ensemble or session.search is not None):
        return device.beam_search(session, memories, plan.beam, visits)
    return beam_search(session, memories, plan.beam, visits)


def explained_sets(
    session: DecoderSession,
    memories: Any,
    plan: DecodingPlan,
    visits: Visits,
    marginals: np.ndarray,
) -> SetResult:
    """The marginal decoding's sets, read from the head's `marginals` [n, M], explained by
    COGNet's own set decoding of the same visits (its samples, drawn as set decoding draws
    them, on the host): each medication's gate, copy share and attention are the means over
    the steps at which samples emitted it; `emitted` says which were (the others have
    none)."""
    cfg, visits = plan.sets, replace(visits, explain=True)
    assert cfg is not None  # the marginal decoding has its set rules
    if isinstance(session, EnsembleSession):
        _, sums, steps = ensemble_marginals(session.members, memories, cfg, visits)
    else:
        _, sums, steps = set_marginals(session, memories, cfg, visits)
    sums = sums or {}
    result = set_result(marginals, steps, cfg, plan.ddi_adj, sums)
    count = sums.get("count", np.zeros(marginals.shape))
    result.emitted = [count[i, m] > 0 for i, m in enumerate(result.meds)]
    return result
