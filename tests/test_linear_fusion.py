"""The float32 graphs' linear layers as Gemms (`cognet.export.linear_fusion`): the same values
as the MatMul + Add form the exporter writes, at several shapes, empty ones included."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from cognet.core.manifest import GRAPHS
from cognet.export.graphs import GRAPH_IO, Sizes, example_inputs
from cognet.export.linear_fusion import fuse_linears
from cognet.export.onnx_export import export_graph
from cognet.model.network import COGNet, ModelConfig

K, M, H = 6, 5, 7


def _hand_graph() -> onnx.ModelProto:
    """Linear layers of every kind `fuse_linears` meets or must leave alone: on rank 2 and
    rank 3 inputs, two around a Relu, one whose product is also a graph output, one whose
    bias is an activation."""
    rng = np.random.default_rng(0)
    consts = {
        name: numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)
        for name, shape in {
            "w1": (K, H),
            "b1": (H,),
            "w2": (H, M),
            "b2": (M,),
            "w3": (K, M),
            "b3": (M,),
        }.items()
    }
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "w1"], ["h0"], "ffn0"),
        node("Add", ["h0", "b1"], ["h1"], "ffn0_bias"),
        node("Relu", ["h1"], ["h2"], "relu"),
        node("MatMul", ["h2", "w2"], ["y0"], "ffn1"),
        node("Add", ["y0", "b2"], ["y"], "ffn1_bias"),  # rank 3: reshaped around a Gemm
        node("MatMul", ["v", "w3"], ["z0"], "flat"),
        node("Add", ["z0", "b3"], ["z"], "flat_bias"),  # rank 2: a Gemm as it is
        node("MatMul", ["x", "w3"], ["seen"], "seen"),  # its product is a graph output
        node("Add", ["seen", "b3"], ["seen_b"], "seen_bias"),
        node("MatMul", ["x", "w3"], ["act0"], "act"),
        node("Add", ["act0", "a"], ["act_b"], "act_bias"),  # bias not a constant: left alone
    ]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "hand",
        [
            helper.make_tensor_value_info("x", f32, ["N", "B", K]),
            helper.make_tensor_value_info("v", f32, ["N", K]),
            helper.make_tensor_value_info("a", f32, ["N", "B", M]),
        ],
        [
            helper.make_tensor_value_info(name, f32, ["N", M] if name == "z" else ["N", "B", M])
            for name in ("y", "z", "seen", "seen_b", "act_b")
        ],
        list(consts.values()),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(proto, feed):
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed), strict=True))


@pytest.mark.parametrize("n,b", [(3, 4), (1, 1), (0, 4), (5, 0)])
def test_fused_linears_give_the_same_values(n, b):
    plain = _hand_graph()
    fused = _hand_graph()
    assert fuse_linears(fused) == 3  # ffn0, ffn1, flat: not `seen` nor `act`
    ops = [(nd.op_type, tuple(nd.input)) for nd in fused.graph.node]
    assert sum(op == "Gemm" for op, _ in ops) == 3
    assert ("Relu", ("h1/2d",)) in ops  # the Relu between two Gemms runs on the 2-D product
    rng = np.random.default_rng(n * 10 + b)
    feed = {
        "x": rng.normal(size=(n, b, K)).astype(np.float32),
        "v": rng.normal(size=(n, K)).astype(np.float32),
        "a": rng.normal(size=(n, b, M)).astype(np.float32),
    }
    want, got = _run(plain, feed), _run(fused, feed)
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_graph_without_fusable_linear_layers_is_left_as_it_is():
    proto = _hand_graph()
    keep = [nd for nd in proto.graph.node if nd.name.startswith(("seen", "act"))]
    del proto.graph.node[:]
    proto.graph.node.extend(keep)
    outputs = [o for o in proto.graph.output if o.name in ("seen", "seen_b", "act_b")]
    del proto.graph.output[:]
    proto.graph.output.extend(outputs)
    before = proto.SerializeToString()
    assert fuse_linears(proto) == 0
    assert proto.SerializeToString() == before


@pytest.mark.parametrize("name", GRAPHS)
def test_the_models_graphs_compute_the_same_fused(name, tmp_path):
    """The encoder, decoder init and decoder step of a small model, as exported and with
    their linear layers fused: the same outputs at three shapes (the step's first, empty
    cache included), and no MatMul left whose product a constant bias is added to."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_diag=12, n_proc=9, n_med=7, dim=16, heads=2, ffn=24)
    rng = np.random.default_rng(0)
    adj = (rng.random((7, 7)) < 0.3).astype(np.float32)
    model = COGNet(cfg, adj, adj.T.copy()).eval()
    path = tmp_path / f"{name}.onnx"
    with torch.no_grad():
        export_graph(model, name, path)
    plain = onnx.load(str(path))
    fused = onnx.load(str(path))
    assert fuse_linears(fused) > 0
    consts = {init.name for init in fused.graph.initializer}
    biased = {  # products that an Add of a constant consumes
        i
        for nd in fused.graph.node
        if nd.op_type == "Add" and set(nd.input) & consts
        for i in nd.input
    }
    left = [nd.name for nd in fused.graph.node if nd.op_type == "MatMul" and nd.output[0] in biased]
    assert not left, left
    ins, _ = GRAPH_IO[name]
    for sizes in (Sizes(), Sizes(N=5, B=3, T=0, Ld=7, Lp=2, Lm=3, J=3, S=4), Sizes(N=1, B=1, T=4)):
        example = example_inputs(model, sizes, seed=sizes.N)
        feed = {k: example[k].numpy() for k in ins}
        want, got = _run(plain, feed), _run(fused, feed)
        for out, value in want.items():
            np.testing.assert_allclose(got[out], value, rtol=1e-5, atol=1e-5, err_msg=out)
