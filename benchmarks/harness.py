"""The measurement loop: every engine on the same batches, timed, guarded, summarised.

For each beam width and batch size, a block: every engine warms up on one untimed batch,
then the engines take turns, one pass over the same batches each, `repeats` times (so that
a machine whose load drifts slows them alike; a time budget stops the repeats of a slow
engine early and skips a larger batch size whose pass would take too long). Reported per
run: the median over repeats of visits/s and generated medications/s, per-batch latency
percentiles over all repeats, the peak RSS of the process during the engine's passes
(Linux: VmHWM, reset before each pass) and the GPU memory where relevant, and whether every
recommendation equals torch-batched's (`matches_reference`).

The slow `torch-perpatient` engine runs once per beam width on a small subset of the
visits, one patient per batch. Scaling series: throughput against the number of past
visits, and end to end through `cognet-batch score` against the input size (a subprocess
per point: its wall time, from process start to the output file, and its own peak RSS).
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from cognet.benchmarks import engines as eng
from cognet.benchmarks.workload import Batch, Pool, repeat_patients, with_history

from cognet.core.decoding import BEAM

log = logging.getLogger(__name__)

REFERENCE = "torch-batched"
PERPATIENT = "torch-perpatient"
SERIES_ENGINES = ("torch-batched", "ort-cpu", "ort-cuda", "ort-tensorrt", "torch-cuda")


@dataclass(frozen=True)
class Settings:
    batch_sizes: tuple[int, ...] = (1, 16, 256, 4096)
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
    input_sizes: tuple[int, ...] = (10_000, 50_000)  # rows per cognet-batch score run
    # Time budget of one run (so that `make bench` fits in 10 minutes on 2 cores): no repeat
    # starts that would end past it (the first always runs), and an engine skips a larger
    # batch size whose one pass is estimated to take longer: at the rate of its previous
    # batch size, slowed down again by the factor its rate fell by at the last step.
    max_run_s: float = 45.0
    profile: bool = True  # profile ort-cpu at beam 4 and its best batch size

    def __post_init__(self) -> None:
        if min(self.batch_sizes, default=0) < 1 or min(self.beams, default=0) < 1:
            raise ValueError("batch sizes and beams must be >= 1")
        if self.repeats < 1 or self.threads < 1 or self.visits < 1:
            raise ValueError("repeats, threads and visits must be >= 1")
        unknown = [e for e in self.engines if e not in eng.ENGINES]
        if unknown:
            raise ValueError(f"unknown engines {unknown}; choose from {', '.join(eng.ENGINES)}")

    @property
    def pool_size(self) -> int:
        return max(max(self.batch_sizes), self.visits, self.perpatient_visits)


# -- memory ----------------------------------------------------------------------------------
def release_memory() -> float:
    """Collect garbage and hand freed heap pages back to the OS (glibc), so that what an
    earlier run freed does not count in the next run's RSS; returns the RSS in MB after."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _status_mb("VmRSS:") or 0.0


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the process' peak RSS (Linux VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    peak = _status_mb("VmHWM:")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the correctness guard -----------------------------------------------------------------------
class Guard:
    """Recommendations of torch-batched per (beam, visit_id); every run is compared to them."""

    def __init__(self, reference: eng.Engine | None):
        self.reference = reference
        self.recs: dict[tuple[int, str], tuple[str, ...]] = {}

    def ensure(self, batches: Sequence[Batch], beam: int, chunk: int = 32) -> None:
        """Decode (untimed, `chunk` patients at a time: torch-batched's fastest) the visits
        of `batches` that have no reference yet."""
        if self.reference is None:
            return
        todo = [p for b in batches for p in b.patients if (beam, p[-1].visit_id) not in self.recs]
        self.reference.prepare(beam, chunk)
        for lo in range(0, len(todo), chunk):
            part = todo[lo : lo + chunk]
            batch = Batch(None, part, [p[-1].visit_id for p in part])  # torch needs no table
            self.add(beam, self.reference.recommendations(batch, self.reference.run(batch)))

    def add(self, beam: int, recs: dict[str, tuple[str, ...]]) -> None:
        for vid, meds in recs.items():
            self.recs.setdefault((beam, vid), meds)

    def compare(self, beam: int, recs: dict[str, tuple[str, ...]]) -> dict:
        if self.reference is None:
            return {"matches_reference": None, "compared": 0, "mismatches": 0, "examples": []}
        compared, examples, bad = 0, [], 0
        for vid, meds in recs.items():
            ref = self.recs.get((beam, vid))
            if ref is None:
                continue
            compared += 1
            if ref != meds:
                bad += 1
                if len(examples) < 3:
                    examples.append({"visit_id": vid, "reference": list(ref), "got": list(meds)})
        return {
            "matches_reference": bad == 0 and compared == len(recs),
            "compared": compared,
            "mismatches": bad,
            "examples": examples,
        }


