"""Output files, written in parts so that a killed run can resume, then merged atomically.

For `--out OUT` (e.g. `recs.parquet`):
- `OUT`: the recommendations (`outputs.output_schema`), in input order;
- `OUT` with `.parquet` replaced by `.rejects.parquet` (`recs.rejects.parquet`; or
  `OUT.rejects.parquet` when OUT does not end in `.parquet`): the rejected rows with their
  input row number and reason (`outputs.REJECTS_SCHEMA`), always written, maybe empty;
- while running: the work directory `OUT.parts/` holding one Parquet part per chunk
  (recommendations, rejects, and per-patient metric rows with `--all`) and
  `progress.json`, the list of committed parts with their counts, rewritten atomically
  after each part. A part is committed only once its files are complete on disk, so after
  a crash (even kill -9) the marker lists exactly the chunks that are done; `--resume`
  skips them and the final files equal those of an uninterrupted run. The work directory
  is removed once `OUT` and the rejects file are in place;
- each part file carries its own place (`PART_KEY` in its Parquet metadata: the part's
  number and input rows), and progress.json its size and sha256: a resume reads
  progress.json like any input (`check_progress`: every field by type and range, names
  fixed by position, so nothing outside `OUT.parts/` is read) and proves each part is the
  one written for its place, or refuses;
- the locks that make a run the only writer of these files (`outputs`, each locked by
  `cognet.core.lock.claim`, as every command locks its outputs), taken before anything is
  written or removed.

A run that fails leaves the parts it committed (for `--resume`) and nothing else: with no
committed part, its work directory goes (`discard`). `--resume` checks the marker, the
signature and every committed part file before it scores anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cognet.core import strict_json
from cognet.core.errors import InputError, one_line, writing
from cognet.core.files import atomic_path, write_text
from cognet.core.interrupt import kill_point
from cognet.runtime.outputs import (
    COUNTS,
    METRIC_COLUMNS,
    METRIC_WIDTH,
    REJECTS_SCHEMA,
    ScoredChunk,
    output_schema,
)
from cognet.runtime.plan import REASONS
from cognet.runtime.summary import total_counts

MARKER = "progress.json"
# 2: parts list their files and sizes; 3: and their sha256, each part file names its place
# (PART_KEY), metrics are Parquet; 4: codes_given, and metric rows of first and later visits
# (`outputs.METRIC_WIDTH`)
FORMAT_VERSION = 4
RESUME_HINT = "delete {dir}/ or run without --resume"
PART_KEY = b"cognet.part"  # Parquet metadata of a part file: {"part": i, "start": s, "end": e}
MAX_MARKER_BYTES = 256 << 20  # a progress file holds ~600 bytes per part
PART_FIELDS = (
    "name",
    "start",
    "end",
    *(c for c in COUNTS if c != "rows_read"),
    "reject_reasons",
    "metrics",
    "files",
)


def rejects_path(out: str | Path) -> Path:
    out = Path(out)
    if out.suffix == ".parquet":
        return out.with_suffix(".rejects.parquet")
    return out.with_name(out.name + ".rejects.parquet")


def work_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".parts")


def outputs(out: str | Path) -> tuple[Path, Path, Path]:
    """What a run on OUT writes: OUT, its rejects file, its work directory (both engines
    lock each of them)."""
    return Path(out), rejects_path(out), work_dir(out)


def write_parquet(path: Path, table: pa.Table) -> None:
    """Write a table atomically (`cognet.core.files.atomic_path`)."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_json(path: Path, obj: dict) -> None:
    write_text(path, strict_json.dumps(obj, indent=1) + "\n")


