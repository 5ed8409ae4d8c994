"""`ScoreOptions`: how a `Scorer` decodes, on what and in what batches, in one frozen value.

Every caller configures scoring with one: `cognet-batch score` and `explain`, the Ray
workers (`--engine ray`), and the benchmarks. It is validated once, on creation, and
`cognet-batch score --summary-json` records it (`to_json`) under "options".

    Scorer("model", ScoreOptions(device="cpu", beam=1))
    Scorer("model", device="cpu", beam=1)  # the same: fields of ScoreOptions as keywords

None means "the model's or the machine's default", resolved by the scorer: beam from the
manifest (4), batch_size 128 on the CPU / 512 on a GPU, batch_slots 2^12 / 2^20, threads
the cores this process may use, streams one per thread on the CPU / 1 on a GPU (more when
asked: host threads feeding the one device).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cognet.core.ddi import DDIPolicy, DDITarget, with_target
from cognet.core.decoding import (
    DECODINGS,
    ESTIMATORS,
    SET_RULES,
    Decoding,
    asked_decoding,
    asked_rule,
)
from cognet.core.errors import InputError

DEVICES = ("auto", "cpu", "cuda", "tensorrt")
# Distinct known codes of one kind (diagnoses, procedures, medications) a visit may hold;
# above it the visit is rejected `too_many_codes`. Real visits stay far below (MIMIC-III: 39
# diagnoses at most); the batches bound the memory of any visit below it (`batches`).
MAX_CODES = 1000
GPU_DEVICES = ("cuda", "tensorrt")
# Where beam search / set decoding pick their candidates: "host" (numpy, after the step's
# log-probabilities are copied back), "device" (the exported search graphs, on the step's
# provider), "auto" (device on a GPU, host on the CPU: see runtime/search.py).
SELECTIONS = ("auto", "host", "device")


@dataclass(frozen=True)
class ScoreOptions:
    # -- decoding
    decoding: str | None = None  # one of cognet.core.decoding.DECODINGS; None: the model's
    beam: int | None = None  # beam width (1 = greedy); None: the model's
    samples: int | None = None  # set decoding: samples per visit; None: the model's
    threshold: float | None = None  # set decoding: on P(k in set); None: the model's
    # DDI-aware decoding over the model's DDI pairs; None: the model's (its DDI target, if it
    # has one, else off: `cognet.core.ddi.with_target`)
    ddi: DDIPolicy | None = None
    max_history_visits: int | None = None  # keep only the last K past visits; None: all
    # -- where
    device: str = "auto"  # one of DEVICES; auto = CUDA when available, else CPU
    threads: int | None = None  # CPU threads in all
    streams: int | None = None  # batches decoded in parallel, threads // streams each
    variant: str | None = None  # graphs of a manifest variant ("fp16"); None: float32
    # -- batching
    batch_size: int | None = None  # visits decoded together at most
    batch_slots: int | None = None  # cap on visits x longest history (past-medication slots)
    compact_at: float = 0.75  # drop done visits when the live share falls below this
    chunk_targets: int | None = None  # visits to score per chunk; None: 16 x batch_size
    chunk_rows: int = 1 << 15  # rows per chunk at most
    encode_batch: int | None = None  # visits per encoder call; None: 64 CPU, 4096 GPU
    # -- the input's limits and columns, and where candidates are selected (a new field goes
    # at the end: `to_json`, which summaries record, keeps the declaration order)
    max_codes_per_visit: int = MAX_CODES  # more known codes of one kind: too_many_codes
    keep_columns: tuple[str, ...] = ()  # input columns carried into the output
    selection: str = "auto"  # one of SELECTIONS: where candidates are selected
    estimator: str | None = None  # set decoding: "plain" or "stratified"; None: the model's
    set_rule: str | None = None  # set decoding: one of SET_RULES; None: the model's

    def __post_init__(self) -> None:
        if self.decoding is not None and self.decoding not in DECODINGS:
            raise InputError(f"unknown decoding {self.decoding!r}; choose from {_names(DECODINGS)}")
        if self.device not in DEVICES:
            raise InputError(f"unknown device {self.device!r}; choose from {_names(DEVICES)}")
        if self.selection not in SELECTIONS:
            raise InputError(
                f"unknown selection {self.selection!r}; choose from {_names(SELECTIONS)}"
            )
        if self.ddi is not None and not isinstance(self.ddi, DDIPolicy):
            raise InputError(f"ddi must be a cognet.core.ddi.DDIPolicy, not {self.ddi!r}")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise InputError(f"threshold must be in (0, 1], not {self.threshold}")
        if self.estimator is not None and self.estimator not in ESTIMATORS:
            raise InputError(
                f"unknown estimator {self.estimator!r}; choose from {_names(ESTIMATORS)}"
            )
        if self.set_rule is not None and self.set_rule not in SET_RULES:
            raise InputError(f"unknown set rule {self.set_rule!r}; choose from {_names(SET_RULES)}")
        at_least_one = (
            "beam",
            "samples",
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
        try:  # beam together with samples or threshold is refused (one rule, core.decoding)
            asked_decoding(self.decoding, self.beam, self.samples, self.threshold)
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def resolve_decoding(self, default: Decoding) -> Decoding:
        """The decoding these options ask for, on top of the model's `default`."""
        name = asked_decoding(self.decoding, self.beam, self.samples, self.threshold)
        try:
            return default.with_changes(
                name=name,
                beam=self.beam,
                samples=self.samples,
                threshold=self.threshold,
                estimator=self.estimator,
                rule=asked_rule(self.set_rule, self.threshold),
            )
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def resolve(
        self, default: Decoding, target: DDITarget | None = None
    ) -> tuple[Decoding, DDIPolicy]:
        """The decoding and the DDI policy to run on a model whose own are `default` and
        `target` (its DDI target: used when these options ask for no policy)."""
        return with_target(self.ddi, target, default, self.resolve_decoding)

    def to_json(self) -> dict:
        return {**asdict(self), "ddi": None if self.ddi is None else self.ddi.to_json()}


def _names(choices: tuple[str, ...]) -> str:
    return ", ".join(choices)
