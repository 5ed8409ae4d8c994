"""Where the time of `ort-cpu` (or `ort-cuda`, or `ort-cpu-gpupath`: the GPU's code path on the
CPU provider) goes: per graph, per ONNX operator, and in Python.

Three passes over the same batches with a fresh `cognet.runtime.Scorer` each:

1. graphs: `onnxruntime.InferenceSession.run` is wrapped with a timer (about a microsecond
   per call), so the time inside each graph and the rest ("Python": the beam driver's numpy,
   history assembly, Arrow in and out) add up to the wall time of the pass;
2. operators: ONNX Runtime's own profiler on every session, summed per operator type;
3. Python: cProfile, the functions with the most own time, as shares of the Python time
   (cProfile slows Python code down, so compare them with each other, not with pass 1);
   on a GPU's code path (a CUDA provider, or `gpu_path` on the CPU) the same pass counts the
   copies between host and device the runtime asks for, per visit.

The host's time per visit (pass 1's time outside the graphs) bounds a GPU's visits/s: a
visit cannot be scored faster than the host prepares it and reads its answer.

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
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
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

    def score(s) -> int:
        """The visits scored."""
        return sum(c.rows_scored for b in batches for c in s.score_table(b.table))

    s = scorer()
    with _timed_runs() as graph_s:
        started = time.perf_counter()
        visits = score(s)
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
        # only the graphs the pass ran: a model's load checks every graph once
        ops = {g: v for g, v in _operator_totals(sessions, top).items() if g in graphs}
        del s

    prof = cProfile.Profile()
    s = scorer()
    with _counted_copies() as copies:
        prof.enable()
        score(s)
        prof.disable()
    return {
        "engine": "ort-cpu-gpupath" if gpu_path else f"ort-{device}",
        "beam": beam,
        "batch_size": batch_size,
        "visits": visits,
        "threads": threads,
        "wall_s": total,
        "graphs": graphs,
        "python_s": total - in_graphs,
        "python_share": (total - in_graphs) / total,
        "host_us_per_visit": (total - in_graphs) / visits * 1e6,
        "copies": _per_visit(copies, visits) if gpu_path or device != "cpu" else None,
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

    with ExitStack() as stack:
        for name, original in originals.items():
            stack.enter_context(_patched(ort.InferenceSession, name, timed(original)))
        yield totals


@contextmanager
def _counted_copies():
    """{"to_device" / "to_host": [calls, bytes]} of the transfers the runtime asks onnxruntime
    for: numpy feeds of `InferenceSession.run` and its results, `IOBinding.bind_cpu_input`,
    `OrtValue.ortvalue_from_numpy` / `update_inplace` (to the device), `OrtValue.numpy()`
    (to the host). On the CPU provider nothing moves, but the same calls name what a GPU
    copies."""
    counts = {"to_device": [0, 0], "to_host": [0, 0]}

    def add(way: str, value) -> None:
        if isinstance(value, np.ndarray):
            counts[way][0] += 1
            counts[way][1] += value.nbytes

    def run(original):
        def wrapped(self, *args, **kwargs):
            feed = args[1] if len(args) > 1 else kwargs.get("input_feed", {})
            for value in feed.values():
                add("to_device", value)
            out = original(self, *args, **kwargs)
            for value in out:
                add("to_host", value)
            return out

        return wrapped

    def feeding(original, at: int):
        def wrapped(*args, **kwargs):
            add("to_device", args[at])
            return original(*args, **kwargs)

        return wrapped

    def reading(original):
        def wrapped(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            add("to_host", out)
            return out

        return wrapped

    from_numpy = ort.OrtValue.__dict__["ortvalue_from_numpy"].__func__  # a classmethod's
    hooks = [
        (ort.InferenceSession, "run", run(ort.InferenceSession.run)),
        (ort.IOBinding, "bind_cpu_input", feeding(ort.IOBinding.bind_cpu_input, 2)),
        (ort.OrtValue, "update_inplace", feeding(ort.OrtValue.update_inplace, 1)),
        (ort.OrtValue, "numpy", reading(ort.OrtValue.numpy)),
        (ort.OrtValue, "ortvalue_from_numpy", classmethod(feeding(from_numpy, 1))),
    ]
    with ExitStack() as stack:
        for cls, name, hook in hooks:
            stack.enter_context(_patched(cls, name, hook))
        yield counts


@contextmanager
def _patched(cls: type, name: str, value):
    """`cls.name` is `value` inside; what it was (its own or inherited) after."""
    own = name in cls.__dict__
    before = cls.__dict__.get(name)
    setattr(cls, name, value)
    try:
        yield
    finally:
        if own:
            setattr(cls, name, before)
        else:
            delattr(cls, name)


def _per_visit(counts: dict, visits: int) -> dict:
    """Each way's calls and bytes, in all and per visit."""
    return {
        way: {
            "calls": calls,
            "bytes": size,
            "calls_per_visit": calls / visits,
            "bytes_per_visit": size / visits,
        }
        for way, (calls, size) in counts.items()
    }


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
