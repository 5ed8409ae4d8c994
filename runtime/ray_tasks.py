"""What runs inside Ray for `--engine ray` (`cognet.runtime.ray_engine` drives it): the Ray
Data UDFs that read, key and pack the input rows, and the scoring actor.

Every function here runs in a Ray worker: an `InputError` it raises is `marked` so that the
driver can tell it from Ray's own errors and exit 2 with its one line.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cognet.core.errors import InputError, one_line, where
from cognet.core.lock import claim
from cognet.runtime import reader, writer
from cognet.runtime.options import ScoreOptions
from cognet.runtime.outputs import COUNTS, METRIC_WIDTH, REJECTS_SCHEMA, output_schema
from cognet.runtime.scorer import Scorer
from cognet.runtime.summary import total_counts

ROW, BUCKET = reader.ROW, "_bucket"
COLUMNS = reader.INPUT_SCHEMA.names
MARK = "<<cognet-input-error>>"  # brackets an InputError's message through Ray's exceptions


# -- reading, keys and buckets ------------------------------------------------------------------
def read_units(
    batch: pa.Table, files: reader.InputFiles, columns: list[str], buckets: int
) -> pa.Table:
    """Ray Data UDF: the rows of the row groups in `batch` (columns file, group, first),
    cast to reader.INPUT_SCHEMA's types, with their row number (and bucket when buckets)."""
    tables = []
    units = zip(*(batch[c].to_pylist() for c in ("file", "group", "first")), strict=True)
    for i, g, first in units:
        path = files.paths[i]
        kept = [f.name for f in files.kept] if columns == COLUMNS else []
        try:
            read = pq.ParquetFile(path).read_row_group(g, columns=[*columns, *kept])
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
        table = reader.cast_input(read, path) if columns == COLUMNS else _cast_keys(read, path)
        table = table.append_column(ROW, pa.array(np.arange(first, first + len(table))))
        if kept:
            table = reader.keep(table, _typed(read, files.kept, path), kept)
        if buckets:
            table = table.append_column(BUCKET, pa.array(_buckets(table, buckets)))
        tables.append(table)
    return pa.concat_tables(tables)


def _typed(table: pa.Table, kept: tuple[pa.Field, ...], path: str) -> pa.Table:
    """The kept columns of `table` cast to the first file's types (every file's output part
    must have one schema)."""
    for field in kept:
        column = table[field.name]
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except (pa.ArrowException, ValueError) as exc:
                detail = one_line(exc)
                raise InputError(
                    f"{where(path, field.name)}: cannot read as {field.type}, its type in the "
                    f"first file ({detail})"
                ) from None
            table = table.set_column(table.schema.get_field_index(field.name), field, column)
    return table


def _cast_keys(table: pa.Table, path: str) -> pa.Table:
    out = {}
    for name in reader.KEYS:
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
    keys = pc.and_(table["patient_id"].is_valid(), table["visit_id"].is_valid())
    return pc.and_(keys, table["visit_seq"].is_valid())


def visit_rows(table: pa.Table) -> pa.Table:
    """Ray Data UDF: visit_id and row number of the rows with a complete key."""
    return table.filter(_complete(table)).select(["visit_id", ROW])


def repeated_visits(table: pa.Table) -> pa.Table:
    """Ray Data UDF: the visit_ids held by several rows, with their first row (columns of
    `aggregate(Count(), Min(ROW))`, by position: their names vary with Ray's version)."""
    visit_id, n, first = table.columns
    keep = pc.greater(n, 1)
    return pa.table({"visit_id": visit_id.filter(keep), "first": first.filter(keep)})


def pack(table: pa.Table) -> pa.Table:
    """Ray Data UDF (map_groups): one bucket's rows, sorted by patient, visit_seq and row
    number (nulls last), as one row holding their Arrow IPC stream."""
    order = [("patient_id", "ascending"), ("visit_seq", "ascending"), (ROW, "ascending")]
    table = table.sort_by(order, null_placement="at_end")
    payload = _to_ipc(table.drop_columns([BUCKET]))
    return pa.table({"payload": pa.array([payload], pa.large_binary())})


