"""The search graphs (`cognet.export.search_graphs`, run by `cognet.runtime.device_selectors`), each
against the numpy rules it replaces, and ONNX TopK's tie order on the CPU provider."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from tiny import DDI_IDS, DDI_POLICIES

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding.beam import NEG_INF, _penalise, top_k_stable
from cognet.core.decoding.draws import uniforms
from cognet.core.decoding.sampling import _step_distribution
from cognet.export.search_graphs import (
    TAKE_TYPES,
    beam_select_graph,
    set_select_graph,
    take_graph,
)
from cognet.runtime import device_selectors

torch.set_num_threads(1)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _ddi_feeds(policy: DDIPolicy) -> dict:
    return device_selectors._ddi_feeds(policy)[1]


def _adjacency(m: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    adj = rng.random((m, m)) < 0.06
    adj = adj | adj.T
    np.fill_diagonal(adj, False)
    return adj


# -- the graphs against the numpy rules -----------------------------------------------------------


def test_cpu_topk_puts_ties_lower_index_first():
    """ONNX: equal values come lower index first (-inf included); the CPU provider honours it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "L"])
    k = helper.make_tensor("k", TensorProto.INT64, [1], [5])
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1, largest=1, sorted=1)
    outs = [
        helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("i", TensorProto.INT64, None),
    ]
    graph = helper.make_graph([node], "topk", [x], outs, [k])
    sess = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    rng = np.random.default_rng(0)
    data = rng.integers(-3, 3, size=(400, 600)).astype(np.float32)
    data[data == -3] = -np.inf
    data[:10] = -np.inf  # rows without a finite value
    _, idx = sess.run(None, {"x": data})
    expected = np.argsort(-data, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(idx, expected)


def _numpy_beam(raw, scores, used, finished, policy, adj):
    """One step of `beam.beam_search`'s selection (its code, step by step)."""
    r, b, v1 = raw.shape
    if policy.mode != "off":
        cand = scores[:, :, None] + _penalise(raw, used, adj.astype(np.float32), policy)
    else:
        cand = scores[:, :, None] + raw
    np.copyto(cand, NEG_INF, where=used)
    cand[finished] = NEG_INF
    cand[finished, v1 - 1] = scores[finished]
    pick, best = top_k_stable(cand.reshape(r, b * v1), b)
    parent, token = np.divmod(pick, v1)
    rows = np.arange(r)[:, None]
    nxt = used[rows, parent]
    nxt[rows, np.arange(b), token] = True
    live = ~finished[rows, parent]
    return {
        "scores_out": best,
        "parent_out": parent,
        "token_out": token,
        "chosen_out": raw[rows, parent, token],
        "live_out": live,
        "finished_out": ~live | (token == v1 - 1),
        "used_out": nxt,
    }


@pytest.mark.parametrize("split", [False, True], ids=["one-stage", "split"])
@pytest.mark.parametrize("beam", [1, 2, 4])
@pytest.mark.parametrize("policy", DDI_POLICIES[:3], ids=DDI_IDS[:3])
def test_beam_select_graph_equals_the_numpy_selection(split, beam, policy):
    v1, n = 41, 300
    adj = _adjacency(v1 - 1, 1)
    ddi = adj if policy.mode != "off" else None
    sess = _session(beam_select_graph(v1, ddi, 18, split))
    rng = np.random.default_rng(beam)
    for trial in range(12):
        raw = np.log(rng.dirichlet(np.full(v1, 0.3), size=(n, beam))).astype(np.float32)
        if trial % 2:  # ties everywhere
            raw = np.round(raw, 0).astype(np.float32)
        scores = np.round(rng.normal(size=(n, beam)), 1).astype(np.float32)
        if trial % 3 == 0:
            scores[:, 1:] = -np.inf  # the first step
        used = rng.random((n, beam, v1)) < 0.15
        used[:20] = rng.random((20, beam, v1)) < 0.98  # fewer finite candidates than beams
        finished = rng.random((n, beam)) < 0.25
        feeds = {"log_probs": raw, "scores": scores, "used": used, "finished": finished}
        names = [o.name for o in sess.get_outputs()]
        got = dict(zip(names, sess.run(None, {**feeds, **_ddi_feeds(policy)}), strict=True))
        want = _numpy_beam(raw, scores, used, finished, policy, adj)
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"{key}, trial {trial}")


