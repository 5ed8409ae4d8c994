"""Float32 -> int8 graphs for the CPU: onnxruntime's dynamic quantization of MatMul weights.

Every MatMul whose weight (input B) is a constant initializer gets symmetric int8 weights,
one scale per tensor (`onnxruntime.quantization.quantize_dynamic`, QInt8); at run time its
float32 input is quantized to uint8 per call (DynamicQuantizeLinear) and the product runs as
a MatMulInteger, scaled back to float32. The products of two activations (attention over
the cache and the memories) stay float32, as do the embeddings, layer norms, softmaxes and
the copy distribution; the graph's inputs and outputs keep the float32 graph's names and
types, so the runtime feeds the int8 graphs as it feeds the float32 ones.

Choices, each measured as the share of beam-4 lists equal to torch's on a checkpoint of the
default model (BENCHMARKS.md "What was tried"):
- 7-bit weights (`reduce_range`): with 8-bit ones the uint8 x int8 products saturate on AVX2
  CPUs without VNNI (pairs of products summed in int16), and far fewer lists equal torch's.
  Per-channel scales did not help. Portable: the graph is written once, run anywhere.
- The step's output heads (`FLOAT32_MODULES`) stay float32: more lists equal. No choice of
  graphs (even the encoder and decoder_init alone) reaches the 99% of the float16 graphs;
  int8 is an opt-in variant, its agreement measured.
- All three graphs are quantized: each is faster per call.
The output is byte-identical for the same float32 graph (tests/test_int8.py).

CPU only: ONNX Runtime's CUDA provider has no kernels for DynamicQuantizeLinear and this
MatMulInteger (uint8 x int8), so it would run them on the CPU with copies both ways
(microsoft/onnxruntime#7745); the runtime refuses the variant on a GPU. Their operators are
outside `onnx_ops_allowlist.txt` (TensorRT's), which covers the float32 and float16 graphs.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

# The only operator type quantized: the graphs as torch exports them hold no Gemm (torch's
# Linear on 3-D inputs exports as MatMul + Add; the float32 files get their Gemms after the
# variants are written, `linear_fusion`), and dynamic quantization has no integer Gemm.
QUANTIZED_OPS = ("MatMul",)
# Modules of `cognet.model.network.COGNet` whose MatMuls stay float32: the step's heads
# (generation logits, copy query, gate), found by the exporter's node names ("/gen_head/...").
FLOAT32_MODULES = ("gen_head", "copy_query", "gate_head")


def quantize(src: Path, dst: Path) -> None:
    """Write the int8 graph of the float32 graph file `src` to `dst`."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet_quantizer():
        quantize_dynamic(
            src,
            dst,
            op_types_to_quantize=list(QUANTIZED_OPS),
            per_channel=False,
            reduce_range=True,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=kept_float32(onnx.load(str(src)).graph),
            extra_options={"MatMulConstBOnly": True},  # weights only: never two activations
        )


def kept_float32(graph) -> list[str]:
    """Names of the nodes of an ONNX graph that `quantize` leaves in float32."""
    return [
        node.name
        for node in graph.node
        if node.op_type in QUANTIZED_OPS
        and node.name.split("/")[1:2] in ([m] for m in FLOAT32_MODULES)
    ]


class _NoPreprocessAdvice(logging.Filter):
    """quantize_dynamic advises, through the root logger, a pre-processing step (shape
    inference and ORT's optimisations, saved into the graph) that the runtime's session
    does itself when it loads the graph."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


@contextmanager
def _quiet_quantizer():
    root, advice = logging.getLogger(), _NoPreprocessAdvice()
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)