def unpack(batch: pa.Table, column: str) -> pa.Table:
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
    """Scores buckets of whole patients (rows sorted as `pack` sorts them) with one Scorer.

    model_files: the model directory's files (name -> bytes); options: the Scorer's (its
    `threads` are this worker's); score_all, explain: as `Scorer.score_batches` takes them;
    duplicates: visit_id -> row number of its first holder, for the visit_ids that several
    rows hold.
    """

    def __init__(
        self,
        model_files: dict[str, bytes],
        options: ScoreOptions,
        score_all: bool,
        explain: bool,
        files: reader.InputFiles,
        duplicates: dict[str, int],
    ):
        self._model = tempfile.TemporaryDirectory(prefix="cognet-model-")
        for name, data in model_files.items():
            Path(self._model.name, name).parent.mkdir(parents=True, exist_ok=True)
            Path(self._model.name, name).write_bytes(data)
        self.score_all, self.explain = score_all, explain
        self.files, self.duplicates = files, duplicates
        self._schema = output_schema(explain, files.kept)
        self.scorer = Scorer(self._model.name, options)
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
        chunks = list(
            self.scorer.score_batches(
                [kept], score_all=self.score_all, explain=self.explain, source=self.files.source
            )
        )
        duplicates = int(later.sum())
        own = {**dict.fromkeys(COUNTS, 0), "rows_rejected": duplicates, "reject_reasons": {}}
        if duplicates:
            own["reject_reasons"] = {"duplicate_visit_id": duplicates}
        counts = total_counts([own, *(chunk.counts() for chunk in chunks)])
        counts["rows_read"] = len(table)
        recs = [chunk.recommendations for chunk in chunks]
        recs = pa.concat_tables(recs) if recs else self._schema.empty_table()
        if len(recs) != counts["rows_scored"]:
            raise RuntimeError(f"{len(recs)} recommendations for {counts}")
        rejects = [_duplicate_rejects(table.filter(pa.array(later)))]
        rejects += [chunk.rejects for chunk in chunks]
        metrics = None
        if self.score_all:
            rows = [c.patient_metrics for c in chunks if c.patient_metrics is not None]
            metrics = _metric_rows(kept, recs, rows)
        stats = {
            **counts,
            "seconds": time.perf_counter() - started,
            "providers": self.scorer.providers,
            "threads": self.scorer.threads,
            "batch_size": self.scorer.batch_size,
            "worker": self.worker,
        }
        return pa.table(
            {
                "recs": pa.array([_to_ipc(recs)], pa.large_binary()),
                "rejects": pa.array([_to_ipc(pa.concat_tables(rejects))], pa.large_binary()),
                "stats": [json.dumps(stats)],
                "metrics": pa.array([metrics], pa.large_binary()),
            }
        )

    def _check_seq(self, table: pa.Table) -> None:
        """InputError when a patient has two rows with one visit_seq: the local reader's rule
        (`reader.continues`) over a bucket's rows, sorted by key (so only repeats remain)."""
        keyed = table.filter(pc.and_(table["patient_id"].is_valid(), table["visit_seq"].is_valid()))
        pid, seq, rows = (
            keyed["patient_id"].combine_chunks(),
            keyed["visit_seq"].to_numpy(),
            keyed[ROW],
        )
        same, prev_seq = reader.continues(pid, seq)
        hits = np.flatnonzero(same & (seq == prev_seq))
        if hits.size:
            i = int(hits[0])
            at, also = (self.files.where("visit_seq", rows[j].as_py()) for j in (i, i - 1))
            raise reader.repeated_seq(at, pid[i].as_py(), int(seq[i]), also)

    def _later_holders(self, table: pa.Table) -> np.ndarray:
        """bool [rows]: a complete-key row whose visit_id an earlier row holds."""
        if not self.duplicates:
            return np.zeros(len(table), bool)
        complete = _complete(table).to_numpy(zero_copy_only=False)
        rows = table[ROW].to_numpy()
        visit_ids = table["visit_id"].to_pylist()
        first = [self.duplicates.get(v, r) for v, r in zip(visit_ids, rows, strict=True)]
        return complete & (rows != np.asarray(first, np.int64))


class RayScorer(BucketScorer):
    """The Ray Data actor: a BucketScorer whose input errors reach the driver (`marked`)."""

    def __init__(self, *args, **kwargs):
        marked(super().__init__)(*args, **kwargs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return marked(super().__call__)(batch)


class LockHolder:
    """Ray actor holding the locks of OUT, its rejects file and work directory
    (`cognet.core.lock.claim`, as every command takes them) where OUT is, for the run: the
    locks go when the actor does, also when the driver dies (Ray ends its actors)."""

    def __init__(self, out: str):
        self.locks = [claim(path, "cognet-batch score") for path in writer.outputs(out)]

    def acquire(self) -> None:
        for lock in self.locks:
            marked(lock.acquire)()

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


@contextlib.contextmanager
def locked(ray, out: str) -> Iterator[None]:
    """Hold OUT's lock for the body, in a LockHolder actor (the driver may not see OUT)."""
    holder = ray.remote(num_cpus=0)(LockHolder).remote(out)
    try:
        ray.get(holder.acquire.remote())
        yield
    finally:
        with contextlib.suppress(Exception):
            ray.get(holder.release.remote())
        ray.kill(holder)


def _duplicate_rejects(table: pa.Table) -> pa.Table:
    reason = pa.array(["duplicate_visit_id"] * len(table), pa.string())
    columns = [table[ROW], table["patient_id"], table["visit_id"], reason]
    return pa.table(columns, schema=REJECTS_SCHEMA)


def _metric_rows(kept: pa.Table, recs: pa.Table, patient_rows: list[np.ndarray]) -> bytes:
    """The chunks' metric rows (one per patient with a scored visit whose medications are
    known, in order of first appearance in `kept`) behind each patient's first such row."""
    scored = pc.is_in(kept["visit_id"], value_set=recs["visit_id"])
    evaluated = kept.filter(pc.and_(scored, kept["medications"].is_valid()))
    first = evaluated[ROW].to_numpy()[reader.patient_starts(evaluated)] if len(evaluated) else []
    rows = np.concatenate(patient_rows) if patient_rows else np.zeros((0, METRIC_WIDTH))
    if len(first) != len(rows):
        raise RuntimeError(f"{len(first)} patients evaluated, {len(rows)} metric rows")
    buf = io.BytesIO()
    np.save(buf, np.column_stack([np.asarray(first, np.float64), rows]), allow_pickle=False)
    return buf.getvalue()


def marked(func: Callable) -> Callable:
    """func, with the message of an InputError it raises (in a Ray worker) bracketed by
    MARK, so that the driver finds it in whatever Ray wraps it in (`ray_engine._input_errors`)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except InputError as exc:
            raise RuntimeError(f"{MARK}{exc}{MARK}") from None

    return wrapper
