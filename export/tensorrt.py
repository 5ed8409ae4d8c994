"""TensorRT engines through ONNX Runtime's TensorRT execution provider (`--tensorrt`).

Engines are built once at export time into `MODEL/trt_cache` (engine cache and timing
cache), one explicit min/opt/max optimisation profile per graph (`PROFILE_AXES`). The
runtime must pass the same provider options (`cognet.core.tensorrt.provider_options`, with
the profiles recorded in the manifest's `tensorrt` entry) to reuse the engines; TensorRT
rebuilds them on another GPU or TensorRT version. With `fp16` the float32 graphs are built
with TensorRT's float16 mode (`trt_fp16_enable`), not the `.fp16.onnx` variant. Untested
here (no TensorRT/GPU): written against the ORT TensorRT EP's documented provider options.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cognet.core import tensorrt
from cognet.core.decoding import MAX_LEN
from cognet.core.manifest import GRAPHS, Manifest
from cognet.core.tensorrt import CACHE_DIR
from cognet.export.errors import TensorRTUnavailable

# Symbolic axis -> (min, opt, max). T starts at 0 (first step, empty cache).
PROFILE_AXES = {
    "N": (1, 64, 512),
    "B": (1, 4, 8),
    "T": (0, 16, MAX_LEN),
    "Ld": (1, 16, 128),
    "Lp": (1, 8, 64),
    "Lm": (1, 16, 64),
    "J": (1, 4, 32),
    "S": (1, 64, 1024),
}


def require_tensorrt() -> None:
    """Raise TensorRTUnavailable unless ONNX Runtime has the TensorRT EP and a GPU is visible."""
    import onnxruntime as ort

    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        raise TensorRTUnavailable(
            "TensorRT is not available here (onnxruntime has no "
            "TensorrtExecutionProvider); nothing was exported"
        )
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise TensorRTUnavailable(
            "TensorRT needs a GPU and none is visible (libcuda.so.1 not "
            "found); nothing was exported"
        ) from None


def profile_shapes(manifest: Manifest, graph: str, variant: str | None = None) -> dict:
    """trt_profile_{min,opt,max}_shapes strings ("name:1x2x3,...") for one graph."""
    spec = manifest.graph_spec(graph, variant)
    out = {}
    for k, which in enumerate(("min", "opt", "max")):
        shapes = []
        for t in spec.inputs:
            dims = [PROFILE_AXES[d][k] if isinstance(d, str) else d for d in t.shape]
            shapes.append(f"{t.name}:{'x'.join(map(str, dims))}")
        out[f"trt_profile_{which}_shapes"] = ",".join(shapes)
    return out


def provider_options(manifest: Manifest, graph: str, fp16: bool = False) -> dict:
    """The provider options of one graph's engine (`cognet.core.tensorrt`)."""
    return tensorrt.provider_options(manifest.model_dir, fp16, profile_shapes(manifest, graph))


def build_engines(manifest: Manifest, fp16: bool = False) -> Manifest:
    """Build (and cache) one engine per graph (of every member of an ensemble: the shapes,
    hence the profiles, are the same) by running it once at the profile's opt shape."""
    import numpy as np
    import onnxruntime as ort

    (Path(manifest.model_dir or ".") / CACHE_DIR).mkdir(exist_ok=True)
    entry = {"cache_dir": CACHE_DIR, "fp16": fp16, "profiles": {}}
    for member, graph in ((m, g) for m in range(manifest.members) for g in GRAPHS):
        options = provider_options(manifest, graph, fp16)
        session = ort.InferenceSession(
            str(manifest.graph_path(graph, member=member)),
            providers=[("TensorrtExecutionProvider", options), "CUDAExecutionProvider"],
        )
        if session.get_providers()[0] != "TensorrtExecutionProvider":
            raise TensorRTUnavailable("TensorRT could not be initialised on this machine")
        feeds = {}
        for t in manifest.graph_spec(graph).inputs:
            shape = [PROFILE_AXES[d][1] if isinstance(d, str) else d for d in t.shape]
            feeds[t.name] = np.zeros(shape, np.int64 if t.dtype == "int64" else np.float32)
        session.run(None, feeds)  # builds and caches the engine
        entry["profiles"][graph] = {k: v for k, v in options.items() if "profile" in k}
    return replace(manifest, tensorrt=entry)
