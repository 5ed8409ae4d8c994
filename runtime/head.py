"""The set head on the runtime (torch-free): P(k in S) of a plan's targets in one pass through
the head's graph (`--decoding marginal`, `cognet.core.head_inputs`), no encoder nor decoder.

Per chunk, the targets are cut into calls of similar list lengths (`HeadSession.batches`):
the graph gathers one embedding row per padded id before summing them, so a call's memory is
its visits x its longest list of each kind; `HEAD_CELLS` bounds that product, as the
decoder's budgets bound its batches (`cognet.runtime.batches`). A GPU takes calls 16 times
larger (`GPU_HEAD_BATCH`, `GPU_HEAD_CELLS`): each call costs it a launch and a wait that
the graph's own work, a few gathers and products, does not hide.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from cognet.core.errors import InputError, one_line
from cognet.core.head_inputs import HEAD_INPUTS, HEAD_OUTPUT, head_arrays, history_meds, take_rows
from cognet.core.manifest import Manifest
from cognet.runtime.batches import cut_padded
from cognet.runtime.plan import Plan

HEAD_BATCH = 1024  # visits per call at most
# visits x the longest list of a kind per call at most: the gathered embedding rows of a
# kind are that many x the head's width floats (2^15 x 1024 wide: 128 MB)
HEAD_CELLS = 1 << 15
GPU_HEAD_BATCH, GPU_HEAD_CELLS = 1 << 14, 1 << 19  # 2 GB of rows a kind at 1024 wide


def open_head(
    manifest: Manifest, opts: ort.SessionOptions, providers: list, gpu: bool = False
) -> HeadSession | None:
    """The checked session of a model directory's set head, or None for a model without one;
    InputError naming the graph file when it cannot load or is not the head's graph. `gpu`:
    the GPU's call sizes (on a GPU, or its code path on the CPU)."""
    spec = manifest.head
    if spec is None:
        return None
    path = Path(manifest.model_dir or ".") / spec.file
    try:
        session = ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as exc:  # noqa: BLE001 - any load failure is a bad model file
        raise InputError(f"{path}: cannot load the ONNX graph ({one_line(exc)})") from None
    got = tuple(i.name for i in session.get_inputs())
    outputs = tuple(o.name for o in session.get_outputs())
    if sorted(got) != sorted(HEAD_INPUTS) or HEAD_OUTPUT not in outputs:
        raise InputError(
            f"{path}: not the set head's graph (its inputs are {', '.join(got)}; the head "
            f"takes {', '.join(HEAD_INPUTS)}); re-export the model"
        )
    dims = manifest.dims
    budget = (GPU_HEAD_BATCH, GPU_HEAD_CELLS) if gpu else (HEAD_BATCH, HEAD_CELLS)
    return HeadSession(session, dims.n_diag, dims.n_proc, dims.n_med, budget)


class HeadSession:
    """The head's ONNX Runtime session, the vocabulary sizes its inputs pad with and its
    calls' budget: (visits, visits x longest list of a kind) at most."""

    def __init__(
        self,
        session: ort.InferenceSession,
        n_diag: int,
        n_proc: int,
        n_med: int,
        budget: tuple[int, int] = (HEAD_BATCH, HEAD_CELLS),
    ):
        self.session = session
        self.pads = (n_diag, n_proc, n_med)
        self.n_med = n_med
        self.budget = budget

    def batches(self, plan: Plan) -> list[np.ndarray]:
        """The plan's targets (indices into `plan.targets`) cut into calls: in order of
        history length then code count, each call within the budget."""
        rows = plan.targets
        diag, proc = plan.diag.lengths[rows], plan.proc.lengths[rows]
        slots = plan.histories.sums(plan.meds.lengths)  # an upper bound of the past list
        last = np.zeros(rows.size, np.int64)
        has = plan.histories.lengths > 0
        last[has] = plan.meds.lengths[plan.histories.rows[plan.histories.end[has] - 1]]
        order = np.lexsort((diag + proc, slots))
        widths = [w[order] for w in (diag, proc, last, np.minimum(slots, self.n_med))]
        visits, cells = self.budget
        return cut_padded(order, widths, [cells] * 4, visits)

    def marginals(self, plan: Plan, part: np.ndarray) -> np.ndarray:
        """float64 [len(part), M]: P(k in S) of the targets `part` (indices into
        `plan.targets`), each read with its plan history (`Plan.histories`)."""
        rows = plan.targets[part]
        histories = plan.histories.take(part)
        last, past = history_meds(plan.meds, histories, self.n_med)
        arrays = head_arrays(
            take_rows(plan.diag, rows),
            take_rows(plan.proc, rows),
            last,
            past,
            histories.lengths > 0,
            self.pads,
        )
        (out,) = self.session.run([HEAD_OUTPUT], arrays)
        return out.astype(np.float64)  # as the torch head's (`SetHead.marginals`)
