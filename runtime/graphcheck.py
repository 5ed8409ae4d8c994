"""Checks of a model's graphs when they are loaded (torch-free): a graph that does not fit
its manifest is refused with one line naming the graph file, the tensor and the axis
(InputError, exit 2), before any visit is scored.

- `check_io`: the graph's input and output names, the element types the manifest declares,
  and every fixed axis (embedding width, heads, head width, vocabulary size) against the
  manifest's. Another cognet model's graph passes names and types but not these.
  The names and shapes the manifest declares are the graph's own: the same input and
  output names (a manifest naming an output otherwise is refused), the same rank, each
  fixed axis the same.
- `check_links`: the graphs of one model agree on the fixed axes of the tensors they pass
  each other (the encoder's outputs, the memories): one graph of another model, its
  manifest entry edited to fit it, fits its entry but not its neighbours.
- `probe`: one tiny run per graph (one visit, one code, ids 0), whose outputs' fixed axes
  are checked too: a graph that loads but cannot run with the manifest's sizes fails here.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from cognet.core.errors import InputError, one_line
from cognet.core.graphspec import (
    ENCODER_INPUTS,
    ENCODER_OUTPUTS,
    ENCODER_PARTS,
    INIT_INPUTS,
    KV_STEP_INPUTS,
    KV_STEP_OUTPUTS,
    MEMORIES,
    STEP_INPUTS,
    STEP_OUTPUTS,
)
from cognet.core.manifest import Dims, GraphSpec, Manifest
from cognet.runtime.device_selectors import ORT_TYPES

# What each graph must take and give (`cognet.core.graphspec`); `diag_attention` is optional
# (models exported before it lack it), and so is the step's cache: the token prefix, or the
# KV cache of models exported before it.
GRAPH_IO = {
    "encoder": (ENCODER_INPUTS, ENCODER_OUTPUTS),
    "decoder_init": (INIT_INPUTS, MEMORIES),
    "decoder_step": (STEP_INPUTS, tuple(n for n in STEP_OUTPUTS if n != "diag_attention")),
    **ENCODER_PARTS,
}
KV_STEP_IO = (KV_STEP_INPUTS, tuple(n for n in KV_STEP_OUTPUTS if n != "diag_attention"))


def check_io(
    name: str, path: object, session: ort.InferenceSession, spec: GraphSpec, dims: Dims | None
) -> None:
    """InputError unless the graph loaded as `name` takes exactly that graph's inputs, with
    the element types the manifest declares (float16 in the fp16 variant) and its fixed axes
    (embedding width, heads, vocabulary sizes; `dims` names them), and gives its outputs: a
    graph file swapped for another (its sha256 re-entered in the manifest) fails here, by
    name and axis, rather than at its first run."""
    inputs, outputs = GRAPH_IO[name]
    got_in = [i.name for i in session.get_inputs()]
    if name == "decoder_step" and "past_key" in got_in:
        inputs, outputs = KV_STEP_IO
    got_out = {o.name for o in session.get_outputs()}
    if sorted(got_in) != sorted(inputs) or not got_out.issuperset(outputs):
        raise InputError(
            f"{path}: not the {name} graph (its inputs are {_names(got_in)}; {name} takes "
            f"{_names(inputs)}); re-export the model"
        )
    check_names(name, path, session, spec)
    declared = {t.name: t.dtype for t in spec.inputs}
    for i in session.get_inputs():
        dtype = ORT_TYPES.get(i.type, i.type)
        if i.name in declared and declared[i.name] != dtype:
            raise InputError(
                f"{path}: input {i.name} is {dtype}, the manifest declares "
                f"{declared[i.name]} (a graph of another variant?); re-export the model"
            )
    # another cognet model's graph has the same names and types: its fixed axes (width,
    # heads, vocabulary) tell it apart
    shapes = {t.name: t.shape for t in (*spec.inputs, *spec.outputs)}
    for kind, tensors in (("input", session.get_inputs()), ("output", session.get_outputs())):
        for t in tensors:
            if t.name in shapes:
                check_axes(path, f"{kind} {t.name}", t.shape, shapes[t.name], dims)


ANY_RANK = "..."  # the manifest's shape of a tensor of any rank


def check_names(name: str, path: object, session: ort.InferenceSession, spec: GraphSpec) -> None:
    """InputError unless the manifest names exactly the graph's inputs and outputs."""
    got = (
        {i.name for i in session.get_inputs()},
        {o.name for o in session.get_outputs()},
    )
    want = (set(spec.input_names), {t.name for t in spec.outputs})
    for kind, graph, manifest in zip(("inputs", "outputs"), got, want, strict=True):
        if graph != manifest:
            raise InputError(
                f"{path}: the manifest names {kind} of the {name} graph that it does not have "
                f"({_names(sorted(manifest - graph)) or 'none'}; the graph has "
                f"{_names(sorted(graph - manifest)) or 'no other'}); re-export the model"
            )