# -- one block of runs -------------------------------------------------------------------------
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
        self.exact_rss = reset_peak_rss()
        outputs = []
        begin = time.perf_counter()
        for batch in self.batches:
            t0 = time.perf_counter()
            outputs.append(self.engine.run(batch))
            self.latencies.append(time.perf_counter() - t0)
        self.seconds.append(time.perf_counter() - begin)
        self.peak_rss = max(self.peak_rss, peak_rss_mb())
        if len(self.seconds) == 1:
            for batch, out in zip(self.batches, outputs, strict=True):
                self.recs.update(self.engine.recommendations(batch, out))

    def record(self, beam: int) -> dict:
        visits = sum(len(b) for b in self.batches)
        meds = sum(len(m) for m in self.recs.values())
        lat = np.asarray(self.latencies) * 1e3
        median_s = float(np.median(self.seconds))
        quantiles = {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99)}
        if self.mode == "stream":  # one call per pass: no per-batch latency to report
            quantiles = dict.fromkeys(quantiles)
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
            "seconds": [round(x, 4) for x in self.seconds],
            "warmup_s": self.warmup_s,
            "peak_rss_mb": self.peak_rss,
            "rss_before_mb": self.rss_before,
            "peak_rss_exact": self.exact_rss,
            "gpu_mem_mb": self.gpu_mb,
            "providers": self.engine.providers,
        }


def measure_block(
    jobs: Sequence[Job], beam: int, repeats: int, guard: Guard, max_s: float = float("inf")
) -> list[dict]:
    """Run the jobs' passes interleaved (pass 1 of every engine, then pass 2, ...), so that
    a machine whose load changes over time slows every engine alike; returns one record per
    job that ran (a failed job has `error` set and no record)."""
    for job in jobs:
        job.engine.prepare(beam, job.batch_size)
    if all(job.engine.name != REFERENCE for job in jobs):
        guard.ensure([b for job in jobs for b in job.batches], beam)
    for job in jobs:
        job.rss_before = release_memory()
        try:
            job.warm_up()
        except Exception as exc:  # noqa: BLE001 - an engine failing is a result
            log.exception("%s failed", job.engine.name)
            job.error = f"failed: {type(exc).__name__}: {exc}"
    while not all(job.finished(repeats, max_s) for job in jobs):
        for job in jobs:
            if job.finished(repeats, max_s):
                continue
            try:
                job.one_pass()
            except Exception as exc:  # noqa: BLE001
                log.exception("%s failed", job.engine.name)
                job.error = f"failed: {type(exc).__name__}: {exc}"
                continue
            if job.engine.name == REFERENCE and len(job.seconds) == 1:
                guard.add(beam, job.recs)
    records = []
    for job in jobs:
        job.gpu_mb = job.engine.gpu_memory_mb()
        job.engine.release()
        if job.error is None:
            if job.engine.name != REFERENCE:
                guard.ensure(job.batches, beam)
            records.append({**job.record(beam), **guard.compare(beam, job.recs)})
    release_memory()
    return records


