"""What a `cognet-bench` run measures (`Settings`) and what it is given (`Context`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cognet.benchmarks import engines as eng
from cognet.benchmarks.workload import Pool
from cognet.core.decoding import BEAM

RUNTIME_BATCH = 0  # in Settings.latency_sizes: the runtime's default batch size


@dataclass(frozen=True)
class Settings:
    batch_sizes: tuple[int, ...] = (1, 16, 256, 4096)
    # beam widths; eng.SET (0, `--beams ...,set`) stands for the model's set decoding and
    # eng.MARGINAL (-1, `--beams ...,marginal`) for its marginal decoding (the set head)
    beams: tuple[int, ...] = (1, 4)
    repeats: int = 3
    engines: tuple[str, ...] = eng.ENGINES
    threads: int = 1  # intra-op threads of every engine (torch and ONNX Runtime alike)
    visits: int = 256  # visits per run (at least one full batch)
    warmup_visits: int = 64  # size of the untimed warm-up batch (at most the batch size)
    perpatient_visits: int = 64  # visits decoded by torch-perpatient, one patient at a time
    past_visits: tuple[int, ...] = (0, 1, 4, 16)
    past_visits_n: int = 128  # visits per point of the past-visits series (one batch)
    series_batch_size: int = 256  # the cognet-batch default
    series_beam: int = BEAM
    # the engine every other one is checked against: torch-batched on a CPU; on a GPU,
    # torch-cuda, since torch-batched is too slow for batches of 16k+ visits; None: no check
    reference: str | None = "torch-batched"
    input_sizes: tuple[int, ...] = (10_000, 50_000)  # rows per cognet-batch score run
    # Time budget of one run (so that `make bench` fits in 10 minutes on 2 cores): no repeat
    # starts that would end past it (the first always runs), and an engine skips a larger
    # batch size whose one pass is estimated to take longer: at the rate of its previous
    # batch size, slowed down again by the factor its rate fell by at the last step.
    max_run_s: float = 45.0
    profile: bool = True  # profile ort-cpu at beam 4 and its best batch size
    # visits per request of the latency series (`benchmarks.latency`); RUNTIME_BATCH: the
    # runtime's default batch size; () skips it
    latency_sizes: tuple[int, ...] = (1, 16, 128, 1024, RUNTIME_BATCH)

    def __post_init__(self) -> None:
        if min(self.batch_sizes, default=1) < 1 or min(self.beams, default=0) < eng.MARGINAL:
            raise ValueError("batch sizes and beams must be >= 1")
        if min(self.latency_sizes, default=0) < 0:
            raise ValueError("latency sizes must be >= 1")
        if self.repeats < 1 or self.threads < 1 or self.visits < 1:
            raise ValueError("repeats, threads and visits must be >= 1")
        unknown = [e for e in self.engines if e not in eng.ENGINES]
        if unknown:
            raise ValueError(f"unknown engines {unknown}; choose from {', '.join(eng.ENGINES)}")

    @property
    def pool_size(self) -> int:
        return max(*self.batch_sizes, self.visits, self.perpatient_visits, *self.latency_sizes)


@dataclass
class Context:
    model_dir: Path
    checkpoint: Path | None
    pool: Pool
    workdir: Path  # scratch space for the input-size series
    notes: list[str] = field(default_factory=list)
