"""One model graph -> one ONNX file: `torch.onnx.export` and the fix-ups its output needs.

Exporter choice: the TorchScript exporter (`dynamo=False`), opset 18. It exports the graphs
many times faster than the dynamo exporter (BENCHMARKS.md "What was tried"), keeps our symbolic axis
names (dynamo renames them s0, s1...), and after ONNX Runtime's optimisations the graphs run
at the same speed. Both give plain graphs (no If/Loop); see `onnx_ops_allowlist.txt` for the
operator set.

`graph_spec` describes a written file for the manifest; `write_fp16` and `write_int8` add its
float16 and int8 variants. `export_head` writes the set head's graph the same way (float32
only: one Gemm a visit, no variant worth its parity checks).
After the export: the inputs an ablation leaves unused are put back, fixed axes are pinned,
the KV-cache Reshapes of the step graph keep literal zeros (`allowzero`), and the graph's
I/O is checked against `cognet.core.graphspec` with its symbolic axes.
"""

from __future__ import annotations

import io
import warnings
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper
from onnx.utils import Extractor
from torch.onnx import symbolic_helper as sym

from cognet.core.files import atomic_path
from cognet.core.graphspec import ENCODER_PARTS, STEP_CACHE_INPUTS
from cognet.core.manifest import GraphSpec, TensorSpec, file_sha256
from cognet.export.errors import ExportError
from cognet.export.fp16 import to_float16
from cognet.export.graphs import (
    GRAPH_IO,
    WRAPPERS,
    HeadSizes,
    Sizes,
    example_inputs,
    head_example,
    head_specs,
    tensor_specs,
)
from cognet.export.int8 import quantize
from cognet.export.linear_fusion import fuse_linears

OPSET = 18


def export_graph(model, name: str, path: Path) -> None:
    """torch.onnx.export one graph with every symbolic axis dynamic, warnings silenced."""
    ins, _ = GRAPH_IO[name]
    example = example_inputs(model, Sizes())
    module = WRAPPERS[name](model)
    _export_module(module, name, tuple(example[k] for k in ins), tensor_specs(model), path)


def export_head(head, path: Path) -> GraphSpec:
    """The set head (`cognet.model.set_head.SetHead`) as the graph `head` written to
    `path`, checked as the model's graphs are; its manifest entry."""
    ins, _ = GRAPH_IO["head"]
    example = head_example(head.cfg, HeadSizes())
    specs = head_specs(head.cfg.n_med)
    with torch.no_grad():
        _export_module(head, "head", tuple(example[k] for k in ins), specs, path)
    return graph_spec(path, "head", specs)


def _export_module(module, name: str, example: tuple, specs: dict, path: Path) -> None:
    """torch.onnx.export `module` as the graph `name` (`graphs.GRAPH_IO`), every symbolic
    axis of `specs` dynamic, warnings silenced; its I/O checked against `specs`."""
    ins, outs = GRAPH_IO[name]
    dynamic_axes = {
        k: {i: d for i, d in enumerate(specs[k].shape) if isinstance(d, str)} for k in (*ins, *outs)
    }
    with (
        atomic_path(path) as tmp,
        warnings.catch_warnings(),
        redirect_stdout(io.StringIO()),
        redirect_stderr(io.StringIO()),
        _zero_safe_flatten(),
    ):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            example,
            str(tmp),
            input_names=list(ins),
            output_names=list(outs),
            dynamic_axes=dynamic_axes,
            opset_version=OPSET,
            dynamo=False,
            external_data=False,
            do_constant_folding=True,
        )
        proto = onnx.load(str(tmp))
        _restore_unused_inputs(proto, ins, specs)
        _pin_fixed_axes(proto, specs)
        if name == "decoder_step":
            _literal_zeros(proto)
        onnx.save(proto, str(tmp))
        onnx.checker.check_model(proto, full_check=True)
        _check_io(proto, name, specs)


