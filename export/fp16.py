"""Float32 -> float16 conversion of an exported ONNX graph, written with `onnx` alone.

Every float tensor becomes float16 (weights, constants, casts, graph inputs and outputs)
except around the operators in `KEEP_FLOAT32`: those run in float32 with casts inserted at
their boundary. The step's `Clip` + `Log` (the mixture's floor and log) stay float32 because
`PROB_FLOOR` (1e-20) underflows to 0 in float16, and `log_probs` leaves the graph as float32
so that beam scores accumulate without float16 rounding.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

KEEP_FLOAT32 = ("Clip", "Log")
FLOAT32_OUTPUTS = ("log_probs",)
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def to_float16(
    model: onnx.ModelProto,
    keep_ops: tuple[str, ...] = KEEP_FLOAT32,
    float32_outputs: tuple[str, ...] = FLOAT32_OUTPUTS,
) -> onnx.ModelProto:
    """Return a float16 copy of `model` (see the module docstring)."""
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    graph = model.graph
    types = _elem_types(graph)
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    kept = lambda node: node.op_type in keep_ops  # noqa: E731
    graph_outputs = {o.name for o in graph.output}

    def only_kept_consumers(name: str) -> bool:
        users = consumers.get(name, [])
        return bool(users) and all(kept(n) for n in users) and name not in graph_outputs

    # Tensors that stay float32: constants read only by kept ops, and outputs of kept ops.
    fp32: set[str] = set()
    for init in graph.initializer:
        if init.data_type == F32:
            if only_kept_consumers(init.name):
                fp32.add(init.name)
            else:
                init.CopyFrom(_half(init))
    for node in graph.node:
        if kept(node):
            fp32.update(o for o in node.output if types.get(o) == F32)
        elif node.op_type == "Constant" and types.get(node.output[0]) == F32:
            if only_kept_consumers(node.output[0]):
                fp32.add(node.output[0])
            else:
                _retype_constant(node)
        elif node.op_type == "ConstantOfShape" and types.get(node.output[0]) == F32:
            _retype_constant(node)
        elif node.op_type == "Cast" and _attr(node, "to") == F32:
            node.attribute[0].CopyFrom(helper.make_attribute("to", F16))
    for value in graph.input:
        if value.type.tensor_type.elem_type == F32:
            value.type.tensor_type.elem_type = F16

    # Insert casts where a float16 tensor meets a kept op and where float32 leaves one.
    nodes: list[onnx.NodeProto] = []
    casts: dict[tuple[str, int], str] = {}

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            casts[key] = f"{name}__as_{'f32' if to == F32 else 'f16'}"
            nodes.append(helper.make_node("Cast", [name], [casts[key]], to=to))
        return casts[key]

    for node in graph.node:
        for i, name in enumerate(node.input):
            if not name or types.get(name) != F32:
                continue
            if kept(node) and name not in fp32:
                node.input[i] = cast(name, F32)
            elif not kept(node) and name in fp32:
                node.input[i] = cast(name, F16)
        nodes.append(node)
    for out in graph.output:
        if out.type.tensor_type.elem_type != F32:
            continue
        if out.name in fp32 and out.name in float32_outputs:
            continue
        if out.name in fp32:  # computed in float32, leaves as float16
            _rename_output(nodes, out.name, out.name + "__f32")
            nodes.append(helper.make_node("Cast", [out.name + "__f32"], [out.name], to=F16))
        out.type.tensor_type.elem_type = F16
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _elem_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {i.name: i.data_type for i in graph.initializer}
    for v in (*graph.input, *graph.value_info, *graph.output):
        types[v.name] = v.type.tensor_type.elem_type
    return types


def _half(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name)


def _retype_constant(node: onnx.NodeProto) -> None:
    for attr in node.attribute:
        if attr.name == "value" and attr.t.data_type == F32:
            attr.t.CopyFrom(_half(attr.t))
            return
    raise ValueError(f"cannot convert {node.op_type} node {node.name!r} to float16")


def _attr(node: onnx.NodeProto, name: str):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return None


def _rename_output(nodes: list[onnx.NodeProto], old: str, new: str) -> None:
    for node in nodes:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
