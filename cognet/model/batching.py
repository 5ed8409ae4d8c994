"""Batches of whole patients as tensors: every visit is encoded once and decoded with the
ground-truth medications of the patient's earlier visits as history."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cognet.core.ddi import ddi_matrix
from cognet.core.history import Visit, history_index, pad, visit_histories
from cognet.core.vocab import Vocab

IGNORE = -100  # target padding, skipped by the loss


def make_batch(
    patients: Sequence[Sequence[Visit]],
    vocab: Vocab,
    max_history: int | None = None,
    targets: bool = True,
    no_history: Sequence[bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Batch of all visits of `patients` (each decoded with its known-medication history).
    no_history: per visit (in patient order), True to decode it without history, as a
    first visit is (training's history dropout); None: every visit with its history.

    Returns encoder inputs [V, L*], `target` [N] (rows being decoded, here every visit),
    history indexes (see `cognet.core.history.history_index`) and, when `targets`, `dec_input`
    (START + medications) and `dec_target` (medications + END) [N, L].
    """
    visits = [v for p in patients for v in p]
    histories = visit_histories(patients, max_history, no_history)
    med_ids = [v.meds or () for v in visits]
    batch = {
        "diagnoses": pad([v.diag for v in visits], vocab.diag_pad),
        "procedures": pad([v.proc for v in visits], vocab.proc_pad),
        "medications": pad(med_ids, vocab.med_pad),
        "target": np.arange(len(visits), dtype=np.int64),
    }
    index = history_index(histories, med_ids)
    index["slot_visit_row"] = index.pop("slot_row")
    batch.update(index)
    if targets:
        meds = [list(v.meds or ()) for v in visits]
        batch["dec_input"] = pad([[vocab.start, *m] for m in meds], vocab.med_pad)
        batch["dec_target"] = pad([[*m, vocab.end] for m in meds], IGNORE)
    return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in batch.items()}


# Batch entries with one row per decoded visit (the rest index the encoded visits).
PER_TARGET = (
    "target",
    "hist_index",
    "hist_mask",
    "slot_visit_row",
    "slot_pos",
    "slot_visit",
    "slot_med",
    "slot_mask",
)


def select_rows(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch decoding only its target rows `rows` (all visits stay encoded)."""
    return {**batch, **{k: batch[k][rows] for k in PER_TARGET}}


def ehr_adjacency(patients: Sequence[Sequence[Visit]], n_med: int) -> np.ndarray:
    """Co-prescription graph of the training visits: A[i, j] = 1 if i and j share a visit."""
    adj = np.zeros((n_med, n_med), np.float32)
    for p in patients:
        for v in p:
            if v.meds:
                ids = np.asarray(v.meds)
                adj[np.ix_(ids, ids)] = 1.0
    np.fill_diagonal(adj, 0.0)
    return adj


def ddi_adjacency(pairs: Sequence[tuple[str, str]], vocab: Vocab) -> np.ndarray:
    """The DDI graph of the model's GCN: `cognet.core.ddi.ddi_matrix` as float32 0/1."""
    return ddi_matrix(vocab, pairs).astype(np.float32)