# -- the whole benchmark ---------------------------------------------------------------------------
@dataclass
class Context:
    model_dir: Path
    checkpoint: Path | None
    pool: Pool
    workdir: Path  # scratch space for the input-size series
    notes: list[str] = field(default_factory=list)


def run_all(ctx: Context, settings: Settings, say: Callable[[str], None] = print) -> dict:
    """Every measurement of `settings`; returns the results.json object."""
    machine = machine_info(settings.threads)
    loaded, skipped = load_engines(ctx, settings, say)
    reference = loaded.get(REFERENCE)
    if reference is None and eng.availability(REFERENCE, ctx.checkpoint) is None:
        reference = eng.load(REFERENCE, ctx.model_dir, ctx.checkpoint, settings.threads)
    guard = Guard(reference)
    runs, over_budget = [], []
    for beam in settings.beams:
        rates: dict[str, tuple[float, float]] = {}  # visits/s at the last batch size, its fall
        for i, bs in enumerate(settings.batch_sizes):
            jobs = []
            for name, engine in loaded.items():
                if name == PERPATIENT:  # once per beam, one patient per batch
                    if i:
                        continue
                    size, visits = 1, settings.perpatient_visits
                else:
                    size, visits = bs, max(bs, settings.visits)
                warmup = ctx.pool.batch(0, min(size, settings.warmup_visits, len(ctx.pool)))
                modes = ["request"]
                if name in eng.ORT_DEVICES and visits > size:
                    modes.append("stream")
                for mode in modes:
                    rate, drop = rates.get(f"{name}/{mode}", (0.0, 1.0))
                    estimate = visits / rate * drop if rate else 0.0
                    if estimate > settings.max_run_s:
                        reason = (
                            f"one pass estimated at {estimate:.0f}s > "
                            f"{settings.max_run_s:g}s budget"
                        )
                        over_budget.append(
                            {
                                "engine": name,
                                "mode": mode,
                                "beam": beam,
                                "batch_size": size,
                                "reason": reason,
                            }
                        )
                        say(
                            f"{_label(name, mode):<24} beam {beam} batch {size:>5}: skipped, "
                            f"{reason}"
                        )
                        continue
                    batches = (
                        ctx.pool.batches(size, visits)
                        if mode == "request"
                        else [ctx.pool.take(np.arange(visits))]
                    )  # in file order
                    jobs.append(Job(engine, size, batches, warmup, mode))
            for run in measure_block(jobs, beam, settings.repeats, guard, settings.max_run_s):
                run["threads"] = settings.threads
                runs.append(run)
                key = f"{run['engine']}/{run['mode']}"
                rate = rates.get(key, (0.0, 1.0))[0]
                rates[key] = (
                    run["visits_per_s"],
                    max(1.0, rate / run["visits_per_s"]) if rate else 1.0,
                )
                say(_run_line(run))
            for job in jobs:
                if job.error:
                    skipped[job.engine.name] = job.error
                    loaded.pop(job.engine.name, None)
    series = {
        "past_visits": past_visits_series(ctx, settings, loaded, guard, say),
        "input_size": input_size_series(ctx, settings, say),
    }
    profile = profile_best(ctx, settings, runs, say) if settings.profile else None
    machine["load_average_end"] = _loadavg()
    return {
        "machine": machine,
        "settings": {
            **asdict(settings),
            "model": str(ctx.model_dir),
            "checkpoint": str(ctx.checkpoint) if ctx.checkpoint else None,
        },
        "workload": workload_info(ctx.pool),
        "engines": {
            **{
                n: {"status": "ok", "load_s": e.load_s, "providers": e.providers}
                for n, e in loaded.items()
            },
            **{n: {"status": "skipped", "reason": r} for n, r in skipped.items()},
        },
        "runs": runs,
        "runs_over_budget": over_budget,
        "series": series,
        "profile": profile,
        "notes": ctx.notes,
    }


