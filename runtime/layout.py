"""Where a chunk's encodings lie (`Layout`), and the encoder calls that write them
(`encoder_calls`): the layout half of `cognet.runtime.encoder`, torch-free and
session-free."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cognet.core.graphspec import ENCODER_INPUTS, ENCODER_OUTPUTS, ENCODER_PARTS
from cognet.runtime.batches import cut_padded
from cognet.runtime.plan import Plan


@dataclass
class Layout:
    """Where the encoder outputs of a chunk's rows go in two flat buffers, each encoder call's
    outputs one after the other, as the call returned them (a plain copy, or the call writes
    them in place). A call encodes every kind of code (the encoder graph) or one kind (an
    encoder part, `graphspec.ENCODER_PARTS`); `kinds` says which:

    - codes [code_rows, s]: per call of n visits, its diag_enc [n, Ld, s], proc_enc
      [n, Lp, s] and med_enc [n, Lm, s] (those of its kinds), each flattened to rows; the
      last row is zero and padding positions point at it;
    - visits [visit_rows, s]: per call, its v_d [n, s] then v_p [n, s] (those of its kinds);
      the last row zero.

    Each output's region starts at a multiple of ALIGN_ROWS rows; the rows between regions
    are never written nor read. at[kind][row]: the buffer row of a chunk row's first code of
    that kind (its j-th code at + j), or of its v_d / v_p; only encoded rows have one."""

    parts: list[np.ndarray]  # the chunk rows of each encoder call, in call order
    kinds: np.ndarray  # bool [calls, 3]: the call encodes diagnoses, procedures, meds
    widths: np.ndarray  # int64 [calls, 3]: padded code width of each kind (0: not encoded)
    code_at: np.ndarray  # int64 [calls, 3]: first buffer row of each output of each call
    visit_at: np.ndarray  # int64 [calls, 2]: buffer row of each call's first v_d, v_p
    at: dict[str, np.ndarray]  # "diag", "proc", "meds", "v_d", "v_p" -> int64 [chunk rows]
    code_rows: int
    visit_rows: int

    def outputs(self, k: int) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        """{encoder output: (its buffer, first row there, shape without the last axis)} of
        call k: those of the kinds it encodes."""
        n = int(self.parts[k].size)
        (ld, lp, lm), (d, p, m) = self.widths[k].tolist(), self.code_at[k].tolist()
        vd, vp = self.visit_at[k].tolist()
        every = {
            "diag_enc": ("codes", d, (n, ld)),
            "proc_enc": ("codes", p, (n, lp)),
            "med_enc": ("codes", m, (n, lm)),
            "v_d": ("visits", vd, (n,)),
            "v_p": ("visits", vp, (n,)),
        }
        return {name: every[name] for name in self.output_names(k)}

    def output_names(self, k: int) -> tuple[str, ...]:
        """The encoder outputs of call k, in `ENCODER_OUTPUTS` order."""
        names = {n for kind, on in zip(KINDS, self.kinds[k], strict=True) if on for n in OUT[kind]}
        return tuple(n for n in ENCODER_OUTPUTS if n in names)

    def part(self, k: int) -> str | None:
        """The encoder part that runs call k (`graphspec.ENCODER_PARTS`), or None: the
        encoder graph."""
        on = self.kinds[k]
        return None if on.all() else PART_OF[KINDS[int(np.flatnonzero(on)[0])]]


# The kinds of code, as `Plan` holds them and in the order of `ENCODER_INPUTS` and
# `ENCODER_PARTS`; each kind's encoder part and its outputs
KINDS = ("diag", "proc", "meds")
PART_OF = dict(zip(KINDS, ENCODER_PARTS, strict=True))
OUT = {kind: ENCODER_PARTS[part][1] for kind, part in PART_OF.items()}
assert [ENCODER_PARTS[p][0] for p in PART_OF.values()] == [(i,) for i in ENCODER_INPUTS]


# Every output's region starts at a multiple of this many rows: 16-byte aligned for any
# width in float16 or float32 (a graph writes there; vectorised GPU kernels load 16 bytes).
ALIGN_ROWS = 8


def layout(plan: Plan, parts: list[np.ndarray], kinds: np.ndarray | None = None) -> Layout:
    """The buffer layout of encoder calls over `parts` (chunk rows per call) that encode
    `kinds` (bool [calls, 3]; None: every kind, the encoder graph's calls)."""
    raggeds = (plan.diag, plan.proc, plan.meds)
    if kinds is None:
        kinds = np.ones((len(parts), 3), bool)
    kinds = np.asarray(kinds, bool).reshape(-1, 3)
    sizes = np.array([p.size for p in parts], np.int64)
    widths = (
        np.array(
            [[max(1, int(r.lengths[p].max(initial=0))) for r in raggeds] for p in parts], np.int64
        ).reshape(-1, 3)
        * kinds
    )
    cells = _aligned(widths * sizes[:, None]).ravel()  # call by call, kind by kind
    code_at = (np.cumsum(cells) - cells).reshape(-1, 3)
    visits = (_aligned(sizes)[:, None] * kinds[:, :2]).ravel()  # v_d, then v_p
    visit_at = (np.cumsum(visits) - visits).reshape(-1, 2)
    at = {kind: np.zeros(plan.rows, np.int64) for kind in (*KINDS, "v_d", "v_p")}
    for j, kind in enumerate(KINDS):
        calls = np.flatnonzero(kinds[:, j])
        if not calls.size:
            continue
        rows = np.concatenate([parts[c] for c in calls])
        call = np.repeat(calls, sizes[calls])
        i = np.concatenate([np.arange(sizes[c]) for c in calls])  # place in its call
        at[kind][rows] = code_at[call, j] + i * widths[call, j]
        if j < 2:
            at[("v_d", "v_p")[j]][rows] = visit_at[call, j] + i
    return Layout(
        list(parts),
        kinds,
        widths,
        code_at,
        visit_at,
        at,
        int(cells.sum()) + 1,
        int(visits.sum()) + 1,
    )


def _aligned(rows):
    """rows rounded up to a multiple of ALIGN_ROWS."""
    return -(-rows // ALIGN_ROWS) * ALIGN_ROWS


def encoder_calls(plan: Plan, split: bool, cells: int, batch: int) -> Layout:
    """The layout of the encoder calls over every row of a plan that is scored or serves as
    history (`plan.encode_rows`): calls of at most `batch` visits and `cells` padded codes
    of each kind (`cut_padded`, squared: attention weights), in which similar lengths pad
    little. `split` (an encoder that runs its parts): each kind of code on its own, rows in
    order of that kind's length, medications only of the rows that have some (only
    histories' are read). Otherwise the three kinds of a row together, rows grouped by
    medication count, then diagnoses + procedures."""
    raggeds = (plan.diag, plan.proc, plan.meds)
    rows = plan.encode_rows
    if not split:
        codes = plan.diag.lengths + plan.proc.lengths
        rows = rows[np.lexsort((codes[rows], plan.meds.lengths[rows] // 4))]
        lengths = [ragged.lengths[rows] for ragged in raggeds]
        return layout(plan, cut_padded(rows, lengths, [cells] * 3, batch, squared=True))
    parts, kinds = [], []
    for j, ragged in enumerate(raggeds):
        mine = rows if j < 2 else rows[ragged.lengths[rows] > 0]
        mine = mine[np.argsort(ragged.lengths[mine], kind="stable")]
        cut = cut_padded(mine, [ragged.lengths[mine]], [cells], batch, squared=True)
        parts += cut
        kinds += [np.arange(3) == j] * len(cut)
    return layout(plan, parts, np.array(kinds, bool).reshape(-1, 3))
