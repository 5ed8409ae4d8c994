"""`cognet-batch score --engine ray`: the local engine's `Scorer` over a Ray cluster (Ray Data).

    summary = score("visits/", "model", "recs", RayOptions(address="auto", num_workers=8))

Ray is imported lazily; without it `import_ray` raises an InputError that says how to
install it. The run, stage by stage (each a Ray task or one Ray Data execution):

1. plan (a task): the outputs are checked first (none may be, hold or be read as an input:
   `preflight.check_overlap`), then OUT is locked for the run (`lock`, by an actor that
   lives as long as the run). INPUT is a Parquet file, a directory (its `*.parquet`,
   recursively) or a glob. The files are taken in name order, and a row's number is its
   position in them (for one file, its row in the file): the numbering of the local
   engine, that the rejects and the first-holder rule of duplicate visit_ids rely on.
   Only footers are read: readable files, contract columns, rows per row group.
2. duplicates: the visit_ids that several rows with a complete key hold (a shuffle of the
   key columns). The first row keeps its visit; the others are rejected `duplicate_visit_id`
   and serve as no history, as in local mode, whichever workers the rows reach.
3. group: every row goes to bucket hash(patient_id) % B, so that all the visits of a patient
   reach one worker together; a bucket's rows, sorted by patient, visit_seq and row number,
   are packed into one Arrow IPC payload, one block per bucket, materialized.
4. score: a pool of `num_workers` actors (`ray_tasks.BucketScorer`); each loads the model
   once (one `Scorer`, on `gpus_per_worker` GPUs or `ScoreOptions.threads` CPU threads) and
   scores a bucket per call, returning its recommendations, rejects, counts (and metric rows
   with score_all).
5. write: `write_parquet` of the recommendations to OUT and of the rejects to
   `writer.rejects_path(OUT)`, two directories staged beside their place and moved in at the
   end, then the local engine's summary (`cognet.runtime.summary`), whose invariant
   rows_read == scored + rejected + skipped == rows of the files is checked.

Choices, measured with Ray 2.60 on 2 CPUs:
- Rows are read by row group with pyarrow inside Ray Data tasks (`from_items` of the row
  groups, then `map_batches`) rather than by `ray.data.read_parquet`, which does not tell a
  row's position in its file: the row numbers above need it.
- A stage's output is materialized before the next: actors hold their CPUs for the whole
  execution, so a read or shuffle task queued behind a pool that took every CPU waits
  forever (it did, a pool of 2 on 2 CPUs). Payloads stay in the object store (it spills to
  disk).
- The sort-based shuffle (tasks) instead of Ray 2.60's default hash shuffle (aggregator
  actors): many times faster per shuffle stage on small inputs.
- A bucket is one row of one block: Ray Data hands whole blocks to an actor, so buckets
  left in one block would all go to one worker.

File system work (listing, footers, moving the outputs in) runs in Ray tasks and the model
travels through the object store: a `ray://` client needs neither INPUT nor OUT, which are
paths on a file system that every node of the cluster sees.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cognet.core.errors import InputError, one_line
from cognet.core.files import commit_dir, temp_path
from cognet.core.manifest import load_manifest
from cognet.runtime import preflight, reader, writer
from cognet.runtime.options import GPU_DEVICES, ScoreOptions
from cognet.runtime.outputs import REJECTS_SCHEMA, output_schema
from cognet.runtime.ray_tasks import (
    BUCKET,
    COLUMNS,
    MARK,
    ROW,
    RayScorer,
    locked,
    marked,
    pack,
    read_units,
    repeated_visits,
    unpack,
    visit_rows,
)
from cognet.runtime.signature import RunFlags
from cognet.runtime.summary import Files, Setup, Timing, check_rows, run_summary, total_counts

log = logging.getLogger(__name__)

INSTALL_HINT = "--engine ray needs Ray: pip install 'cognet[ray]'"
MAX_READ_TASKS = 1000
DATA_CONTEXT = {"enable_progress_bars": False, "shuffle_strategy": "sort_shuffle_pull_based"}


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide to run (how to score: `ScoreOptions`, whose `threads`, default 1,
    are each worker's CPU threads, reserved as Ray CPUs).

    address: None starts Ray on this machine for the run (or uses the Ray this process
    already started); "auto" joins the cluster of this node; "ray://HOST:10001" connects as
    a client. num_workers: scoring actors (default: as many as the cluster's CPUs, or GPUs
    with gpus_per_worker, hold). gpus_per_worker: GPUs of each actor (a fraction shares a
    GPU). block_rows: rows per bucket, what a worker scores at a time (more buckets when
    that makes fewer than 4 per worker).
    """

    address: str | None = None
    num_workers: int | None = None
    gpus_per_worker: float = 0.0
    block_rows: int = 16384

    def __post_init__(self):
        if (self.num_workers or 1) < 1 or self.block_rows < 1:
            raise InputError("workers and block rows must be >= 1")
        if self.gpus_per_worker < 0:
            raise InputError("--gpus-per-worker must be >= 0")


