"""ONNX Runtime sessions of a model directory: providers, threads, and the decoder session
the beam driver runs (`cognet.core.decoding.beam.DecoderSession`).

CPU: numpy in, numpy out; every array stays in host memory. Sessions run with a fixed number
of intra-op threads and no spinning (see `session_options`).
CUDA / TensorRT: the encoder writes its outputs into buffers on the device (`Encoder`), from
which the `init_gather` graph builds the decoder-init inputs there; the memories and the KV
cache live on the device as OrtValues and are passed from step to step by IO binding; only
tokens/parents go up, and per step either the candidates of the search graphs or the
log-probabilities (host selection, explanations) come back. Finished visits leave the batch
by the `take` graphs, on the device.
TensorRT reuses the engines that `cognet-export --tensorrt` built: the provider options are
the exporter's (`cognet.core.tensorrt`), with the cache folder and the min/opt/max shape
profile of each graph from the manifest's `tensorrt` entry.

ONNX Runtime falls back to the CPU silently when a provider cannot be loaded: `providers`
is what the sessions really got, and a requested provider missing from it is logged as a
warning (the CLI's summary reports them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from cognet.core import tensorrt
from cognet.core.decoding.ensemble import EnsembleSession
from cognet.core.errors import InputError, one_line
from cognet.core.graphspec import (
    ENCODER_PARTS,
    INIT_INPUTS,
    KV_CACHE_INPUTS,
    KV_CACHE_OUTPUTS,
    MEMORIES,
    MIX_GRAPH,
    STEP_CACHE_INPUTS,
    STEP_CACHE_OUTPUTS,
    cache_shapes,
    step_feed,
)
from cognet.core.manifest import GRAPHS, Manifest
from cognet.runtime.device_selectors import (
    INIT_GATHER,
    ORT_TYPES,
    SEARCH_GRAPHS,
    SearchGraphs,
    bind_input,
)
from cognet.runtime.encoder import Encoder, Encodings, EnsembleEncoder
from cognet.runtime.graphcheck import check_io, check_links, check_search, probe
from cognet.runtime.head import open_head
from cognet.runtime.options import CPU_VARIANTS, DEVICES, SELECTIONS, check_variant_device

log = logging.getLogger(__name__)

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


def default_threads() -> int:
    """Cores this process may run on (ONNX Runtime's own default counts the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def resolve_device(device: str) -> str:
    """cpu, cuda or tensorrt for a --device choice; InputError when it is not installed."""
    if device not in DEVICES:
        raise InputError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    available = ort.get_available_providers()
    if device == "auto":
        device = "cuda" if CUDA in available else "cpu"
    if device != "cpu":
        _preload_cuda()
        # onnxruntime >= 1.30 warns at every CUDA session with provider options ("no
        # registered plugin EP device"); what the sessions got is read back and reported
        ort.set_default_logger_severity(3)
    wanted = {"cpu": CPU, "cuda": CUDA, "tensorrt": TRT}[device]
    if wanted not in available:
        raise InputError(
            f"--device {device}: this onnxruntime has no {wanted} "
            f"(available: {', '.join(available)}); install onnxruntime-gpu with the CUDA "
            "(and TensorRT) libraries, or use --device cpu"
        )
    return device


def _preload_cuda() -> None:
    """Load the CUDA / cuDNN libraries of the nvidia-* pip packages (onnxruntime-gpu >= 1.21
    finds them only this way or through LD_LIBRARY_PATH); without them onnxruntime falls
    back to the CPU, which `OrtModel` then reports."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        try:
            preload()
        except Exception as exc:  # noqa: BLE001 - a missing library shows at session creation
            log.debug("onnxruntime.preload_dlls: %s", exc)


def providers(device: str, manifest: Manifest, graph: str) -> list:
    """The provider list of one graph's session for a resolved device."""
    if device == "cpu":
        return [CPU]
    # TF32 (onnxruntime's default on Ampere and later) rounds MatMul inputs to 10 mantissa
    # bits: beam search then flips near-ties against the float32 torch reference (measured on
    # an H200). Full float32 keeps parity.
    cuda = (CUDA, {"device_id": 0, "use_tf32": "0"})
    if device == "cuda":
        return [cuda, CPU]
    trt = manifest.tensorrt
    if not trt:
        raise InputError(
            f"{manifest.model_dir}: --device tensorrt needs engines built by "
            "`cognet-export --tensorrt` (the manifest has none)"
        )
    options = tensorrt.provider_options(
        manifest.model_dir, bool(trt.get("fp16")), trt["profiles"][graph], trt["cache_dir"]
    )
    return [(TRT, {"device_id": 0, **options}), cuda, CPU]


def session_options(threads: int | None) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or default_threads()
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    # Idle intra-op threads would spin between the many small ops of a step and between steps,
    # taking the core the Python side of the beam search needs.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


class OrtModel:
    """The encoder, decoder-init and decoder-step sessions of a model directory.

    An ensemble (`Manifest.members` > 1): every member's sessions, on the same provider,
    threads and variant, and one set of search graphs for all; `encoder` is then an
    `encoder.EnsembleEncoder` and `decoder` a `cognet.core.decoding.ensemble.EnsembleSession`
    over the members' decoders, and `sessions` member 0's.

    gpu_path: on the CPU provider, run what a GPU runs (IO binding into CPU memory,
    encodings gathered by init_gather, the split selection graphs, gathers by the take
    graphs): the tests check it against the host path, and cognet-bench's ort-cpu-gpupath
    measures the GPU path's host side without a GPU."""

    def __init__(
        self,
        manifest: Manifest,
        device: str = "auto",
        threads: int | None = None,
        variant: str | None = None,
        selection: str = "auto",
        gpu_path: bool = False,
    ):
        self.manifest = manifest
        check_variant_device(variant, device)
        # --device auto with the int8 graphs: the CPU, whatever GPU is there
        self.device = resolve_device("cpu" if variant in CPU_VARIANTS else device)
        opts = session_options(threads)
        self.threads = opts.intra_op_num_threads
        members = [self._open(opts, variant, m) for m in range(manifest.members)]
        self.sessions: dict[str, ort.InferenceSession] = members[0]
        self.providers = self.sessions["decoder_step"].get_providers()
        gpu = self.providers[0] in (CUDA, TRT)
        if gpu_path and (gpu or not manifest.search):
            raise InputError(
                "gpu_path runs the GPU's bindings on the CPU: --device cpu, and a "
                "model with the search graphs"
            )
        self.on_device = gpu or gpu_path
        bound = ("cuda", 0) if gpu else ("cpu", 0)  # where device tensors live
        decoders = [
            DeviceDecoder(m["decoder_init"], m["decoder_step"], manifest, device=bound)
            if self.on_device
            else HostDecoder(
                m["decoder_init"], m["decoder_step"], manifest.dims.heads, manifest.dims.head_dim
            )
            for m in members
        ]
        self.selection = self._selection(selection)
        # the set head (`--decoding marginal`): one graph of its own, no engine (no profile)
        cuda = (CUDA, {"device_id": 0, "use_tf32": "0"})  # full float32, as the decoder's
        providers = [CPU] if self.device == "cpu" else [cuda, CPU]
        self.head = open_head(manifest, opts, providers, gpu=self.on_device)
        search = None
        if self.selection == "device" or (self.on_device and self.manifest.search):
            search = SearchGraphs(self._search(opts, gpu), bound if self.on_device else None)
        for decoder in decoders:  # on a GPU the take graphs run there whatever the selection
            decoder.search = search
        encoders = [
            Encoder(
                m["encoder"],
                manifest.dims.dim,
                search if self.on_device else None,
                {part: m[part] for part in ENCODER_PARTS if part in m},  # none: no parts
            )
            for m in members
        ]
        if len(members) == 1:
            self.decoder, self.encoder = decoders[0], encoders[0]
        else:
            self.decoder, self.encoder = EnsembleSession(decoders), EnsembleEncoder(encoders)
            if search is not None and MIX_GRAPH in search.sessions:  # mixed where it ran
                self.decoder.search = search

    def _open(self, opts, variant: str | None, member: int) -> dict[str, ort.InferenceSession]:
        """The checked sessions of one member's three graphs, and of its encoder parts where
        they serve (`_parts`)."""
        manifest, sessions = self.manifest, {}
        for name in GRAPHS + (tuple(ENCODER_PARTS) if self._parts(variant) else ()):
            path = manifest.graph_path(name, variant, member)
            wanted = providers(self.device, manifest, name)
            try:
                sessions[name] = ort.InferenceSession(
                    str(path), opts, providers=wanted, disabled_optimizers=self._disabled()
                )
            except Exception as exc:  # noqa: BLE001 - any load failure is a bad model file
                raise InputError(f"{path}: cannot load the ONNX graph ({one_line(exc)})") from None
            spec = manifest.graph_spec(name, variant, member)
            check_io(name, path, sessions[name], spec, manifest.dims)
            probe(name, path, sessions[name], manifest)
            got = sessions[name].get_providers()
            first = wanted[0] if isinstance(wanted[0], str) else wanted[0][0]
            if first not in got:
                log.warning("%s: requested %s, onnxruntime runs %s", name, first, got)
        check_links(sessions, {n: manifest.graph_path(n, variant, member) for n in sessions})
        return sessions

    def _parts(self, variant: str | None) -> bool:
        """Whether the encoder runs as its parts, one graph per kind of code
        (`graphspec.ENCODER_PARTS`), each called on rows grouped by that kind's length: on
        the CPU, with the float32 graphs of a model that has them: less padding, less
        time. A GPU keeps the one encoder (three times the calls; not measured there), and
        so do the variants, which have no parts."""
        return self.device == "cpu" and variant is None and self.manifest.encoder_parts

    def _search(self, opts, gpu: bool) -> dict[str, ort.InferenceSession]:
        """The checked sessions of the search graphs, on the decoder's device."""
        search = {}
        wanted = [(CUDA, {"device_id": 0, "use_tf32": "0"}), CPU] if gpu else [CPU]
        for name, spec in self.manifest.search.items():
            path = Path(self.manifest.model_dir or ".") / spec.file
            try:
                search[name] = ort.InferenceSession(str(path), opts, providers=wanted)
            except Exception as exc:  # noqa: BLE001 - any load failure is a bad model file
                raise InputError(f"{path}: cannot load the ONNX graph ({one_line(exc)})") from None
            check_search(path, search[name], spec, self.manifest.dims)
        return search

    def _disabled(self) -> list[str]:
        """Graph optimisations left out. On the CPU, SkipLayerNormFusion: its fused kernel is
        slower than the Add + LayerNormalization it replaces at the widths measured
        (BENCHMARKS.md "What was tried"), with the same lists. A GPU keeps it (fewer kernels; not
        measured there)."""
        return [] if self.device != "cpu" else ["SkipLayerNormFusion"]

    def _selection(self, selection: str) -> str:
        """host or device for a --selection choice (auto: device on a GPU, host on the CPU,
        where the numpy selection measured faster; host for a model without the graphs)."""
        if selection not in SELECTIONS:
            raise InputError(
                f"unknown selection {selection!r}; choose from {', '.join(SELECTIONS)}"
            )
        missing = [g for g in SEARCH_GRAPHS if g not in self.manifest.search]
        if selection == "device" and missing:
            raise InputError(
                f"{self.manifest.model_dir}: --selection device needs the search graphs "
                f"({', '.join(missing)}), which models exported before them lack; re-export"
            )
        if selection == "auto":
            return "device" if self.on_device and not missing else "host"
        return selection


def input_dtypes(session: ort.InferenceSession) -> dict[str, np.dtype]:
    """The numpy type of each input of a session (float16 in the fp16 variant)."""
    return {i.name: np.dtype(ORT_TYPES.get(i.type, "float32")) for i in session.get_inputs()}


class StepCache:
    """The cache a step graph carries from step to step: the token prefix of every row
    (`graphspec.STEP_CACHE_INPUTS`, int64 [N, B, T]), or the KV cache of a model exported
    before it (past_key, past_value, in the graph's float type)."""

    def __init__(self, step: ort.InferenceSession, heads: int, head_dim: int):
        types = input_dtypes(step)
        self.kv = "past_key" in types
        self.inputs = KV_CACHE_INPUTS if self.kv else STEP_CACHE_INPUTS
        self.outputs = KV_CACHE_OUTPUTS if self.kv else STEP_CACHE_OUTPUTS
        self._type = types["past_key"] if self.kv else np.dtype(np.int64)
        self._heads, self._head_dim = heads, head_dim

    def empty(self, n: int, width: int) -> tuple[np.ndarray, ...]:
        """The cache of n visits x width rows before the first step (T = 0)."""
        if not self.kv:
            return (np.zeros((n, width, 0), np.int64),)
        key, value = cache_shapes(n, width, self._heads, self._head_dim)
        return np.zeros(key, self._type), np.zeros(value, self._type)


class HostDecoder:
    """Decoder init and step on the CPU provider (numpy arrays throughout).

    Inputs are cast to the types the graphs declare: the assembly builds float32 arrays,
    which the float16 variant takes as float16 (its memories stay float16; its
    log-probabilities leave the step as float32)."""

    def __init__(
        self, init: ort.InferenceSession, step: ort.InferenceSession, heads: int, head_dim: int
    ):
        self._init, self._step = init, step
        self._init_types = input_dtypes(init)
        self._cache = StepCache(step, heads, head_dim)
        # what `step` can return (models exported before `diag_attention` lack it)
        self.step_outputs = tuple(o.name for o in step.get_outputs())
        self.search: SearchGraphs | None = None  # the search graphs, on the CPU provider
        # the cache is the token prefix: set decoding steps only its open rows
        # (`cognet.core.decoding.open_samples`)
        self.prefix_cache = not self._cache.kv

    def init(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {k: np.asarray(inputs[k], self._init_types[k]) for k in INIT_INPUTS}
        out = self._init.run(list(MEMORIES), feed)
        return dict(zip(MEMORIES, out, strict=True))

    def empty_cache(self, n: int, beam: int) -> tuple[np.ndarray, ...]:
        return self._cache.empty(n, beam)

    def step(
        self, tokens: np.ndarray, parent: np.ndarray, cache, memories, outputs: Sequence[str]
    ) -> tuple[dict[str, np.ndarray], Any]:
        feed = step_feed(tokens, parent, cache, memories, self._cache.inputs)
        out = self._step.run([*outputs, *self._cache.outputs], feed)
        k = len(outputs)
        return dict(zip(outputs, out[:k], strict=True)), tuple(out[k:])

    def step_log_probs(self, tokens: np.ndarray, parent: np.ndarray, cache, memories):
        """(log_probs [n, B, V1], the next cache) of one step, for the search graphs."""
        out, cache = self.step(tokens, parent, cache, memories, ("log_probs",))
        return out["log_probs"], cache

    def take(self, value, rows: np.ndarray):
        if isinstance(value, dict):
            return {k: v[rows] for k, v in value.items()}
        return tuple(v[rows] for v in value)


class DeviceDecoder:
    """Decoder init and step on CUDA / TensorRT with IO binding: memories and the step's cache
    stay on the device; tokens and parents are bound from host arrays each step and only
    the requested outputs (log-probabilities, ...) are copied back.

    Handles are OrtValues on the device, except the empty cache of the first step, a
    zero-size host array that ONNX Runtime copies itself."""

    def __init__(
        self,
        init: ort.InferenceSession,
        step: ort.InferenceSession,
        manifest: Manifest,
        device: tuple[str, int] = ("cuda", 0),
    ):
        self._init, self._step = init, step
        self._device = device  # ("cpu", 0) runs the same bindings on the CPU (tests)
        self._init_types = input_dtypes(init)
        self._cache = StepCache(step, manifest.dims.heads, manifest.dims.head_dim)
        self.step_outputs = tuple(o.name for o in step.get_outputs())
        self.search: SearchGraphs | None = None  # the search graphs, on the device
        self.prefix_cache = False  # handles on the device: every row steps

    def _to_device(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), *self._device)

    _bind = staticmethod(bind_input)  # numpy from host memory, OrtValues where they are

    def init(self, inputs: Mapping[str, Any]) -> dict[str, ort.OrtValue]:
        """Memories on the device from init inputs: host arrays (cast to the graph's types)
        or OrtValues already there."""
        io = self._init.io_binding()
        for name in INIT_INPUTS:
            value = inputs[name]
            if isinstance(value, np.ndarray):
                value = np.asarray(value, self._init_types[name])
            self._bind(io, name, value)
        for name in MEMORIES:
            io.bind_output(name, *self._device)
        self._init.run_with_iobinding(io)
        return dict(zip(MEMORIES, io.get_outputs(), strict=True))

    def init_gathered(
        self, enc: Encodings, rows: Mapping[str, np.ndarray], rest: Mapping[str, np.ndarray]
    ) -> dict[str, ort.OrtValue]:
        """Memories from encodings on the device (`Encoder`): the encoding inputs gathered
        there by the `init_gather` graph (`rows`: `encoder.init_index`), the rest bound
        from the host."""
        feeds = {"codes": enc.codes, "visits": enc.visits}
        feeds.update({f"{name}_rows": value for name, value in rows.items()})
        _, gathered = self.search.run(INIT_GATHER[enc.codes.data_type()], feeds, (), tuple(rows))
        return self.init({**rest, **gathered})

    def empty_cache(self, n: int, beam: int) -> tuple[np.ndarray, ...]:
        return self._cache.empty(n, beam)

    def step(
        self, tokens: np.ndarray, parent: np.ndarray, cache, memories, outputs: Sequence[str]
    ) -> tuple[dict[str, np.ndarray], Any]:
        io = self._step.io_binding()
        for name, value in step_feed(tokens, parent, cache, memories, self._cache.inputs).items():
            self._bind(io, name, value)
        for name in outputs:
            io.bind_output(name, "cpu")
        for name in self._cache.outputs:
            io.bind_output(name, *self._device)
        self._step.run_with_iobinding(io)
        out = io.get_outputs()  # in binding order
        host = {name: np.array(out[i].numpy(), copy=True) for i, name in enumerate(outputs)}
        return host, tuple(out[len(outputs) :])

    def step_log_probs(self, tokens: np.ndarray, parent: np.ndarray, cache, memories):
        """(log_probs [n, B, V1] left on the device, the next cache) of one step, for the
        search graphs."""
        io = self._step.io_binding()
        for name, value in step_feed(tokens, parent, cache, memories, self._cache.inputs).items():
            self._bind(io, name, value)
        for name in ("log_probs", *self._cache.outputs):
            io.bind_output(name, *self._device)
        self._step.run_with_iobinding(io)
        out = io.get_outputs()
        return out[0], tuple(out[1:])

    def take(self, value, rows: np.ndarray):
        search = self.search

        def one(v):
            if search is not None and not isinstance(v, np.ndarray):
                return search.take(v, rows)  # a gather on the device
            return self._to_device((v if isinstance(v, np.ndarray) else v.numpy())[rows])

        if isinstance(value, dict):
            return {k: one(v) for k, v in value.items()}
        return tuple(one(v) for v in value)
