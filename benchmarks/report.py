"""results.json -> results.md (tables), throughput.png and latency.png (matplotlib, Agg
backend; skipped, with a note, without it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cognet.benchmarks.engines import decoding_label
from cognet.benchmarks.latency import MIN_SAMPLES, TARGET_REQUESTS, run_percentiles, shown
from cognet.core import strict_json
from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import BEAM
from cognet.core.files import atomic_path, write_text
from cognet.evaluation.ddi_tradeoff import TradeoffRow, markdown_table

BASELINES = ("torch-batched", "torch-perpatient")
MAIN = "ort-cpu"


def write_all(results: dict, out: Path, plots: bool = True) -> list[Path]:
    """results.json and results.md, and with `plots` throughput.png and latency.png (skipped,
    with a note saying why, without matplotlib); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    if plots:
        paths += _plots(results, out)
    write_text(paths[0], strict_json.dumps(results, indent=1) + "\n")
    write_text(paths[1], markdown(results))
    if results.get("ddi_tradeoff") and (out / "ddi_tradeoff.png").is_file():
        paths.append(out / "ddi_tradeoff.png")  # written by the trade-off run
    return paths


def _plots(results: dict, out: Path) -> list[Path]:
    """The plots written; none, and a note, without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        note = (
            "plots skipped: matplotlib is not installed (the [bench] extra: "
            'pip install -e ".[bench]")'
        )
        if note not in results.setdefault("notes", []):
            results["notes"].append(note)
        return []
    paths = [out / "throughput.png"]
    plot(results, paths[0])
    if results.get("latency"):
        paths.append(out / "latency.png")
        plot_latency(results, paths[1])
    return paths


def ratios(results: dict, beam: int = BEAM, engine: str = MAIN, mode: str | None = None) -> dict:
    """visits/s of `engine` at its best batch size (among runs of `mode`, default any) over
    each baseline at its own best."""
    best: dict[str, dict] = {}
    for run in results["runs"]:
        if run["beam"] != beam or (run["engine"] == engine and mode and _mode(run) != mode):
            continue
        if run["visits_per_s"] > best.get(run["engine"], {"visits_per_s": 0})["visits_per_s"]:
            best[run["engine"]] = run
    if engine not in best:
        return {}
    mine = best[engine]
    out = {}
    for base in BASELINES:
        if base in best:
            out[base] = {
                "ratio": mine["visits_per_s"] / best[base]["visits_per_s"],
                "engine_batch_size": mine["batch_size"],
                "engine_mode": _mode(mine),
                "engine_visits_per_s": mine["visits_per_s"],
                "baseline_batch_size": best[base]["batch_size"],
                "baseline_visits_per_s": best[base]["visits_per_s"],
            }
    return out


def markdown(results: dict) -> str:
    lines = _header(results) + _ratio_lines(results) + _latency_section(results)
    lines += _runs_table(results)
    lines += _engines_table(results["engines"])
    lines += _past_visits_section(results)
    lines += _input_size_section(results)
    for key in ("profile", "set_profile", "marginal_profile"):
        if results.get(key):
            lines += _profile_section(results[key])
    lines += _over_budget_lines(results.get("runs_over_budget") or [])
    if results.get("ddi_tradeoff"):
        lines += ["", *_tradeoff_section(results["ddi_tradeoff"])]
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"


def _header(results: dict) -> list[str]:
    """The title, the machine, the versions, the model and how each run was measured."""
    m, s = results["machine"], results["settings"]
    return [
        "# cognet-bench results",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores available, {m['memory_gb']} GB; "
        f"GPU: {m['gpu'] or 'none'}; {m['threads']} intra-op thread(s) per engine; "
        f"load average {_load(m.get('load_average_start'))} at start, "
        f"{_load(m.get('load_average_end'))} at the end.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v) + ".",
        f"Model: `{s['model']}`. Workload: {_workload(results['workload'])}.",
        f"Each run: one warm-up batch, then up to {s['repeats']} repeat(s) over the same "
        "batches (the passes column: how many ran; the time budget stops a slow run's "
        "repeats), the engines taking turns pass by pass; visits/s and meds/s are the median "
        "over passes, batch latency percentiles are over every batch of every pass, marked "
        '"not enough" over fewer batches than the latency section asks. '
        "(stream): the run's visits handed to the runtime in one call, which it chunks, sorts "
        "and batches itself, as `cognet-batch score` does (no per-batch latency).",
        "",
    ]


def _ratio_lines(results: dict) -> list[str]:
    """One bold line per decoding: MAIN's speed over each baseline, each at its best batch."""
    lines = []
    for beam in results["settings"]["beams"]:
        for mode in (None, "request"):
            r = ratios(results, beam, mode=mode)
            if not r or (
                mode and all(v["engine_mode"] == mode for v in ratios(results, beam).values())
            ):
                continue  # the request-only line only when it differs
            lines.append(
                f"**{decoding_label(beam).capitalize()}**{' (request mode)' if mode else ''}: "
                + "; ".join(
                    f"{MAIN} ({'stream, ' if v['engine_mode'] == 'stream' else ''}batch "
                    f"{v['engine_batch_size']}) = **{v['ratio']:.1f}x** {k} "
                    f"(batch {v['baseline_batch_size']})"
                    for k, v in r.items()
                )
                + "."
            )
    return lines


