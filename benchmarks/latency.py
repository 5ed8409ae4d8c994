"""Latency as a user meets it: requests of N visits, each one `Scorer.score_table` call of the
runtime with its default options (the model's decoding, the default batch size), timed one by
one until enough requests were timed or the time budget is spent.

Each size reports p50, p95 and p99 per request and per visit (a request's time over its N
visits) with the number of requests behind them: a percentile over fewer requests than
MIN_SAMPLES asks is marked "not enough" wherever it is shown. Requests take consecutive
patients of the pool in file order (as a caller would send them), a new slice each time; one
untimed request of at most `warmup_visits` visits comes first. Lists are not checked here:
the throughput runs check the same engine's lists against the reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from cognet.benchmarks import engines as eng
from cognet.benchmarks.settings import RUNTIME_BATCH, Context, Settings

# The runtime engines a user calls by default on each device (float32, default selection).
LATENCY_ENGINES = ("ort-cpu", "ort-cuda", "ort-tensorrt")
# Requests a percentile needs to be more than a rough figure: p99 is the largest of fewer
# than 100 requests, and p50 / p95 move by a whole request below 20.
MIN_SAMPLES = {"p50": 20, "p95": 20, "p99": 100}
TARGET_REQUESTS = 100  # timed requests per size when the time budget allows (p99's need)


def percentiles(values: Sequence[float]) -> dict[str, dict]:
    """{"p50" | "p95" | "p99": {"ms", "n", "enough"}} of `values` (milliseconds); "ms" is None
    without values, "enough" whether there are MIN_SAMPLES of them."""
    n = len(values)
    return {
        q: {
            "ms": float(np.percentile(values, int(q[1:]))) if n else None,
            "n": n,
            "enough": n >= need,
        }
        for q, need in MIN_SAMPLES.items()
    }


def shown(p: dict, fmt: str = ",.1f", unit: str = "") -> str:
    """A percentile as printed: "412.3", or "412.3 (n=12, not enough)" below its minimum."""
    if p["ms"] is None:
        return "-"
    value = format(p["ms"], fmt) + unit
    return value if p["enough"] else f"{value} (n={p['n']}, not enough)"


def brief(ps: dict[str, dict], fmt: str = ",.1f") -> str:
    """All three on one short line: "p50 / p95 / p99 21.5 / 24.6 / 25.6 ms over 16 (not
    enough for p50, p95, p99)"."""
    names = " / ".join(ps)
    values = " / ".join(format(p["ms"], fmt) for p in ps.values())
    short = [q for q, p in ps.items() if not p["enough"]]
    n = next(iter(ps.values()))["n"]
    return f"{names} {values} ms over {n}" + (
        f" (not enough for {', '.join(short)})" if short else ""
    )


def run_percentiles(run: dict) -> dict[str, dict]:
    """A throughput run's per-batch latency percentiles as `percentiles` gives them."""
    n = run.get("latency_samples", 0)
    return {
        q: {"ms": run["latency_ms"].get(q), "n": n, "enough": n >= need}
        for q, need in MIN_SAMPLES.items()
    }


def request_sizes(settings: Settings, default_batch: int) -> tuple[int, ...]:
    """settings.latency_sizes, RUNTIME_BATCH read as the runtime's default batch size,
    sorted, each once."""
    return tuple(
        sorted({default_batch if n == RUNTIME_BATCH else n for n in settings.latency_sizes})
    )


def measure(
    scorer,
    pool,
    visits: int,
    max_s: float,
    warmup_visits: int,
    target: int = TARGET_REQUESTS,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Seconds of each timed request of `visits` visits: `target` of them, fewer when the next
    one would end past `max_s` (the first always runs)."""
    visits = min(visits, len(pool))
    _score(scorer, pool.batch(0, min(visits, warmup_visits)))
    starts = range(0, len(pool) - visits + 1, visits) or range(1)
    seconds: list[float] = []
    while len(seconds) < target:
        if seconds and sum(seconds) + max(seconds) > max_s:
            break
        lo = starts[len(seconds) % len(starts)]
        batch = pool.batch(lo, lo + visits)
        began = clock()
        _score(scorer, batch)
        seconds.append(clock() - began)
    return seconds


def _score(scorer, batch) -> int:
    """One request: every chunk's recommendations collected, as a caller would."""
    return sum(chunk.recommendations.num_rows for chunk in scorer.score_table(batch.table))


def record(engine: str, decoding: str, batch_size: int, visits: int, seconds: list[float]):
    """One size's entry of results.json "latency"."""
    ms = np.asarray(seconds) * 1e3
    return {
        "engine": engine,
        "decoding": decoding,
        "batch_size": batch_size,  # the runtime's default, which a large request is cut into
        "visits": visits,
        "requests": len(seconds),
        "cut_by_budget": len(seconds) < TARGET_REQUESTS,
        "per_request_ms": percentiles(ms.tolist()),
        "per_visit_ms": percentiles((ms / visits).tolist()),
        "visits_per_s": visits * len(seconds) / sum(seconds),
        "seconds": round(sum(seconds), 3),
    }


def line(r: dict) -> str:
    """A size's console line."""
    req, per = r["per_request_ms"], r["per_visit_ms"]
    return (
        f"latency {r['engine']} ({r['decoding']}), requests of {r['visits']:,} visit(s), "
        f"{r['requests']} timed: per request p50 {shown(req['p50'], unit=' ms')}, p95 "
        f"{shown(req['p95'], unit=' ms')}, p99 {shown(req['p99'], unit=' ms')}; per visit "
        f"p50 {shown(per['p50'], ',.2f', ' ms')}; {r['visits_per_s']:,.1f} visits/s"
    )


def latency_series(
    ctx: Context,
    settings: Settings,
    loaded: dict,
    say: Callable[[str], None],
    progress: Callable[[list[dict]], None] = lambda _: None,
) -> list[dict]:
    """Every size of every loaded LATENCY_ENGINES engine; `progress` gets the records so far
    after each size."""
    out: list[dict] = []
    if not settings.latency_sizes:
        return out
    for name in (n for n in LATENCY_ENGINES if n in loaded):
        scorer = runtime_scorer(ctx, settings, loaded[name])
        try:
            resolved = scorer.settings()
            batch_size = resolved["batch_size"]
            beam = eng.SET if scorer.decoding.name == "set" else resolved["beam"]
            decoding = eng.decoding_label(beam)
            for visits in request_sizes(settings, batch_size):
                seconds = measure(
                    scorer, ctx.pool, visits, settings.max_run_s, settings.warmup_visits
                )
                out.append(record(name, decoding, batch_size, min(visits, len(ctx.pool)), seconds))
                say(line(out[-1]))
                progress(out)
        finally:
            scorer.close()
    return out


def runtime_scorer(ctx: Context, settings: Settings, engine):
    """The engine's `Scorer` with the runtime's defaults: only where it runs and its threads
    are set."""
    options = eng.score_options(device=engine.device, threads=settings.threads)
    return eng.scorer(ctx.model_dir, options)
