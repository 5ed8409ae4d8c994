"""`cognet.core.history.history_index` (vectorised) against the plain definition: each
decoded visit's past visits, then every medication slot of them, in order."""

from __future__ import annotations

import numpy as np
import pytest

from cognet.core.history import history_index
from cognet.core.ragged import Ragged


def _by_loops(histories, med_ids) -> dict[str, np.ndarray]:
    n = len(histories)
    slots = [sum(len(med_ids[r]) for r in h) for h in histories]
    j_max, s_max = max([1, *map(len, histories)]), max([1, *slots])
    out = {"hist_index": np.zeros((n, j_max), np.int64), "hist_mask": np.zeros((n, j_max))}
    for name in ("slot_row", "slot_pos", "slot_visit", "slot_med", "slot_mask"):
        out[name] = np.zeros((n, s_max))
    for i, rows in enumerate(histories):
        at = 0
        for j, r in enumerate(rows):
            out["hist_index"][i, j], out["hist_mask"][i, j] = r, 1
            for p, med in enumerate(med_ids[r]):
                for name, value in (
                    ("slot_row", r),
                    ("slot_pos", p),
                    ("slot_visit", j),
                    ("slot_med", med),
                    ("slot_mask", 1),
                ):
                    out[name][i, at] = value
                at += 1
    return out


@pytest.mark.parametrize("ragged", [False, True], ids=["lists", "ragged"])
def test_history_index_equals_its_definition(ragged):
    rng = np.random.default_rng(0)
    for _ in range(100):
        n_rows, n = int(rng.integers(1, 30)), int(rng.integers(0, 20))
        med_ids = [list(rng.integers(0, 50, rng.integers(0, 6))) for _ in range(n_rows)]
        histories = [list(rng.integers(0, n_rows, rng.integers(0, 5))) for _ in range(n)]
        given = med_ids
        if ragged:
            offsets = np.concatenate([[0], np.cumsum([len(m) for m in med_ids])]).astype(np.int64)
            given = Ragged(np.array([m for ids in med_ids for m in ids], np.int64), offsets)
        got, want = history_index(histories, given), _by_loops(histories, med_ids)
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        assert got["slot_mask"].dtype == got["hist_mask"].dtype == np.float32
