"""Set decoding's loop that steps only the rows whose output is read: each visit's open
samples, packed into calls of a few widths, on memories laid out so that every call's are
a slice.

The one loop (`driver.run`) feeds the step every sample of every visit in the batch: a
visit decodes until its longest sample ends, so a fifth of the rows it computes belong to
samples already finished (their distribution is all on END; `SetSampler` reads none of
them), and at the first step a visit's 16 samples are one computation. Here:

- the first step is one call of one row a visit (every sample has fed START alone);
- after it, each visit takes the narrowest width of `widths` that holds its open samples
  (a visit's open samples only ever fall), and each width is one call of the step on those
  visits alone ([n_c, c] rows, the open samples in order, the first repeated in spare
  slots); a width whose call would save fewer than `MIN_SAVED` rows runs with the next;
- the memories (and each sample's prefix) are kept in one copy ordered by width, widest
  first, visits already over last (`_Blocks`): a visit that narrows changes place with the
  last visit of each block it leaves (two rows copied), so that each call's memories are a
  contiguous slice, not a copy;
- the outputs are read by the sampler in the [n, W, V1] layout it knows (`_Rows`).

This runs in the one loop (`driver.run`, its finishing and compaction), as a session over
the real one (`NarrowSession`), for sessions whose cache is the token prefix and whose
memories are host arrays (`session.prefix_cache`: the runtime's host decoder on a model
exported with the token-prefix step). A row's output is the same computation as in the one
loop, on the same inputs, at another batch shape: equal but for the float32 rounding a
shape can change. The torch session keeps the one loop (the reference); so do
explanations, the sampler in the search graphs and beam search (whose beams are few and
rarely finish early).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cognet.core.decoding import driver
from cognet.core.decoding.driver import DecoderSession, LoopConfig, Selector

MIN_SAVED = 64  # a width whose own call would save fewer rows runs with the next wider one


def applies(session: DecoderSession, sampler: Any) -> bool:
    """Whether `run` can drive this session and set sampler (a `SetSampler`): a session
    whose cache is the token prefix, and a sampler that reads the log-probabilities alone
    (no explanations)."""
    return session.prefix_cache and tuple(sampler.outputs) == ("log_probs",)


def widths(width: int) -> tuple[int, ...]:
    """The call widths for `width` rows per visit, widest first: the width, three quarters
    of it, and powers of two down to 4 (each width is a call of the step at every step)."""
    out = {width}
    c = min(4, width)
    while c < width:
        out.add(c)
        c *= 2
    if width % 4 == 0:
        out.add(3 * width // 4)
    return tuple(sorted(out, reverse=True))


def run(session: DecoderSession, memories: Any, n: int, selector: Selector, cfg: LoopConfig) -> Any:
    """`driver.run` for a set sampler (`applies`), stepping only its open rows."""
    if n == 0:
        return selector.empty()
    narrowed = NarrowSession(session, selector, memories, n, cfg.max_len)
    return driver.run(narrowed, np.arange(n), n, selector, cfg)


class _Blocks:
    """The memories of the loop's n visits and each sample's prefix, in one copy whose rows
    are ordered by the visits' call width: block 0 (the widest) first, the visits already
    over last. `at[v]` is visit v's row, `order` the visit of each row, `start[l]` the first
    row of block l (l = len(widths): the visits over)."""

    def __init__(self, memories: dict, n: int, width: int, levels: int, max_len: int):
        self.memories = {k: np.array(v, copy=True) for k, v in memories.items()}
        self.prefix = np.zeros((n, width, max_len), np.int64)
        self.order, self.at = np.arange(n), np.arange(n)
        self.level = np.zeros(n, np.int64)
        self.start = np.zeros(levels + 2, np.int64)
        self.start[1:] = n

    def lower(self, visits: np.ndarray, target: np.ndarray) -> None:
        """Move `visits` down to the blocks `target` (>= their own), block by block: the
        movers of a block change rows with the visits in its last rows that stay. The rows
        of the memories and prefixes move once, at the end (`_move`)."""
        src = None  # the row whose contents each row takes, where any moved
        for lvl in range(len(self.start) - 2):
            movers = visits[(self.level[visits] == lvl) & (target > lvl)]
            if movers.size == 0:
                continue
            end = self.start[lvl + 1]
            tail = np.arange(end - movers.size, end)
            out = np.sort(self.at[movers])
            out = out[out < tail[0]]  # movers not already in the tail
            moving = np.zeros(self.order.size, bool)
            moving[movers] = True
            stay = tail[~moving[self.order[tail]]]
            if out.size:
                src = np.arange(self.order.size) if src is None else src
                src[out], src[stay] = src[stay], src[out]
                va, vb = self.order[out], self.order[stay]
                self.order[out], self.order[stay] = vb, va
                self.at[vb], self.at[va] = out, stay
            self.start[lvl + 1] = end - movers.size
            self.level[movers] = lvl + 1
        if src is not None:
            self._move(src)

    def _move(self, src: np.ndarray) -> None:
        """Each row r of the memories and prefixes takes the contents of row src[r]."""
        rows = np.flatnonzero(src != np.arange(src.size))
        for value in (*self.memories.values(), self.prefix):
            value[rows] = value[src[rows]]


class NarrowSession:
    """A `driver.DecoderSession` over a token-prefix session that steps, at each step, the
    open samples of `selector` only (the module's rules). Its cache and memory handles are
    the loop's visit of each batch row; the state is its own (`_Blocks`). Samples never
    change rows (`parent` is read as the identity, as set decoding feeds it)."""

    step_outputs = ("log_probs",)
    search = None
    prefix_cache = False

    def __init__(self, session: Any, selector: Selector, memories: Any, n: int, max_len: int):
        self.session, self.selector = session, selector
        self.widths = widths(selector.width)
        self.level_of = _level_table(self.widths)
        self.blocks = _Blocks(memories, n, selector.width, len(self.widths), max_len)
        self.t = 0

    def empty_cache(self, n: int, width: int) -> np.ndarray:
        return np.arange(n)

    def take(self, value: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return value[rows]

    def step(self, tokens, parent, cache: np.ndarray, memories: np.ndarray, outputs):
        blocks, t, w = self.blocks, self.t, tokens.shape[1]
        visits = memories  # the loop's visit of each batch row
        blocks.prefix[blocks.at[visits], :, t] = tokens
        self.t += 1
        open_ = self.selector.open()
        count = open_.sum(1)
        if t == 0:  # every sample has fed START alone: one row a visit, every visit
            fed = np.ascontiguousarray(tokens[:, :1])
            past = np.zeros((visits.size, 1, 0), np.int64)
            logp = self._run(fed, past, blocks.memories)
            where = np.broadcast_to(np.arange(visits.size)[:, None], tokens.shape)
            return {"log_probs": _Rows(logp, where)}, cache
        row_of = np.full(blocks.order.size, -1, np.int64)
        row_of[visits] = np.arange(visits.size)
        gone = blocks.order[: blocks.start[-2]]
        gone = gone[row_of[gone] < 0]  # over, and compacted out of the batch since
        blocks.lower(
            np.concatenate([visits, gone]),
            np.concatenate([self.level_of[count], np.full_like(gone, len(self.widths))]),
        )
        rank = np.cumsum(open_, axis=1) - 1  # each open sample's slot
        where = np.zeros(tokens.shape, np.int64)
        packed, offset = [], 0
        for lo, hi, c in self._calls():
            rows = row_of[blocks.order[lo:hi]]
            if c == w:
                slots = None
            else:  # the open samples in order, the first one again in spare slots
                slots = np.argsort(~open_[rows], axis=1, kind="stable")[:, :c]
                spare = np.arange(c) >= count[rows][:, None]
                slots = np.where(spare, slots[:, :1], slots)
            packed.append(self._call(lo, hi, slots, t))
            where[rows] = (
                offset
                + np.arange(rows.size)[:, None] * c
                + (np.arange(w) if c == w else rank[rows])
            )
            offset += rows.size * c
        flat = np.concatenate(packed) if len(packed) > 1 else packed[0]
        return {"log_probs": _Rows(flat, where)}, cache

    def _calls(self) -> list[tuple[int, int, int]]:
        """(first row, end row, width) of each call: a block whose own call would save fewer
        than MIN_SAVED rows joins the wider one before it."""
        start, calls = self.blocks.start, []
        for lvl, c in enumerate(self.widths):
            lo, hi = int(start[lvl]), int(start[lvl + 1])
            if hi == lo:
                continue
            if calls and calls[-1][1] == lo and (hi - lo) * (calls[-1][2] - c) < MIN_SAVED:
                calls[-1] = (calls[-1][0], hi, calls[-1][2])
            else:
                calls.append((lo, hi, c))
        return calls

    def _call(self, a: int, b: int, slots, t: int) -> np.ndarray:
        """float32 [(b - a) * c, V1]: step t's call on the block rows [a, b), the samples
        `slots` [b - a, c] of each (None: all W, in order)."""
        prefix = self.blocks.prefix[a:b, :, : t + 1]
        if slots is not None:
            prefix = np.take_along_axis(prefix, slots[..., None], axis=1)
        mem = {k: v[a:b] for k, v in self.blocks.memories.items()}
        return self._run(
            np.ascontiguousarray(prefix[..., t]), np.ascontiguousarray(prefix[..., :t]), mem
        )

    def _run(self, fed: np.ndarray, past: np.ndarray, mem: dict) -> np.ndarray:
        """float32 [n * c, V1]: the real session's step on tokens `fed` [n, c] after the
        prefixes `past` [n, c, T] (`parent` the identity)."""
        par = np.ascontiguousarray(
            np.broadcast_to(np.arange(fed.shape[1], dtype=np.int64), fed.shape)
        )
        got, _ = self.session.step(fed, par, (past,), mem, ("log_probs",))
        logp = got["log_probs"]
        return logp.reshape(-1, logp.shape[-1])


def _level_table(ws: tuple[int, ...]) -> np.ndarray:
    """int64 [W + 1]: the block of a visit with d open samples, d = 0..W: the narrowest
    width that holds them (block len(ws): none open, the visit is over)."""
    table = np.full(ws[0] + 1, len(ws), np.int64)
    for lvl, c in enumerate(ws):
        table[1 : c + 1] = lvl
    return table


class _Rows:
    """The log-probabilities [R, W, V1] of a narrowed step as the sampler reads them
    (`got["log_probs"][vis, smp]` of open samples): rows of the packed calls' outputs."""

    def __init__(self, flat: np.ndarray, where: np.ndarray):
        self.flat, self.where = flat, where  # float32 [rows, V1]; int64 [R, W]

    def __getitem__(self, key) -> np.ndarray:
        return self.flat[self.where[key]]
