"""The set head's inputs (`cognet.model.set_head`), torch-free: what the one-pass decoding
reads of a visit, built the same way for training, `cognet evaluate` and the runtime.

A visit is read as five arrays, the id lists padded with each kind's PAD id (its
vocabulary size) and at least one column wide:
- `diagnoses` [N, Ld], `procedures` [N, Lp]: the visit's own codes;
- `last_meds` [N, Ll]: the medications of its latest history visit;
- `past_meds` [N, Lh]: every medication of its history, once each (ascending ids: the head
  sums them, so their order is free);
- `has_history` [N] float32: 1 for a visit with a history, 0 for a first visit (or one
  whose history training dropped).
The history is what COGNet's decoder reads: the patient's earlier visits with known
medications (the last `max_history` of them when set).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cognet.core.history import visit_histories
from cognet.core.ragged import Ragged

HEAD_INPUTS = ("diagnoses", "procedures", "last_meds", "past_meds", "has_history")
HEAD_OUTPUT = "marginals"  # [N, M] float32: P(k in S) of every medication
# visits x medications at most for which `history_meds` marks each visit's past medications
# in a bool matrix (16 MB) instead of sorting them; above it, np.unique sorts them
SEEN_CELLS = 1 << 24


def ragged(rows: Sequence[Sequence[int]]) -> Ragged:
    """A `Ragged` of int rows."""
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((x for r in rows for x in r), np.int64, int(offsets[-1]))
    return Ragged(values, offsets)


def take_rows(r: Ragged, rows: np.ndarray) -> Ragged:
    """The rows `rows` of `r`, in that order."""
    lengths = r.lengths[rows]
    offsets = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    at = np.repeat(r.offsets[rows] - offsets[:-1], lengths) + np.arange(offsets[-1])
    return Ragged(r.values[at], offsets)


def history_meds(meds: Ragged, histories: Ragged, n_med: int) -> tuple[Ragged, Ragged]:
    """Per visit, from its history (`histories`: one row a visit, the rows of `meds` of its
    history visits, oldest first): (the latest history visit's medications, every history
    medication once, ascending). Vectorised: no loop over visits."""
    n = len(histories)
    has = histories.lengths > 0
    latest = take_rows(meds, histories.values[histories.offsets[1:][has] - 1])
    lengths = np.zeros(n, np.int64)
    lengths[has] = latest.lengths
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    last = Ragged(latest.values, offsets)
    everything = take_rows(meds, histories.values)  # each history row's medications
    owner = np.repeat(np.arange(n), histories.lengths)  # the visit of each history row
    visit = np.repeat(owner, everything.lengths)
    if n * (n_med + 1) <= SEEN_CELLS:  # (visit, id) once, sorted: marks, no sort
        seen = np.zeros((n, n_med + 1), bool)
        seen[visit, everything.values] = True
        visit, ids = np.nonzero(seen)
    else:
        key = np.unique(visit * (n_med + 1) + everything.values)
        visit, ids = key // (n_med + 1), key % (n_med + 1)
    past = Ragged.of_lengths(ids.astype(np.int64, copy=False), np.bincount(visit, minlength=n))
    return last, past


def head_arrays(
    diag: Ragged,
    proc: Ragged,
    last: Ragged,
    past: Ragged,
    has_history: np.ndarray,
    pads: tuple[int, int, int],
) -> dict[str, np.ndarray]:
    """The head's input arrays (HEAD_INPUTS) of visits given as ragged id lists (one row a
    visit); `pads`: the PAD ids of diagnoses, procedures and medications."""
    rows = np.arange(len(diag))
    return {
        "diagnoses": diag.pad(rows, pads[0]),
        "procedures": proc.pad(rows, pads[1]),
        "last_meds": last.pad(rows, pads[2]),
        "past_meds": past.pad(rows, pads[2]),
        "has_history": np.asarray(has_history, np.float32),
    }


def patient_head_arrays(
    patients: Sequence[Sequence],
    pads: tuple[int, int, int],
    n_med: int,
    max_history: int | None = None,
    no_history: Sequence[bool] | None = None,
) -> dict[str, np.ndarray]:
    """The head's input arrays of every visit of `patients` (lists of
    `cognet.core.history.Visit`, in order), each with the history COGNet's decoder reads
    (`cognet.model.batching.make_batch`): the earlier visits with known medications, the
    last `max_history`; `no_history[i]` True reads visit i without any (history dropout)."""
    histories = visit_histories(patients, max_history, no_history)
    visits = [v for p in patients for v in p]
    meds = ragged([v.meds or () for v in visits])
    last, past = history_meds(meds, ragged(histories), n_med)
    has = np.fromiter((len(h) > 0 for h in histories), bool, len(histories))
    diag, proc = ragged([v.diag for v in visits]), ragged([v.proc for v in visits])
    return head_arrays(diag, proc, last, past, has, pads)