@pytest.mark.parametrize("policy", DDI_POLICIES[:3], ids=DDI_IDS[:3])
def test_set_select_graph_equals_the_numpy_sampling_step(policy):
    v1, n, s = 37, 200, 16
    end = v1 - 1
    adj = _adjacency(end, 2)
    sess = _session(set_select_graph(v1, adj if policy.mode != "off" else None, 18))
    rng = np.random.default_rng(3)
    for step in range(6):
        raw = np.log(rng.dirichlet(np.full(v1, 0.5), size=(n, s))).astype(np.float32)
        used = rng.random((n, s, v1)) < 0.2
        finished = rng.random((n, s)) < 0.3
        hazard = rng.random((n, end))
        u = uniforms(7, np.arange(n, dtype=np.uint64), s, step)
        feeds = {
            "log_probs": raw,
            "used": used,
            "finished": finished,
            "uniforms": u,
            "hazard": hazard,
            **_ddi_feeds(policy),
        }
        names = [o.name for o in sess.get_outputs()]
        got = dict(zip(names, sess.run(None, feeds), strict=True))
        p = _step_distribution(raw, used, finished, end, policy, adj.astype(np.float32))
        cum = np.cumsum(p, -1)
        token = np.minimum((cum < (u * cum[..., -1])[..., None]).sum(-1), end)
        np.testing.assert_array_equal(got["token_out"], token)
        # the exponentials are float32, ONNX Runtime's and numpy's up to 2 ulps apart
        np.testing.assert_allclose(got["hazard_out"], hazard + p[..., :end].sum(1), rtol=5e-7)
        nxt = used.copy()
        nxt[np.arange(n)[:, None], np.arange(s), token] = True
        np.testing.assert_array_equal(got["used_out"], nxt)
        np.testing.assert_array_equal(got["finished_out"], finished | (token == end))


def _softmax64(raw, used, finished, end):
    """The step distribution in float64 throughout, shifted by the maximum (the reference)."""
    logp = raw.astype(np.float64)
    logp[used] = -np.inf
    logp[finished] = -np.inf
    logp[finished, end] = 0.0
    e = np.exp(logp - logp.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "low, rtol", [(0.0, 5e-7), (-160.0, 1e-5)], ids=["model-range", "sum-below-2^-100"]
)
def test_set_select_step_is_the_float64_softmax_to_float32_accuracy(low, rtol):
    """The float32 exponentials of the host and of `set_select`: every probability within
    float32 rounding of the float64 softmax, also for rows whose unshifted exponentials
    would underflow (log-probabilities near -160: shifted by their maximum first, in
    float32, which rounds the difference); the graph's draws equal the host's."""
    v1, n, s = 29, 64, 16
    end = v1 - 1
    rng = np.random.default_rng(11)
    raw = np.log(rng.dirichlet(np.full(v1, 0.5), size=(n, s))).astype(np.float32)
    raw = np.maximum(raw, np.float32(np.log(1e-20)))  # the model's floor
    raw[: n // 2] += np.float32(low)  # half the visits far below the model's range
    used = rng.random((n, s, v1)) < 0.3
    used[..., end] = False
    finished = rng.random((n, s)) < 0.2
    p = _step_distribution(raw, used, finished, end, DDIPolicy(), None)
    want = _softmax64(raw, used, finished, end)
    np.testing.assert_allclose(p, want, rtol=rtol, atol=1e-300)
    assert np.allclose(p.sum(-1), 1.0, rtol=1e-12)
    sess = _session(set_select_graph(v1, None, 18))
    u = uniforms(5, np.arange(n, dtype=np.uint64), s, 0)
    feeds = {
        "log_probs": raw,
        "used": used,
        "finished": finished,
        "uniforms": u,
        "hazard": np.zeros((n, end)),
    }
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, feeds), strict=True))
    cum = np.cumsum(p, -1)
    np.testing.assert_array_equal(
        got["token_out"], np.minimum((cum < (u * cum[..., -1])[..., None]).sum(-1), end)
    )
    np.testing.assert_allclose(got["hazard_out"], p[..., :end].sum(1), rtol=5e-7)


@pytest.mark.parametrize("dtype", list(TAKE_TYPES))
def test_take_graphs_gather_rows_of_any_rank(dtype):
    rng = np.random.default_rng(0)
    for shape in [(9,), (9, 3), (9, 2, 4, 5, 3)]:
        sess = _session(take_graph(dtype, 18, rank=len(shape)))  # one graph per rank
        x = (rng.random(shape) * 10).astype(dtype)
        rows = np.array([8, 0, 3, 3], np.int64)
        np.testing.assert_array_equal(sess.run(None, {"x": x, "rows": rows})[0], x[rows])


# -- --selection device against the torch reference ----------------------------------------------
