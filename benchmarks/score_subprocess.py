"""`cognet-batch score` end to end in a subprocess, with the child's own peak RSS: the
input-size series of `cognet-bench`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from cognet.benchmarks.settings import Context, Settings
from cognet.benchmarks.workload import Pool, repeat_patients
from cognet.core.files import atomic_path

# `cognet-batch` in a child that writes its own peak RSS (VmHWM) at exit: the rusage of a
# child is no good here, Linux carries the parent's peak into it across fork + exec.
CHILD = """\
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
                CHILD,
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
        rss = "-" if rss_mb is None else f"{rss_mb:.0f}"
        say(
            f"cognet-batch score {rows:>8} rows: {seconds:7.1f}s, "
            f"{point['visits_per_s']:8.1f} scored visits/s, peak RSS {rss} MB"
            + (f" FAILED ({point['error']})" if rc else "")
        )
    return out


def write_input(pool: Pool, rows: int, path: Path) -> int:
    """A visits file of `rows` rows: the pool's patients repeated under new ids; returns the
    number of visits to score (last visits of the patients whose rows are all in)."""
    table = pool.table
    table = repeat_patients(table, -(-rows // len(table))).slice(0, rows)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return int(table["medications"].null_count)