def import_ray():
    """The ray module (with ray.data), or InputError with the install command."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise InputError(INSTALL_HINT) from None
    return ray


def score(
    input_path: str | Path,
    model_dir: str | Path,
    out: str | Path,
    options: RayOptions = RayOptions(),
    score_options: ScoreOptions = ScoreOptions(),
    flags: RunFlags = RunFlags(),
    verbose: bool = False,
) -> dict:
    """Score INPUT on Ray into the directories OUT and writer.rejects_path(OUT).

    flags: --all (`score_all`) and --explain; a bucket's rows are always sorted (`sort`
    changes nothing) and `split` is the local engine's (an InputError here).
    Returns the local engine's summary plus engine, workers (workers_used: those that got
    a bucket), threads_per_worker, gpus_per_worker, input_files, buckets, stage_seconds.
    """
    if flags.split is not None:
        raise InputError("--split is for --engine local; filter the input files instead")
    device = score_options.device
    if options.gpus_per_worker and device == "cpu":
        raise InputError("--gpus-per-worker needs --device auto, cuda or tensorrt")
    if device in GPU_DEVICES and not options.gpus_per_worker:
        raise InputError(f"--device {device} with --engine ray needs --gpus-per-worker")
    ray = import_ray()
    started = time.perf_counter()
    manifest = load_manifest(model_dir)  # a bad model directory fails here, not in a worker
    out = os.path.abspath(out)
    rejects = str(writer.rejects_path(out))
    worker_options = replace(score_options, threads=score_options.threads or 1)
    with _ray_session(ray, options.address, verbose), _input_errors():
        plan = ray.remote(num_cpus=0)(marked(_plan))
        source, keep = os.path.abspath(input_path), score_options.keep_columns
        files = ray.get(plan.remote(source, out, keep))
        workers = _workers(ray, options, worker_options.threads)
        model = {
            str(p.relative_to(model_dir)): p.read_bytes()
            for p in sorted(Path(model_dir).rglob("*"))
            if p.is_file()
        }
        load_seconds = time.perf_counter() - started
        run = _Run(ray, files, worker_options, flags, options, workers)
        with locked(ray, out):
            rows = run.execute(model, out, rejects)
    stats = [json.loads(row["stats"]) for row in rows]
    totals = total_counts(stats)
    check_rows(totals, files.num_rows)
    last = stats[-1] if stats else {"providers": None, "threads": 0, "batch_size": None}
    end = manifest.special.end
    plan = score_options.plan(manifest.default_decoding(), manifest.default_target(), end=end)
    setup = Setup(
        score_options,
        plan.decoding,
        last["providers"],
        last["threads"] * workers,
        last["batch_size"],
        plan.ddi,
    )
    result = run_summary(
        Files(files.source, out, rejects),
        setup,
        totals,
        Timing(load_seconds, sum(run.stages.values()), totals["rows_scored"]),
        _metric_rows(rows) if flags.score_all else None,
    )
    result.update(
        engine="ray",
        input_files=len(files.paths),
        workers=workers,
        workers_used=len({s["worker"] for s in stats}),
        threads_per_worker=last["threads"],
        gpus_per_worker=options.gpus_per_worker,
        buckets=run.buckets,
        stage_seconds=run.stages,
    )
    return result


def _metric_rows(rows: list[dict]) -> np.ndarray:
    """The buckets' per-patient metric rows, patients in input order (each row came with
    its patient's first evaluated row number in column 0)."""
    parts = [np.load(io.BytesIO(r["metrics"]), allow_pickle=False) for r in rows if r["metrics"]]
    both = np.concatenate(parts) if parts else np.zeros((0, 1))
    return both[np.argsort(both[:, 0], kind="stable"), 1:]


