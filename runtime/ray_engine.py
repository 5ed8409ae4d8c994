"""`cognet-batch score --engine ray`: the local engine's `Scorer` over a Ray cluster (Ray Data).

    summary = score("visits/", "model", "recs", RayOptions(address="auto", num_workers=8))

Ray is imported lazily; without it `import_ray` raises an InputError that says how to
install it. The run, stage by stage (each a Ray task or one Ray Data execution):

1. plan (a task): INPUT is a Parquet file, a directory (its `*.parquet`, recursively) or a
   glob. The files are taken in name order, and a row's number is its position in them (for
   one file, its row in the file): the numbering of the local engine, that the rejects and
   the first-holder rule of duplicate visit_ids rely on. Only footers are read: readable
   files, contract columns, rows per row group.
2. duplicates: the visit_ids that several rows with a complete key hold (a shuffle of the
   key columns). The first row keeps its visit; the others are rejected `duplicate_visit_id`
   and serve as no history, as in local mode, whichever workers the rows reach.
3. group: every row goes to bucket hash(patient_id) % B, so that all the visits of a patient
   reach one worker together; a bucket's rows, sorted by patient, visit_seq and row number,
   are packed into one Arrow IPC payload, one block per bucket, materialized.
4. score: a pool of `num_workers` actors; each loads the model once (one `Scorer`, on
   `gpus_per_worker` GPUs or `threads_per_worker` CPU threads) and scores a bucket per call,
   returning its recommendations, rejects, counts (and metric rows with score_all).
5. write: `write_parquet` of the recommendations to OUT and of the rejects to
   `writer.rejects_path(OUT)`, two directories staged beside their place and moved in at the
   end, then the local engine's summary, whose invariant
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
  actors): 0.5 s instead of 13-22 s per shuffle stage of the tests' 248 rows, warm.
- A bucket is one row of one block: Ray Data hands whole blocks to an actor, so buckets
  left in one block would all go to one worker.

File system work (listing, footers, moving the outputs in) runs in Ray tasks and the model
travels through the object store: a `ray://` client needs neither INPUT nor OUT, which are
paths on a file system that every node of the cluster sees.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from cognet.runtime import reader, writer
from cognet.runtime.outputs import REJECTS_SCHEMA, output_schema
from cognet.runtime.scorer import Scorer

from cognet.core import metrics
from cognet.core.ddi import DDIPolicy
from cognet.core.errors import InputError, one_line, where
from cognet.core.manifest import load_manifest

log = logging.getLogger(__name__)

INSTALL_HINT = "--engine ray needs Ray: pip install 'cognet[ray]'"
ROW, BUCKET = reader.ROW, "_bucket"
KEYS = ["patient_id", "visit_id", "visit_seq"]
COLUMNS = reader.INPUT_SCHEMA.names
COUNTS = ("rows_read", "rows_scored", "rows_rejected", "rows_skipped", "unknown_codes",
          "visits_evaluated")  # fmt: skip
MAX_READ_TASKS = 1000
DATA_CONTEXT = {"enable_progress_bars": False, "shuffle_strategy": "sort_shuffle_pull_based"}
_MARK = "<<cognet-input-error>>"  # brackets an InputError's message through Ray's exceptions


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide to run.

    address: None starts Ray on this machine for the run (or uses the Ray this process
    already started); "auto" joins the cluster of this node; "ray://HOST:10001" connects as
    a client. num_workers: scoring actors (default: as many as the cluster's CPUs, or GPUs
    with gpus_per_worker, hold). threads_per_worker: CPU threads of each actor's Scorer,
    reserved as Ray CPUs. gpus_per_worker: GPUs of each actor (a fraction shares a GPU).
    block_rows: rows per bucket, what a worker scores at a time (more buckets when that
    makes fewer than 4 per worker).
    """

    address: str | None = None
    num_workers: int | None = None
    threads_per_worker: int = 1
    gpus_per_worker: float = 0.0
    block_rows: int = 16384

    def __post_init__(self):
        if (self.num_workers or 1) < 1 or self.threads_per_worker < 1 or self.block_rows < 1:
            raise InputError("workers, threads per worker and block rows must be >= 1")
        if self.gpus_per_worker < 0:
            raise InputError("--gpus-per-worker must be >= 0")