class PartWriter:
    """Commits chunks as parts under `work_dir(out)`; `finish` merges them into the outputs.

    signature: everything the results depend on (input file, model, settings); a resume
    with a different signature raises InputError instead of mixing results. rows: the
    input's row count, which no committed part may claim to pass.
    """

    def __init__(
        self,
        out: str | Path,
        signature: dict,
        explain: bool,
        resume: bool = False,
        kept: Sequence[pa.Field] = (),
        rows: int | None = None,
    ):
        self.out = Path(out)
        self.dir = work_dir(self.out)
        self.schema = output_schema(explain, kept)  # kept: the --keep-columns fields
        self.signature = signature
        self.parts: list[dict] = []
        marker = self.dir / MARKER
        if resume and (marker.exists() or marker.is_symlink()):
            self.parts = self._resumable(marker, rows)
        else:
            self.clear()
            with writing(self.dir):  # a full disk: exit 1 naming the folder
                self.dir.mkdir(parents=True, exist_ok=True)
        self.resumed_rows = self.rows_done

    def _resumable(self, marker: Path, rows: int | None) -> list[dict]:
        """The committed parts of the interrupted run (`check_progress`); InputError
        (`MARKER: cannot resume: ...`) when they cannot be proven to be the ones it wrote."""
        hint = RESUME_HINT.format(dir=self.dir)
        try:
            state = _read_marker(marker)
            differ = _differences(state["signature"], self.signature)
            if differ:
                raise ValueError(f"{differ} differ from the interrupted run")
            parts = check_progress(state["parts"], rows)
            for i, part in enumerate(parts):
                _check_part_files(self.dir, i, part)
        except ValueError as exc:  # InputError included
            raise InputError(f"{marker}: cannot resume: {one_line(exc)[:300]} ({hint})") from None
        return parts

    def clear(self) -> None:
        """Remove the work directory (an earlier run's parts, or this one's once merged)."""
        if self.dir.is_dir() and not self.dir.is_symlink():
            shutil.rmtree(self.dir)

    def discard(self) -> None:
        """After a failed run: keep the committed parts (--resume needs them), or, with none,
        remove what this run wrote."""
        if not self.parts:
            self.clear()

    @property
    def rows_done(self) -> int:
        """Stream rows covered by the committed parts."""
        return self.parts[-1]["end"] if self.parts else 0

    def write(self, chunk: ScoredChunk) -> None:
        if chunk.start != self.rows_done:
            raise RuntimeError(f"chunk starts at row {chunk.start}, expected {self.rows_done}")
        index = len(self.parts)
        name = part_name(index)
        place = {"part": index, "start": chunk.start, "end": chunk.end}
        tables = [chunk.recommendations, chunk.rejects]
        if chunk.patient_metrics is not None:
            tables.append(_metrics_table(chunk.patient_metrics))
        files = part_files(index, chunk.patient_metrics is not None)
        for file, table in zip(files, tables, strict=True):
            write_parquet(self.dir / file, _placed(table, place))
        self.parts.append(
            {
                "name": name,
                "start": chunk.start,
                "end": chunk.end,
                "rows_scored": chunk.rows_scored,
                "rows_rejected": chunk.rows_rejected,
                "rows_skipped": chunk.rows_skipped,
                "reject_reasons": chunk.reject_reasons,
                "unknown_codes": chunk.unknown_codes,
                "codes_given": chunk.codes_given,
                "visits_evaluated": chunk.visits_evaluated,
                "metrics": chunk.patient_metrics is not None,
                "files": {f: _file_record(self.dir / f) for f in files},
            }
        )
        write_json(
            self.dir / MARKER,
            {"format_version": FORMAT_VERSION, "signature": self.signature, "parts": self.parts},
        )

    def totals(self) -> dict:
        """Counts summed over every committed part (this run's and resumed ones)."""
        return total_counts({**p, "rows_read": p["end"] - p["start"]} for p in self.parts)

    def patient_metrics(self) -> np.ndarray | None:
        """Per-patient metric rows of every part (None when no part has metrics)."""
        rows = [
            _metrics_rows(pq.read_table(self.dir / part_files(i, True)[2]))
            for i, p in enumerate(self.parts)
            if p["metrics"]
        ]
        return np.concatenate(rows) if rows else None

    def finish(self) -> tuple[Path, Path]:
        """Merge the parts into OUT and its rejects file (atomically), drop the work dir."""
        outputs = (
            (self.out, ".parquet", self.schema),
            (rejects_path(self.out), ".rejects.parquet", REJECTS_SCHEMA),
        )
        for i, (path, suffix, schema) in enumerate(outputs):
            if i:
                kill_point("merged")
            with writing(path):
                path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema) as w:
                for part in self.parts:
                    table = pq.read_table(self.dir / f"{part['name']}{suffix}")
                    if table.num_rows:  # the part's place (metadata) stays out of OUT
                        w.write_table(table.replace_schema_metadata(schema.metadata))
        self.clear()
        return outputs[0][0], outputs[1][0]