@contextmanager
def _zero_safe_flatten():
    """Export `flatten` as Reshape(x, [..., prod(dims), ...], allowzero=1).

    The stock symbolic reshapes to [-1, ...], which cannot be resolved when the tensor is
    empty (the first decoder step has T = 0) and, with allowzero=0, reads the literal 0 of
    T as "copy the input's dim".
    """

    def flatten(g, x, start_dim, end_dim):
        rank = sym._get_tensor_rank(x)
        start, end = sym._get_const(start_dim, "i", "start"), sym._get_const(end_dim, "i", "end")
        end = end + rank if end < 0 else end

        def part(lo: int, hi: int):
            const = lambda v: g.op("Constant", value_t=torch.tensor([v]))  # noqa: E731
            return g.op("Slice", shape, const(lo), const(hi), const(0))

        shape = g.op("Shape", x)
        merged = g.op("ReduceProd", part(start, end + 1), keepdims_i=1)
        new = g.op("Concat", part(0, start), merged, part(end + 1, rank), axis_i=0)
        return g.op("Reshape", x, new, allowzero_i=1)

    torch.onnx.register_custom_op_symbolic("aten::flatten", flatten, OPSET)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::flatten", OPSET)


def _restore_unused_inputs(proto, names, specs: dict[str, TensorSpec]) -> None:
    """Put back the inputs an ablation leaves unused (the exporter drops them), in graphspec
    order, so every graph has the same inputs whatever the ablation."""
    have = {v.name: v for v in proto.graph.input}
    elem = {"int64": TensorProto.INT64, "float32": TensorProto.FLOAT}
    inputs = [
        have.get(k) or helper.make_tensor_value_info(k, elem[specs[k].dtype], list(specs[k].shape))
        for k in names
    ]
    del proto.graph.input[:]
    proto.graph.input.extend(inputs)


def _pin_fixed_axes(proto, specs: dict[str, TensorSpec]) -> None:
    """Write the spec's fixed sizes into output axes the exporter left symbolic (the heads
    axis of `diag_attention`, which shape inference does not resolve through Softmax)."""
    for value in proto.graph.output:
        dims = value.type.tensor_type.shape.dim
        for dim, want in zip(dims, specs[value.name].shape, strict=False):
            if isinstance(want, int) and dim.dim_param:
                dim.ClearField("dim_param")
                dim.dim_value = want


# Operators that move or select the cache's elements without computing on them: a tensor
# they produce from the cache still holds cache values (and its T axis).
_MOVES = {
    "Reshape",
    "Gather",
    "GatherElements",
    "GatherND",
    "Concat",
    "Identity",
    "Unsqueeze",
    "Squeeze",
    "Slice",
    "Expand",
    "Flatten",
    "Transpose",
    "Cast",
}


def cache_tensors(graph, sources=STEP_CACHE_INPUTS) -> set[str]:
    """Names of the tensors of an ONNX graph that hold the step's cache: the inputs `sources`
    (the token prefix; a KV cache's names for models exported before) and what
    data-movement operators make of them (up to the ops that consume them)."""
    found = set(sources)
    for node in graph.node:  # topological order
        if node.op_type in _MOVES and node.input and node.input[0] in found:
            found.update(node.output)
    return found


def _literal_zeros(proto, sources=STEP_CACHE_INPUTS) -> None:
    """allowzero=1 on the Reshapes of the step's cache (`sources`; empty at T = 0): their
    target shapes come from Shape ops, so a 0 is a real size, as in torch, not "copy the
    input's dim"."""
    cache = cache_tensors(proto.graph, sources)
    for node in proto.graph.node:
        if node.op_type == "Reshape" and node.input[0] in cache:
            kept = [a for a in node.attribute if a.name != "allowzero"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("allowzero", 1)])


