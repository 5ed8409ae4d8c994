"""The visits every engine decodes: a pool of patients whose last visit is to be scored.

A benchmark visit is the last visit of a patient, its medications unknown (null), with the
patient's earlier visits (medications known) as history: the production shape of
`cognet-batch score` and of `make demo`. A run over V visits takes the first V patients of
the pool, orders them by history size and cuts them into batches of n patients (so a batch
pads little, whichever engine decodes it), handed to each engine in its own input format,
prepared outside the timer:

- the runtime gets the Arrow table of the patients' rows (`Batch.table`);
- the torch engines get the same patients as `cognet.core.history.Visit` lists (`Batch.patients`).

The pool comes from a dataset directory (`--data`) or from the synthetic generator; when it
holds fewer patients than the largest batch, its patients are repeated under new ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cognet.core.dataset import read_visits
from cognet.core.history import Visit, patients_from_table
from cognet.core.vocab import Vocab
from cognet.data.synth import generate

COLUMNS = ("patient_id", "visit_id", "visit_seq", "diagnoses", "procedures", "medications")
# Patients 0..TRAIN_PATIENTS-1 of the synthetic generator train the demo model; benchmark
# patients come after them (the generator draws patient i the same whatever the cohort size).
TRAIN_PATIENTS = 2000


@dataclass
class Batch:
    table: pa.Table | None  # the patients' rows, last medications null (runtime input)
    patients: list[list[Visit]]  # the same patients, ids from the model's vocabulary
    visit_ids: list[str]  # the scored visits (one per patient), in order

    def __len__(self) -> int:
        return len(self.visit_ids)


class Pool:
    """Patients with contiguous, ordered rows; the last visit of each is the one to score."""

    def __init__(self, table: pa.Table, vocab: Vocab, description: str = ""):
        self.source = table.select(list(COLUMNS))  # medications of every visit known
        self.vocab, self.description = vocab, description
        table = mask_last_visits(self.source)
        self.table = table
        self.patients = list(patients_from_table(table, vocab))
        keep = [i for i, p in enumerate(self.patients) if p[-1].diag or p[-1].proc]
        if len(keep) < len(self.patients):  # the runtime rejects visits without known codes
            self.patients = [self.patients[i] for i in keep]
            self.table = _take_patients(table, keep)
        sizes = np.array([len(p) for p in self.patients], np.int64)
        # past medication slots and code count of each scored visit (batching keys)
        self.slots = np.array([sum(len(v.meds or ()) for v in p[:-1]) for p in self.patients])
        self.codes = np.array([len(p[-1].diag) + len(p[-1].proc) for p in self.patients])
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        if not self.patients:
            raise ValueError("no scoreable visit in the benchmark data")

    @classmethod
    def at_least(cls, table: pa.Table, vocab: Vocab, patients: int, description: str = "") -> Pool:
        """A pool of `patients` patients or more: the table's repeated as needed."""
        pool = cls(table, vocab, description)
        if len(pool) < patients:
            copies = -(-patients // len(pool))
            pool = cls(
                repeat_patients(pool.source, copies),
                vocab,
                f"{description}, repeated {copies}x under new ids",
            )
        return pool

    def __len__(self) -> int:
        return len(self.patients)

    def batch(self, lo: int, hi: int) -> Batch:
        """Patients [lo, hi) of the pool."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        patients = self.patients[lo:hi]
        return Batch(self.table.slice(a, b - a), patients, [p[-1].visit_id for p in patients])

    def batches(self, size: int, visits: int) -> list[Batch]:
        """The first `visits` patients in batches of `size` (the last one may be smaller),
        ordered by history size (past medication slots), then code count, so that a batch
        holds similar visits: what the runtime's batcher does within a chunk, and what any
        engine pads least with."""
        visits = min(visits, len(self))
        order = np.lexsort((self.codes[:visits], self.slots[:visits]))
        return [self.take(order[lo : lo + size]) for lo in range(0, visits, size)]

    def take(self, patients: np.ndarray) -> Batch:
        """The patients of the given pool indices, in that order."""
        rows = np.concatenate(
            [np.arange(self.offsets[i], self.offsets[i + 1]) for i in patients.tolist()]
        )
        chosen = [self.patients[i] for i in patients.tolist()]
        return Batch(self.table.take(pa.array(rows)), chosen, [p[-1].visit_id for p in chosen])

    def history_lengths(self) -> np.ndarray:
        return self.offsets[1:] - self.offsets[:-1] - 1


def mask_last_visits(table: pa.Table) -> pa.Table:
    """Null the medications of each patient's last row (rows of a patient contiguous)."""
    pid = table["patient_id"].combine_chunks()
    last = np.ones(len(table), bool)
    if len(table) > 1:
        last[:-1] = ~pc.equal(pid[:-1], pid[1:]).to_numpy(zero_copy_only=False)
    meds = table["medications"].combine_chunks()
    masked = pc.if_else(pa.array(last), pa.nulls(len(table), meds.type), meds)
    return table.set_column(table.schema.get_field_index("medications"), "medications", masked)


def repeat_patients(table: pa.Table, copies: int) -> pa.Table:
    """The table `copies` times, copy k's patient and visit ids suffixed with `~k`."""
    if copies <= 1:
        return table
    parts = [table]
    for k in range(1, copies):
        part = table
        for name in ("patient_id", "visit_id"):
            ids = pc.binary_join_element_wise(table[name], pa.scalar(f"~{k}"), "")
            index = part.schema.get_field_index(name)
            part = part.set_column(index, part.schema.field(index), ids)
        parts.append(part)
    return pa.concat_tables(parts).combine_chunks()


def with_history(table: pa.Table, past: int, patients: int) -> pa.Table:
    """`patients` patients of exactly `past` earlier visits each, made of consecutive rows of
    `table` (re-keyed: new patient ids, visit_seq 0..past), the last visit to be scored."""
    rows = past + 1
    need = rows * patients
    table = table.select(list(COLUMNS))
    table = repeat_patients(table, -(-need // len(table)))
    table = table.slice(0, need)
    group = np.arange(need) // rows
    pid = pa.array([f"H{past}-{g}" for g in group.tolist()], pa.string())
    seq = (np.arange(need) % rows).tolist()
    vid = pa.array([f"H{past}-{g}-{s}" for g, s in zip(group.tolist(), seq, strict=True)])
    seq = pa.array((np.arange(need) % rows).astype(np.int32))
    out = table
    for name, column in (("patient_id", pid), ("visit_id", vid), ("visit_seq", seq)):
        out = out.set_column(out.schema.get_field_index(name), name, column)
    return out


def synthetic_visits(out_dir: Path, patients: int, seed: int = 0) -> pa.Table:
    """Rows of synthetic patients TRAIN_PATIENTS..TRAIN_PATIENTS + patients - 1."""
    generate(out_dir, patients=TRAIN_PATIENTS + patients, seed=seed)
    table = read_visits(out_dir / "visits.parquet")
    first = pc.index(table["patient_id"], _patient_id_at(table, TRAIN_PATIENTS)).as_py()
    return table.slice(first)


def _patient_id_at(table: pa.Table, k: int) -> str:
    pid = table["patient_id"].combine_chunks()
    starts = np.flatnonzero(
        np.r_[True, ~pc.equal(pid[1:], pid[:-1]).to_numpy(zero_copy_only=False)]
    )
    return pid[int(starts[min(k, starts.size - 1)])].as_py()


def dataset_visits(data_dir: Path) -> pa.Table:
    """Every row of a dataset directory's visits.parquet (patients contiguous, ordered)."""
    return read_visits(Path(data_dir) / "visits.parquet")


def _take_patients(table: pa.Table, keep: list[int]) -> pa.Table:
    pid = table["patient_id"].combine_chunks()
    starts = np.flatnonzero(
        np.r_[True, ~pc.equal(pid[1:], pid[:-1]).to_numpy(zero_copy_only=False)]
    )
    ends = np.r_[starts[1:], len(table)]
    rows = np.concatenate([np.arange(starts[i], ends[i]) for i in keep])
    return table.take(pa.array(rows))
