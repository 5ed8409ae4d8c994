"""`cognet.core.decoding.plan`: a request resolved once into what runs, and the one dispatch."""

from __future__ import annotations

import numpy as np
import pytest

from cognet.core.ddi import DDIPolicy, DDITarget
from cognet.core.decoding import Decoding
from cognet.core.decoding import plan as plan_module
from cognet.core.decoding.beam import BeamConfig
from cognet.core.decoding.ensemble import EnsembleSession
from cognet.core.decoding.plan import DecodingPlan, decode
from cognet.core.decoding.request import DecodingRequest
from cognet.core.decoding.sampling import SetConfig
from cognet.core.errors import InputError
from cognet.runtime.options import ScoreOptions

END = 5
STORED = Decoding("set", samples=8, threshold=0.3, head_threshold=0.4)
TARGET = DDITarget(
    0.1, DDIPolicy("off", max_rate=0.1), 0.25, 0.5, 0.1, rule="threshold", decoding="set"
)


@pytest.mark.parametrize(
    "request_",
    [
        DecodingRequest(),
        DecodingRequest(beam=2),
        DecodingRequest(decoding="set", samples=4, set_rule="jaccard"),
        DecodingRequest(decoding="marginal", threshold=0.6),
        DecodingRequest(ddi=DDIPolicy("hard")),
        DecodingRequest(ddi=DDIPolicy("off", pair_price=0.1)),
    ],
)
@pytest.mark.parametrize("target", [None, TARGET])
def test_a_plan_holds_the_configs_the_resolved_request_gives(request_, target):
    """The decoding and policy are `DecodingRequest.resolve`'s; beam search's configuration
    always, set decoding's for the set and marginal decodings, with compact_at."""
    plan = DecodingPlan.of(request_, STORED, target, end=END, compact_at=0.5)
    decoding, ddi = request_.resolve(STORED, target)
    assert (plan.decoding, plan.ddi) == (decoding, ddi)
    assert plan.beam == BeamConfig.of(decoding, END, ddi, 0.5)
    if decoding.name == "beam":
        assert plan.sets is None
    else:
        assert plan.sets == SetConfig.of(decoding, END, ddi, 0.5)
    assert plan.selection == "host" and not (plan.prauc or plan.explain or plan.attention)


def test_a_request_that_does_not_apply_is_refused_once():
    with pytest.raises(ValueError, match="--beam is for beam search"):
        DecodingPlan.of(DecodingRequest(decoding="set", beam=2), STORED, end=END)
    options = ScoreOptions.of(decoding="marginal", ddi=DDIPolicy("soft", penalty=1.0))
    with pytest.raises(InputError, match="--ddi-mode soft"):
        options.plan(STORED, end=END)


def test_the_plan_carries_where_selection_runs_and_what_a_call_returns():
    adj = np.zeros((END, END), bool)
    options = ScoreOptions.of(compact_at=0.6)
    plan = options.plan(STORED, end=END, selection="device", attention=True, ddi_adj=adj)
    assert plan.on_device and plan.beam.compact_at == plan.sets.compact_at == 0.6
    assert not DecodingPlan(STORED, END).on_device
    with pytest.raises(ValueError, match="selection"):
        DecodingPlan(STORED, END, selection="auto")  # resolved before: host or device
    assert plan.asking(prauc=False, explain=False) is plan
    asked = plan.asking(prauc=True, explain=True)
    assert (asked.prauc, asked.explain, asked.on_device, asked.sets) == (
        True,
        True,
        True,
        plan.sets,
    )
    visits = asked.visits(["a", "b", "c"])
    assert visits.n == 3 and visits.keys.shape == (3,) and visits.ddi_adj is adj
    assert (visits.prauc, visits.explain, visits.attention) == (True, True, True)
    assert DecodingPlan(Decoding(beam=2), END).visits(["a"]).keys is None  # beam draws nothing


class _Session:
    """A stand-in decoder session: the dispatch reads only `search` (and the ensemble's
    members)."""

    step_outputs = ("log_probs",)
    prefix_cache = False

    def __init__(self, search=None):
        self.search = search


class _Device:
    """Device selectors that record which one ran."""

    def __init__(self, calls):
        self.calls = calls

    def beam_search(self, session, memories, cfg, visits):
        self.calls.append(("device beam", cfg, visits.prauc))
        return "device beam"

    def set_marginals(self, session, memories, cfg, visits):
        self.calls.append(("device sets", cfg.seed))
        return np.zeros((visits.n, END)), None, 1


@pytest.fixture
def calls(monkeypatch):
    """What the host decodings were called with, in order."""
    got = []

    def host(name):
        def run(*args):
            got.append((name, *args[2:]))
            return name

        return run

    monkeypatch.setattr(plan_module, "beam_search", host("host beam"))
    monkeypatch.setattr(plan_module, "decode_sets", host("sets"))
    monkeypatch.setattr(plan_module, "decode_ensemble_sets", host("ensemble sets"))
    return got


def test_the_dispatch_selects_where_the_plan_says(calls):
    """Beam or set decoding by the plan; the device selectors only where it selects there,
    not for explanations nor beam search's PRAUC scores; an ensemble's beams on the device
    only with the mixture graph (`search`)."""
    device = _Device(calls)
    beam = DecodingPlan(Decoding(beam=2), END, selection="device")
    assert decode(_Session(), None, beam, ["a"], device) == "device beam"
    assert decode(_Session(), None, beam.asking(True, False), ["a"], device) == "host beam"
    assert decode(_Session(), None, beam.asking(False, True), ["a"], device) == "host beam"
    ensemble = EnsembleSession([_Session(), _Session()])
    assert decode(ensemble, (None, None), beam, ["a"], device) == "host beam"
    ensemble.search = object()  # the mixture graph
    assert decode(ensemble, (None, None), beam, ["a"], device) == "device beam"
    host = DecodingPlan(Decoding(beam=2), END)
    assert decode(_Session(), None, host, ["a"]) == "host beam"
    with pytest.raises(ValueError, match="device selectors"):
        decode(_Session(), None, beam, ["a"])

    sets = DecodingPlan(STORED, END, selection="device")
    calls.clear()
    assert decode(_Session(), None, sets, ["a", "b"], device) == "sets"
    (name, cfg, visits, marginals) = calls[0]
    assert cfg == sets.sets and visits.n == 2 and marginals == device.set_marginals
    calls.clear()
    assert (
        decode(ensemble, (None, None), sets.asking(False, True), ["a"], device) == "ensemble sets"
    )
    assert calls[0][-1] is plan_module.set_marginals  # explanations: the host sampler


def test_the_marginal_decoding_reads_its_head_and_explains_by_the_set_decoding(monkeypatch):
    marginal = Decoding("marginal", head_threshold=0.5, head_rule="threshold")
    plan = DecodingPlan(marginal, END, explain=True)
    with pytest.raises(ValueError, match="marginals"):
        decode(_Session(), None, plan, ["a"])
    sums = {"count": np.array([[0.0, 2.0, 0.0, 0.0, 0.0]])}
    monkeypatch.setattr(plan_module, "set_marginals", lambda *_: (None, sums, 7))
    marginals = np.array([[0.9, 0.8, 0.1, 0.0, 0.0]])
    got = decode(_Session(), None, plan, ["a"], marginals=marginals)
    assert got.meds[0].tolist() == [0, 1] and got.steps == 7
    assert got.emitted[0].tolist() == [False, True]
    with pytest.raises(ValueError, match="no set"):
        DecodingPlan(Decoding(beam=2), END).read_sets(marginals)
    assert plan.read_sets(marginals).meds[0].tolist() == [0, 1]