def _differences(before: object, now: dict) -> str:
    """What differs between two signatures, as "beam, ddi" (by top-level key)."""
    if not isinstance(before, dict):
        return "the run's settings"
    keys = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    return ", ".join(SHOWN_KEYS.get(k, k) for k in keys)


# the signature's keys that an option sets under another name
SHOWN_KEYS = {"chunk_targets": "chunk_targets (the input rows per part: --batch-size x 16)"}


def part_name(index: int) -> str:
    return f"part-{index:06d}"


def part_files(index: int, metrics: bool) -> list[str]:
    """The files of part `index`: recommendations, rejects (and metrics): fixed by its
    number, so a progress file cannot name any other."""
    name = part_name(index)
    files = [f"{name}.parquet", f"{name}.rejects.parquet"]
    return [*files, f"{name}.metrics.parquet"] if metrics else files


def _placed(table: pa.Table, place: dict) -> pa.Table:
    """`table` carrying its part's place in its Parquet metadata (PART_KEY)."""
    meta = dict(table.schema.metadata or {})
    meta[PART_KEY] = json.dumps(place, sort_keys=True).encode()
    return table.replace_schema_metadata(meta)


def _metrics_table(rows: np.ndarray) -> pa.Table:
    return pa.table({c: rows[:, j] for j, c in enumerate(METRIC_COLUMNS)})


def _metrics_rows(table: pa.Table) -> np.ndarray:
    """float64 [patients, METRIC_WIDTH] from `_metrics_table`'s table."""
    columns = [table[c].to_numpy() for c in METRIC_COLUMNS]
    return np.stack(columns, axis=1) if table.num_rows else np.zeros((0, METRIC_WIDTH))


def _file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_marker(marker: Path) -> dict:
    """progress.json's top level, checked (ValueError naming what is wrong)."""
    try:
        info = os.lstat(marker)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_MARKER_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than a progress file holds")
        state = strict_json.loads(marker.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"unreadable progress file ({one_line(exc)[:120]})") from None
    if not isinstance(state, dict) or set(state) != {"format_version", "signature", "parts"}:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"unreadable progress file (not a progress file's fields: {keys})")
    version = state["format_version"]
    if type(version) is not int or version != FORMAT_VERSION:
        raise ValueError(f"written by another version ({version!r})")
    if not isinstance(state["signature"], dict):
        raise ValueError(f"field 'signature': {_shown(state['signature'])} is not an object")
    return state


def check_progress(parts: object, rows: int | None) -> list[dict]:
    """The committed parts listed in progress.json, each field checked by type and range
    (ValueError naming the field): part i is named `part_name(i)` and lists exactly
    `part_files(i, metrics)`; the parts follow one another from row 0, each within the
    input's `rows`, and its counts add up to its rows."""
    if not isinstance(parts, list):
        raise ValueError(f"field 'parts': {_shown(parts)} is not a list")
    end = 0
    for i, part in enumerate(parts):
        field = f"parts.{i}"
        if not isinstance(part, dict) or set(part) != set(PART_FIELDS):
            keys = sorted(part) if isinstance(part, dict) else _shown(part)
            raise ValueError(f"field '{field}': {keys} are not a part's fields")
        if part["name"] != part_name(i):
            raise ValueError(
                f"field '{field}.name': {_shown(part['name'])} is not {part_name(i)!r} "
                "(parts are numbered in order)"
            )
        if part["start"] != end or type(part["start"]) is not int:
            raise ValueError(
                f"field '{field}.start': {_shown(part['start'])} is not {end}, the end of "
                "the part before (the parts do not follow each other)"
            )
        limit = f"the input's {rows} rows" if rows is not None else "no limit"
        end = _count(part, "end", field, part["start"], rows, f"in [start, {limit}]")
        for key in COUNTS[1:]:
            _count(part, key, field, 0, None, ">= 0")
        read = sum(part[k] for k in ("rows_scored", "rows_rejected", "rows_skipped"))
        if read != end - part["start"]:
            raise ValueError(
                f"field '{field}': scored + rejected + skipped = {read}, not its "
                f"{end - part['start']} rows"
            )
        _check_reasons(part, field)
        if type(part["metrics"]) is not bool:
            raise ValueError(f"field '{field}.metrics': {_shown(part['metrics'])} is not a bool")
        _check_file_records(part, i, field)
    return parts


