"""The exported step's cache is the token prefix (`graphspec.STEP_CACHE_INPUTS`): the step
graph computes the model's own KV-cached step, and models exported before it, whose step
carries a KV cache, still score the same lists."""

from __future__ import annotations

import io
import json
import shutil
import warnings
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import onnx
import pyarrow.parquet as pq
import pytest
import torch
from tiny import make_tiny
from torch import nn

from cognet.core.decoding.request import DecodingRequest
from cognet.core.graphspec import (
    KV_CACHE_INPUTS,
    KV_STEP_INPUTS,
    KV_STEP_OUTPUTS,
    MEMORIES,
    STEP_INPUTS,
    STEP_OUTPUTS,
)
from cognet.core.manifest import file_sha256, load_manifest
from cognet.export import OPSET, ExportOptions, export, graphs
from cognet.export.graphs import ReferenceStep, Sizes, StepGraph, example_inputs, kv_cache
from cognet.export.onnx_export import _literal_zeros, _zero_safe_flatten
from cognet.model import checkpoint
from cognet.runtime import ScoreOptions, Scorer
from cognet.runtime.session import OrtModel


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """(data, ckpt, model dir, torch model) of a tiny random model, exported unvalidated."""
    data, ckpt = make_tiny(tmp_path_factory.mktemp("tiny"), n_patients=120)
    out = tmp_path_factory.mktemp("model") / "model"
    export(ckpt, out, ExportOptions(validate=False))
    model, _, _ = checkpoint.load(ckpt)
    return data, ckpt, out, model.eval()


@pytest.mark.parametrize("score_table", [True, False])
@pytest.mark.parametrize("n,b,t", [(1, 1, 0), (1, 1, 3), (3, 4, 0), (3, 4, 7), (2, 4, 45)])
def test_step_graph_computes_the_models_kv_step(tiny_model, n, b, t, score_table, monkeypatch):
    """StepGraph (tables, token prefix) against `COGNet.decoder_step` fed the KV cache of
    the same prefix, at several shapes, with the self-attention scores from the table of
    token pairs and (a vocabulary over its size bound) from q . k: every output within
    float32 rounding, the next prefix exactly the parents' prefixes with the new tokens."""
    model = tiny_model[3]
    if not score_table:
        monkeypatch.setattr(graphs, "SCORE_TABLE_MAX", 0)
    inputs = example_inputs(model, Sizes(N=n, B=b, T=t, Ld=6, Lp=3, S=5), seed=t)
    step = StepGraph(model)
    assert hasattr(step, "score_table") == score_table
    assert hasattr(step, "k_table") != score_table
    with torch.no_grad():
        got = step(*(inputs[k] for k in STEP_INPUTS))
        ref = ReferenceStep(model)(*(inputs[k] for k in STEP_INPUTS))
    for name, g, r in zip(STEP_OUTPUTS, got, ref, strict=True):
        if name == "present_tokens":
            np.testing.assert_array_equal(g.numpy(), r.numpy())
        else:
            np.testing.assert_allclose(g.numpy(), r.numpy(), atol=2e-5, err_msg=name)
    parent, prefix = inputs["parent"], inputs["past_tokens"]
    for i in range(n):
        for j in range(b):
            want = [*prefix[i, parent[i, j]].tolist(), int(inputs["tokens"][i, j])]
            assert got[-1][i, j].tolist() == want


def test_kv_cache_of_a_prefix_is_the_steps_own(tiny_model):
    """`kv_cache(prefix)` equals the cache the model's own step builds token by token (the
    reference the step graph is checked against is the model's step)."""
    model = tiny_model[3]
    n, b, steps = 2, 3, 5
    inputs = example_inputs(model, Sizes(N=n, B=b, T=2, Ld=6, Lp=3, S=5))
    memories = [inputs[k] for k in MEMORIES]
    graph = model.graph_embeddings().detach()
    parent = torch.arange(b).repeat(n, 1)
    tokens = torch.randint(0, model.cfg.n_med + 2, (n, b, steps), generator=torch.manual_seed(0))
    cache = model.empty_cache(n, b)
    with torch.no_grad():
        for s in range(steps):
            out = model.decoder_step(tokens[..., s], parent, *cache, *memories, graph=graph)
            cache = out[-2:]
        want = kv_cache(model, tokens, graph)
    for g, w in zip(cache, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-6)