@dataclass(frozen=True)
class ScoreOptions:
    """The local engine's options, for every worker's Scorer."""

    device: str = "auto"
    beam: int | None = None
    batch_size: int | None = None
    max_history_visits: int | None = None
    score_all: bool = False
    explain: bool = False
    ddi: DDIPolicy | None = None


def import_ray():
    """The ray module (with ray.data), or InputError with the install command."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise InputError(INSTALL_HINT) from None
    return ray


def score(input_path: str | Path, model_dir: str | Path, out: str | Path,
          options: RayOptions = RayOptions(), score_options: ScoreOptions = ScoreOptions(),
          verbose: bool = False) -> dict:  # fmt: skip
    """Score INPUT on Ray into the directories OUT and writer.rejects_path(OUT).

    Returns the local engine's summary plus engine, workers (workers_used: those that got
    a bucket), threads_per_worker, gpus_per_worker, input_files, buckets, stage_seconds.
    """
    so = score_options
    if options.gpus_per_worker and so.device == "cpu":
        raise InputError("--gpus-per-worker needs --device auto, cuda or tensorrt")
    if so.device in ("cuda", "tensorrt") and not options.gpus_per_worker:
        raise InputError(f"--device {so.device} with --engine ray needs --gpus-per-worker")
    ray = import_ray()
    started = time.perf_counter()
    manifest = load_manifest(model_dir)  # a bad model directory fails here, not in a worker
    out = os.path.abspath(out)
    rejects = str(writer.rejects_path(out))
    with _ray_session(ray, options.address, verbose), _input_errors():
        plan = ray.remote(num_cpus=0)(_marked(_plan))
        files = ray.get(plan.remote(os.path.abspath(input_path), [out, rejects]))
        workers = _workers(ray, options)
        model = {str(p.relative_to(model_dir)): p.read_bytes()
                 for p in sorted(Path(model_dir).rglob("*")) if p.is_file()}  # fmt: skip
        load_seconds = time.perf_counter() - started
        run = _Run(ray, files, so, options, workers)
        rows = run.execute(model, out, rejects)
    summary = _summary(files, rows, so, run.stages)
    summary.update(
        output=out, rejects=rejects, load_seconds=round(load_seconds, 3),
        beam=so.beam or manifest.beam, workers=workers, threads_per_worker=summary["threads"],
        threads=summary["threads"] * workers, gpus_per_worker=options.gpus_per_worker,
        buckets=run.buckets,
    )  # fmt: skip
    return summary


def _plan(source: str, outputs: list[str]) -> reader.InputFiles:
    """Ray task: the input's plan, after checking that the outputs may be written."""
    files = reader.plan_input(source)
    for path in outputs:
        _check_out(path)
    return files


