"""Visits as id lists, and the history index arrays of the decoder init (torch-free, numpy).

Shared by training (`cognet.model.batching`) and the runtime: both encode every visit once and
then point each decoded visit at the encodings of its past visits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cognet.core.dataset import split_rows
from cognet.core.ragged import Ragged
from cognet.core.vocab import Vocab


@dataclass(frozen=True)
class Visit:
    patient_id: str
    visit_id: str
    diag: tuple[int, ...]
    proc: tuple[int, ...]
    meds: tuple[int, ...] | None  # rare-first; None = unknown
    unknown_codes: int = 0  # codes dropped because the vocabulary does not know them


def encode_visit(
    vocab: Vocab, patient_id: str, visit_id: str, diagnoses, procedures, medications
) -> Visit:
    diag, ud = vocab.encode("diagnoses", diagnoses or ())
    proc, up = vocab.encode("procedures", procedures or ())
    meds, um = (None, 0) if medications is None else vocab.encode("medications", medications)
    if meds is not None:
        meds = vocab.rare_first(meds)
    return Visit(
        patient_id,
        visit_id,
        tuple(diag),
        tuple(proc),
        None if meds is None else tuple(meds),
        ud + up + um,
    )


def patients_from_table(table: pa.Table, vocab: Vocab) -> Iterator[list[Visit]]:
    """Group a visits table (rows of a patient contiguous and ordered) into patients."""
    cols = {
        c: table.column(c).to_pylist()
        for c in ("patient_id", "visit_id", "diagnoses", "procedures", "medications")
    }
    current: list[Visit] = []
    for i, pid in enumerate(cols["patient_id"]):
        if current and current[-1].patient_id != pid:
            yield current
            current = []
        current.append(
            encode_visit(
                vocab,
                pid,
                cols["visit_id"][i],
                cols["diagnoses"][i],
                cols["procedures"][i],
                cols["medications"][i],
            )
        )
    if current:
        yield current


def train_vocabulary(visits: pa.Table) -> Vocab:
    """The vocabulary of a dataset's training split (codes of the other splits are unknown to
    the model, as they would be in deployment)."""
    train = split_rows(visits, "train")
    return Vocab.build(*(train[c].to_pylist() for c in ("diagnoses", "procedures", "medications")))


@dataclass
class SplitData:
    """The labelled visits of one split, grouped into patients."""

    patients: list[list[Visit]]
    unknown_codes: int  # codes of the split that the vocabulary does not know (dropped)
    unlabeled_visits: int  # visits without medications, neither decoded nor used as history


def load_split(visits: pa.Table, vocab: Vocab, split: str) -> SplitData:
    """The labelled visits of a split grouped into patients (unknown codes dropped)."""
    patients, unknown, unlabeled = [], 0, 0
    for p in patients_from_table(split_rows(visits, split), vocab):
        unknown += sum(v.unknown_codes for v in p)
        kept = [v for v in p if v.meds is not None]
        unlabeled += len(p) - len(kept)
        if kept:
            patients.append(kept)
    return SplitData(patients, unknown, unlabeled)


def visit_histories(
    patients: Sequence[Sequence[Visit]],
    max_history: int | None = None,
    no_history: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Per visit of `patients` (in order), the rows (visit positions in that order) of its
    history: its patient's earlier visits with known medications, the last `max_history`;
    none where `no_history[row]` is True (training's history dropout). The one rule of the
    decoder's batches (`cognet.model.batching.make_batch`) and the set head's inputs."""
    histories: list[list[int]] = []
    row = 0
    for p in patients:
        known: list[int] = []
        for v in p:
            kept = known if max_history is None else known[len(known) - max_history :]
            dropped = max_history == 0 or (no_history is not None and no_history[row])
            histories.append([] if dropped else list(kept))
            if v.meds is not None:
                known.append(row)
            row += 1
    return histories


def pad(seqs: Sequence[Sequence[int]], pad_id: int, min_len: int = 1) -> np.ndarray:
    """Right-pad id lists into an int64 matrix [len(seqs), max(len, min_len)]."""
    width = max([min_len, *map(len, seqs)])
    out = np.full((len(seqs), width), pad_id, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def history_index(histories: Sequence[Sequence[int]], med_ids) -> dict[str, np.ndarray]:
    """Index arrays that gather each decoded visit's history from encoded visit rows.

    histories[n]: rows (into the encoded visits) of visit n's past visits, oldest first.
    med_ids[r]: medication ids of encoded row r, in the order given to the encoder.
    Both: a sequence of sequences, or a `Ragged` (`offsets` [N + 1] and `values`).
    Returns hist_index/hist_mask [N, J] and slot_row/slot_pos/slot_visit/slot_med/slot_mask
    [N, S] (J, S >= 1; padding points at row 0 with mask 0). Vectorised: no Python loop
    over visits (the runtime builds it for every batch).
    """
    if isinstance(med_ids, Ragged):
        offsets, values = np.asarray(med_ids.offsets), np.asarray(med_ids.values)
    else:
        lengths = np.fromiter(map(len, med_ids), np.int64, len(med_ids))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        values = np.fromiter((m for ids in med_ids for m in ids), np.int64, int(offsets[-1]))
    if isinstance(histories, Ragged):
        per_visit = np.diff(np.asarray(histories.offsets))
        rows = np.asarray(histories.values, np.int64)
    else:
        per_visit = np.fromiter(map(len, histories), np.int64, len(histories))
        rows = np.concatenate(
            [np.zeros(0, np.int64), *(np.asarray(h, np.int64) for h in histories)]
        )
    n = per_visit.size
    visit = np.repeat(np.arange(n), per_visit)  # entry -> decoded visit
    j = np.arange(rows.size) - np.repeat(np.cumsum(per_visit) - per_visit, per_visit)
    hist_index = np.zeros((n, max(1, int(per_visit.max(initial=0)))), np.int64)
    hist_mask = np.zeros(hist_index.shape, np.float32)
    hist_index[visit, j] = rows
    hist_mask[visit, j] = 1.0
    k = offsets[rows + 1] - offsets[rows]  # medications of each history entry
    slots = np.bincount(visit, weights=k, minlength=n).astype(np.int64)
    entry = np.repeat(np.arange(rows.size), k)  # slot -> history entry
    first = np.cumsum(k) - k  # first slot of each entry, over all visits
    pos = np.arange(entry.size) - first[entry]
    col = first[entry] - (np.cumsum(slots) - slots)[visit[entry]] + pos
    shape = (n, max(1, int(slots.max(initial=0))))
    out = {
        name: np.zeros(shape, np.int64)
        for name in ("slot_row", "slot_pos", "slot_visit", "slot_med")
    }
    at = (visit[entry], col)
    out["slot_row"][at] = rows[entry]
    out["slot_pos"][at] = pos
    out["slot_visit"][at] = j[entry]
    out["slot_med"][at] = values[offsets[rows[entry]] + pos]
    slot_mask = np.zeros(shape, np.float32)
    slot_mask[at] = 1.0
    return {"hist_index": hist_index, "hist_mask": hist_mask, **out, "slot_mask": slot_mask}