def profile_best(ctx: Context, settings: Settings, runs: list[dict], say) -> dict | None:
    """Profile ort-cpu at the widest beam measured and its best batch size (and mode)."""
    mine = [r for r in runs if r["engine"] == "ort-cpu"]
    if not mine:
        return None
    beam = max(r["beam"] for r in mine)
    best = max((r for r in mine if r["beam"] == beam), key=lambda r: r["visits_per_s"])
    bs, visits = best["batch_size"], max(best["batch_size"], settings.visits)
    batches = (
        ctx.pool.batches(bs, visits)
        if best["mode"] == "request"
        else [ctx.pool.take(np.arange(visits))]
    )
    from cognet.benchmarks.profile import profile_ort

    out = profile_ort(ctx.model_dir, batches, beam, bs, settings.threads)
    out["mode"] = best["mode"]
    graphs = ", ".join(f"{g} {v['share']:.0%}" for g, v in out["graphs"].items())
    say(
        f"profile {_label('ort-cpu', best['mode'])} beam {beam} batch {bs}: {graphs}, "
        f"Python {out['python_share']:.0%}"
    )
    return out


def load_engines(ctx: Context, settings: Settings, say) -> tuple[dict, dict]:
    """Loaded engines (torch-batched first) and {name: reason} for the skipped ones."""
    order = sorted(settings.engines, key=lambda n: n != REFERENCE)
    loaded, skipped = {}, {}
    for name in order:
        reason = eng.availability(name, ctx.checkpoint)
        if reason is None:
            try:
                loaded[name] = eng.load(name, ctx.model_dir, ctx.checkpoint, settings.threads)
                say(
                    f"loaded {name} in {loaded[name].load_s:.2f}s "
                    f"({', '.join(loaded[name].providers)})"
                )
                continue
            except Exception as exc:  # noqa: BLE001
                reason = f"failed to load: {type(exc).__name__}: {exc}"
        skipped[name] = reason
        say(f"skipped {name}: {reason}")
    return loaded, skipped


def past_visits_series(
    ctx: Context, settings: Settings, loaded: dict, guard: Guard, say
) -> list[dict]:
    """Throughput against the number of past visits of each scored visit."""
    out = []
    engines = [loaded[n] for n in SERIES_ENGINES if n in loaded]
    bs, beam = min(settings.series_batch_size, settings.past_visits_n), settings.series_beam
    for past in settings.past_visits:
        table = with_history(ctx.pool.source, past, settings.past_visits_n)
        pool = Pool(table, ctx.pool.vocab)
        warmup = pool.batch(0, min(bs, settings.warmup_visits, len(pool)))
        jobs = [Job(e, bs, pool.batches(bs, settings.past_visits_n), warmup) for e in engines]
        for run in measure_block(jobs, beam, settings.repeats, guard, settings.max_run_s):
            run["past_visits"] = past
            out.append(run)
            say(f"past visits {past:>2}: " + _run_line(run))
    return out


def input_size_series(ctx: Context, settings: Settings, say) -> list[dict]:
    """`cognet-batch score` end to end (a subprocess) on inputs of growing row counts."""
    out = []
    for rows in settings.input_sizes:
        path = ctx.workdir / f"input_{rows}.parquet"
        n_scored = write_input(ctx.pool, rows, path)
        with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
            cmd = [
                sys.executable,
                "-c",
                _CHILD,
                "score",
                str(path),
                "--model",
                str(ctx.model_dir),
                "--out",
                f"{tmp}/recs.parquet",
                "--beam",
                str(settings.series_beam),
                "--batch-size",
                str(settings.series_batch_size),
                "--device",
                "cpu",
                "--threads",
                str(settings.threads),
                "--quiet",
                "--summary-json",
                f"{tmp}/summary.json",
            ]
            seconds, rss_mb, rc, err = run_child(cmd)
            summary = json.loads(Path(f"{tmp}/summary.json").read_text()) if rc == 0 else {}
        path.unlink(missing_ok=True)
        point = {
            "engine": "cognet-batch score (ort-cpu)",
            "rows": rows,
            "visits_scored": summary.get("rows_scored", n_scored),
            "returncode": rc,
            "seconds": seconds,
            "rows_per_s": rows / seconds,
            "visits_per_s": summary.get("rows_scored", 0) / seconds,
            "scoring_visits_per_s": summary.get("visits_per_s"),
            "peak_rss_mb": rss_mb,
            "batch_size": settings.series_batch_size,
            "beam": settings.series_beam,
        }
        if rc != 0:
            point["error"] = err.strip().splitlines()[-1] if err.strip() else f"exit {rc}"
        out.append(point)
        say(
            f"cognet-batch score {rows:>8} rows: {seconds:7.1f}s, "
            f"{point['visits_per_s']:8.1f} scored visits/s, peak RSS {_num(rss_mb)} MB"
            + (f" FAILED ({point['error']})" if rc else "")
        )
    return out