def _read_units(
    batch: pa.Table, files: reader.InputFiles, columns: list[str], buckets: int
) -> pa.Table:
    """Ray Data UDF: the rows of the row groups in `batch` (columns file, group, first),
    cast to reader.INPUT_SCHEMA's types, with their row number (and bucket when buckets)."""
    tables = []
    for i, g, first in zip(*(batch[c].to_pylist() for c in ("file", "group", "first")),
                           strict=True):  # fmt: skip
        path = files.paths[i]
        try:
            table = pq.ParquetFile(path).read_row_group(g, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
        table = reader.cast_input(table, path) if columns == COLUMNS else _cast_keys(table, path)
        table = table.append_column(ROW, pa.array(np.arange(first, first + len(table))))
        if buckets:
            table = table.append_column(BUCKET, pa.array(_buckets(table, buckets)))
        tables.append(table)
    return pa.concat_tables(tables)


def _cast_keys(table: pa.Table, path: str) -> pa.Table:
    out = {}
    for name in KEYS:
        kind = reader.INPUT_SCHEMA.field(name).type
        try:
            out[name] = table[name].cast(kind)
        except (pa.ArrowException, ValueError) as exc:
            detail = one_line(exc)
            raise InputError(f"{where(path, name)}: cannot read as {kind} ({detail})") from None
    return pa.table(out)


def _buckets(table: pa.Table, buckets: int) -> np.ndarray:
    """int64 [rows]: a stable hash of patient_id (the same in every process, unlike Python's
    hash) modulo buckets; rows without a patient_id are spread by row number."""
    from pandas.util import hash_array

    pid = table["patient_id"].to_numpy(zero_copy_only=False).astype(object)
    out = (hash_array(pid) % np.uint64(buckets)).astype(np.int64)
    null = ~table["patient_id"].is_valid().to_numpy(zero_copy_only=False)
    out[null] = table[ROW].to_numpy()[null] % buckets
    return out


def _complete(table: pa.Table) -> pa.ChunkedArray:
    """bool [rows]: patient_id, visit_id and visit_seq present (else missing_key)."""
    return pc.and_(pc.and_(table["patient_id"].is_valid(), table["visit_id"].is_valid()),
                   table["visit_seq"].is_valid())  # fmt: skip


def _visit_rows(table: pa.Table) -> pa.Table:
    """Ray Data UDF: visit_id and row number of the rows with a complete key."""
    return table.filter(_complete(table)).select(["visit_id", ROW])


def _repeated(table: pa.Table) -> pa.Table:
    """Ray Data UDF: the visit_ids held by several rows, with their first row (columns of
    `aggregate(Count(), Min(ROW))`, by position: their names vary with Ray's version)."""
    visit_id, n, first = table.columns
    keep = pc.greater(n, 1)
    return pa.table({"visit_id": visit_id.filter(keep), "first": first.filter(keep)})


def _pack(table: pa.Table) -> pa.Table:
    """Ray Data UDF (map_groups): one bucket's rows, sorted by patient, visit_seq and row
    number (nulls last), as one row holding their Arrow IPC stream."""
    table = table.sort_by([("patient_id", "ascending"), ("visit_seq", "ascending"),
                           (ROW, "ascending")], null_placement="at_end")  # fmt: skip
    payload = _to_ipc(table.drop_columns([BUCKET]))
    return pa.table({"payload": pa.array([payload], pa.large_binary())})


def _unpack(batch: pa.Table, column: str) -> pa.Table:
    """Ray Data UDF: the tables packed in `column`."""
    return pa.concat_tables([_from_ipc(p) for p in batch[column].to_pylist()])


def _to_ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _from_ipc(payload: bytes) -> pa.Table:
    return pa.ipc.open_stream(payload).read_all()


# -- scoring ------------------------------------------------------------------------------------
class BucketScorer:
    """Scores buckets of whole patients (rows sorted as `_pack` sorts them) with one Scorer.

    model_files: the model directory's files (name -> bytes); duplicates: visit_id -> row
    number of its first holder, for the visit_ids that several rows hold.
    """

    def __init__(self, model_files: dict[str, bytes], options: ScoreOptions, threads: int,
                 files: reader.InputFiles, duplicates: dict[str, int]):  # fmt: skip
        self._model = tempfile.TemporaryDirectory(prefix="cognet-model-")
        for name, data in model_files.items():
            Path(self._model.name, name).parent.mkdir(parents=True, exist_ok=True)
            Path(self._model.name, name).write_bytes(data)
        self.options, self.files, self.duplicates = options, files, duplicates
        self.scorer = Scorer(self._model.name, device=options.device, beam=options.beam,
                             batch_size=options.batch_size, threads=threads,
                             max_history_visits=options.max_history_visits,
                             ddi=options.ddi)  # fmt: skip
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Ray Data UDF: a result row (see `bucket`) per packed bucket of `batch`."""
        return pa.concat_tables([self.bucket(_from_ipc(p)) for p in batch["payload"].to_pylist()])

    def bucket(self, table: pa.Table) -> pa.Table:
        """One row: the bucket's recommendations and rejects (Arrow IPC), its counts (JSON),
        and with score_all its per-patient metric rows (.npy, first column: the patient's
        first evaluated row number, which orders patients as the local engine does)."""
        started = time.perf_counter()
        self._check_seq(table)
        later = self._later_holders(table)
        kept = table.filter(pa.array(~later))
        counts = dict.fromkeys(COUNTS, 0)
        counts.update(rows_read=len(table), rows_rejected=int(later.sum()))
        reasons = {"duplicate_visit_id": int(later.sum())} if later.any() else {}
        recs, rejects, metrics = [], [_duplicate_rejects(table.filter(pa.array(later)))], []
        opts = self.options
        chunks = self.scorer.score_batches(
            [kept], score_all=opts.score_all, explain=opts.explain, source=self.files.source
        )
        for chunk in chunks:
            recs.append(chunk.recommendations)
            rejects.append(chunk.rejects)
            for key in COUNTS[1:]:
                counts[key] += getattr(chunk, key)
            for reason, n in chunk.reject_reasons.items():
                reasons[reason] = reasons.get(reason, 0) + n
            if chunk.patient_metrics is not None:
                metrics.append(chunk.patient_metrics)
        recs = pa.concat_tables(recs) if recs else output_schema(opts.explain).empty_table()
        if len(recs) != counts["rows_scored"]:
            raise RuntimeError(f"{len(recs)} recommendations for {counts}")
        stats = {**counts, "reject_reasons": reasons, "seconds": time.perf_counter() - started,
                 "providers": self.scorer.providers, "threads": self.scorer.threads,
                 "batch_size": self.scorer.batch_size, "worker": self.worker}  # fmt: skip
        return pa.table({
            "recs": pa.array([_to_ipc(recs)], pa.large_binary()),
            "rejects": pa.array([_to_ipc(pa.concat_tables(rejects))], pa.large_binary()),
            "stats": [json.dumps(stats)],
            "metrics": pa.array([_metric_rows(kept, recs, metrics) if opts.score_all else None],
                                pa.large_binary()),
        })  # fmt: skip

    def _check_seq(self, table: pa.Table) -> None:
        """InputError when a patient has two rows with one visit_seq (as in local mode)."""
        keyed = table.filter(pc.and_(table["patient_id"].is_valid(), table["visit_seq"].is_valid()))
        if len(keyed) < 2:
            return
        pid, seq, rows = keyed["patient_id"], keyed["visit_seq"], keyed[ROW]
        twice = pc.and_(pc.equal(pid[1:], pid[:-1]), pc.equal(seq[1:], seq[:-1]))
        hits = np.flatnonzero(twice.to_numpy(zero_copy_only=False))
        if hits.size:
            i = int(hits[0]) + 1
            raise InputError(
                f"{self.files.where('visit_seq', rows[i].as_py())}: patient {pid[i].as_py()!r} "
                f"has visit_seq {seq[i].as_py()} twice (also at "
                f"{self.files.where('visit_seq', rows[i - 1].as_py())})"
            )  # fmt: skip

    def _later_holders(self, table: pa.Table) -> np.ndarray:
        """bool [rows]: a complete-key row whose visit_id an earlier row holds."""
        if not self.duplicates:
            return np.zeros(len(table), bool)
        complete = _complete(table).to_numpy(zero_copy_only=False)
        rows = table[ROW].to_numpy()
        first = [self.duplicates.get(v, r) for v, r in zip(table["visit_id"].to_pylist(), rows,
                                                             strict=True)]  # fmt: skip
        return complete & (rows != np.asarray(first, np.int64))


class _RayScorer(BucketScorer):
    """The Ray Data actor: a BucketScorer whose input errors reach the driver (`_marked`)."""

    def __init__(self, *args, **kwargs):
        _marked(super().__init__)(*args, **kwargs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return _marked(super().__call__)(batch)


def _duplicate_rejects(table: pa.Table) -> pa.Table:
    reason = pa.array(["duplicate_visit_id"] * len(table), pa.string())
    return pa.table([table[ROW], table["patient_id"], table["visit_id"], reason],
                    schema=REJECTS_SCHEMA)  # fmt: skip


def _metric_rows(kept: pa.Table, recs: pa.Table, metrics: list[np.ndarray]) -> bytes:
    """The chunks' metric rows (one per patient with a scored visit whose medications are
    known, in order of first appearance in `kept`) behind each patient's first such row."""
    evaluated = kept.filter(pc.and_(pc.is_in(kept["visit_id"], value_set=recs["visit_id"]),
                                    kept["medications"].is_valid()))  # fmt: skip
    first = evaluated[ROW].to_numpy()[reader.patient_starts(evaluated)] if len(evaluated) else []
    rows = np.concatenate(metrics) if metrics else np.zeros((0, len(metrics.PATIENT_COLUMNS)))
    if len(first) != len(rows):
        raise RuntimeError(f"{len(first)} patients evaluated, {len(rows)} metric rows")
    buf = io.BytesIO()
    np.save(buf, np.column_stack([np.asarray(first, np.float64), rows]), allow_pickle=False)
    return buf.getvalue()


