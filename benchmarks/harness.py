"""The measurement loop: every engine on the same batches, timed, guarded, summarised.

For each beam width and batch size, a block: every engine warms up on one untimed batch,
then the engines take turns, one pass over the same batches each, `repeats` times (a machine
whose load drifts slows them alike; a time budget stops the repeats of a slow engine early
and skips a larger batch size whose pass would take too long). Each pass is reported as it
ends; per run: the median over repeats of visits/s and medications/s, per-batch latency
percentiles, the peak RSS of the process during the engine's passes (Linux VmHWM, reset
before each pass), GPU memory where relevant, and whether every recommendation equals
the reference's (`matches_reference`).

`torch-perpatient` runs once per beam width on a subset, one patient per batch. Scaling
series: throughput against past visits, and end to end through `cognet-batch score` against
input size (`child`: a subprocess per point). The guard is `guard`, the /proc probes `probes`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from cognet.benchmarks import engines as eng
from cognet.benchmarks.child import input_size_series
from cognet.benchmarks.guard import Guard
from cognet.benchmarks.probes import (
    loadavg,
    machine_info,
    peak_rss_mb,
    release_memory,
    reset_peak_rss,
    workload_info,
)
from cognet.benchmarks.settings import Context, Settings
from cognet.benchmarks.workload import Batch, Pool, with_history
from cognet.core.manifest import load_manifest

log = logging.getLogger(__name__)
PERPATIENT = "torch-perpatient"
SERIES_ENGINES = ("torch-batched", "ort-cpu", "ort-cuda", "ort-tensorrt", "torch-cuda")


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
    jobs: Sequence[Job],
    beam: int,
    repeats: int,
    guard: Guard,
    max_s: float = float("inf"),
    say: Callable[[str], None] | None = None,
) -> list[dict]:
    """Run the jobs' passes interleaved (pass 1 of every engine, then pass 2, ...): a load
    that drifts slows every engine alike. One record per job that ran (a failed job has
    `error` set); `say` gets a line per pass as it ends (a run cut short still reports)."""
    reference = guard.reference.name if guard.reference is not None else None
    for job in jobs:
        job.engine.prepare(beam, job.batch_size)
    if all(job.engine.name != reference for job in jobs):
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
            if job.engine.name == reference and len(job.seconds) == 1:
                guard.add(beam, job.recs)
            if say is not None:
                say(_pass_line(job, beam))
    records = []
    for job in jobs:
        job.gpu_mb = job.engine.gpu_memory_mb()
        job.engine.release()
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


RECS = "_recs"  # a record's recommendations, until `recompare`


def _pass_line(job: Job, beam: int) -> str:
    n, s = sum(len(b) for b in job.batches), job.seconds[-1]
    return (
        f"  pass {len(job.seconds)}: {job.engine.name} ({job.mode}) {eng.decoding_label(beam)} "
        f"batch {job.batch_size}: {n / s:,.1f} visits/s ({n} visits in {s:.2f} s, peak RSS "
        f"{job.peak_rss:,.0f} MB)"
    )


def recompare(runs: list[dict], guard: Guard) -> None:
    """Compare every run with all the answers the reference gave (at any batch size)."""
    for run in runs:
        recs = run.pop(RECS, None)
        if recs is not None:
            run.update(guard.compare(run["beam"], recs, run["engine"] not in eng.APPROXIMATE))


# -- the whole benchmark ---------------------------------------------------------------------------
def run_all(ctx: Context, settings: Settings, say: Callable[[str], None] = print) -> dict:
    """Every measurement of `settings`; returns the results.json object."""
    machine = machine_info(settings.threads)
    loaded, skipped = load_engines(ctx, settings, say)
    reference = loaded.get(settings.reference)
    if reference is None and eng.availability(settings.reference, ctx.checkpoint) is None:
        reference = eng.load(settings.reference, ctx.model_dir, ctx.checkpoint, settings.threads)
    guard = Guard(reference)
    runs, over_budget = [], []
    for beam in _beams_to_run(ctx, settings, say):
        rates: dict[str, tuple[float, float]] = {}  # visits/s at the last batch size, its fall
        for i, bs in enumerate(settings.batch_sizes):
            jobs = _block_jobs(ctx, settings, loaded, beam, i, bs, rates, over_budget, say)
            for run in measure_block(jobs, beam, settings.repeats, guard, settings.max_run_s, say):
                run["threads"] = settings.threads
                runs.append(run)
                _update_rate(rates, run)
                say(_run_line(run))
            for job in jobs:
                if job.error:
                    skipped[job.engine.name] = job.error
                    loaded.pop(job.engine.name, None)
    recompare(runs, guard)
    series = {
        "past_visits": past_visits_series(ctx, settings, loaded, guard, say),
        "input_size": input_size_series(ctx, settings, say),
    }
    profile = profile_best(ctx, settings, runs, say) if settings.profile else None
    machine["load_average_end"] = loadavg()
    return {
        "machine": machine,
        "settings": {
            **asdict(settings),
            "model": str(ctx.model_dir),
            "checkpoint": str(ctx.checkpoint) if ctx.checkpoint else None,
        },
        "workload": workload_info(ctx.pool),
        "engines": _engines_json(loaded, skipped),
        "runs": runs,
        "runs_over_budget": over_budget,
        "series": series,
        "profile": profile,
        "notes": ctx.notes,
    }


def _beams_to_run(ctx: Context, settings: Settings, say) -> tuple[int, ...]:
    """settings.beams, less set decoding (with a note) when the model has no tuned threshold."""
    beams = settings.beams
    if eng.SET in beams and load_manifest(ctx.model_dir).default_decoding().name != "set":
        beams = tuple(b for b in beams if b != eng.SET)
        ctx.notes.append("set decoding skipped: the model has no tuned set threshold")
        say(ctx.notes[-1])
    return beams


def _block_jobs(
    ctx: Context,
    settings: Settings,
    loaded: dict,
    beam: int,
    i: int,
    bs: int,
    rates: dict[str, tuple[float, float]],
    over_budget: list[dict],
    say,
) -> list[Job]:
    """The jobs of one (beam, batch size) block: each loaded engine in each of its modes,
    less those whose estimated pass is over the time budget (appended to `over_budget`)."""
    jobs = []
    for name, engine in loaded.items():
        if name == PERPATIENT:  # once per beam, one patient per batch; no set decoding
            if i or beam == eng.SET:
                continue
            size, visits = 1, settings.perpatient_visits
        else:
            size, visits = bs, max(bs, settings.visits)
        warmup = ctx.pool.batch(0, min(size, settings.warmup_visits, len(ctx.pool)))
        for mode in _modes(name, size, visits):
            reason = _over_budget_reason(rates, f"{name}/{mode}", visits, settings.max_run_s)
            if reason:
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
                    f"{_label(name, mode):<24} {eng.decoding_label(beam)} "
                    f"batch {size:>5}: skipped, "
                    f"{reason}"
                )
                continue
            batches = (
                ctx.pool.batches(size, visits)
                if mode == "request"
                else [ctx.pool.take(np.arange(visits))]
            )  # in file order
            jobs.append(Job(engine, size, batches, warmup, mode))
    return jobs


def _modes(name: str, size: int, visits: int) -> list[str]:
    """How an engine is fed: batch by batch ("request"), and for the runtime also every
    visit in one call ("stream"); stream only for engines that run one batch a call."""
    modes = ["request"]
    if name in eng.ORT_DEVICES and visits > size:
        modes.append("stream")
        if name in eng.ORT_STREAMS:  # one batch a call: nothing to run in parallel
            modes.remove("request")
    return modes


def _over_budget_reason(
    rates: dict[str, tuple[float, float]], key: str, visits: int, max_run_s: float
) -> str | None:
    """Why a pass is skipped: its time estimated from the last batch size's rate and fall
    is over the budget; None when it is not."""
    rate, drop = rates.get(key, (0.0, 1.0))
    estimate = visits / rate * drop if rate else 0.0
    if estimate > max_run_s:
        return f"one pass estimated at {estimate:.0f}s > {max_run_s:g}s budget"
    return None


def _update_rate(rates: dict[str, tuple[float, float]], run: dict) -> None:
    """Keep the run's visits/s and how far it fell from the last batch size's."""
    key = f"{run['engine']}/{run['mode']}"
    rate = rates.get(key, (0.0, 1.0))[0]
    rates[key] = (
        run["visits_per_s"],
        max(1.0, rate / run["visits_per_s"]) if rate else 1.0,
    )


def _engines_json(loaded: dict, skipped: dict) -> dict:
    """Each engine's status: ok (load time, providers) or skipped (the reason)."""
    return {
        **{
            n: {"status": "ok", "load_s": e.load_s, "providers": e.providers}
            for n, e in loaded.items()
        },
        **{n: {"status": "skipped", "reason": r} for n, r in skipped.items()},
    }


