"""cognet.runtime: torch-free batch scoring of visits with an exported COGNet model.

Imports numpy, pyarrow, onnxruntime and `cognet.core` only (`make lint` checks it). Entry
points: `Scorer`, configured by one `ScoreOptions` (Python API), and
`cognet-batch score` (`cognet.runtime.cli`). `DDIPolicy` and `DecodingRequest` are the
decoding values a caller may pass it.
"""

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding.request import DecodingRequest
from cognet.runtime.options import ScoreOptions
from cognet.runtime.outputs import OUTPUT_SCHEMA, REJECTS_SCHEMA, ScoredChunk
from cognet.runtime.scorer import Scorer

__all__ = [
    "OUTPUT_SCHEMA",
    "REJECTS_SCHEMA",
    "DDIPolicy",
    "DecodingRequest",
    "ScoreOptions",
    "ScoredChunk",
    "Scorer",
]
