"""Decoding with the candidate selection on the execution provider: the search graphs of
`cognet-export` (`cognet.export.search_graphs`) run right after each decoder step, so that
the log-probabilities [n, B, V1] stay where the step computed them (on a GPU: on the device).

Per step only [n, B] values cross to the host: the parent, token, chosen log-probability and
liveness of each beam (for the trace back, `beam.trace_back`), the finished flags and the
scores (to tell when a visit is done), or for set decoding the drawn tokens and finished
flags. The `used` masks, the set decoding's hazard sums, the step's cache and the memories
stay on the device; finished visits leave the batch by the `take_*` graphs (a gather on the
device). The rules are those of the numpy selectors (`beam.BeamSelector`,
`cognet.core.decoding.sampling.SetSampler`), which remain the path for explanations and for the
PRAUC scores of beam search; both run in the one loop of `cognet.core.decoding.driver`, and tests
hold both paths equal visit by visit.

`SearchGraphs` runs the graphs on the decoder's provider: numpy arrays on the CPU provider,
OrtValues with IO binding on CUDA / TensorRT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from cognet.core.ddi import DDIPolicy, check_adjacency
from cognet.core.decoding import driver
from cognet.core.decoding.beam import BeamConfig, BeamResult, BeamRule, BeamStep
from cognet.core.decoding.driver import DeviceDecoderSession, Visits
from cognet.core.decoding.sampling import SetConfig, SetRule
from cognet.core.graphspec import (
    BEAM_SELECT_HOST,
    BEAM_SELECT_INPUTS,
    BEAM_SELECT_STATE,
    DDI_INPUTS,
    SET_SELECT_HOST,
    SET_SELECT_INPUTS,
    SET_SELECT_STATE,
    TAKE_INPUTS,
    TAKE_OUTPUT,
    take_graph_name,
)

_TAKE = {
    "tensor(float)": "take_float32",
    "tensor(float16)": "take_float16",
    "tensor(double)": "take_float64",
    "tensor(int64)": "take_int64",
    "tensor(bool)": "take_bool",
}
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64"}
# the decoder-init gathers on the device, by the encoder outputs' type (models exported
# before them decode with encodings gathered on the host)
INIT_GATHER = {"tensor(float)": "init_gather_float32", "tensor(float16)": "init_gather_float16"}
# every graph the runtime needs from a manifest's "search" entry for --selection device
SEARCH_GRAPHS = (
    "beam_select",
    "beam_select_ddi",
    "beam_select_split",
    "beam_select_split_ddi",
    "set_select",
    "set_select_ddi",
    *_TAKE.values(),
)


class SearchGraphs:
    """The search graphs of a model on one provider. `device` None: the CPU provider, numpy
    in and out; ("cuda", 0): IO binding, with outputs left on the device unless asked."""

    def __init__(self, sessions: Mapping[str, ort.InferenceSession], device=None):
        self.sessions = dict(sessions)
        self.device = device

    def run(
        self, name: str, feeds: Mapping[str, Any], host: Sequence[str], keep: Sequence[str] = ()
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Run graph `name`: ({output: numpy} for `host`, {output: handle} for `keep`)."""
        sess = self.sessions[name]
        if self.device is None:
            out = sess.run([*host, *keep], dict(feeds))
            got = dict(zip([*host, *keep], out, strict=True))
            return {k: got[k] for k in host}, {k: got[k] for k in keep}
        io = sess.io_binding()
        for key, value in feeds.items():
            bind_input(io, key, value)
        for key in host:
            io.bind_output(key, "cpu")
        for key in keep:
            io.bind_output(key, *self.device)
        sess.run_with_iobinding(io)
        out = io.get_outputs()
        got = {k: out[i].numpy() for i, k in enumerate(host)}
        return got, {k: out[len(host) + i] for i, k in enumerate(keep)}

    def zeros(self, shape: tuple[int, ...], dtype) -> Any:
        """A zero state tensor, on the device for IO binding."""
        array = np.zeros(shape, dtype)
        if self.device is None:
            return array
        return ort.OrtValue.ortvalue_from_numpy(array, *self.device)

    def take(self, value: Any, rows: np.ndarray) -> Any:
        """Rows (axis 0) of a handle, gathered where it lives."""
        if isinstance(value, np.ndarray):
            return value[rows]
        name = take_graph_name(_TAKE[value.data_type()][5:], len(value.shape()))
        if name not in self.sessions:  # a model exported before: one take graph of any rank
            name = _TAKE[value.data_type()]
        feeds = dict(zip(TAKE_INPUTS, (value, np.asarray(rows, np.int64)), strict=True))
        _, out = self.run(name, feeds, (), (TAKE_OUTPUT,))
        return out[TAKE_OUTPUT]

    def host(self, value: Any, rows: np.ndarray) -> np.ndarray:
        """Rows of a handle as a numpy array."""
        got = self.take(value, rows)
        return got if isinstance(got, np.ndarray) else got.numpy()


def bind_input(io: ort.IOBinding, name: str, value) -> None:
    """Bind a numpy array (copied from host memory) or an OrtValue (where it lives)."""
    if isinstance(value, np.ndarray):
        io.bind_cpu_input(name, np.ascontiguousarray(value))
    else:
        io.bind_ortvalue_input(name, value)


