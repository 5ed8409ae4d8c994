"""One block of the benchmark: every engine's runs at one beam width and batch size.

Every engine warms up on one untimed batch just before its first pass, then the engines
take turns, one pass over the same batches each, `repeats` times (a machine whose load
drifts slows them alike; a time budget stops the repeats of a slow engine early). Each pass
is reported as it ends. An engine hands back its memory as soon as its last pass of the
block has ended, not when the block ends: on a GPU, where each engine runs one pass, the
engines' arenas then never share the device (five engines together ran an H200 out of
memory at batch 4,096).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cognet.benchmarks import engines as eng
from cognet.benchmarks.guard import Guard
from cognet.benchmarks.machine_info import peak_rss_mb, release_memory, reset_peak_rss
from cognet.benchmarks.workload import Batch

log = logging.getLogger(__name__)
RECS = "_recs"  # a record's recommendations, until `harness.recompare`


@dataclass
class Job:
    """One engine's run inside a block: its batches and what was measured."""

    engine: eng.Engine
    batch_size: int
    batches: list[Batch]
    warmup: Batch
    # request: each batch is its own call (per-batch latency); stream: the whole run in one
    # call, which the runtime chunks, sorts and batches itself (what cognet-batch does)
    mode: str = "request"
    seconds: list[float] = field(default_factory=list)  # per repeat
    latencies: list[float] = field(default_factory=list)  # per batch, all repeats
    recs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    warmup_s: float = 0.0
    rss_before: float = 0.0
    peak_rss: float = 0.0
    exact_rss: bool = True
    gpu_mb: float | None = None
    error: str | None = None
    released: bool = False  # the engine's memory handed back (`_release_when_done`)

    def finished(self, repeats: int, max_s: float) -> bool:
        n = len(self.seconds)
        # no repeat starts that would end past the budget (the first always runs)
        return (
            self.error is not None
            or n >= repeats
            or (n > 0 and sum(self.seconds) + self.seconds[-1] > max_s)
        )

    def warm_up(self) -> None:
        started = time.perf_counter()
        self.engine.run(self.warmup)
        self.warmup_s = time.perf_counter() - started

    def one_pass(self) -> None:
        # hand back what the engine before this one freed (glibc keeps freed heap pages
        # resident), so that its memory does not count as this pass's peak
        release_memory()
        self.exact_rss = reset_peak_rss()
        outputs = []
        begin = time.perf_counter()
        for batch in self.batches:
            t0 = time.perf_counter()
            outputs.append(self.engine.run(batch))
            self.latencies.append(time.perf_counter() - t0)
        self.seconds.append(time.perf_counter() - begin)
        self.peak_rss = max(self.peak_rss, peak_rss_mb())
        self.engine.after_pass()
        if len(self.seconds) == 1:
            for batch, out in zip(self.batches, outputs, strict=True):
                self.recs.update(self.engine.recommendations(batch, out))

    def record(self, beam: int) -> dict:
        visits = sum(len(b) for b in self.batches)
        meds = sum(len(m) for m in self.recs.values())
        lat = np.asarray(self.latencies) * 1e3
        median_s = float(np.median(self.seconds))
        quantiles = {f"p{q}": float(np.percentile(lat, q)) for q in (50, 95, 99)}
        if self.mode == "stream":  # one call per pass: no per-batch latency to report
            quantiles, lat = dict.fromkeys(quantiles), lat[:0]
        return {
            "engine": self.engine.name,
            "mode": self.mode,
            "batch_size": self.batch_size,
            "beam": beam,
            "visits": visits,
            "batches": len(self.batches),
            "repeats": len(self.seconds),
            "visits_per_s": visits / median_s,
            "meds_per_s": meds / median_s,
            "meds_per_visit": meds / visits,
            "latency_ms": quantiles,
            "latency_samples": len(lat),  # batches behind the percentiles
            "seconds": [round(x, 4) for x in self.seconds],
            "warmup_s": self.warmup_s,
            "peak_rss_mb": self.peak_rss,
            "rss_before_mb": self.rss_before,
            "peak_rss_exact": self.exact_rss,
            "gpu_mem_mb": self.gpu_mb,
            "providers": self.engine.providers,
        }

    def pass_line(self, beam: int) -> str:
        """The pass just ended: engine, mode, decoding, batch size, visits/s, peak RSS."""
        n, s = sum(len(b) for b in self.batches), self.seconds[-1]
        return (
            f"  pass {len(self.seconds)}: {self.engine.name} ({self.mode}) "
            f"{eng.decoding_label(beam)} batch {self.batch_size}: {n / s:,.1f} visits/s "
            f"({n} visits in {s:.2f} s, peak RSS {self.peak_rss:,.0f} MB)"
        )


def measure_block(
    jobs: Sequence[Job],
    beam: int,
    repeats: int,
    guard: Guard,
    max_s: float = float("inf"),
    say: Callable[[str], None] | None = None,
    on_pass: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Run the jobs' passes interleaved (pass 1 of every engine, then pass 2, ...). One
    record per job that ran (a failed job has `error` set); `say` gets a line per pass as
    it ends (a run cut short still reports), `on_pass` the records so far, unchecked."""
    reference = guard.reference.name if guard.reference is not None else None
    for job in jobs:
        job.engine.prepare(beam, job.batch_size)
    if all(job.engine.name != reference for job in jobs):
        guard.ensure([b for job in jobs for b in job.batches], beam)
    while not all(job.finished(repeats, max_s) for job in jobs):
        for job in jobs:
            if job.finished(repeats, max_s):
                continue
            try:
                if not job.seconds:
                    job.rss_before = release_memory()
                    job.warm_up()
                job.one_pass()
            except Exception as exc:  # noqa: BLE001 - an engine failing is a result
                log.exception("%s failed", job.engine.name)
                job.error = f"failed: {type(exc).__name__}: {exc}"
            else:
                if job.engine.name == reference and len(job.seconds) == 1:
                    guard.add(beam, job.recs)
                if say is not None:
                    say(job.pass_line(beam))
                if on_pass is not None:
                    on_pass([j.record(beam) for j in jobs if j.seconds and j.error is None])
            _release_when_done(job.engine, jobs, repeats, max_s)
    records = []
    for job in jobs:
        if job.error is None:
            if job.engine.name != reference:
                guard.ensure(job.batches, beam)
            # compared again at the end (`recompare`), once every reference answer is known
            exact = job.engine.name not in eng.APPROXIMATE
            records.append(
                {**job.record(beam), **guard.compare(beam, job.recs, exact), RECS: job.recs}
            )
    release_memory()
    return records


def _release_when_done(engine, jobs: Sequence[Job], repeats: int, max_s: float) -> None:
    """Once every job of `engine` (its request and stream modes) has run its last pass:
    read its device memory, then hand its memory back."""
    mine = [j for j in jobs if j.engine is engine]
    if mine[0].released or not all(j.finished(repeats, max_s) for j in mine):
        return
    gpu_mb = engine.gpu_memory_mb()
    engine.release()
    for j in mine:
        j.gpu_mb, j.released = gpu_mb, True
