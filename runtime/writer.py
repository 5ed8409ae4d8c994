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
- the locks that make a run the only writer of these files (`outputs`, each locked by
  `cognet.core.lock.claim`, as every command locks its outputs), taken before anything is
  written or removed.

A run that fails leaves the parts it committed (for `--resume`) and nothing else: with no
committed part, its work directory goes (`discard`). `--resume` checks the marker, the
signature and every committed part file before it scores anything.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cognet.core import strict_json
from cognet.core.errors import InputError, one_line, writing
from cognet.core.files import atomic_path, write_text
from cognet.core.interrupt import kill_point
from cognet.runtime.outputs import REJECTS_SCHEMA, ScoredChunk, output_schema
from cognet.runtime.summary import total_counts

MARKER = "progress.json"
# 2: parts list their files and sizes; the signature of `signature.py`; 3: codes_given, and
# metric rows of first and later visits (`outputs.METRIC_WIDTH`)
FORMAT_VERSION = 3
RESUME_HINT = "delete {dir}/ or run without --resume"


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
    with a different signature raises InputError instead of mixing results.
    """

    def __init__(
        self,
        out: str | Path,
        signature: dict,
        explain: bool,
        resume: bool = False,
        kept: Sequence[pa.Field] = (),
    ):
        self.out = Path(out)
        self.dir = work_dir(self.out)
        self.schema = output_schema(explain, kept)  # kept: the --keep-columns fields
        self.signature = signature
        self.parts: list[dict] = []
        marker = self.dir / MARKER
        if resume and marker.is_file():
            self.parts = self._resumable(marker)
        else:
            self.clear()
            self.dir.mkdir(parents=True, exist_ok=True)
        self.resumed_rows = self.rows_done

    def _resumable(self, marker: Path) -> list[dict]:
        """The committed parts of the interrupted run; InputError when it cannot resume."""

        def refuse(why: str) -> InputError:
            hint = RESUME_HINT.format(dir=self.dir)
            return InputError(f"{marker}: cannot resume: {why} ({hint})")

        try:
            state = json.loads(marker.read_text())
            parts = state["parts"]
            if state.get("format_version") != FORMAT_VERSION:
                raise refuse(f"written by another version ({state.get('format_version')!r})")
            ends = [0] + [p["end"] for p in parts]
            if any(p["start"] != ends[i] for i, p in enumerate(parts)):
                raise refuse("the parts do not follow each other")
            files = [(self.dir / name, size) for p in parts for name, size in p["files"].items()]
        except InputError:
            raise
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise refuse(f"unreadable progress file ({one_line(exc)[:120]})") from None
        differ = _differences(state.get("signature"), self.signature)
        if differ:
            raise refuse(f"{differ} differ from the interrupted run")
        for path, size in files:  # every committed part is still there, as it was written
            if not path.is_file() or path.stat().st_size != size:
                raise refuse(f"{path.name} is missing or changed")
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
        name = f"part-{len(self.parts):06d}"
        files = [f"{name}.parquet", f"{name}.rejects.parquet"]
        write_parquet(self.dir / files[0], chunk.recommendations)
        write_parquet(self.dir / files[1], chunk.rejects)
        if chunk.patient_metrics is not None:
            files.append(f"{name}.metrics.npy")
            with atomic_path(self.dir / files[-1]) as tmp, open(tmp, "wb") as f:
                np.save(f, chunk.patient_metrics, allow_pickle=False)
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
                "files": {f: (self.dir / f).stat().st_size for f in files},
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
                    if table.num_rows:
                        w.write_table(table)
        self.clear()
        return outputs[0][0], outputs[1][0]


def _differences(before: object, now: dict) -> str:
    """What differs between two signatures, as "beam, ddi" (by top-level key)."""
    if not isinstance(before, dict):
        return "the run's settings"
    keys = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    return ", ".join(keys)