def check_links(sessions: dict[str, ort.InferenceSession], paths: dict[str, object]) -> None:
    """InputError naming a graph whose tensor has another rank or fixed axis than the same
    tensor in an earlier graph of the model (`sessions` in load order)."""
    seen: dict[str, tuple[str, list]] = {}
    for name, session in sessions.items():
        for kind, tensors in (("input", session.get_inputs()), ("output", session.get_outputs())):
            for t in tensors:
                if t.name not in seen:
                    seen[t.name] = (name, t.shape)
                    continue
                other, shape = seen[t.name]
                pairs = enumerate(zip(t.shape, shape, strict=False))  # ranks compared below
                fixed = [(a, g, o) for a, (g, o) in pairs if _differ(g, o)]
                if len(t.shape) != len(shape) or fixed:
                    axis, g, o = fixed[0] if fixed else ("rank", len(t.shape), len(shape))
                    raise InputError(
                        f"{paths[name]}: {kind} {t.name} axis {axis} is {g}, {o} in "
                        f"{paths[other]}: graphs of two models; re-export the model"
                    )


def _differ(a, b) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a != b


def check_search(path: object, session: ort.InferenceSession, spec: GraphSpec, dims: Dims) -> None:
    """A search graph (`cognet.export.search_graphs`): its inputs are the manifest's, and its
    fixed axes (the vocabulary: out_size or n_med) those of the manifest and of its dims."""
    got_in = sorted(i.name for i in session.get_inputs())
    if got_in != sorted(spec.input_names):
        raise InputError(
            f"{path}: not the graph the manifest names (its inputs are {_names(got_in)}); "
            "re-export the model"
        )
    sizes = {dims.out_size, dims.n_med}
    shapes = {t.name: t.shape for t in (*spec.inputs, *spec.outputs)}
    for kind, tensors in (("input", session.get_inputs()), ("output", session.get_outputs())):
        for t in tensors:
            want = shapes.get(t.name)
            if want is None or ANY_RANK in want:
                continue  # an any-rank tensor (the take graphs of models exported before ranks)
            if any(isinstance(w, int) and w not in sizes for w in want):
                raise InputError(
                    f"{path}: the manifest's {kind} {t.name} has shape {list(want)}, not one "
                    f"of this model's sizes (out_size {dims.out_size}, n_med {dims.n_med})"
                )
            check_axes(path, f"{kind} {t.name}", t.shape, want, dims)


def check_axes(path: object, what: str, got, want, dims: Dims | None) -> None:
    """InputError naming the graph, the tensor and the axis when a fixed axis of `got`
    differs from the manifest's `want` (dims: the manifest's, to name the axis)."""
    if len(got) != len(want):
        raise InputError(
            f"{path}: {what} has {len(got)} axes, the manifest declares {len(want)}; "
            "re-export the model"
        )
    for axis, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(g, int) and isinstance(w, int) and g != w:
            named = [k for k, v in vars(dims or {}).items() if v == w]
            field = f" (dims.{named[0]})" if named else ""
            raise InputError(
                f"{path}: {what} axis {axis} is {g}, the manifest's is {w}{field}: a graph "
                "of another model; re-export the model"
            )


def probe(name: str, path: object, session: ort.InferenceSession, manifest: Manifest) -> None:
    """Run the graph once on one visit of one code (every symbolic axis 1, ids 0, masks
    1) and check its outputs' fixed axes against the manifest: a graph that loads but
    cannot run with the manifest's sizes is refused here (InputError naming it), not at the
    first batch. One tiny run per graph: cheap beside loading it."""
    feed = {}
    for i in session.get_inputs():
        shape = [a if isinstance(a, int) else 1 for a in i.shape]
        dtype = np.dtype(ORT_TYPES.get(i.type, "float32"))
        feed[i.name] = (np.zeros if dtype == np.int64 else np.ones)(shape, dtype)
    try:
        got = session.run(None, feed)
    except Exception as exc:  # noqa: BLE001 - any failure of the run is a bad graph
        raise InputError(
            f"{path}: the {name} graph fails a probe run with the manifest's sizes "
            f"({one_line(exc)[:200]}); re-export the model"
        ) from None
    want = {t.name: t.shape for t in manifest.graph_spec(name).outputs}
    for o, value in zip(session.get_outputs(), got, strict=True):
        if o.name in want:
            check_axes(path, f"output {o.name}", list(value.shape), want[o.name], manifest.dims)


def _names(names) -> str:
    names = list(names)
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
