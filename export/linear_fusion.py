"""Linear layers as two-dimensional Gemms: the form of the float32 graphs that the CPU runs
faster.

torch's Linear on an input of rank 3 (the step's rows [N, B, s], the encoder's codes
[N, L, s]) exports as MatMul(x, W) + Add(., b): two kernels, the second one more pass over
the whole output to add the bias, and ONNX Runtime fuses neither (its MatMul + Add fusion
wants two-dimensional inputs). `fuse_linears` writes each such pair as

    Reshape(x, [-1, K]) -> Gemm(., W, b) -> Reshape(., [leading dims of x..., M])

Reshapes of contiguous tensors are views (no copy), and one Shape reads the leading dims of
all the tensors that shape inference gives the same ones. A Relu between two linear layers
(the feed-forward blocks) runs on the two-dimensional tensor, so that ONNX Runtime fuses it
into the first Gemm (FusedGemm). The products are the same; MLAS starts each sum from the
bias instead of adding it at the end, so float32 results differ by reassociation only.

A few percent faster on the CPU (BENCHMARKS.md "What was tried"). Applied to the float32
graphs only: the int8 variant's dynamic quantization has no integer Gemm, so its graphs are
written from the unfused ones. Gemm, Relu, Shape, Concat and Reshape are standard operators
(`onnx_ops_allowlist.txt`).
"""

from __future__ import annotations

import numpy as np


def fuse_linears(proto) -> int:
    """Rewrite, in place, every MatMul by a constant [K, M] weight whose only consumer adds a
    constant [M] bias as a Gemm on the input flattened to two dimensions; returns how many.

    A MatMul whose product is a graph output, or feeds anything but that Add, is left as it
    is, as is one whose input rank shape inference cannot tell."""
    import onnx
    from onnx import helper, numpy_helper

    graph = proto.graph
    ranks, leading = _shapes(proto)
    consts = {init.name: init for init in graph.initializer}
    users: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    outputs = {v.name for v in graph.output}
    producer = {out: node for node in graph.node for out in node.output}

    def bias_of(matmul):
        """The Add that adds a constant [M] bias to `matmul`'s product, and that bias."""
        found = users.get(matmul.output[0], [])
        if matmul.output[0] in outputs or len(found) != 1 or found[0].op_type != "Add":
            return None, None
        add = found[0]
        other = [name for name in add.input if name != matmul.output[0]]
        weight = consts[matmul.input[1]]
        if (
            len(other) != 1
            or other[0] not in consts
            or list(consts[other[0]].dims) != [weight.dims[1]]
        ):
            return None, None
        return add, other[0]

    fused = {}  # MatMul name -> (its Add, the bias)
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in consts:
            continue
        if len(consts[node.input[1]].dims) != 2 or ranks.get(node.input[0], 0) < 2:
            continue
        add, bias = bias_of(node)
        if add is not None:
            fused[node.name] = (add, bias)
    if not fused:
        return 0

    extra: list = []  # initializers made here
    flat: dict[str, str] = {}  # a tensor -> its two-dimensional view
    lead_dims: dict[str, str] = {}  # a tensor -> the tensor of its leading dims (a Shape)
    named: dict[tuple, str] = {}  # leading dims as shape inference names them -> that tensor
    back: dict[tuple, str] = {}  # (leading dims' tensor, width) -> the shape to take back

    def const(name: str, values) -> str:
        name = f"linear_fusion/{name}"
        if name not in consts:
            consts[name] = numpy_helper.from_array(np.asarray(values, np.int64), name)
            extra.append(consts[name])
        return name

    def flatten(x: str, k: int, emit) -> str:  # x of rank >= 3
        if x not in flat:
            src = producer.get(x)
            if src is not None and src.op_type == "Relu" and src.input[0] in flat:
                # between two linear layers: the Relu on the 2-D product, fused into its Gemm
                emit(helper.make_node("Relu", [flat[src.input[0]]], [f"{x}/2d"], f"{src.name}/2d"))
            else:
                emit(helper.make_node("Reshape", [x, const(f"rows_{k}", [-1, k])], [f"{x}/2d"]))
            flat[x] = f"{x}/2d"
        return flat[x]

    def lead_of(x: str, emit) -> str:
        """The tensor of x's leading dims: a product's are its input's, a Relu's its input's,
        and tensors whose leading dims shape inference names alike (equal by its rules)
        share one Shape."""
        if x in lead_dims:
            return lead_dims[x]
        src = producer.get(x)
        if src is not None and src.op_type == "Relu" and src.input[0] in lead_dims:
            lead_dims[x] = lead_dims[src.input[0]]
        elif leading.get(x) in named:
            lead_dims[x] = named[leading[x]]
        else:
            lead_dims[x] = f"{x}/leading"
            emit(helper.make_node("Shape", [x], [lead_dims[x]], end=-1))
            if x in leading:
                named[leading[x]] = lead_dims[x]
        return lead_dims[x]

    nodes: list = []
    skip = {add.name for add, _ in fused.values()}
    for node in graph.node:
        if node.name in skip:
            continue
        if node.name not in fused:
            nodes.append(node)
            continue
        add, bias = fused[node.name]
        x, weight = node.input
        k, m = consts[weight].dims
        y = add.output[0]
        if ranks[x] == 2:
            nodes.append(helper.make_node("Gemm", [x, weight, bias], [y], f"{node.name}/gemm"))
            continue
        x2 = flatten(x, k, nodes.append)
        nodes.append(helper.make_node("Gemm", [x2, weight, bias], [f"{y}/2d"], f"{node.name}/gemm"))
        lead = lead_of(x, nodes.append)
        lead_dims[y] = lead
        if (lead, m) not in back:  # the product's shape: x's leading dims, then M
            back[lead, m] = f"{y}/back"
            width = const(f"width_{m}", [m])
            nodes.append(helper.make_node("Concat", [lead, width], [back[lead, m]], axis=0))
        # allowzero: a leading size of 0 is a size (an empty batch), not "copy the input's"
        nodes.append(helper.make_node("Reshape", [f"{y}/2d", back[lead, m]], [y], allowzero=1))
        flat[y] = f"{y}/2d"
    for i, node in enumerate(nodes):
        if not node.name:
            node.name = f"linear_fusion/{node.op_type}_{i}"
    del graph.node[:]
    graph.node.extend(_live(nodes, outputs))
    graph.initializer.extend(extra)
    onnx.checker.check_model(proto, full_check=True)
    return len(fused)


def _shapes(proto) -> tuple[dict[str, int], dict[str, tuple]]:
    """The rank of every tensor whose rank shape inference knows, and the leading dims (all
    but the last) of those whose leading dims it names or knows, every one."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(proto)
    graph = inferred.graph
    ranks = {init.name: len(init.dims) for init in graph.initializer}
    leading = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        if tensor.HasField("shape"):
            dims = tensor.shape.dim
            ranks[value.name] = len(dims)
            lead = tuple(d.dim_param or d.dim_value or None for d in dims[:-1])
            if None not in lead:
                leading[value.name] = lead
    return ranks, leading


def _live(nodes: list, outputs: set[str]) -> list:
    """`nodes` less those whose outputs nothing uses any more (a Relu now run on the 2-D
    product), in their order."""
    while True:
        used = {name for node in nodes for name in node.input} | outputs
        kept = [node for node in nodes if any(out in used for out in node.output)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept
