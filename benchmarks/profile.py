"""Where the time of `ort-cpu` (or `ort-cuda`, or `ort-cpu-gpupath`: the GPU's code path on the
CPU provider) goes: per graph, per ONNX operator, and in Python.

Three passes over the same batches with a fresh `cognet.runtime.Scorer` each:

1. graphs: `onnxruntime.InferenceSession.run` is wrapped with a timer (about a microsecond
   per call), so the time inside each graph and the rest ("Python": the beam driver's numpy,
   history assembly, Arrow in and out) add up to the wall time of the pass;
2. operators: ONNX Runtime's own profiler on every session, summed per operator type;
3. Python: cProfile, the functions with the most own time, as shares of the Python time
   (cProfile slows Python code down, so compare them with each other, not with pass 1).

Only onnxruntime's public classes are hooked, never the runtime's internals.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import onnxruntime as ort

from cognet.benchmarks.engines import DECODING_NAMES, score_options
from cognet.benchmarks.engines import scorer as open_scorer
from cognet.benchmarks.workload import Batch


def profile_ort(
    model_dir: Path,
    batches: Sequence[Batch],
    beam: int,
    batch_size: int,
    threads: int,
    device: str = "cpu",
    top: int = 10,
    gpu_path: bool = False,
) -> dict:
    """The three passes of the module docstring over `batches`, at beam width `beam` or
    the model's set decoding (`beam` = engines.SET)."""

    def scorer():
        names = {v: k for k, v in DECODING_NAMES.items()}
        decoding = {"decoding": names[beam]} if beam in names else {"beam": beam}
        options = score_options(**decoding, device=device, threads=threads, batch_size=batch_size)
        s = open_scorer(model_dir, options, gpu_path)
        list(s.score_table(batches[0].table))  # warm-up
        return s

    def score(s) -> None:
        for b in batches:
            list(s.score_table(b.table))

    s = scorer()
    with _timed_runs() as graph_s:
        started = time.perf_counter()
        score(s)
        total = time.perf_counter() - started
    del s
    in_graphs = sum(graph_s.values())
    graphs = {
        name: {"seconds": t, "share": t / total}
        for name, t in sorted(graph_s.items(), key=lambda kv: -kv[1])
    }

    with tempfile.TemporaryDirectory() as tmp, _ort_profiling(Path(tmp)) as sessions:
        s = scorer()
        score(s)
        ops = _operator_totals(sessions, top)
        del s

    prof = cProfile.Profile()
    s = scorer()
    prof.enable()
    score(s)
    prof.disable()
    return {
        "engine": "ort-cpu-gpupath" if gpu_path else f"ort-{device}",
        "beam": beam,
        "batch_size": batch_size,
        "visits": sum(len(b) for b in batches),
        "threads": threads,
        "wall_s": total,
        "graphs": graphs,
        "python_s": total - in_graphs,
        "python_share": (total - in_graphs) / total,
        "operators": ops,
        "python_functions": _hotspots(prof, top),
    }


@contextmanager
def _timed_runs():
    """Seconds spent inside InferenceSession.run and run_with_iobinding (a GPU's way), per
    graph file stem."""
    totals: dict[str, float] = defaultdict(float)
    names = ("run", "run_with_iobinding")
    originals = {name: getattr(ort.InferenceSession, name) for name in names}

    def timed(original):
        def run(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                totals[Path(str(getattr(self, "_model_path", "graph"))).stem] += (
                    time.perf_counter() - started
                )

        return run

    for name, original in originals.items():
        setattr(ort.InferenceSession, name, timed(original))
    try:
        yield totals
    finally:
        for name, original in originals.items():
            setattr(ort.InferenceSession, name, original)


@contextmanager
def _ort_profiling(folder: Path):
    """Every InferenceSession created inside has ONNX Runtime's profiler on."""
    sessions: list = []
    original = ort.InferenceSession.__init__

    def init(self, path_or_bytes, sess_options=None, *args, **kwargs):
        opts = sess_options or ort.SessionOptions()
        opts.enable_profiling = True
        opts.profile_file_prefix = str(folder / Path(str(path_or_bytes)).stem)
        original(self, path_or_bytes, opts, *args, **kwargs)
        sessions.append(self)

    ort.InferenceSession.__init__ = init
    try:
        yield sessions
    finally:
        ort.InferenceSession.__init__ = original


def _operator_totals(sessions: list, top: int) -> dict:
    """{graph: [{op, ms, share}]} from the profiles of the sessions (ends their profiling)."""
    per_graph: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for session in sessions:
        graph = Path(str(getattr(session, "_model_path", "graph"))).stem
        events = json.loads(Path(session.end_profiling()).read_text())
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                per_graph[graph][e["args"].get("op_name", "?")] += e["dur"] / 1e3
    out = {}
    for graph, ops in per_graph.items():
        total = sum(ops.values()) or 1.0
        out[graph] = [
            {"op": op, "ms": ms, "share": ms / total}
            for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:top]
        ]
    return out


def _hotspots(prof: cProfile.Profile, top: int) -> list[dict]:
    stats = {
        k: v for k, v in pstats.Stats(prof).stats.items() if "onnxruntime" not in k[2]
    }  # graph time is pass 1's business
    total = sum(v[2] for v in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "function": f"{Path(f).name}:{line}({name})",
            "own_s": v[2],
            "share": v[2] / total,
            "calls": v[1],
        }
        for (f, line, name), v in rows
    ]
