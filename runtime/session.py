"""ONNX Runtime sessions of a model directory: providers, threads, and the decoder session
the beam driver runs (`cognet.runtime.beam.DecoderSession`).

CPU: numpy in, numpy out; every array stays in host memory and nothing is copied between
steps except what ONNX Runtime itself allocates.
CUDA / TensorRT: the memories and the KV cache live on the device as OrtValues and are
passed from step to step by IO binding; only tokens/parents go up and log-probabilities
(plus gate and copy distribution when explaining) come back each step. Dropping finished
visits (`take`) goes through the host, which happens a few times per batch, not per step.

ONNX Runtime falls back to the CPU silently when a provider cannot be loaded: `providers`
is what the sessions really got, and a requested provider that is missing from it is
logged as a warning (and reported by the CLI's summary).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from cognet.errors import InputError
from cognet.graphspec import ENCODER_OUTPUTS, INIT_INPUTS, MEMORIES
from cognet.manifest import Manifest
from cognet.runtime.beam import DecoderSession

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda", "tensorrt")
CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


def default_threads() -> int:
    """Cores this process may run on (ONNX Runtime's own default counts the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def resolve_providers(device: str, trt_cache: Path | None = None) -> list:
    """Execution providers for a --device choice; InputError when one is not installed."""
    if device not in DEVICES:
        raise InputError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    available = ort.get_available_providers()
    if device == "auto":
        device = "cuda" if CUDA in available else "cpu"
    if device == "cpu":
        return [CPU]
    wanted = TRT if device == "tensorrt" else CUDA
    if wanted not in available:
        raise InputError(f"--device {device}: this onnxruntime has no {wanted} "
                         f"(available: {', '.join(available)}); install onnxruntime-gpu "
                         "with CUDA (and TensorRT) libraries, or use --device cpu")
    cuda = (CUDA, {"device_id": 0})
    if device == "cuda":
        return [cuda, CPU]
    cache = str(trt_cache or Path.home() / ".cache" / "cognet" / "tensorrt")
    trt = (TRT, {"device_id": 0, "trt_engine_cache_enable": True,
                 "trt_engine_cache_path": cache, "trt_timing_cache_enable": True,
                 "trt_timing_cache_path": cache})
    return [trt, cuda, CPU]


def session_options(threads: int | None) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or default_threads()
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    return opts


class OrtModel:
    """The encoder, decoder-init and decoder-step sessions of a model directory."""

    def __init__(self, manifest: Manifest, device: str = "auto", threads: int | None = None,
                 variant: str | None = None):
        self.manifest = manifest
        requested = resolve_providers(device)
        opts = session_options(threads)
        self.threads = opts.intra_op_num_threads
        self.sessions = {}
        for name in ("encoder", "decoder_init", "decoder_step"):
            path = manifest.graph_path(name, variant)
            try:
                self.sessions[name] = ort.InferenceSession(str(path), opts, providers=requested)
            except Exception as exc:  # noqa: BLE001 - any load failure is a bad model file
                detail = " ".join(str(exc).split())
                raise InputError(f"{path}: cannot load the ONNX graph ({detail})") from None
        self.providers = self.sessions["decoder_step"].get_providers()
        first = requested[0] if isinstance(requested[0], str) else requested[0][0]
        if first not in self.providers:
            log.warning("requested %s but onnxruntime runs %s", first, self.providers)
        self.on_device = self.providers[0] in (CUDA, TRT)
        self.decoder: DecoderSession = (DeviceDecoder if self.on_device else HostDecoder)(
            self.sessions["decoder_init"], self.sessions["decoder_step"], manifest)

    def encode(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Encoder outputs (`graphspec.ENCODER_OUTPUTS`) as host arrays."""
        out = self.sessions["encoder"].run(list(ENCODER_OUTPUTS), dict(inputs))
        return dict(zip(ENCODER_OUTPUTS, out))


class HostDecoder:
    """Decoder init and step on the CPU provider (numpy arrays throughout)."""

    def __init__(self, init: ort.InferenceSession, step: ort.InferenceSession,
                 manifest: Manifest):
        self._init, self._step = init, step
        dims = manifest.dims
        self._heads, self._head_dim = dims.heads, dims.head_dim

    def init(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self._init.run(list(MEMORIES), {k: inputs[k] for k in INIT_INPUTS})
        return dict(zip(MEMORIES, out))

    def empty_cache(self, n: int, beam: int) -> tuple[np.ndarray, np.ndarray]:
        h, dh = self._heads, self._head_dim
        return (np.zeros((n, beam, h, dh, 0), np.float32),
                np.zeros((n, beam, h, 0, dh), np.float32))

    def step(self, tokens: np.ndarray, parent: np.ndarray, cache, memories,
             outputs: Sequence[str]) -> tuple[dict[str, np.ndarray], Any]:
        feed = {"tokens": tokens, "parent": parent, "past_key": cache[0],
                "past_value": cache[1], **memories}
        names = [*outputs, "present_key", "present_value"]
        out = self._step.run(names, feed)
        return dict(zip(outputs, out)), (out[-2], out[-1])

    def take(self, value, rows: np.ndarray):
        if isinstance(value, dict):
            return {k: v[rows] for k, v in value.items()}
        return tuple(v[rows] for v in value)


class DeviceDecoder:
    """Decoder init and step on CUDA / TensorRT with IO binding: memories and the KV cache
    stay on the device; tokens and parents are bound from host arrays each step and only
    the requested outputs (log-probabilities, ...) are copied back."""

    def __init__(self, init: ort.InferenceSession, step: ort.InferenceSession,
                 manifest: Manifest, device_id: int = 0):
        self._init, self._step = init, step
        self._device = ("cuda", device_id)
        dims = manifest.dims
        self._heads, self._head_dim = dims.heads, dims.head_dim

    def _to_device(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), *self._device)

    def init(self, inputs: Mapping[str, np.ndarray]) -> dict[str, ort.OrtValue]:
        io = self._init.io_binding()
        for name in INIT_INPUTS:
            io.bind_cpu_input(name, np.ascontiguousarray(inputs[name]))
        for name in MEMORIES:
            io.bind_output(name, *self._device)
        self._init.run_with_iobinding(io)
        return dict(zip(MEMORIES, io.get_outputs()))

    def empty_cache(self, n: int, beam: int) -> tuple[ort.OrtValue, ort.OrtValue]:
        h, dh = self._heads, self._head_dim
        return (self._to_device(np.zeros((n, beam, h, dh, 0), np.float32)),
                self._to_device(np.zeros((n, beam, h, 0, dh), np.float32)))

    def step(self, tokens: np.ndarray, parent: np.ndarray, cache, memories,
             outputs: Sequence[str]) -> tuple[dict[str, np.ndarray], Any]:
        io = self._step.io_binding()
        io.bind_cpu_input("tokens", np.ascontiguousarray(tokens))
        io.bind_cpu_input("parent", np.ascontiguousarray(parent))
        io.bind_ortvalue_input("past_key", cache[0])
        io.bind_ortvalue_input("past_value", cache[1])
        for name, value in memories.items():
            io.bind_ortvalue_input(name, value)
        for name in outputs:
            io.bind_output(name, "cpu")
        io.bind_output("present_key", *self._device)
        io.bind_output("present_value", *self._device)
        self._step.run_with_iobinding(io)
        out = io.get_outputs()
        host = {name: out[i].numpy() for i, name in enumerate(outputs)}
        return host, (out[-2], out[-1])

    def take(self, value, rows: np.ndarray):
        if isinstance(value, dict):
            return {k: self._to_device(v.numpy()[rows]) for k, v in value.items()}
        return tuple(self._to_device(v.numpy()[rows]) for v in value)
