"""TensorRT execution-provider options (torch-free): the exporter builds engines with them
(`cognet.export.tensorrt`) and the runtime must pass the same ones to reuse the engines
(`cognet.runtime.session`).

Engines and timing caches live in `MODEL/<cache_dir>` (CACHE_DIR at export, recorded in the
manifest's `tensorrt` entry with each graph's min/opt/max shape profile).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

CACHE_DIR = "trt_cache"


def provider_options(
    model_dir: str | Path | None,
    fp16: bool,
    profile: Mapping[str, str],
    cache_dir: str = CACHE_DIR,
) -> dict[str, str]:
    """The TensorrtExecutionProvider options of one graph: engine and timing caches in
    model_dir/cache_dir, float16 mode, and the graph's `trt_profile_*_shapes` (`profile`)."""
    cache = str(Path(model_dir or ".") / cache_dir)
    return {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": cache,
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": cache,
        "trt_fp16_enable": str(bool(fp16)),
        **profile,
    }
