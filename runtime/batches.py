"""Batches whose padded size stays bounded on every padded axis, so that one long visit cannot
blow up the memory of the visits batched with it.

A batch pads every visit to its longest one on each axis: the decoder's to the longest
diagnosis list, procedure list and history (past-medication slots), the encoder's to the
longest code list of each kind. `cut_padded` closes a batch before its visits x the longest width
passes a budget on any axis (the encoder's self-attention grows with the square of the
width: `squared`).

Without the budgets, one visit holding every code of the vocabulary padded its whole batch
to that width and multiplied the peak memory (BENCHMARKS.md "What was tried"). The budgets
below split only the batches holding such a visit: a real visit (MIMIC-III: at most 39
diagnoses) with the default batch sizes never reaches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cognet.runtime.options import ScoreOptions

# Decoder: visits x the longest code list of a kind (diagnoses, procedures). The per-visit
# memories are [visits, dim, codes] floats: 2^16 codes of dim 64 are 16 MB per tensor.
CPU_BATCH_CODES, GPU_BATCH_CODES = 1 << 16, 1 << 18
# Encoder: visits x the square of the longest code list of a kind (its attention weights,
# per head); 64 visits of 64 codes fit. A GPU takes 64 times more per call: each encoder call
# costs launch latency, which at 64 visits per call dominated ort-cuda's time.
ENCODE_CELLS, GPU_ENCODE_CELLS = 1 << 18, 1 << 24
CPU_ENCODE_BATCH, GPU_ENCODE_BATCH = 64, 4096  # visits per encoder call


# Visits decoded together. CPU: small batches keep a batch's memories and cache in the
# core's cache (the sweep: BENCHMARKS.md "What was tried"). GPU: many rows,
# within the N <= 512 shape profile of the TensorRT engines built by cognet-export.
CPU_BATCH, GPU_BATCH = 128, 512
# Cap on a batch's padded history: visits x the largest number of past-medication slots among
# them. Every visit of a batch carries copy memories as long as the longest history (the
# one-hot scatter alone is [visits, slots, V1] floats): without a cap one long history pads
# thousands of visits. Visits are batched in order of history size, so the cap splits only
# the batches of long histories. 2^12 was the fastest cap on the CPU (the sweep:
# BENCHMARKS.md "What was tried"); on a GPU, where wide batches pay, the cap only bounds memory.
CPU_BATCH_SLOTS, GPU_BATCH_SLOTS = 1 << 12, 1 << 20


@dataclass(frozen=True)
class Budgets:
    """How chunks and batches are cut (`ScoreOptions`, resolved for the CPU or a GPU)."""

    batch_size: int  # visits per decoder batch
    batch_slots: int  # visits x longest history of a batch, at most
    batch_codes: int  # visits x longest code list of a kind of a batch, at most
    encode_batch: int  # visits per encoder call
    encode_cells: int  # visits x squared longest code list of an encoder call, at most
    chunk_targets: int  # visits to score per chunk
    chunk_rows: int  # rows per chunk

    @classmethod
    def of(cls, options: ScoreOptions, gpu: bool) -> Budgets:
        batch_size = options.batch_size or (GPU_BATCH if gpu else CPU_BATCH)
        encode_batch, encode_cells = encoder_budget(gpu)
        return cls(
            batch_size=batch_size,
            batch_slots=options.batch_slots or (GPU_BATCH_SLOTS if gpu else CPU_BATCH_SLOTS),
            batch_codes=GPU_BATCH_CODES if gpu else CPU_BATCH_CODES,
            encode_batch=options.encode_batch or encode_batch,
            encode_cells=encode_cells,
            chunk_targets=options.chunk_targets or 16 * batch_size,
            chunk_rows=options.chunk_rows,
        )


def encoder_budget(gpu: bool) -> tuple[int, int]:
    """(visits, cells) per encoder call at most, on a GPU or the CPU."""
    return (GPU_ENCODE_BATCH, GPU_ENCODE_CELLS) if gpu else (CPU_ENCODE_BATCH, ENCODE_CELLS)


def cut_padded(
    order: np.ndarray,
    widths: Sequence[np.ndarray],
    budgets: Sequence[int],
    batch_size: int,
    squared: bool = False,
) -> list[np.ndarray]:
    """Cut `order` into consecutive batches of at most `batch_size` items such that, on each
    axis k, items x the largest widths[k] among them (squared: its square) stays within
    budgets[k]. widths[k][i] is the width of order[i]; a width of 0 counts as 1 (a padded
    axis holds one slot at least); an item alone may exceed a budget."""
    parts, lo, n = [], 0, order.size
    while lo < n:
        hi = min(lo + batch_size, n)
        size = np.arange(1, hi - lo + 1)
        fits = np.ones(hi - lo, bool)
        for width, budget in zip(widths, budgets, strict=True):
            longest = np.maximum.accumulate(np.maximum(width[lo:hi], 1)).astype(np.int64)
            fits &= size * (longest * longest if squared else longest) <= budget
        take = max(1, int(fits.sum()))  # the volume grows with the size: the fits are a prefix
        parts.append(order[lo : lo + take])
        lo += take
    return parts


def least_padded(
    orders: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]],
    budgets: Sequence[int],
    batch_size: int,
) -> list[np.ndarray]:
    """The batches (`cut_padded`) of the candidate order (order, its widths per axis) whose
    batches pad least: visits x the longest width, summed over batches and axes (the
    decoder's per-visit memories, where a history slot and a code cost a step about the
    same: ~2 x dim multiply-adds per row). The first of equals wins."""
    best: tuple[int, list[np.ndarray]] | None = None
    for order, widths in orders:
        parts = cut_padded(order, widths, budgets, batch_size)
        if not parts:
            return parts
        sizes = np.array([p.size for p in parts], np.int64)
        starts = np.cumsum(sizes) - sizes
        cells = sum(
            int((np.maximum.reduceat(np.maximum(w, 1), starts) * sizes).sum()) for w in widths
        )
        if best is None or cells < best[0]:
            best = (cells, parts)
    assert best is not None, "no candidate order"
    return best[1]
