"""Decoding with the candidate selection on the execution provider: the search graphs of
`cognet-export` (`cognet.export.search_graphs`) run right after each decoder step, so that
the log-probabilities [n, B, V1] stay where the step computed them (on a GPU: on the device).

Per step only [n, B] values cross to the host: the parent, token, chosen log-probability and
liveness of each beam (for the trace back, `beam._trace_back`), the finished flags and the
scores (to tell when a visit is done), or for set decoding the drawn tokens and finished
flags. The `used` masks, the set decoding's hazard sums, the KV cache and the memories stay
on the device; finished visits leave the batch by the `take_*` graphs (a gather on the
device). The rules are those of the numpy drivers (`beam.beam_search`,
`cognet.core.sampling.set_marginals`), which remain the path for explanations and for the
PRAUC scores of beam search; tests hold both paths equal visit by visit.

`SearchGraphs` runs the graphs on the decoder's provider: numpy arrays on the CPU provider,
OrtValues with IO binding on CUDA / TensorRT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from cognet.core.ddi import DDIPolicy
from cognet.core.sampling import SetConfig, uniforms
from cognet.runtime.beam import NEG_INF, BeamConfig, BeamResult, _Step, _trace_back, _within_rate

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
        name = _TAKE[value.data_type()]
        _, out = self.run(name, {"x": value, "rows": np.asarray(rows, np.int64)}, (), ("y",))
        return out["y"]

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
        "penalty": np.array(policy.penalty if policy.mode == "soft" else 0.0, np.float32),
        "hard": np.array(policy.mode == "hard"),
    }


def beam_search(session, memories: Any, n: int, cfg: BeamConfig, ddi_adj=None) -> BeamResult:
    """`beam.beam_search` (no PRAUC scores, no explanations) with the selection in the
    `beam_select` graphs of `session.search` (a `SearchGraphs`)."""
    search: SearchGraphs = session.search
    b, end = cfg.beam, cfg.end
    if n == 0:
        return BeamResult([], np.zeros(0, np.float32), [])
    policy = cfg.ddi
    if policy.max_rate is not None:
        if ddi_adj is None or ddi_adj.shape != (end, end):
            raise ValueError(f"DDI policy {policy.label!r} needs the [{end}, {end}] adjacency")
        ddi_adj = np.asarray(ddi_adj, np.float32)
    suffix, extra = _ddi_feeds(policy)
    graph = ("beam_select" if search.device is None else "beam_select_split") + suffix
    rows = np.arange(n)
    scores = np.full((n, b), NEG_INF, np.float32)
    scores[:, 0] = 0.0
    finished = np.zeros((n, b), bool)
    used = search.zeros((n, b, end + 1), bool)
    tokens = np.full((n, b), end + 1, np.int64)  # START
    parent = np.tile(np.arange(b, dtype=np.int64), (n, 1))
    done = np.zeros(n, bool)
    cache = session.empty_cache(n, b)
    end_step = np.full(n, -1, np.int64)
    end_beam = np.zeros(n, np.int64)
    final_score = np.zeros(n, np.float32)
    trace: list[_Step] = []
    host_out = ("scores_out", "parent_out", "token_out", "chosen_out", "live_out", "finished_out")
    for t in range(cfg.max_len):
        logp, cache = session.step_log_probs(tokens, parent, cache, memories)
        feeds = {"log_probs": logp, "scores": scores, "used": used, "finished": finished}
        got, state = search.run(graph, {**feeds, **extra}, host_out, ("used_out",))
        scores, parent, tokens = got["scores_out"], got["parent_out"], got["token_out"]
        finished, used = got["finished_out"], state["used_out"]
        trace.append(
            _Step(rows, parent, tokens, got["live_out"], got["chosen_out"], None, None, None, None)
        )
        over = finished[:, 0] if policy.max_rate is None else finished.all(1)
        newly = ~done & (over if t < cfg.max_len - 1 else True)
        if newly.any():
            choice = 0
            if policy.max_rate is not None:
                held = search.host(used, np.flatnonzero(newly))[..., :end]
                choice = _within_rate(held, scores[newly], ddi_adj, policy.max_rate)
                end_beam[rows[newly]] = choice
            end_step[rows[newly]] = t
            final_score[rows[newly]] = scores[newly, choice]
            done |= newly
            n_live = rows.size - int(done.sum())
            if n_live == 0:
                break
            if n_live < cfg.compact_at * rows.size:
                keep = np.flatnonzero(~done)
                rows, scores, finished, tokens, parent, done = (
                    x[keep] for x in (rows, scores, finished, tokens, parent, done)
                )
                used = search.take(used, keep)
                cache = session.take(cache, keep)
                memories = session.take(memories, keep)
    return _trace_back(trace, end_step, end_beam, final_score, end, False, False)


def set_marginals(
    session, memories: Any, n: int, cfg: SetConfig, keys: np.ndarray
) -> tuple[np.ndarray, None, int]:
    """`cognet.core.sampling.set_marginals` (no explanations) with each sampling step in the
    `set_select` graphs of `session.search`: (P(k in S) float64 [n, M], None, steps run)."""
    search: SearchGraphs = session.search
    s, end = cfg.samples, cfg.end
    suffix, extra = _ddi_feeds(cfg.ddi)
    rows = np.arange(n)
    tokens = np.full((n, s), end + 1, np.int64)  # START
    parent = np.tile(np.arange(s, dtype=np.int64), (n, 1))  # samples never change rows
    finished = np.zeros((n, s), bool)
    used = search.zeros((n, s, end + 1), bool)
    hazard = search.zeros((n, end), np.float64)
    out = np.zeros((n, end), np.float64)
    done = np.zeros(n, bool)
    cache = session.empty_cache(n, s)
    steps = 0
    for t in range(cfg.max_len):
        logp, cache = session.step_log_probs(tokens, parent, cache, memories)
        steps += 1
        feeds = {
            "log_probs": logp,
            "used": used,
            "finished": finished,
            "uniforms": uniforms(cfg.seed, keys[rows], s, t),
            "hazard": hazard,
            **extra,
        }
        got, state = search.run(
            "set_select" + suffix, feeds, ("token_out", "finished_out"), ("used_out", "hazard_out")
        )
        tokens, finished = got["token_out"], got["finished_out"]
        used, hazard = state["used_out"], state["hazard_out"]
        newly = ~done & (finished.all(1) if t < cfg.max_len - 1 else True)
        if newly.any():
            # an estimate may pass 1 (an unbiased sum, not a probability): clip it
            out[rows[newly]] = np.minimum(search.host(hazard, np.flatnonzero(newly)) / s, 1.0)
            done |= newly
            live = np.flatnonzero(~done)
            if live.size == 0:
                break
            if live.size < cfg.compact_at * done.size:
                rows, tokens, parent, finished, done = (
                    x[live] for x in (rows, tokens, parent, finished, done)
                )
                used, hazard = search.take(used, live), search.take(hazard, live)
                cache = session.take(cache, live)
                memories = session.take(memories, live)
    return out, None, steps
