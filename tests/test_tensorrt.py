"""TensorRT provider options: the runtime passes the exporter's (no TensorRT needed here)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cognet.core.manifest import GRAPHS, load_manifest
from cognet.core.tensorrt import CACHE_DIR
from cognet.export.tensorrt import profile_shapes, provider_options
from cognet.runtime.session import TRT, providers


@pytest.mark.parametrize("fp16", [False, True])
def test_runtime_reuses_the_engines_with_the_exporters_options(tiny, fp16):
    manifest = load_manifest(tiny / "model")
    # what `build_engines` records in the manifest
    entry = {
        "cache_dir": CACHE_DIR,
        "fp16": fp16,
        "profiles": {g: profile_shapes(manifest, g) for g in GRAPHS},
    }
    manifest = replace(manifest, tensorrt=entry)
    for graph in GRAPHS:
        (name, options), *fallbacks = providers("tensorrt", manifest, graph)
        assert name == TRT
        assert options == {"device_id": 0, **provider_options(manifest, graph, fp16)}
        assert options["trt_engine_cache_path"] == str(tiny / "model" / CACHE_DIR)
        assert [f if isinstance(f, str) else f[0] for f in fallbacks] == [
            "CUDAExecutionProvider",
            "CPUExecutionProvider",
        ]