def _plan(source: str, out: str, keep: tuple[str, ...]) -> reader.InputFiles:
    """Ray task: the input's plan, after checking that the outputs may be written and are
    no input (`preflight.check_overlap`, before any file is read)."""
    outputs = preflight.outputs_of(out)
    preflight.check_overlap(source, outputs)
    for label in ("--out", "rejects file"):
        _check_out(outputs[label])
    return reader.plan_input(source, keep)


# -- the run ------------------------------------------------------------------------------------
class _Run:
    """Stages 2-5 over the planned input (see the module docstring)."""

    def __init__(
        self,
        ray,
        files: reader.InputFiles,
        score_options: ScoreOptions,
        flags: RunFlags,
        options: RayOptions,
        workers: int,
    ):
        self.ray, self.files, self.options, self.workers = ray, files, options, workers
        # what every worker's BucketScorer gets (score_options.threads: its CPU threads)
        self.scoring = {
            "options": score_options,
            "score_all": flags.score_all,
            "explain": flags.explain,
        }
        self.buckets = max(4 * workers, math.ceil(files.num_rows / options.block_rows))
        self.stages: dict[str, float] = {}

    def execute(self, model: dict[str, bytes], out: str, rejects: str) -> list[dict]:
        """The buckets' rows of stats and metrics, after the outputs are in place."""
        schema = output_schema(self.scoring["explain"], self.files.kept)
        staged = [
            (str(temp_path(out)), out, schema),  # folders named as every temporary output
            (str(temp_path(rejects)), rejects, REJECTS_SCHEMA),
        ]
        rows = []
        try:
            if self.files.num_rows:
                duplicates = self._timed("duplicates", self._duplicates)
                packed = self._timed("group", self._group)
                scored = self._timed("score", self._score, packed, model, duplicates)
                rows = self._timed("write", self._write, scored, staged)
            commit = self.ray.remote(num_cpus=0)(marked(_commit))
            self.ray.get(commit.remote(staged))
        except BaseException:  # leave no partial output behind
            discard = self.ray.remote(num_cpus=0)(_discard)
            with contextlib.suppress(Exception):
                self.ray.get(discard.remote([tmp for tmp, _, _ in staged]))
            raise
        return rows

    def _timed(self, stage: str, func: Callable, *args):
        started = time.perf_counter()
        result = func(*args)
        self.stages[stage] = round(time.perf_counter() - started, 3)
        log.info("%s: %.1f s", stage, self.stages[stage])
        return result

    def _read(self, columns: list[str], buckets: int = 0):
        units = [{"file": f, "group": g, "first": r} for f, g, r in self.files.units]
        kwargs = {"files": self.files, "columns": columns, "buckets": buckets}
        items = self.ray.data.from_items(units, override_num_blocks=min(len(units), MAX_READ_TASKS))
        return items.map_batches(
            marked(read_units), batch_size=1, batch_format="pyarrow", fn_kwargs=kwargs
        )

    def _duplicates(self) -> dict[str, int]:
        try:
            from ray.data.aggregate import Count, Min
        except ImportError:  # older Ray (2.40) keeps them here
            from ray.data._internal.aggregate import Count, Min

        repeated = (
            self._read(list(reader.KEYS))
            .map_batches(visit_rows, batch_format="pyarrow")
            .groupby("visit_id")
            .aggregate(Count(), Min(ROW))
            .map_batches(repeated_visits, batch_format="pyarrow")
            .take_all()
        )
        return {r["visit_id"]: int(r["first"]) for r in repeated}

    def _group(self):
        return (
            self._read(COLUMNS, self.buckets)
            .groupby(BUCKET)
            .map_groups(marked(pack), batch_format="pyarrow")
            .repartition(self.buckets)  # one block per bucket (Ray gives blocks to actors)
            .materialize()
        )

    def _score(self, packed, model: dict[str, bytes], duplicates: dict[str, int]):
        return packed.map_batches(
            RayScorer,
            batch_size=1,
            batch_format="pyarrow",
            compute=self.ray.data.ActorPoolStrategy(size=self.workers),
            num_cpus=self.scoring["options"].threads,
            num_gpus=self.options.gpus_per_worker or None,
            fn_constructor_kwargs={
                "model_files": model,
                **self.scoring,
                "files": self.files,
                "duplicates": duplicates,
            },
        ).materialize()

    def _write(self, scored, staged: list[tuple[str, str, pa.Schema]]) -> list[dict]:
        for column, (tmp, _, _) in zip(("recs", "rejects"), staged, strict=True):
            tables = scored.map_batches(
                unpack, batch_size=1, batch_format="pyarrow", fn_kwargs={"column": column}
            )
            tables.write_parquet(tmp)
        return scored.select_columns(["stats", "metrics"]).take_all()