def _ddi_feeds(policy: DDIPolicy) -> tuple[str, dict[str, np.ndarray]]:
    """The select graph variant of a policy and its extra inputs."""
    if policy.mode == "off":
        return "", {}
    return "_ddi", {
        DDI_INPUTS[0]: np.array(policy.penalty if policy.mode == "soft" else 0.0, np.float32),
        DDI_INPUTS[1]: np.array(policy.mode == "hard"),
    }


class BeamGraphSelector(BeamRule):
    """Beam search's selection in the `beam_select` graphs (the split variant on a device):
    the `used` masks stay where the graphs run; per step the parent, token, chosen
    log-probability, liveness, finished flag and score of each beam come to the host."""

    on_device = True

    def __init__(self, search: SearchGraphs, cfg: BeamConfig, ddi_adj: np.ndarray | None = None):
        if cfg.ddi.max_rate is not None:
            ddi_adj = check_adjacency(cfg.ddi, ddi_adj, cfg.end)
        super().__init__(cfg, ddi_adj)
        self.search = search
        suffix, self.extra = _ddi_feeds(cfg.ddi)
        self.graph = ("beam_select" if search.device is None else "beam_select_split") + suffix

    def start(self, n: int) -> None:
        super().start(n)
        self.used = self.search.zeros((n, self.width, self.cfg.end + 1), bool)

    def select(self, t, out, rows, parent):
        inputs = (out["log_probs"], self.scores, self.used, self.finished)
        feeds = dict(zip(BEAM_SELECT_INPUTS, inputs, strict=True))
        got, state = self.search.run(
            self.graph, {**feeds, **self.extra}, BEAM_SELECT_HOST, BEAM_SELECT_STATE
        )
        self.scores, parent, tokens, chosen, live, self.finished = (
            got[k] for k in BEAM_SELECT_HOST
        )
        (self.used,) = (state[k] for k in BEAM_SELECT_STATE)
        self.trace.append(BeamStep(rows, parent, tokens, live, chosen, None, None, None, None))
        return tokens, parent, self.over()

    def held(self, newly: np.ndarray) -> np.ndarray:
        return self.search.host(self.used, np.flatnonzero(newly))[..., : self.cfg.end]

    def keep(self, live: np.ndarray) -> None:
        self.scores, self.finished = self.scores[live], self.finished[live]
        self.used = self.search.take(self.used, live)


class SetGraphSampler(SetRule):
    """The set decoding's sampling step in the `set_select` graphs (`SetSampler`'s rule, a
    `cognet.core.decoding.driver.Selector`): the `used` masks and the hazard sums stay where the
    graphs run; per step the drawn tokens and finished flags come to the host."""

    on_device = True
    outputs = ("log_probs",)

    def __init__(self, search: SearchGraphs, cfg: SetConfig, keys: np.ndarray):
        super().__init__(cfg, keys)
        self.search = search
        suffix, self.extra = _ddi_feeds(cfg.ddi)
        self.graph = "set_select" + suffix

    def start(self, n: int) -> None:
        super().start(n)
        s, end = self.cfg.samples, self.cfg.end
        self.used = self.search.zeros((n, s, end + 1), bool)
        self.hazard = self.search.zeros((n, end), np.float64)

    def select(self, t, out, rows, parent):
        inputs = (out["log_probs"], self.used, self.finished, self.draws.at(t, rows), self.hazard)
        feeds = {**dict(zip(SET_SELECT_INPUTS, inputs, strict=True)), **self.extra}
        got, state = self.search.run(self.graph, feeds, SET_SELECT_HOST, SET_SELECT_STATE)
        tokens, self.finished = (got[k] for k in SET_SELECT_HOST)
        self.used, self.hazard = (state[k] for k in SET_SELECT_STATE)
        self.draws.drawn(tokens)
        return tokens, parent, self.finished.all(1)  # samples never change rows

    def hazard_of(self, newly: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return self.search.host(self.hazard, np.flatnonzero(newly))  # compacted with the rows

    def keep(self, live: np.ndarray) -> None:
        super().keep(live)
        self.used, self.hazard = (
            self.search.take(self.used, live),
            self.search.take(self.hazard, live),
        )


def beam_search(
    session: DeviceDecoderSession, memories: Any, cfg: BeamConfig, visits: Visits
) -> BeamResult:
    """`beam.beam_search` (no PRAUC scores, no explanations) with the selection in the
    `beam_select` graphs of `session.search` (a `SearchGraphs`)."""
    selector = BeamGraphSelector(session.search, cfg, visits.ddi_adj)
    return driver.run(session, memories, visits.n, selector, cfg)


def set_marginals(
    session: DeviceDecoderSession, memories: Any, cfg: SetConfig, visits: Visits
) -> tuple[np.ndarray, None, int]:
    """`cognet.core.decoding.sampling.set_marginals` (no explanations) with each sampling
    step in the `set_select` graphs of `session.search`: (P(k in S) float64 [n, M], None,
    steps run)."""
    sampler = SetGraphSampler(session.search, cfg, visits.drawn_keys())
    return driver.run(session, memories, visits.n, sampler, cfg)
