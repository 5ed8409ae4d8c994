"""The search graphs: candidate selection of beam search and set decoding as ONNX graphs, so
that a decoder step's log-probabilities never leave the device (written with `onnx` alone).

The runtime runs one of them right after each decoder step (`cognet.runtime.device_selectors`). They
compute exactly the rules of docs/DESIGN.md "Beam search" / "Set decoding" and
`cognet.core.ddi`, which the numpy drivers (`cognet.core.decoding.beam`,
`cognet.core.decoding.sampling`)
also follow; tests hold the two equal, visit by visit.

- `beam_select` (and `beam_select_ddi`, which takes the DDI penalty and hard flag and holds the
  DDI adjacency as a constant): from log_probs [N, B, V1], the running scores [N, B], the
  `used` mask [N, B, V1] and `finished` [N, B], the B best candidates per visit as scores,
  parent, token, the chosen raw log-probability, whether the beam was live, and the next
  `used` / `finished` (reordered by parent, like the KV cache).
  The B best of the B x V1 candidates come from one TopK over them (ONNX's TopK puts equal
  values lower index first: the stable descending order of the flat index b * V1 + v that the
  numpy driver uses). The `_split` variants take them in two stages, B per beam then B of
  those B x B, in the same order (value, beam, rank in beam); each TopK then ranks at most
  max(V1, B^2) values, which ONNX Runtime's CUDA TopK sorts in one block with the index as
  tie-break (its radix path, for longer rows, does not promise the order of ties). The CPU
  runs the one-stage graphs (faster there), a GPU the split ones.
- `set_select` (and `set_select_ddi`): one sampling step of set decoding, from
  log_probs [N, S, V1], `used`, `finished`, the step's uniforms u [N, S] (counter-based, from
  the host) and the running hazard sums [N, M]: the drawn tokens and the next used / finished
  / hazard. As the host's sampler: float32 exponentials, float64 from the normalisation on.
- `take_<dtype>` and `take_<dtype>_<r>d` (`graphspec.take_graph_name`): rows (Gather on
  axis 0) of a matrix, or of a rank-r tensor (r = 1, 3, 4, 5): finished visits leave the
  batch on the device.
- `mix_log_probs` (ensembles only): the members' step log-probabilities mixed token by
  token, in float64 as the host's `mix_log_probs` mixes them, so that an ensemble's beam search
  selects on the device too.
- `init_gather_<dtype>` (float32, float16): the decoder-init inputs gathered from the
  encoder outputs where the encoder wrote them (`cognet.runtime.layout.Layout`): from the
  flat `codes` and `visits` buffers and one index tensor per input (`<input>_rows`), the
  seven encoding inputs of `decoder_init`, so that encodings never cross to the host.

Only standard ONNX operators, no control flow, and every input and output has a rank: each
graph passes `onnx.checker.check_model(full_check=True)` (tests/test_graph_validity.py). With
`--device tensorrt` they run on the CUDA provider, not TensorRT: set decoding is float64,
which TensorRT does not have.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cognet.core.graphspec import (
    BEAM_SELECT_HOST,
    BEAM_SELECT_INPUTS,
    BEAM_SELECT_STATE,
    DDI_INPUTS,
    INIT_GATHERED,
    MIX_GRAPH,
    MIX_OUTPUT,
    SET_SELECT_HOST,
    SET_SELECT_INPUTS,
    SET_SELECT_STATE,
    TAKE_DTYPES,
    TAKE_INPUTS,
    TAKE_OUTPUT,
    TAKE_RANKS,
    mix_inputs,
    take_graph_name,
)
from cognet.core.manifest import GraphSpec, TensorSpec, file_sha256

F32, F64, I64, BOOL = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.BOOL
TAKE_TYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "float64": TensorProto.DOUBLE,
    "int64": TensorProto.INT64,
    "bool": TensorProto.BOOL,
}
assert tuple(TAKE_TYPES) == TAKE_DTYPES
TAKES = {take_graph_name(t, r): (t, r) for t in TAKE_DTYPES for r in TAKE_RANKS}
INIT_GATHER_TYPES = ("float32", "float16")  # the encoder outputs' types (fp32, fp16 variant)
BEAM_SELECT = ("beam_select", "beam_select_ddi", "beam_select_split", "beam_select_split_ddi")
SEARCH_FILES = {
    **{name: f"{name}.onnx" for name in BEAM_SELECT},
    "set_select": "set_select.onnx",
    "set_select_ddi": "set_select_ddi.onnx",
    **{name: f"{name}.onnx" for name in TAKES},
    **{f"init_gather_{t}": f"init_gather_{t}.onnx" for t in INIT_GATHER_TYPES},
    MIX_GRAPH: f"{MIX_GRAPH}.onnx",
}
# A candidate at or below this is impossible (-inf): far below any hypothesis score (45 steps
# of log-probabilities >= log 1e-20, DDI penalties of sane size) and above float32's lowest.
IMPOSSIBLE = -1e30
_DTYPE_NAMES = {elem: name for name, elem in TAKE_TYPES.items()}  # manifest dtype names


class _Graph:
    """A small builder: named constants and nodes with generated output names."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._n = 0

    def input(self, name: str, elem: int, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def const(self, value, dtype) -> str:
        self._n += 1
        name = f"c{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None, **attrs):
        self._n += 1
        outs = [name] if name else [f"t{self._n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if outputs == 1 else outs

    def output(self, value: str, name: str, elem: int, shape) -> None:
        self.op("Identity", value, name=name)
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def model(self, opset: int) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model


def _adjacency(ddi_adj: np.ndarray, v1: int) -> np.ndarray:
    """float32 [V1, V1]: the DDI adjacency [M, M] with a zero row and column for END."""
    m = ddi_adj.shape[0]
    out = np.zeros((v1, v1), np.float32)
    out[:m, :m] = np.asarray(ddi_adj, bool)
    return out


def _ddi_penalty(g: _Graph, logp: str, used: str, adj: np.ndarray) -> str:
    """float32 logp lowered by penalty x interacting pairs with the hypothesis, or -inf
    where `hard` and it interacts (the rules of `cognet.core.ddi`)."""
    penalty, hard = (g.input(name, t, []) for name, t in zip(DDI_INPUTS, (F32, BOOL), strict=True))
    clashes = g.op("MatMul", g.op("Cast", used, to=F32), g.const(adj, np.float32))
    soft = g.op("Sub", logp, g.op("Mul", penalty, clashes))
    blocked = g.op("And", hard, g.op("Greater", clashes, g.const(0.0, np.float32)))
    return g.op("Where", blocked, g.const(-np.inf, np.float32), soft)


def beam_select_graph(
    v1: int, ddi_adj: np.ndarray | None, opset: int, split: bool = False
) -> onnx.ModelProto:
    """The candidate selection of one beam-search step, any beam width B <= V1 (see the
    module docstring); `split`: in two TopK stages."""
    end = v1 - 1
    g = _Graph(_beam_name(ddi_adj is not None, split))
    nb, nbv = ["N", "B"], ["N", "B", v1]
    logp, scores, used, finished = (
        g.input(name, elem, dims)
        for name, elem, dims in zip(
            BEAM_SELECT_INPUTS, (F32, F32, BOOL, BOOL), (nbv, nb, nbv, nb), strict=True
        )
    )
    neg_inf = g.const(-np.inf, np.float32)
    ax2 = g.const([2], np.int64)
    raw = logp
    if ddi_adj is not None:
        logp = _ddi_penalty(g, logp, used, _adjacency(ddi_adj, v1))
    scores3 = g.op("Unsqueeze", scores, ax2)
    cand = g.op("Where", used, neg_inf, g.op("Add", scores3, logp))
    is_end = g.const(np.arange(v1) == end, bool)
    frozen = g.op("Where", is_end, scores3, neg_inf)  # a finished beam proposes END only
    cand = g.op("Where", g.op("Unsqueeze", finished, ax2), frozen, cand)
    # -inf -> IMPOSSIBLE before the TopK, back after: CUDA's TopK pads its rows with the
    # lowest float, which would outrank -inf (measured on an H100: padding indices chosen)
    sentinel = g.const(IMPOSSIBLE, np.float32)
    cand = g.op("Max", cand, sentinel)
    k = g.op("Slice", g.op("Shape", scores), g.const([1], np.int64), g.const([2], np.int64))
    flat = g.const([0, -1], np.int64)
    if split:
        v_beam, i_beam = g.op("TopK", cand, k, axis=2, largest=1, sorted=1, outputs=2)
        v_flat = g.op("Reshape", v_beam, flat)
        best, pos = g.op("TopK", v_flat, k, axis=1, largest=1, sorted=1, outputs=2)
        token = g.op("GatherElements", g.op("Reshape", i_beam, flat), pos, axis=1)
        parent = g.op("Div", pos, k)
        flat_ix = g.op("Add", g.op("Mul", parent, g.const(v1, np.int64)), token)
    else:
        best, flat_ix = g.op(
            "TopK", g.op("Reshape", cand, flat), k, axis=1, largest=1, sorted=1, outputs=2
        )
        width = g.const(v1, np.int64)
        parent, token = g.op("Div", flat_ix, width), g.op("Mod", flat_ix, width)
    best = g.op("Where", g.op("LessOrEqual", best, sentinel), neg_inf, best)
    chosen = g.op("GatherElements", g.op("Reshape", raw, flat), flat_ix, axis=1)
    live = g.op("Not", g.op("GatherElements", finished, parent, axis=1))
    rows = g.op("Expand", g.op("Unsqueeze", parent, ax2), g.op("Shape", used))
    onehot = g.op("Equal", g.op("Unsqueeze", token, ax2), g.const(np.arange(v1), np.int64))
    used_next = g.op("Or", g.op("GatherElements", used, rows, axis=1), onehot)
    fin_next = g.op("Or", g.op("Not", live), g.op("Equal", token, g.const(end, np.int64)))
    outputs = (
        (best, F32, nb),
        (parent, I64, nb),
        (token, I64, nb),
        (chosen, F32, nb),
        (live, BOOL, nb),
        (fin_next, BOOL, nb),
        (used_next, BOOL, nbv),
    )
    for (value, elem, dims), name in zip(
        outputs, (*BEAM_SELECT_HOST, *BEAM_SELECT_STATE), strict=True
    ):
        g.output(value, name, elem, dims)
    return g.model(opset)


def _beam_name(ddi: bool, split: bool) -> str:
    return "beam_select" + ("_split" if split else "") + ("_ddi" if ddi else "")


def set_select_graph(v1: int, ddi_adj: np.ndarray | None, opset: int) -> onnx.ModelProto:
    """One sampling step of set decoding, float64 (see the module docstring)."""
    end = v1 - 1
    g = _Graph("set_select_ddi" if ddi_adj is not None else "set_select")
    ns, nsv = ["N", "S"], ["N", "S", v1]
    logp32, used, finished, u, hazard = (
        g.input(name, elem, dims)
        for name, elem, dims in zip(
            SET_SELECT_INPUTS,
            (F32, BOOL, BOOL, F64, F64),
            (nsv, nsv, ns, ns, ["N", end]),
            strict=True,
        )
    )
    ax1, ax2 = g.const([1], np.int64), g.const([2], np.int64)
    fin3 = g.op("Unsqueeze", finished, ax2)
    # a finished sample: all its mass on END (log 0 there, -inf elsewhere)
    logp = g.op("Where", fin3, g.const(0.0, np.float32), logp32)
    if ddi_adj is not None:
        logp = _ddi_penalty(g, logp, used, _adjacency(ddi_adj, v1))
    not_end = g.const(np.arange(v1) != end, bool)
    neg_inf, zero = g.const(-np.inf, np.float32), g.const(0.0, np.float32)
    logp = g.op("Where", g.op("And", fin3, not_end), neg_inf, logp)
    # float32 exponentials, held medications 0, then float64 (the host's
    # `_step_distribution`): unshifted, but for a row whose sum falls below 2^-100, which is
    # shifted by its largest log-probability not held
    held = g.op("And", g.op("Not", fin3), used)
    e = g.op("Cast", g.op("Where", held, zero, g.op("Exp", logp)), to=F64)
    low = g.op("Less", g.op("ReduceSum", e, ax2, keepdims=1), g.const(2.0**-100, np.float64))
    top = g.op("ReduceMax", g.op("Where", held, neg_inf, logp), ax2, keepdims=1)
    shifted = g.op("Exp", g.op("Sub", logp, g.op("Where", low, top, zero)))
    e = g.op("Cast", g.op("Where", held, zero, shifted), to=F64)
    p = g.op("Div", e, g.op("ReduceSum", e, ax2, keepdims=1))
    meds = g.op("Slice", p, g.const([0], np.int64), g.const([end], np.int64), ax2)
    hazard_next = g.op("Add", hazard, g.op("ReduceSum", meds, ax1, keepdims=0))
    cum = g.op("CumSum", p, g.const(2, np.int64))
    total = g.op("Slice", cum, g.const([-1], np.int64), g.const([v1], np.int64), ax2)
    below = g.op("Less", cum, g.op("Mul", g.op("Unsqueeze", u, ax2), total))
    count = g.op("ReduceSum", g.op("Cast", below, to=F64), ax2, keepdims=0)  # exact
    token = g.op("Min", g.op("Cast", count, to=I64), g.const(end, np.int64))
    onehot = g.op("Equal", g.op("Unsqueeze", token, ax2), g.const(np.arange(v1), np.int64))
    fin_next = g.op("Or", finished, g.op("Equal", token, g.const(end, np.int64)))
    outputs = (
        (token, I64, ns),
        (fin_next, BOOL, ns),
        (g.op("Or", used, onehot), BOOL, nsv),
        (hazard_next, F64, ["N", end]),
    )
    for (value, elem, dims), name in zip(
        outputs, (*SET_SELECT_HOST, *SET_SELECT_STATE), strict=True
    ):
        g.output(value, name, elem, dims)
    return g.model(opset)


def take_graph(dtype: str, opset: int, rank: int = 2) -> onnx.ModelProto:
    """Rows of a rank-`rank` tensor: y [K, ...] = Gather(x [N, ...], rows [K], axis=0)."""
    elem = TAKE_TYPES[dtype]
    g = _Graph(take_graph_name(dtype, rank))
    rest = [f"A{i}" for i in range(1, rank)]
    x = g.input(TAKE_INPUTS[0], elem, ["N", *rest])
    rows = g.input(TAKE_INPUTS[1], I64, ["K"])
    g.op("Gather", x, rows, axis=0, name=TAKE_OUTPUT)
    g.outputs.append(helper.make_tensor_value_info(TAKE_OUTPUT, elem, ["K", *rest]))
    return g.model(opset)


def init_gather_graph(dtype: str, opset: int) -> onnx.ModelProto:
    """Gather(codes or visits, <input>_rows, axis=0) for each decoder-init encoding input."""
    elem = TAKE_TYPES[dtype]
    g = _Graph(f"init_gather_{dtype}")
    source = {b: g.input(b, elem, [f"R_{b}", "D"]) for b in ("codes", "visits")}
    for name, buffer, rank in INIT_GATHERED:
        dims = ["N", f"L_{name}"][:rank]
        rows = g.input(f"{name}_rows", I64, dims)
        g.output(g.op("Gather", source[buffer], rows, axis=0), name, elem, [*dims, "D"])
    return g.model(opset)


def mix_graph(v1: int, members: int, opset: int) -> onnx.ModelProto:
    """The token-level mixture of `members` networks' step log-probabilities, the value
    `cognet.core.decoding.ensemble.mix_log_probs` gives on the host (at most 1 ulp apart):
    in float64, a running logaddexp (max + log(1 + exp(-|a - b|))) less log K, rounded once
    to float32 (the host sums exponentials; this form holds for any finite input).
    -inf is clamped to -1e300 first (so that two -inf never meet in a subtraction); a token
    every member gives -inf ends at about -1e300, which float32 rounds back to -inf."""
    g = _Graph(MIX_GRAPH)
    dims = ["N", "B", v1]
    floor = g.const(-1e300, np.float64)
    parts = [
        g.op("Max", g.op("Cast", g.input(name, F32, dims), to=F64), floor)
        for name in mix_inputs(members)
    ]
    one = g.const(1.0, np.float64)
    mixed = parts[0]
    for part in parts[1:]:
        gap = g.op("Neg", g.op("Abs", g.op("Sub", mixed, part)))
        lift = g.op("Log", g.op("Add", one, g.op("Exp", gap)))
        mixed = g.op("Add", g.op("Max", mixed, part), lift)
    mixed = g.op("Sub", mixed, g.const(np.log(members), np.float64))
    g.output(g.op("Cast", mixed, to=F32), MIX_OUTPUT, F32, dims)
    return g.model(opset)


def write_search_graphs(
    out: Path, v1: int, ddi_adj: np.ndarray, opset: int, members: int = 1
) -> dict[str, GraphSpec]:
    """Write every search graph into the model directory `out` (the mixture graph for an
    ensemble of `members` >= 2 networks); their manifest entries."""
    models = {
        **{
            _beam_name(ddi, split): beam_select_graph(v1, ddi_adj if ddi else None, opset, split)
            for ddi in (False, True)
            for split in (False, True)
        },
        "set_select": set_select_graph(v1, None, opset),
        "set_select_ddi": set_select_graph(v1, ddi_adj, opset),
        **{name: take_graph(t, opset, rank) for name, (t, rank) in TAKES.items()},
        **{f"init_gather_{t}": init_gather_graph(t, opset) for t in INIT_GATHER_TYPES},
        **({MIX_GRAPH: mix_graph(v1, members, opset)} if members > 1 else {}),
    }
    specs = {}
    for name, model in models.items():
        path = out / SEARCH_FILES[name]
        onnx.save(model, str(path))
        specs[name] = GraphSpec(
            SEARCH_FILES[name],
            file_sha256(path),
            _specs(model.graph.input),
            _specs(model.graph.output),
        )
    return specs


def _specs(values) -> tuple[TensorSpec, ...]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = tuple(d.dim_param or d.dim_value for d in t.shape.dim)
        out.append(TensorSpec(v.name, _DTYPE_NAMES[t.elem_type], dims))
    return tuple(out)
