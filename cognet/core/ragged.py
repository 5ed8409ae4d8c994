"""`Ragged`: rows of different lengths in two flat int64 arrays (numpy, torch-free), as the
runtime plans histories and code lists and `history.history_index` reads them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Ragged:
    """Variable-length int64 rows: row i is values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def positions(self, rows: np.ndarray, min_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Flat positions [len(rows), L] of each row's items (L = max(lengths, min_len)) and
        the bool mask of real items (padding positions are 0)."""
        lengths = self.lengths[rows]
        width = max(min_len, int(lengths.max(initial=0)))
        k = np.arange(width)
        mask = k < lengths[:, None]
        return np.where(mask, self.offsets[rows, None] + k, 0), mask

    def pad(self, rows: np.ndarray, pad_id: int) -> np.ndarray:
        """int64 [len(rows), max(1, longest)] padded with pad_id."""
        pos, mask = self.positions(rows)
        return np.where(mask, self.values[pos] if self.values.size else 0, pad_id)

    def rows(self) -> list[np.ndarray]:
        """Every row, as views of `values` (slicing: np.split costs four times as much)."""
        at = self.offsets.tolist()
        return [self.values[a:b] for a, b in zip(at[:-1], at[1:], strict=True)]

    @classmethod
    def of_lengths(cls, values: np.ndarray, lengths: np.ndarray) -> Ragged:
        """The rows of `values` cut in order by `lengths`."""
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(values, offsets)