def _check_out(path: str) -> None:
    """InputError unless `path` is free or an earlier output (a Parquet file or a directory
    of Parquet files), which the run replaces."""
    p = Path(path)
    if p.is_dir():
        others = [q.name for q in p.iterdir() if not q.name.endswith(".parquet")]
        if others:
            raise InputError(
                f"{path}: holds other files than Parquet ({others[0]}); choose another --out"
            )
    elif p.exists() and not p.is_file():
        raise InputError(f"{path}: exists and is not a directory; choose another --out")


def _commit(staged: list[tuple[str, str, pa.Schema]]) -> None:
    """Ray task: move each staged directory to its place (with an empty Parquet file of its
    schema when nothing was written in it)."""
    for tmp, final, schema in staged:
        os.makedirs(tmp, exist_ok=True)
        if not any(name.endswith(".parquet") for name in os.listdir(tmp)):
            pq.write_table(schema.empty_table(), os.path.join(tmp, "part-empty.parquet"))
        _check_out(final)
        if os.path.exists(final) and not os.path.isdir(final):
            os.remove(final)
        commit_dir(tmp, final)


def _discard(folders: list[str]) -> None:
    """Ray task: remove the staged folders of a failed run."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


# -- Ray session and errors ---------------------------------------------------------------------
@contextlib.contextmanager
def _ray_session(ray, address: str | None, verbose: bool) -> Iterator[None]:
    """Connect to (or start) Ray with quiet logs and DATA_CONTEXT; shut Ray down afterwards
    only if this call started it."""
    started = not ray.is_initialized()
    if started:
        level = logging.INFO if verbose else logging.ERROR
        extra = {"include_dashboard": False} if address is None else {}
        try:
            ray.init(address=address, log_to_driver=verbose, logging_level=level, **extra)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            detail = one_line(exc)
            raise InputError(f"--address {address}: cannot connect to Ray ({detail})") from None
    loggers = [logging.getLogger(name) for name in ("ray", "ray.data")]
    levels = [lg.level for lg in loggers]
    if not verbose:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
    ctx = ray.data.DataContext.get_current()
    saved = {name: getattr(ctx, name) for name in DATA_CONTEXT if hasattr(ctx, name)}
    for name in saved:  # older Ray: no shuffle_strategy, its shuffle is sort-based
        setattr(ctx, name, DATA_CONTEXT[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ctx, name, value)
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        if started:
            ray.shutdown()


def _workers(ray, options: RayOptions, threads: int) -> int:
    """options.num_workers, or as many workers of `threads` CPUs as the cluster holds;
    InputError when they do not fit."""
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    per_gpu = options.gpus_per_worker
    fits = int(min(cpus // threads, gpus // per_gpu if per_gpu else math.inf))
    n = options.num_workers or max(fits, 1)
    if n > fits:
        raise InputError(
            f"{n} worker(s) of {threads} CPU(s) and {per_gpu:g} GPU(s) do not fit in the Ray "
            f"cluster ({cpus:g} CPUs, {gpus:g} GPUs)"
        )
    return n


@contextlib.contextmanager
def _input_errors() -> Iterator[None]:
    """Raise a marked error that came back from a Ray worker as its one-line InputError."""
    try:
        yield
    except InputError:
        raise
    except Exception as exc:
        found = re.search(f"{re.escape(MARK)}(.*?){re.escape(MARK)}", str(exc), re.S)
        if found:
            raise InputError(" ".join(found.group(1).split())) from None
        raise
