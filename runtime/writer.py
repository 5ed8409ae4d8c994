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
  is removed once `OUT` and the rejects file are in place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cognet.core.errors import InputError
from cognet.runtime.outputs import REJECTS_SCHEMA, ScoredChunk, output_schema
from cognet.runtime.summary import total_counts

MARKER = "progress.json"
FORMAT_VERSION = 1


def rejects_path(out: str | Path) -> Path:
    out = Path(out)
    if out.suffix == ".parquet":
        return out.with_suffix(".rejects.parquet")
    return out.with_name(out.name + ".rejects.parquet")


def work_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".parts")


def _fsync_replace(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_parquet(path: Path, table: pa.Table) -> None:
    """Write a table atomically (temporary name, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    _fsync_replace(tmp, path)


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    _fsync_replace(tmp, path)


class PartWriter:
    """Commits chunks as parts under `work_dir(out)`; `finish` merges them into the outputs.

    signature: everything the results depend on (input file, model, settings); a resume
    with a different signature raises InputError instead of mixing results.
    """

    def __init__(self, out: str | Path, signature: dict, explain: bool, resume: bool = False):
        self.out = Path(out)
        self.dir = work_dir(self.out)
        self.explain = explain
        self.signature = signature
        self.parts: list[dict] = []
        marker = self.dir / MARKER
        if resume and marker.is_file():
            state = json.loads(marker.read_text())
            if state.get("format_version") != FORMAT_VERSION or state.get("signature") != signature:
                raise InputError(
                    f"{marker}: cannot resume, the input, model or options differ "
                    "from the interrupted run (rerun without --resume)"
                )
            self.parts = state["parts"]
        else:
            if self.dir.exists():
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
        self.resumed_rows = self.rows_done

    @property
    def rows_done(self) -> int:
        """Stream rows covered by the committed parts."""
        return self.parts[-1]["end"] if self.parts else 0

    def write(self, chunk: ScoredChunk) -> None:
        if chunk.start != self.rows_done:
            raise RuntimeError(f"chunk starts at row {chunk.start}, expected {self.rows_done}")
        name = f"part-{len(self.parts):06d}"
        write_parquet(self.dir / f"{name}.parquet", chunk.recommendations)
        write_parquet(self.dir / f"{name}.rejects.parquet", chunk.rejects)
        if chunk.patient_metrics is not None:
            tmp = self.dir / f".{name}.metrics.npy.tmp"
            with open(tmp, "wb") as f:
                np.save(f, chunk.patient_metrics, allow_pickle=False)
            _fsync_replace(tmp, self.dir / f"{name}.metrics.npy")
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
                "visits_evaluated": chunk.visits_evaluated,
                "metrics": chunk.patient_metrics is not None,
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
            np.load(self.dir / f"{p['name']}.metrics.npy", allow_pickle=False)
            for p in self.parts
            if p["metrics"]
        ]
        return np.concatenate(rows) if rows else None

    def finish(self) -> tuple[Path, Path]:
        """Merge the parts into OUT and its rejects file (atomically), drop the work dir."""
        outputs = (
            (self.out, ".parquet", output_schema(self.explain)),
            (rejects_path(self.out), ".rejects.parquet", REJECTS_SCHEMA),
        )
        for path, suffix, schema in outputs:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            with pq.ParquetWriter(tmp, schema) as w:
                for part in self.parts:
                    table = pq.read_table(self.dir / f"{part['name']}{suffix}")
                    if table.num_rows:
                        w.write_table(table)
            _fsync_replace(tmp, path)
        shutil.rmtree(self.dir)
        return outputs[0][0], outputs[1][0]
