"""The mixture graph (`mix_log_probs` of an ensemble's export) computes what the host's
`cognet.core.decoding.ensemble.mix_log_probs` computes, value for value, at several shapes
and member counts, -inf included."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from cognet.core.decoding.ensemble import mix_log_probs
from cognet.core.graphspec import MIX_OUTPUT, mix_inputs
from cognet.export.search_graphs import mix_graph

V1 = 23


def _log_probs(rng, shape, impossible):
    """float32 log-softmax rows, with a share `impossible` of tokens at -inf."""
    logits = rng.normal(0, 4, shape).astype(np.float32)
    logits[rng.random(shape) < impossible] = -np.inf
    logits[..., 0] = np.maximum(logits[..., 0], 0)  # no row all -inf
    out = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    return out.astype(np.float32)


@pytest.mark.parametrize("members", [2, 3, 5])
@pytest.mark.parametrize("shape", [(1, 1), (3, 4), (64, 8)])
def test_the_mixture_graph_equals_the_host_mixture(members, shape):
    rng = np.random.default_rng(members * 100 + shape[0])
    parts = [_log_probs(rng, (*shape, V1), 0.2) for _ in range(members)]
    for p in parts:  # a token every member gives -inf stays -inf
        p[..., 1] = -np.inf
    for p in parts[:-1]:
        p[..., 2] = -3.0
    parts[-1][..., 2] = -np.inf  # one member's -inf leaves the others' mass
    sess = ort.InferenceSession(
        mix_graph(V1, members, 18).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (got,) = sess.run([MIX_OUTPUT], dict(zip(mix_inputs(members), parts, strict=True)))
    want = mix_log_probs(parts)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.isneginf(got[..., 1]).all() and np.isfinite(got[..., 2]).all()
    # the same float32 values, bit for bit, but for float64 roundings that land on the
    # other side of a float32 boundary (log(1 + x) here, log1p in numpy): one ulp at most
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all()
    ulps = np.abs(got[finite].view(np.int32).astype(np.int64) - want[finite].view(np.int32))
    assert ulps.max() <= 1 and (ulps == 0).mean() >= 0.99