def _count(part: dict, key: str, field: str, low: int, high: int | None, what: str) -> int:
    value = part[key]
    if type(value) is not int or value < low or (high is not None and value > high):
        raise ValueError(f"field '{field}.{key}': {_shown(value)} is not an integer {what}")
    return value


def _check_reasons(part: dict, field: str) -> None:
    reasons = part["reject_reasons"]
    where = f"field '{field}.reject_reasons'"
    if not isinstance(reasons, dict):
        raise ValueError(f"{where}: {_shown(reasons)} is not an object")
    for reason, n in reasons.items():
        if reason not in REASONS or type(n) is not int or n < 0:
            raise ValueError(f"{where}: {_shown(reason)}: {_shown(n)} is not a reason's count")
    if sum(reasons.values()) != part["rows_rejected"]:
        raise ValueError(f"{where}: they add up to {sum(reasons.values())}, not rows_rejected")


def _check_file_records(part: dict, index: int, field: str) -> None:
    files = part["files"]
    want = part_files(index, part["metrics"])
    if not isinstance(files, dict) or sorted(files) != sorted(want):
        shown = sorted(files) if isinstance(files, dict) else _shown(files)
        raise ValueError(f"field '{field}.files': {_shown(shown)} are not {want}")
    for name, record in files.items():
        ok = isinstance(record, dict) and set(record) == {"bytes", "sha256"}
        ok = ok and type(record["bytes"]) is int and record["bytes"] >= 0
        sha = record.get("sha256") if ok else None
        if not (isinstance(sha, str) and len(sha) == 64 and set(sha) <= set("0123456789abcdef")):
            raise ValueError(
                f"field '{field}.files.{name}': {_shown(record)} is not a file's bytes and sha256"
            )


def _check_part_files(folder: Path, index: int, part: dict) -> None:
    """ValueError unless every file of the part is a regular file in `folder` (no link),
    of the size and sha256 progress.json records, carrying the part's place (PART_KEY)
    and the rows its counts claim."""
    rows = {
        part_files(index, True)[0]: part["rows_scored"],
        part_files(index, True)[1]: part["rows_rejected"],
    }
    place = {"part": index, "start": part["start"], "end": part["end"]}
    for name, record in part["files"].items():
        path = folder / name
        try:
            info = os.lstat(path)
            same = stat.S_ISREG(info.st_mode) and info.st_size == record["bytes"]
            if not same or _sha256(path) != record["sha256"]:
                raise ValueError
            meta = pq.read_metadata(path)
            written = json.loads((meta.metadata or {}).get(PART_KEY, b"null"))
        except (OSError, ValueError, pa.ArrowException):
            raise ValueError(f"{name} is missing or changed") from None
        if written != place:
            raise ValueError(
                f"{name} was written as {_shown(written)}, not as {place} (parts renamed?)"
            )
        if name in rows and meta.num_rows != rows[name]:
            raise ValueError(f"{name} holds {meta.num_rows} rows, not the {rows[name]} it claims")


def _shown(value: object) -> str:
    """A value of progress.json in an error line: its repr, cut."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
