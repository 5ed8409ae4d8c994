"""`ScoreOptions`: how a `Scorer` decodes, on what and in what batches, in one frozen value.

Every caller configures scoring with one: `cognet-batch score` and `explain`, the Ray
workers (`--engine ray`), and the benchmarks. It is validated once, on creation, and
`cognet-batch score --summary-json` records it (`to_json`) under "options".

    Scorer("model", ScoreOptions(device="cpu", request=DecodingRequest(beam=1)))
    Scorer("model", ScoreOptions.of(device="cpu", beam=1))  # the same: fields of both as keywords

None means "the model's or the machine's default", resolved by the scorer: beam from the
manifest (4), batch_size 128 on the CPU / 512 on a GPU, batch_slots 2^12 / 2^20, threads
the cores this process may use, streams one per thread on the CPU / 1 on a GPU (more when
asked: host threads feeding the one device).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from cognet.core.ddi import DDIPolicy, DDITarget
from cognet.core.decoding import Decoding
from cognet.core.decoding.driver import COMPACT_AT
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError

DEVICES = ("auto", "cpu", "cuda", "tensorrt")
# Distinct known codes of one kind (diagnoses, procedures, medications) a visit may hold;
# above it the visit is rejected `too_many_codes`. Real visits stay far below (MIMIC-III: 39
# diagnoses at most); the batches bound the memory of any visit below it (`batches`).
MAX_CODES = 1000
CHUNK_ROWS = 1 << 15  # rows of input per chunk at most
GPU_DEVICES = ("cuda", "tensorrt")
# Where beam search / set decoding pick their candidates: "host" (numpy, after the step's
# log-probabilities are copied back), "device" (the exported search graphs, on the step's
# provider), "auto" (device on a GPU, host on the CPU: see runtime/device_selectors.py).
SELECTIONS = ("auto", "host", "device")
# The int8 graphs (`cognet.core.manifest.VARIANTS`) are for the CPU: ONNX Runtime has no CUDA
# kernels for their quantized MatMuls (DynamicQuantizeLinear, uint8 x int8 MatMulInteger)
# and runs them on the CPU, with copies both ways, inside a CUDA session (cognet.export.int8).
CPU_VARIANTS = ("int8",)


@dataclass(frozen=True)
class ScoreOptions:
    # -- decoding: the decoding and DDI policy asked on top of the model's own
    request: DecodingRequest = DecodingRequest()
    max_history_visits: int | None = None  # keep only the last K past visits; None: all
    # -- where
    device: str = "auto"  # one of DEVICES; auto = CUDA when available, else CPU
    threads: int | None = None  # CPU threads in all
    streams: int | None = None  # batches decoded in parallel, threads // streams each
    variant: str | None = None  # graphs of a manifest variant ("fp16", "int8"); None: float32
    # -- batching
    batch_size: int | None = None  # visits decoded together at most
    batch_slots: int | None = None  # cap on visits x longest history (past-medication slots)
    compact_at: float = COMPACT_AT  # drop done visits when the live share falls below this
    chunk_targets: int | None = None  # visits to score per chunk; None: 16 x batch_size
    chunk_rows: int = CHUNK_ROWS  # rows per chunk at most
    encode_batch: int | None = None  # visits per encoder call; None: 64 CPU, 4096 GPU
    # -- the input's limits and columns, and where candidates are selected (a new field goes
    # at the end: `to_json`, which summaries record, keeps the declaration order)
    max_codes_per_visit: int = MAX_CODES  # more known codes of one kind: too_many_codes
    keep_columns: tuple[str, ...] = ()  # input columns carried into the output
    selection: str = "auto"  # one of SELECTIONS: where candidates are selected

    def __post_init__(self) -> None:
        if not isinstance(self.request, DecodingRequest):
            raise InputError(f"request must be a DecodingRequest, not {self.request!r}")
        if self.device not in DEVICES:
            raise InputError(f"unknown device {self.device!r}; choose from {_names(DEVICES)}")
        check_variant_device(self.variant, self.device)
        if self.selection not in SELECTIONS:
            raise InputError(
                f"unknown selection {self.selection!r}; choose from {_names(SELECTIONS)}"
            )
        at_least_one = (
            "threads",
            "streams",
            "batch_size",
            "batch_slots",
            "chunk_targets",
        )
        for name in at_least_one:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"{name} must be >= 1, not {value}")
        if self.max_codes_per_visit < 1:
            raise InputError(f"max_codes_per_visit must be >= 1, not {self.max_codes_per_visit}")
        object.__setattr__(self, "keep_columns", tuple(self.keep_columns))
        if self.chunk_rows < 1 or (self.encode_batch is not None and self.encode_batch < 1):
            raise InputError("chunk_rows and encode_batch must be >= 1")
        if self.max_history_visits is not None and self.max_history_visits < 0:
            raise InputError(f"max_history_visits must be >= 0, not {self.max_history_visits}")
        if not 0.0 < self.compact_at <= 1.0:
            raise InputError(f"compact_at must be in (0, 1], not {self.compact_at}")

    @classmethod
    def of(cls, **fields_: object) -> ScoreOptions:
        """Options from keywords naming fields of ScoreOptions or of its `DecodingRequest`
        (`ScoreOptions.of(device="cpu", beam=1)`); a bad value is an InputError."""
        return cls().with_fields(**fields_)

    def with_fields(self, **changes: object) -> ScoreOptions:
        """These options with fields of ScoreOptions or of its request changed."""
        asked = {k: changes.pop(k) for k in REQUEST_FIELDS & changes.keys()}
        request = changes.pop("request", self.request)
        if asked:
            try:
                request = replace(request, **asked)
            except ValueError as exc:
                raise InputError(str(exc)) from None
        return replace(self, request=request, **changes)

    def resolve(
        self, default: Decoding, target: DDITarget | None = None
    ) -> tuple[Decoding, DDIPolicy]:
        """The decoding and the DDI policy to run on a model whose own are `default` and
        `target` (`DecodingRequest.resolve`); InputError when the request does not apply."""
        try:
            return self.request.resolve(default, target)
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def plan(
        self,
        default: Decoding,
        target: DDITarget | None = None,
        *,
        end: int,
        selection: str = "host",
        attention: bool = False,
        ddi_adj: np.ndarray | None = None,
    ) -> DecodingPlan:
        """The decoding plan of these options on a model whose own decoding and DDI target
        are `default` and `target` (`DecodingPlan.of`, with `compact_at`; `selection`: host
        or device, as the model resolved `--selection`); InputError when the request does
        not apply."""
        try:
            return DecodingPlan.of(
                self.request,
                default,
                target,
                end=end,
                compact_at=self.compact_at,
                selection=selection,
                attention=attention,
                ddi_adj=ddi_adj,
            )
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def to_json(self) -> dict:
        """The fields, the request's spelled out among them (in the order that run summaries
        and resume signatures have always recorded)."""
        asked = self.request.to_json()
        out = {k: asked[k] for k in ("decoding", "beam", "samples", "threshold", "ddi")}
        out.update((k, v) for k, v in asdict(self).items() if k != "request")
        out.update(estimator=asked["estimator"], set_rule=asked["set_rule"])
        return out


REQUEST_FIELDS = {f.name for f in fields(DecodingRequest)}


def check_variant_device(variant: str | None, device: str) -> None:
    """InputError for a CPU-only variant (CPU_VARIANTS) asked on a GPU device; with --device
    auto such a variant runs on the CPU (`cognet.runtime.session.OrtModel`)."""
    if variant in CPU_VARIANTS and device in GPU_DEVICES:
        raise InputError(
            f"the {variant} graphs run on the CPU only (ONNX Runtime's GPU providers have no "
            f"kernels for their quantized MatMuls); use --device cpu, or drop --variant {variant}"
        )


def _names(choices: tuple[str, ...]) -> str:
    return ", ".join(choices)