# -- the run ------------------------------------------------------------------------------------
class _Run:
    """Stages 2-5 over the planned input (see the module docstring)."""

    def __init__(self, ray, files: reader.InputFiles, so: ScoreOptions, options: RayOptions,
                 workers: int):  # fmt: skip
        self.ray, self.files, self.so, self.options, self.workers = ray, files, so, options, workers
        self.buckets = max(4 * workers, math.ceil(files.num_rows / options.block_rows))
        self.stages: dict[str, float] = {}

    def execute(self, model: dict[str, bytes], out: str, rejects: str) -> list[dict]:
        """The buckets' rows of stats and metrics, after the outputs are in place."""
        staged = [(f"{out}.tmp-{uuid.uuid4().hex[:8]}", out, output_schema(self.so.explain)),
                  (f"{rejects}.tmp-{uuid.uuid4().hex[:8]}", rejects, REJECTS_SCHEMA)]  # fmt: skip
        rows = []
        if self.files.num_rows:
            duplicates = self._timed("duplicates", self._duplicates)
            packed = self._timed("group", self._group)
            scored = self._timed("score", self._score, packed, model, duplicates)
            rows = self._timed("write", self._write, scored, staged)
        commit = self.ray.remote(num_cpus=0)(_marked(_commit))
        self.ray.get(commit.remote(staged))
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
        return items.map_batches(_marked(_read_units), batch_size=1, batch_format="pyarrow",
                                 fn_kwargs=kwargs)  # fmt: skip

    def _duplicates(self) -> dict[str, int]:
        try:
            from ray.data.aggregate import Count, Min
        except ImportError:  # older Ray (2.40) keeps them here
            from ray.data._internal.aggregate import Count, Min

        repeated = (
            self._read(KEYS).map_batches(_visit_rows, batch_format="pyarrow")
            .groupby("visit_id")
            .aggregate(Count(), Min(ROW))
            .map_batches(_repeated, batch_format="pyarrow").take_all()
        )  # fmt: skip
        return {r["visit_id"]: int(r["first"]) for r in repeated}

    def _group(self):
        return (
            self._read(COLUMNS, self.buckets)
            .groupby(BUCKET)
            .map_groups(_marked(_pack), batch_format="pyarrow")
            .repartition(self.buckets)  # one block per bucket (Ray gives blocks to actors)
            .materialize()
        )

    def _score(self, packed, model: dict[str, bytes], duplicates: dict[str, int]):
        threads = self.options.threads_per_worker
        return packed.map_batches(
            _RayScorer, batch_size=1, batch_format="pyarrow",
            compute=self.ray.data.ActorPoolStrategy(size=self.workers), num_cpus=threads,
            num_gpus=self.options.gpus_per_worker or None,
            fn_constructor_kwargs={"model_files": model, "options": self.so, "threads": threads,
                                   "files": self.files, "duplicates": duplicates},
        ).materialize()  # fmt: skip

    def _write(self, scored, staged: list[tuple[str, str, pa.Schema]]) -> list[dict]:
        for column, (tmp, _, _) in zip(("recs", "rejects"), staged, strict=True):
            scored.map_batches(_unpack, batch_size=1, batch_format="pyarrow",
                               fn_kwargs={"column": column}).write_parquet(tmp)  # fmt: skip
        return scored.select_columns(["stats", "metrics"]).take_all()