class _KVStep(nn.Module):
    """The step graph of models exported before the token prefix: KV cache in and out."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.register_buffer("graph_emb", model.graph_embeddings().detach().clone())

    def forward(self, tokens, parent, past_key, past_value, *memories):
        return self.model.decoder_step(
            tokens, parent, past_key, past_value, *memories, graph=self.graph_emb, attention=True
        )


def _kv_model(tiny_model, dst: Path) -> Path:
    """A copy of the exported model whose decoder_step is a KV-cache graph, as models
    exported before carry, with its manifest entry (names, shapes, sha256) to match."""
    _, _, out, model = tiny_model
    shutil.copytree(out, dst)
    cfg = model.cfg
    inputs = example_inputs(model, Sizes(N=3, B=2, T=2))
    h, dh = cfg.heads, cfg.head_dim
    kv = kv_cache(model, inputs["past_tokens"], model.graph_embeddings().detach())
    feeds = dict(inputs, past_key=kv[0], past_value=kv[1])
    axes = {"past_key": ("N", "B", h, dh, "T"), "past_value": ("N", "B", h, "T", dh)}
    axes |= {"present_key": ("N", "B", h, dh, "T+1"), "present_value": ("N", "B", h, "T+1", dh)}
    manifest = json.loads((dst / "manifest.json").read_text())
    entry = manifest["graphs"]["decoder_step"]
    shapes = {t["name"]: t["shape"] for t in (*entry["inputs"], *entry["outputs"])}
    shapes.update({k: list(v) for k, v in axes.items()})
    dynamic = {k: {i: a for i, a in enumerate(shapes[k]) if isinstance(a, str)} for k in shapes}
    path = dst / entry["file"]
    with (
        redirect_stderr(io.StringIO()),
        warnings.catch_warnings(),
        torch.no_grad(),
        _zero_safe_flatten(),
    ):
        warnings.simplefilter("ignore")  # the tracer's notes on the embedding's padding
        torch.onnx.export(
            _KVStep(model).eval(),
            tuple(feeds[k] for k in KV_STEP_INPUTS),
            str(path),
            input_names=list(KV_STEP_INPUTS),
            output_names=list(KV_STEP_OUTPUTS),
            dynamic_axes={k: dynamic[k] for k in (*KV_STEP_INPUTS, *KV_STEP_OUTPUTS)},
            opset_version=OPSET,
            dynamo=False,
        )
    proto = onnx.load(str(path))
    _literal_zeros(proto, KV_CACHE_INPUTS)
    onnx.save(proto, str(path))
    dtype = {"past_key": "float32", "past_value": "float32"}
    dtype |= {"present_key": "float32", "present_value": "float32"}
    types = {t["name"]: t["dtype"] for t in (*entry["inputs"], *entry["outputs"])} | dtype
    entry["inputs"] = [{"name": k, "dtype": types[k], "shape": shapes[k]} for k in KV_STEP_INPUTS]
    entry["outputs"] = [{"name": k, "dtype": types[k], "shape": shapes[k]} for k in KV_STEP_OUTPUTS]
    entry["sha256"] = file_sha256(path)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


@pytest.mark.parametrize("decoding", ["beam", "set"])
def test_a_model_with_a_kv_cache_step_scores_the_same(tiny_model, tmp_path, decoding):
    """Models exported before the token prefix keep working: the runtime runs their KV
    step, and its lists equal those of the token-prefix step (beam 4 and set decoding)."""
    data, _, out, _ = tiny_model
    old = _kv_model(tiny_model, tmp_path / "kv")
    table = pq.read_table(data / "visits.parquet")
    lists = []
    for model_dir in (out, old):
        sessions = OrtModel(load_manifest(model_dir), device="cpu", threads=1).sessions
        cache = {i.name for i in sessions["decoder_step"].get_inputs()} - set(STEP_INPUTS)
        assert cache == (set() if model_dir == out else {"past_key", "past_value"})
        asked = {"set_rule": "jaccard", "estimator": "stratified"} if decoding == "set" else {}
        request = DecodingRequest(decoding=decoding, **asked)
        scorer = Scorer(model_dir, ScoreOptions.of(device="cpu", threads=1, request=request))
        chunks = list(scorer.score_table(table, score_all=True))
        got = {}
        for chunk in chunks:
            rec = chunk.recommendations.to_pydict()
            got.update(zip(rec["visit_id"], map(tuple, rec["medications"]), strict=True))
        lists.append(got)
    assert len(lists[0]) >= 200
    same = sum(lists[0][v] == lists[1][v] for v in lists[0])
    assert same == len(lists[0]) if decoding == "beam" else same >= 0.99 * len(lists[0])


def test_the_exported_score_table_validates_and_scores_like_q_dot_k(
    tiny_model, tmp_path, monkeypatch
):
    """The exported step with its self-attention scores from the token-pair table (the
    default) and without it (a vocabulary over the table's bound): each passes export
    validation (the graph against the torch model's step at every prefix length) and both
    give the same beam-4 lists."""
    data, ckpt, out, _ = tiny_model
    monkeypatch.setattr(graphs, "SCORE_TABLE_MAX", 0)
    export(ckpt, tmp_path / "qk", ExportOptions(validate=True))
    monkeypatch.undo()
    export(ckpt, tmp_path / "table", ExportOptions(validate=True))
    table = pq.read_table(data / "visits.parquet")
    lists = []
    for name, has_table in (("table", True), ("qk", False)):
        proto = onnx.load(str(tmp_path / name / "decoder_step.onnx"))
        names = {i.name for i in proto.graph.initializer}
        assert ("score_table" in names) == has_table and ("k_table" in names) != has_table
        request = DecodingRequest(decoding="beam")
        scorer = Scorer(tmp_path / name, ScoreOptions.of(device="cpu", threads=1, request=request))
        got = {}
        for chunk in scorer.score_table(table, score_all=True):
            rec = chunk.recommendations.to_pydict()
            got.update(zip(rec["visit_id"], map(tuple, rec["medications"]), strict=True))
        lists.append(got)
    assert len(lists[0]) >= 200 and lists[0] == lists[1]
