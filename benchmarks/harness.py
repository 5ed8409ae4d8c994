"""The measurement loop: every engine on the same batches, timed, guarded, summarised.

First the latency series (`latency`: requests of N visits through the runtime), then the
blocks. The results grow as it goes and are handed to a `progress` callback after every pass.
For each beam width and batch size, a block (`interleaved_runs`): every engine warms up on one
untimed batch, then the engines take turns, one pass over the same batches each, `repeats`
times (a time budget stops the repeats of a slow engine early and skips a larger batch size
whose pass would take too long). Each pass is reported as it ends; per run: the median
over repeats of visits/s and medications/s, per-batch latency percentiles, the peak RSS of
the process during the engine's passes (Linux VmHWM, reset before each pass), GPU memory
where relevant, and whether every recommendation equals the reference's
(`matches_reference`).

`torch-perpatient` runs once per beam width on a subset, one patient per batch. Scaling
series: throughput against past visits, and end to end through `cognet-batch score` against
input size (`score_subprocess`: a subprocess per point). The guard is `guard`, the /proc probes
`machine_info`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict

import numpy as np

from cognet.benchmarks import engines as eng
from cognet.benchmarks.guard import Guard
from cognet.benchmarks.interleaved_runs import RECS, Job, measure_block
from cognet.benchmarks.latency import brief, latency_series, run_percentiles
from cognet.benchmarks.machine_info import loadavg, machine_info, workload_info
from cognet.benchmarks.score_subprocess import input_size_series
from cognet.benchmarks.settings import Context, Settings
from cognet.benchmarks.workload import Pool, with_history
from cognet.core.manifest import load_manifest

log = logging.getLogger(__name__)
PERPATIENT = "torch-perpatient"
SERIES_ENGINES = ("torch-batched", "ort-cpu", "ort-cuda", "ort-tensorrt", "torch-cuda")
MAIN_RUNTIME = "ort-cpu"  # the engine `cognet-batch score` runs on a CPU (the input-size series)


def recompare(runs: list[dict], guard: Guard) -> None:
    """Compare every run with all the answers the reference gave (at any batch size)."""
    for run in runs:
        recs = run.pop(RECS, None)
        if recs is not None:
            run.update(guard.compare(run["beam"], recs, run["engine"] not in eng.APPROXIMATE))


# -- the whole benchmark ---------------------------------------------------------------------------
def run_all(
    ctx: Context,
    settings: Settings,
    say: Callable[[str], None] = print,
    progress: Callable[[dict], None] = lambda _: None,
) -> dict:
    """Every measurement of `settings`; returns the results.json object, handed to `progress`
    as it grows (after every pass and every latency size), so that a run stopped from outside
    leaves what it measured."""
    loaded, skipped = load_engines(ctx, settings, say)
    reference = correctness_reference(ctx, settings, loaded, say)
    guard = Guard(reference)
    runs, over_budget = [], []
    results = {
        "machine": machine_info(settings.threads),
        "settings": {
            **asdict(settings),
            "model": str(ctx.model_dir),
            "checkpoint": str(ctx.checkpoint) if ctx.checkpoint else None,
        },
        "workload": workload_info(ctx.pool),
        "engines": _engines_json(loaded, skipped, reference),
        "latency": [],
        "runs": runs,
        "runs_over_budget": over_budget,
        "series": {"past_visits": [], "input_size": []},
        "profile": None,
        "set_profile": None,
        "marginal_profile": None,
        "notes": ctx.notes,
    }
    # first: what a user calling the runtime waits
    results["latency"] = latency_series(
        ctx, settings, loaded, say, lambda done: progress({**results, "latency": done})
    )
    progress(results)
    for beam in _beams_to_run(ctx, settings, say):
        rates: dict[str, tuple[float, float]] = {}  # visits/s at the last batch size, its fall
        for i, bs in enumerate(settings.batch_sizes):
            jobs = _block_jobs(ctx, settings, loaded, (beam, i, bs), (rates, over_budget), say)

            def partial(records: list[dict]) -> None:
                progress({**results, "runs": runs + [_in_progress(r) for r in records]})

            block = measure_block(
                jobs, beam, settings.repeats, guard, settings.max_run_s, say, on_pass=partial
            )
            for run in block:
                run["threads"] = settings.threads
                runs.append(run)
                _update_rate(rates, run)
                say(_run_line(run))
            for job in jobs:
                if job.error:
                    skipped[job.engine.name] = job.error
                    loaded.pop(job.engine.name, None)
            results["engines"] = _engines_json(loaded, skipped, reference)
            progress(results)
    recompare(runs, guard)
    results["series"]["past_visits"] = past_visits_series(ctx, settings, loaded, guard, say)
    progress(results)
    if MAIN_RUNTIME in settings.engines:  # the runtime's own command, ort-cpu's path
        results["series"]["input_size"] = input_size_series(ctx, settings, say)
    if settings.profile:
        results["profile"] = profile_best(ctx, settings, runs, say)
        results["set_profile"] = profile_best(ctx, settings, runs, say, eng.SET)
        results["marginal_profile"] = profile_best(ctx, settings, runs, say, eng.MARGINAL)
    results["machine"]["load_average_end"] = loadavg()
    return results


def correctness_reference(ctx: Context, settings: Settings, loaded: dict, say):
    """The engine every run's lists are checked against: the asked engine of that name, else
    loaded for the check alone (untimed: it decodes each visit once) and named the
    correctness reference; None, with a note, for `--reference none` or when it cannot run."""
    name = settings.reference
    if name is None:
        ctx.notes.append("lists not checked (--reference none)")
        return None
    if name in loaded:
        return loaded[name]
    reason = eng.availability(name, ctx.checkpoint, ctx.model_dir)
    if reason is not None:
        ctx.notes.append(
            f"lists not checked: the correctness reference {name} cannot run here: {reason}"
        )
        say(ctx.notes[-1])
        return None
    reference = eng.load(name, ctx.model_dir, ctx.checkpoint, settings.threads)
    say(
        f"loaded {name} in {reference.load_s:.2f}s as the correctness reference (not timed: "
        "it decodes each visit once to check the lists of the engines asked)"
    )
    return reference


def _in_progress(run: dict) -> dict:
    """A run of the block still measuring: its passes so far, not compared yet."""
    return {**run, **Guard(None).compare(run["beam"], {}), "in_progress": True}


def _beams_to_run(ctx: Context, settings: Settings, say) -> tuple[int, ...]:
    """settings.beams, less set decoding (with a note) when the model has no tuned threshold,
    and less the marginal decoding when it has no set head."""
    beams = settings.beams
    manifest = load_manifest(ctx.model_dir)
    if eng.SET in beams and manifest.default_decoding().name != "set":
        beams = tuple(b for b in beams if b != eng.SET)
        ctx.notes.append("set decoding skipped: the model has no tuned set threshold")
        say(ctx.notes[-1])
    if eng.MARGINAL in beams and manifest.head is None:
        beams = tuple(b for b in beams if b != eng.MARGINAL)
        ctx.notes.append("marginal decoding skipped: the model has no set head")
        say(ctx.notes[-1])
    return beams


def _block_jobs(
    ctx: Context,
    settings: Settings,
    loaded: dict,
    block: tuple[int, int, int],
    budget: tuple[dict[str, tuple[float, float]], list[dict]],
    say,
) -> list[Job]:
    """The jobs of one block (beam, i, bs: the beam width, the index of the batch size in
    settings.batch_sizes, the batch size): each loaded engine in each of its modes, less
    those whose estimated pass is over the time budget. budget: (the rates measured, by
    `_update_rate`; the list the passes over budget are appended to)."""
    beam, i, bs = block
    rates, over_budget = budget
    jobs = []
    for name, engine in loaded.items():
        if name == PERPATIENT:  # once per beam, one patient per batch; no set decoding
            if i or beam in eng.SETS:
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


def _engines_json(loaded: dict, skipped: dict, reference=None) -> dict:
    """Each engine's status: ok (load time, providers), skipped (the reason), or the
    correctness reference when it runs only to check the others."""
    out = {
        **{
            n: {"status": "ok", "load_s": e.load_s, "providers": e.providers}
            for n, e in loaded.items()
        },
        **{n: {"status": "skipped", "reason": r} for n, r in skipped.items()},
    }
    if reference is not None and reference.name not in loaded:
        out[reference.name] = {
            "status": "correctness reference",
            "load_s": reference.load_s,
            "providers": reference.providers,
            "reason": "not asked: decodes each visit once, untimed, to check the others' lists",
        }
    return out


def profile_best(
    ctx: Context, settings: Settings, runs: list[dict], say, beam: int | None = None
) -> dict | None:
    """Profile the runtime at its best batch size (and mode) for a decoding: the widest beam
    measured by default, or `beam` (eng.SET: the set decoding, eng.MARGINAL: the set head's
    one pass). ort-cuda where it ran, else
    ort-cpu, else ort-cpu-gpupath (the GPU path's host side: `--engines ort-cpu-gpupath`
    profiles it). None when no such run was measured."""
    ran = {r["engine"] for r in runs}
    engine = next((e for e in ("ort-cuda", "ort-cpu", "ort-cpu-gpupath") if e in ran), None)
    if engine is None:
        return None
    mine = [r for r in runs if r["engine"] == engine]
    if beam is None:
        beam = max((r["beam"] for r in mine if r["beam"] not in eng.SETS), default=None)
    mine = [r for r in mine if r["beam"] == beam]
    if not mine:
        return None
    best = max(mine, key=lambda r: r["visits_per_s"])
    bs = best["batch_size"]
    visits = max(bs, settings.visits)
    batches = (
        ctx.pool.batches(bs, visits)
        if best["mode"] == "request"
        else [ctx.pool.take(np.arange(visits))]
    )
    # onnxruntime, which profile imports: lazy, so that --help and the torch engines run without it
    from cognet.benchmarks.profile import profile_ort

    device = eng.ORT_DEVICES[engine]
    gpu_path = engine in eng.GPU_PATH
    out = profile_ort(ctx.model_dir, batches, beam, bs, settings.threads, device, gpu_path=gpu_path)
    out["mode"] = best["mode"]
    graphs = ", ".join(f"{g} {v['share']:.0%}" for g, v in out["graphs"].items())
    say(
        f"profile {_label(engine, best['mode'])} {eng.decoding_label(beam)} batch {bs}: "
        f"{graphs}, Python {out['python_share']:.0%} "
        f"({out['host_us_per_visit']:,.1f} us a visit)"
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
    bs = min(settings.series_batch_size, settings.past_visits_n)
    beam = settings.series_beam
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
    lat = run_percentiles(run)
    latency = (
        "batch latency " + brief(lat, ".2f") if lat["p50"]["ms"] is not None else "one call a pass"
    )
    return (
        f"{_label(run['engine'], run.get('mode', 'request')):<24} "
        f"{eng.decoding_label(run['beam']):<6} "
        f"batch {run['batch_size']:>5}: {run['visits_per_s']:9.1f} visits/s "
        f"{run['meds_per_s']:10.1f} meds/s, {run['repeats']} pass(es), {latency}  "
        f"RSS {run['peak_rss_mb']:6.0f} MB  {ok}"
    )
