"""Visits as id lists, and the history index arrays of the decoder init (torch-free, numpy).

Shared by training (`cognet.batching`) and the runtime: both encode every visit once and
then point each decoded visit at the encodings of its past visits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

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


def pad(seqs: Sequence[Sequence[int]], pad_id: int, min_len: int = 1) -> np.ndarray:
    """Right-pad id lists into an int64 matrix [len(seqs), max(len, min_len)]."""
    width = max([min_len, *map(len, seqs)])
    out = np.full((len(seqs), width), pad_id, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def history_index(
    histories: Sequence[Sequence[int]], med_ids: Sequence[Sequence[int]]
) -> dict[str, np.ndarray]:
    """Index arrays that gather each decoded visit's history from encoded visit rows.

    histories[n]: rows (into the encoded visits) of visit n's past visits, oldest first.
    med_ids[r]: medication ids of encoded row r, in the order given to the encoder.
    Returns hist_index/hist_mask [N, J] and slot_row/slot_pos/slot_visit/slot_med/slot_mask
    [N, S] (J, S >= 1; padding points at row 0 with mask 0).
    """
    n = len(histories)
    j_max = max([1, *map(len, histories)])
    slots = [sum(len(med_ids[r]) for r in h) for h in histories]
    s_max = max([1, *slots])
    hist_index = np.zeros((n, j_max), np.int64)
    hist_mask = np.zeros((n, j_max), np.float32)
    slot = {
        k: np.zeros((n, s_max), np.int64)
        for k in ("slot_row", "slot_pos", "slot_visit", "slot_med")
    }
    slot_mask = np.zeros((n, s_max), np.float32)
    for i, rows in enumerate(histories):
        hist_index[i, : len(rows)] = rows
        hist_mask[i, : len(rows)] = 1.0
        at = 0
        for j, r in enumerate(rows):
            meds = med_ids[r]
            k = len(meds)
            slot["slot_row"][i, at : at + k] = r
            slot["slot_pos"][i, at : at + k] = np.arange(k)
            slot["slot_visit"][i, at : at + k] = j
            slot["slot_med"][i, at : at + k] = meds
            at += k
        slot_mask[i, :at] = 1.0
    return {"hist_index": hist_index, "hist_mask": hist_mask, **slot, "slot_mask": slot_mask}