def _check_out(path: str) -> None:
    """InputError unless `path` is free or an earlier output (a Parquet file or a directory
    of Parquet files), which the run replaces."""
    p = Path(path)
    if p.is_dir():
        others = [q.name for q in p.iterdir() if not q.name.endswith(".parquet")]
        if others:
            raise InputError(f"{path}: holds other files than Parquet ({others[0]}); choose "
                             "another --out")  # fmt: skip
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
        if os.path.isdir(final):
            shutil.rmtree(final)
        elif os.path.exists(final):
            os.remove(final)
        os.replace(tmp, final)


def _summary(files: reader.InputFiles, rows: list[dict], so: ScoreOptions, stages: dict) -> dict:
    """The local engine's summary from the buckets' stats; checks the row invariant."""
    totals = dict.fromkeys(COUNTS, 0)
    reasons: dict[str, int] = {}
    metric_rows, busy, last = [], set(), {"providers": None, "threads": 0, "batch_size": None}
    for row in rows:
        stats = json.loads(row["stats"])
        for key in COUNTS:
            totals[key] += stats[key]
        for reason, n in stats["reject_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
        last = stats
        busy.add(stats["worker"])
        if row["metrics"] is not None:
            metric_rows.append(np.load(io.BytesIO(row["metrics"]), allow_pickle=False))
    accounted = totals["rows_scored"] + totals["rows_rejected"] + totals["rows_skipped"]
    if not totals["rows_read"] == accounted == files.num_rows:
        raise RuntimeError(f"row accounting is off ({files.num_rows} rows in the files): {totals}")
    seconds = sum(stages.values())
    summary = {
        "input": files.source, **totals, "reject_reasons": dict(sorted(reasons.items())),
        "resumed_rows": 0, "seconds": round(seconds, 3),
        "visits_per_s": round(totals["rows_scored"] / max(seconds, 1e-9), 2),
        "providers": last["providers"], "threads": last["threads"],
        "batch_size": last["batch_size"], "ddi": (so.ddi or DDIPolicy()).to_json(),
        "engine": "ray", "input_files": len(files.paths), "workers_used": len(busy),
        "stage_seconds": stages,
    }  # fmt: skip
    if so.score_all:
        both = np.concatenate(metric_rows) if metric_rows else np.zeros((0, 1))
        both = both[np.argsort(both[:, 0], kind="stable")]  # patients in file order
        summary["metrics"] = (metrics.report(both[:, 1:], totals["visits_evaluated"])
                              if len(both) else None)  # fmt: skip
    return summary


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


def _workers(ray, options: RayOptions) -> int:
    """options.num_workers, or as many as the cluster holds; InputError when they do not fit."""
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    per_gpu = options.gpus_per_worker
    fits = int(min(cpus // options.threads_per_worker, gpus // per_gpu if per_gpu else math.inf))
    n = options.num_workers or max(fits, 1)
    if n > fits:
        raise InputError(f"{n} worker(s) of {options.threads_per_worker} CPU(s) and "
                         f"{per_gpu:g} GPU(s) do not fit in the Ray cluster ({cpus:g} CPUs, "
                         f"{gpus:g} GPUs)")  # fmt: skip
    return n


def _marked(func: Callable) -> Callable:
    """func, with the message of an InputError it raises (in a Ray worker) bracketed by
    _MARK, so that the driver finds it in whatever Ray wraps it in (`_input_errors`)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except InputError as exc:
            raise RuntimeError(f"{_MARK}{exc}{_MARK}") from None

    return wrapper


@contextlib.contextmanager
def _input_errors() -> Iterator[None]:
    """Raise a marked error that came back from a Ray worker as its one-line InputError."""
    try:
        yield
    except InputError:
        raise
    except Exception as exc:
        found = re.search(f"{re.escape(_MARK)}(.*?){re.escape(_MARK)}", str(exc), re.S)
        if found:
            raise InputError(" ".join(found.group(1).split())) from None
        raise