def _check_io(proto, name: str, specs: dict[str, TensorSpec]) -> None:
    """The graph's inputs and outputs are exactly the spec's, with symbolic axes kept."""
    ins, outs = GRAPH_IO[name]
    for values, expected in ((proto.graph.input, ins), (proto.graph.output, outs)):
        names = tuple(v.name for v in values)
        if names != tuple(expected):
            raise ExportError(f"{name}: graph I/O {names} differ from graphspec {expected}")
        for v in values:
            dims = tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)
            want = specs[v.name].shape
            if dims != want:
                raise ExportError(
                    f"{name}: {v.name} has shape {dims}, expected {want} "
                    "(an axis was specialised to its example size?)"
                )


def graph_spec(
    path: Path, name: str, specs: dict[str, TensorSpec], dtype_of=lambda spec: spec.dtype
) -> GraphSpec:
    """The manifest entry of a written graph file: its sha256 and typed inputs/outputs."""
    ins, outs = GRAPH_IO[name]
    typed = lambda k: TensorSpec(k, dtype_of(specs[k]), specs[k].shape)  # noqa: E731
    return GraphSpec(path.name, file_sha256(path), tuple(map(typed, ins)), tuple(map(typed, outs)))


def fuse_linear_layers(path: Path, name: str, specs: dict[str, TensorSpec]) -> None:
    """Rewrite the float32 graph file `path` with its linear layers as two-dimensional Gemms
    (`cognet.export.linear_fusion`), checked, in place."""
    proto = onnx.load(str(path))
    if fuse_linears(proto):
        _check_io(proto, name, specs)
        with atomic_path(path) as tmp:
            onnx.save(proto, str(tmp))


def write_encoder_parts(
    src: Path, files: dict[str, Path], specs: dict[str, TensorSpec]
) -> dict[str, GraphSpec]:
    """The encoder graph file `src` cut into one graph per kind of code
    (`graphspec.ENCODER_PARTS`: each part's nodes are the encoder's nodes its outputs need,
    unchanged), checked and written to `files` ({part: path}); their manifest entries."""
    cut = Extractor(onnx.load(str(src)))
    out = {}
    for name, (ins, outs) in ENCODER_PARTS.items():
        part = cut.extract_model(list(ins), list(outs))
        part.graph.name = name
        onnx.checker.check_model(part, full_check=True)
        _check_io(part, name, specs)
        with atomic_path(files[name]) as tmp:
            onnx.save(part, str(tmp))
        out[name] = graph_spec(files[name], name, specs)
    return out


def write_fp16(src: Path, dst: Path, name: str, specs: dict[str, TensorSpec]) -> GraphSpec:
    """The float16 variant of the graph file `src`, checked and written to `dst`."""
    half = to_float16(onnx.load(str(src)))
    onnx.checker.check_model(half, full_check=True)
    with atomic_path(dst) as tmp:
        onnx.save(half, str(tmp))
    return _variant_spec(half, dst, name, specs)


def write_int8(src: Path, dst: Path, name: str, specs: dict[str, TensorSpec]) -> GraphSpec:
    """The int8 variant of the graph file `src` (`cognet.export.int8`), checked and written
    to `dst`: its inputs and outputs are the float32 graph's."""
    with atomic_path(dst) as tmp:
        quantize(src, tmp)
        proto = onnx.load(str(tmp))
        onnx.checker.check_model(proto, full_check=True)
        _check_io(proto, name, specs)
    return _variant_spec(proto, dst, name, specs)


def _variant_spec(proto, path: Path, name: str, specs: dict[str, TensorSpec]) -> GraphSpec:
    """`graph_spec` of a variant's graph file, its tensors typed as the graph declares them."""
    dtypes = {
        v.name: v.type.tensor_type.elem_type for v in (*proto.graph.input, *proto.graph.output)
    }
    names = {
        onnx.TensorProto.FLOAT16: "float16",
        onnx.TensorProto.FLOAT: "float32",
        onnx.TensorProto.INT64: "int64",
    }
    return graph_spec(path, name, specs, dtype_of=lambda spec: names[dtypes[spec.name]])
