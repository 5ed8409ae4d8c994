"""cognet.export: a trained checkpoint -> a model directory the torch-free runtime serves.

`export(checkpoint, out)` writes `encoder.onnx`, `decoder_init.onnx`, `decoder_step.onnx`,
the encoder cut by kind of code (`encoder_diag.onnx`, `encoder_proc.onnx`,
`encoder_med.onnx`; `PART_FILES`), plus `*.fp16.onnx` with `ExportOptions(fp16=True)`,
`*.int8.onnx` with `int8=True`, and `manifest.json`
(`cognet.core.manifest`), after checking the graphs (`onnx.checker`, symbolic input axes)
and, unless `validate=False`, their parity with the torch model (`cognet.export.validate`).

Modules: `pipeline` (the steps, in order), `onnx_export` (one graph, exporter choice and
fix-ups), `graphs` (the torch wrappers and tensor specs of each graph), `fp16`, `int8`,
`validate`, `tensorrt`, `cli` (`cognet-export`). torch and onnx are imported where they are
used.
"""

import importlib

from cognet.export.errors import ExportError, TensorRTUnavailable

# Imported on first use, so that `cognet-export --help` (and the error naming the extra to
# install) works on a runtime-only install, which has neither torch nor onnx.
_LAZY = {
    "OPSET": "onnx_export",
    "cache_tensors": "onnx_export",
    "export": "pipeline",
    "ExportOptions": "pipeline",
    "FP16_FILES": "pipeline",
    "GRAPH_FILES": "pipeline",
    "INT8_FILES": "pipeline",
    "PART_FILES": "pipeline",
}

__all__ = [
    "export",
    "ExportOptions",
    "ExportError",
    "TensorRTUnavailable",
    "OPSET",
    "GRAPH_FILES",
    "FP16_FILES",
    "INT8_FILES",
    "PART_FILES",
    "cache_tensors",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