def profile_best(ctx: Context, settings: Settings, runs: list[dict], say) -> dict | None:
    """Profile the runtime at the widest beam measured and its best batch size (and mode):
    ort-cuda where it ran, else ort-cpu, else ort-cpu-gpupath (the GPU path's host side:
    `--engines ort-cpu-gpupath` profiles it)."""
    ran = {r["engine"] for r in runs}
    engine = next((e for e in ("ort-cuda", "ort-cpu", "ort-cpu-gpupath") if e in ran), None)
    if engine is None:
        return None
    mine = [r for r in runs if r["engine"] == engine]
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

    device = eng.ORT_DEVICES[engine]
    gpu_path = engine in eng.GPU_PATH
    out = profile_ort(ctx.model_dir, batches, beam, bs, settings.threads, device, gpu_path=gpu_path)
    out["mode"] = best["mode"]
    graphs = ", ".join(f"{g} {v['share']:.0%}" for g, v in out["graphs"].items())
    say(
        f"profile {_label(engine, best['mode'])} beam {beam} batch {bs}: {graphs}, "
        f"Python {out['python_share']:.0%}"
    )
    return out


def load_engines(ctx: Context, settings: Settings, say) -> tuple[dict, dict]:
    """Loaded engines (the reference first) and {name: reason} for the skipped ones."""
    order = sorted(settings.engines, key=lambda n: n != settings.reference)
    loaded, skipped = {}, {}
    for name in order:
        reason = eng.availability(name, ctx.checkpoint, ctx.model_dir)
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
            run.pop(RECS, None)
            out.append(run)
            say(f"past visits {past:>2}: " + _run_line(run))
    return out


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _label(engine: str, mode: str = "request") -> str:
    return engine if mode == "request" else f"{engine} (stream)"


def _run_line(run: dict) -> str:
    ok = {True: "ok", False: f"MISMATCH {run['mismatches']}/{run['compared']}", None: "unguarded"}[
        run["matches_reference"]
    ]
    if run["matches_reference"] is None and run.get("agreement") is not None:
        ok = f"agrees on {run['agreement']:.2%}"
    if run.get("batch_dependent"):  # the reference's answer there depends on its batch
        ok += f" ({run['batch_dependent']} batch-dependent reference)"
    p50 = run["latency_ms"]["p50"]
    return (
        f"{_label(run['engine'], run.get('mode', 'request')):<24} "
        f"{eng.decoding_label(run['beam']):<6} "
        f"batch {run['batch_size']:>5}: {run['visits_per_s']:9.1f} visits/s "
        f"{run['meds_per_s']:10.1f} meds/s p50 {_num(p50, '.2f'):>9} ms  "
        f"RSS {run['peak_rss_mb']:6.0f} MB  {ok}"
    )