def write_input(pool: Pool, rows: int, path: Path) -> int:
    """A visits file of `rows` rows: the pool's patients repeated under new ids; returns the
    number of visits to score (last visits of the patients whose rows are all in)."""
    table = pool.table
    table = repeat_patients(table, -(-rows // len(table))).slice(0, rows)
    pq.write_table(table, path)
    return int(table["medications"].null_count)


# `cognet-batch` in a child that writes its own peak RSS (VmHWM) at exit: the rusage of a
# child is no good here, Linux carries the parent's peak into it across fork + exec.
_CHILD = """\
import atexit, os, sys
def _peak():
    with open('/proc/self/status') as f, open(os.environ['COGNET_BENCH_PEAK'], 'w') as o:
        o.write(next(x for x in f if x.startswith('VmHWM:')).split()[1])
atexit.register(_peak)
sys.argv[0] = 'cognet-batch'
from cognet.runtime.cli import main
main()
"""


def run_child(cmd: list[str]) -> tuple[float, float | None, int, str]:
    """(wall seconds, peak RSS MB or None, return code, stderr) of a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak"
        env = {**os.environ, "COGNET_BENCH_PEAK": str(peak)}
        started = time.perf_counter()
        proc = subprocess.run(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False
        )
        seconds = time.perf_counter() - started
        rss = int(peak.read_text()) / 1024 if peak.is_file() else None
    return seconds, rss, proc.returncode, proc.stderr.decode(errors="replace")


# -- descriptions ----------------------------------------------------------------------------------
def machine_info(threads: int) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
            cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cores = os.cpu_count()
    info = {
        "cpu": cpu,
        "cores": cores,
        "threads": threads,
        "memory_gb": _memory_gb(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": _gpu_name(),
        "versions": _versions(),
        "load_average_start": _loadavg(),
    }
    return info


def workload_info(pool: Pool) -> dict:
    past = pool.history_lengths()
    return {
        "source": pool.description,
        "patients": len(pool),
        "past_visits_mean": float(past.mean()),
        "past_visits_max": int(past.max()),
        "codes_mean": float(np.mean([len(p[-1].diag) + len(p[-1].proc) for p in pool.patients])),
    }


def _versions() -> dict:
    out = {}
    for mod in ("numpy", "pyarrow", "onnxruntime", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def _gpu_name() -> str | None:
    out = (eng.nvidia_smi("--query-gpu=name") or "").strip()
    return out.splitlines()[0] if out else None


def _memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            return round(int(fh.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _label(engine: str, mode: str = "request") -> str:
    return engine if mode == "request" else f"{engine} (stream)"


def _run_line(run: dict) -> str:
    ok = {True: "ok", False: f"MISMATCH {run['mismatches']}/{run['compared']}", None: "unguarded"}[
        run["matches_reference"]
    ]
    p50 = run["latency_ms"]["p50"]
    return (
        f"{_label(run['engine'], run.get('mode', 'request')):<24} beam {run['beam']} "
        f"batch {run['batch_size']:>5}: {run['visits_per_s']:9.1f} visits/s "
        f"{run['meds_per_s']:10.1f} meds/s p50 {_num(p50, '.2f'):>9} ms  "
        f"RSS {run['peak_rss_mb']:6.0f} MB  {ok}"
    )