def _runs_table(results: dict) -> list[str]:
    """Throughput and latency: one row per run, sorted by decoding, engine and batch size;
    nothing without runs (`--batch-sizes ''`)."""
    if not results["runs"]:
        return []
    lines = [
        "",
        "## Throughput and latency",
        "",
        "| engine | decoding | batch | passes | visits/s | meds/s | batch p50 ms "
        "| batch p95 ms | batch p99 ms | peak RSS MB | GPU MB | matches "
        + (results["settings"].get("reference") or "(no reference)")
        + " |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in sorted(results["runs"], key=lambda r: (r["beam"], r["engine"], r["batch_size"])):
        lat = run_percentiles(run)
        lines.append(
            f"| {_label(run)} | {decoding_label(run['beam'])} | {_batch(run)} "
            f"| {run['repeats']} | {run['visits_per_s']:.1f} "
            f"| {run['meds_per_s']:.0f} | {shown(lat['p50'])} | {shown(lat['p95'])} "
            f"| {shown(lat['p99'])} | {run['peak_rss_mb']:.0f} "
            f"| {_num(run.get('gpu_mem_mb'), '.0f', '')} "
            f"| {_guard(run)} |"
        )
    return lines


def _engines_table(engines: dict) -> list[str]:
    """Each engine: loaded (with its load time and providers) or skipped (with the reason)."""
    lines = [
        "",
        "## Engines",
        "",
        "| engine | status | model load s | providers / reason |",
        "|---|---|---:|---|",
    ]
    for name, e in engines.items():
        if e["status"] == "ok":
            lines.append(f"| {name} | ok | {e['load_s']:.2f} | {', '.join(e['providers'])} |")
        elif "load_s" in e:  # the correctness reference, loaded to check the others only
            lines.append(f"| {name} | {e['status']} | {e['load_s']:.2f} | {e['reason']} |")
        else:
            lines.append(f"| {name} | skipped | | {e['reason']} |")
    return lines


def _latency_section(results: dict) -> list[str]:
    """Requests of N visits through the runtime (`benchmarks.latency`); nothing when that
    series did not run."""
    rows = results.get("latency") or []
    if not rows:
        return []
    lines = [
        "",
        "## Latency: requests of N visits through the runtime",
        "",
        "Each request is one `Scorer.score_table` call with the runtime's defaults (the "
        "model's decoding, its default batch size), timed alone, after one untimed request; "
        f"up to {TARGET_REQUESTS} requests per size, fewer when the time budget "
        "(`--max-run-seconds`) runs out. Per visit: a request's time over its visits. A "
        "percentile over fewer requests than it needs "
        f"({', '.join(f'{q}: {n}' for q, n in MIN_SAMPLES.items())}) is marked "
        '"not enough".',
        "",
        "| engine | decoding | visits per request | requests | p50 ms | p95 ms | p99 ms "
        "| p50 ms per visit | p95 ms per visit | p99 ms per visit | visits/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        req, per = r["per_request_ms"], r["per_visit_ms"]
        lines.append(
            f"| {r['engine']} | {r['decoding']} | {r['visits']:,}"
            f"{' (default batch)' if r['visits'] == r['batch_size'] else ''} | {r['requests']} "
            f"| {shown(req['p50'])} | {shown(req['p95'])} | {shown(req['p99'])} "
            f"| {shown(per['p50'], ',.2f')} | {shown(per['p95'], ',.2f')} "
            f"| {shown(per['p99'], ',.2f')} | {r['visits_per_s']:,.1f} |"
        )
    return lines


def _past_visits_section(results: dict) -> list[str]:
    """Throughput against the number of past visits; nothing when that series did not run."""
    s = results["settings"]
    past = results["series"].get("past_visits") or []
    if not past:
        return []
    lines = [
        "",
        f"## Throughput against past visits (beam {s['series_beam']}, "
        f"batch {past[0]['batch_size']}, {s['past_visits_n']} visits per point)",
        "",
        "| past visits | engine | visits/s | meds/s | p50 ms | matches |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for run in past:
        lines.append(
            f"| {run['past_visits']} | {run['engine']} | "
            f"{run['visits_per_s']:.1f} | {run['meds_per_s']:.0f} | "
            f"{run['latency_ms']['p50']:.1f} | {_guard(run)} |"
        )
    return lines


def _input_size_section(results: dict) -> list[str]:
    """End to end `cognet-batch score` against the input size; nothing when it did not run."""
    s = results["settings"]
    sizes = results["series"].get("input_size") or []
    if not sizes:
        return []
    lines = [
        "",
        f"## End to end: `cognet-batch score` (beam {s['series_beam']}, batch "
        f"{s['series_batch_size']}, ort-cpu, a fresh process per point)",
        "",
        "| input rows | visits scored | wall s | rows/s | scored visits/s | peak RSS MB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sizes:
        err = f" (failed: {p['error']})" if p.get("error") else ""
        lines.append(
            f"| {p['rows']} | {p['visits_scored']} | {p['seconds']:.1f} | "
            f"{p['rows_per_s']:.0f} | {p['visits_per_s']:.1f}{err} | "
            f"{_num(p['peak_rss_mb'])} |"
        )
    return lines


def _profile_section(prof: dict) -> list[str]:
    """Where the time goes: each graph's share, the Python share, the top operators and
    the Python functions with the most own time."""
    lines = [
        "",
        f"## Where the time goes: {_label(prof)}, {decoding_label(prof['beam'])}, batch "
        f"{prof['batch_size']} ({prof['visits']} visits, {prof['wall_s']:.2f}s)",
        "",
        "| part | seconds | share of wall time |",
        "|---|---:|---:|",
    ]
    for graph, v in prof["graphs"].items():
        lines.append(f"| graph `{graph}` | {v['seconds']:.2f} | {v['share']:.0%} |")
    lines.append(
        f"| Python (decoding driver, assembly, Arrow) | {prof['python_s']:.2f} | "
        f"{prof['python_share']:.0%} |"
    )
    lines += ["", f"Host time per visit (outside the graphs): {_host_us(prof)}."]
    copies = prof.get("copies")
    if copies:
        lines += [
            "",
            "Copies between host and device per visit (the GPU's code path): "
            + "; ".join(
                f"{way.replace('_', ' ')} {c['calls_per_visit']:.3g} calls, "
                f"{c['bytes_per_visit']:,.0f} bytes"
                for way, c in copies.items()
            )
            + ".",
        ]
    for graph, ops in prof["operators"].items():
        lines += [
            "",
            f"Operators of `{graph}` (ONNX Runtime profiler): "
            + ", ".join(f"{o['op']} {o['share']:.0%}" for o in ops[:8])
            + ".",
        ]
    lines += [
        "",
        "Python functions with the most own time, as shares of the Python time "
        "(cProfile): "
        + ", ".join(f"`{f['function']}` {f['share']:.0%}" for f in prof["python_functions"][:8])
        + ".",
    ]
    return lines


def _host_us(prof: dict) -> str:
    """The host's microseconds per visit and the visits/s they allow at most."""
    us = prof["host_us_per_visit"]
    return f"{us:,.1f} us, at most {1e6 / us:,.0f} visits/s on this host" if us else "0 us"


def _over_budget_lines(skipped: list[dict]) -> list[str]:
    """The runs that `--max-run-seconds` skipped; nothing when none was."""
    if not skipped:
        return []
    return [
        "",
        "Runs skipped by the time budget (`--max-run-seconds`): "
        + "; ".join(
            f"{_label(r)} {decoding_label(r['beam'])} batch {r['batch_size']} ({r['reason']})"
            for r in skipped
        )
        + ".",
    ]


def _tradeoff_section(t: dict) -> list[str]:
    """The DDI trade-off (`cognet.evaluation.ddi_tradeoff.TradeoffResult.to_json`) as Markdown."""
    rows = [TradeoffRow(DDIPolicy(**r["policy"]), r["report"], r["seconds"]) for r in t["rows"]]
    best = next((r for r in rows if r.policy.label == t["recommended"]), None)
    first = rows[0].report
    return [
        "## DDI trade-off (torch reference, beam 4)",
        "",
        f"Test split of `{t['data']}`: {first['n_patients']} patients, {first['n_visits']} "
        f"visits, ground-truth DDI rate {t['ground_truth_ddi']:.4f}; mean over "
        f"{first['rounds']} bootstrap rounds. Recommended (lowest DDI rate within 0.01 "
        f"Jaccard of off): {t['recommended'] or 'none'}. Plot: `ddi_tradeoff.png`.",
        "",
        markdown_table(rows, best),
    ]


def plot(results: dict, path: Path) -> None:
    """visits/s against batch size, log axes, one line per engine, a panel per beam."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    beams = sorted({r["beam"] for r in results["runs"]}) or [4]
    fig, axes = plt.subplots(
        1, len(beams), figsize=(5.5 * len(beams), 4.2), squeeze=False, sharey=True
    )
    for ax, beam in zip(axes[0], beams, strict=True):
        for label in _labels(results["runs"]):
            runs = sorted(
                (r for r in results["runs"] if _label(r) == label and r["beam"] == beam),
                key=lambda r: r["batch_size"],
            )
            if runs:
                ax.plot(
                    [r["batch_size"] for r in runs],
                    [r["visits_per_s"] for r in runs],
                    marker="o",
                    linestyle="--" if _mode(runs[0]) == "stream" else "-",
                    label=label,
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("batch size (visits)")
        ax.set_title(decoding_label(beam))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("visits / s")
    axes[0][-1].legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(f"cognet-bench: {m['cpu']}, {m['threads']} thread(s)", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def plot_latency(results: dict, path: Path) -> None:
    """ms per request and per visit against visits per request, log axes, p50 / p95 / p99
    of each engine; a hollow marker where a percentile has not enough requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), squeeze=False)
    styles = {"p50": "-", "p95": "--", "p99": ":"}
    for ax, key, title in zip(
        axes[0], ("per_request_ms", "per_visit_ms"), ("per request", "per visit"), strict=True
    ):
        for engine in dict.fromkeys(r["engine"] for r in results["latency"]):
            rows = [r for r in results["latency"] if r["engine"] == engine]
            for q, style in styles.items():
                points = [(r["visits"], r[key][q]) for r in rows if r[key][q]["ms"] is not None]
                if not points:
                    continue
                xs, ps = [x for x, _ in points], [p for _, p in points]
                (line,) = ax.plot(
                    xs, [p["ms"] for p in ps], style, label=f"{engine} ({rows[0]['decoding']}) {q}"
                )
                ax.scatter(
                    xs,
                    [p["ms"] for p in ps],
                    facecolors=[line.get_color() if p["enough"] else "none" for p in ps],
                    edgecolors=line.get_color(),
                    zorder=3,
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("visits per request")
        ax.set_ylabel(f"ms {title}")
        ax.set_title(f"latency {title} (hollow: not enough requests)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    m = results["machine"]
    fig.suptitle(f"cognet-bench latency: {m['cpu']}, {m['threads']} thread(s)", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def _labels(runs: Sequence[dict]) -> list[str]:
    seen: list[str] = []
    for r in runs:
        if _label(r) not in seen:
            seen.append(_label(r))
    return seen


def _mode(run: dict) -> str:
    return run.get("mode") or "request"


def _label(run: dict) -> str:
    """The engine, plus "(stream)" for a run that handed the engine all its visits at once."""
    return run["engine"] if _mode(run) == "request" else f"{run['engine']} (stream)"


def _batch(run: dict) -> str:
    return "1 patient" if run["engine"] == "torch-perpatient" else str(run["batch_size"])


def _guard(run: dict) -> str:
    if run.get("in_progress"):
        return "not compared yet (run in progress)"
    if run["matches_reference"] is None:
        if run.get("agreement") is not None:  # an approximate engine (fp16)
            equal = run["compared"] - run["mismatches"]
            return f"{equal} of {run['compared']} equal ({run['agreement']:.2%}; not required)"
        return "n/a (no reference)"
    notes = []
    if run.get("ties"):
        shown = run.get("tie_examples", [])
        if any("score_gap" in t for t in shown):
            gaps = ", ".join(f"{t['score_gap']:.1e}" for t in shown if "score_gap" in t)
            notes.append(f"{run['ties']} float tie(s) broken the other way (score gap {gaps})")
        else:
            notes.append(
                f"{run['ties']} set(s) equal in another order (P(k in S) tied within float32)"
            )
    if run.get("reference_ambiguous"):
        notes.append(f"the reference answered {run['reference_ambiguous']} visit(s) two ways")
    if run.get("batch_dependent"):
        notes.append(
            f"batch-dependent reference on {run['batch_dependent']} visit(s): decoded alone, "
            "it gives this engine's answer"
        )
    note = "".join(f"; {n}" for n in notes)
    if not run["matches_reference"]:
        return f"**NO: {run['mismatches']} of {run['compared']} differ**{note}"
    if run["mismatches"] or notes:  # a set decoding within its tolerance, or notes
        apart = run.get("ties", 0) + run.get("batch_dependent", 0)
        same = run["compared"] - run["mismatches"] - apart
        return f"yes ({same} of {run['compared']} equal{note})"
    return f"yes ({run['compared']})"


def _num(x, fmt: str = ".0f", missing: str = "-") -> str:
    return missing if x is None else format(x, fmt)


def _load(x) -> str:
    return "?" if not x else "/".join(f"{v:.1f}" for v in x)


def _workload(w: dict) -> str:
    return (
        f"{w['patients']} patients from {w['source']}; the last visit of each is scored "
        f"with the earlier ones as history ({w['past_visits_mean']:.2f} past visits on "
        f"average, at most {w['past_visits_max']}; {w['codes_mean']:.1f} diagnosis + "
        "procedure codes per scored visit)"
    )
