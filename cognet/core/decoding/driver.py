"""The one decoding loop (torch-free): start, step, select, finish, compact, result.

Every decoding of cognet runs `run`: beam search and set decoding, with the selection in
numpy on the host (`cognet.core.decoding.beam.BeamSelector`,
`cognet.core.decoding.sampling.SetSampler`) or in the exported search graphs on the
execution provider (`cognet.runtime.device_selectors`), over any `DecoderSession` (ONNX
Runtime on the CPU or a GPU: `cognet.runtime.session`; the torch model:
`cognet.model.session`). What differs between decodings is the `Selector`: how one step's
output becomes each row's next token, when a visit is over and what it keeps of it. The loop
itself, and the rule by which finished visits leave the batch, are written here once.

Rows: each of the n visits owns `selector.width` rows (beams or samples), all fed to the
decoder step at once. A visit is over when its selector says so (at `max_len` steps at the
latest); the selector then records its answer (`finish`). Finished visits stay in the batch
until the live share of visits falls below `compact_at`: a compaction copies every memory
and cache row, so doing it at each finish costs more than carrying a few dead rows for a few
steps (the sweep of `compact_at`: BENCHMARKS.md "What was tried"). The tests hold this loop
equal to an independent one, the plain torch beam search that compacts at every finish
(tests/beam_oracle.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol, cast

import numpy as np

from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import MAX_LEN

COMPACT_AT = 0.75  # compact when fewer than this share of a batch's visits are live


class DecoderSession(Protocol):
    """What the driver needs from a model runtime (ONNX Runtime on the CPU or a GPU, or torch).

    Memories and caches are opaque handles (numpy arrays on the CPU, device buffers on a
    GPU, torch tensors); step outputs come back as numpy arrays, freshly allocated at each
    call. `step_outputs` names what `step` can return (models exported before
    `diag_attention` lack it); `search` is the model's search graphs where the selectors on
    the device run them (`cognet.runtime.device_selectors.SearchGraphs`), else None."""

    step_outputs: tuple[str, ...]
    search: Any
    # the cache is the token prefix (`graphspec.STEP_CACHE_INPUTS`: one int64 array [n, W,
    # T]) and the memories a dict of arrays: set decoding can step chosen rows alone
    # (`cognet.core.decoding.open_samples`)
    prefix_cache: bool

    def init(self, inputs: Mapping[str, np.ndarray]) -> Any:
        """Per-visit memories from the decoder-init inputs (`graphspec.INIT_INPUTS`)."""

    def empty_cache(self, n: int, width: int) -> Any:
        """The KV cache of n visits x width rows before the first step (T = 0)."""

    def step(
        self,
        tokens: np.ndarray,
        parent: np.ndarray,
        cache: Any,
        memories: Any,
        outputs: Sequence[str],
    ) -> tuple[dict[str, np.ndarray], Any]:
        """One decoder step: tokens, parent int64 [n, W] -> ({name: array} for `outputs`
        among log_probs [n, W, V1], gate [n, W], copy_probs [n, W, S], diag_attention
        [n, H, W, Ld]; the next cache, reordered by `parent`)."""

    def take(self, value: Any, rows: np.ndarray) -> Any:
        """Rows (axis 0) of a memories or cache handle."""


class DeviceDecoderSession(DecoderSession, Protocol):
    """A session whose step can leave the log-probabilities where it computed them, for a
    selector that runs on the device too (`Selector.on_device`)."""

    def step_log_probs(
        self, tokens: np.ndarray, parent: np.ndarray, cache: Any, memories: Any
    ) -> tuple[Any, Any]:
        """(log_probs [n, W, V1] as a device handle, the next cache) of one step."""


class Selector(Protocol):
    """One decoding rule, driven by `run`. The selector keeps its own per-row state (scores,
    masks, sums: on the host or on a device) and compacts it in `keep`; the driver keeps the
    rows' visits, tokens and parents."""

    width: int  # rows per visit: beams or samples
    on_device: bool  # the step's log-probabilities stay on the device (`step_log_probs`)
    outputs: tuple[str, ...]  # what the host step returns (log_probs first), when not

    def start(self, n: int) -> None:
        """The state of n fresh visits."""

    def select(
        self, t: int, out: Mapping[str, Any], rows: np.ndarray, parent: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step t's output for the visits `rows` -> (tokens int64 [R, W], parent int64
        [R, W] for the next step, over bool [R]: the visit's answer is final)."""

    def finish(self, t: int, newly: np.ndarray, rows: np.ndarray) -> None:
        """Record the answers of the rows `newly` (bool [R]) that are over at step t."""

    def keep(self, live: np.ndarray) -> None:
        """Keep only the rows `live` (int64 indices) of the per-row state."""

    def result(self, steps: int) -> Any:
        """The answer of every visit, after `steps` decoder steps."""

    def empty(self) -> Any:
        """The answer for no visit at all."""


@dataclass(frozen=True)
class LoopConfig:
    """What every decoding's driver configuration holds."""

    end: int  # END id (= number of medications M); START = END + 1
    _: KW_ONLY
    max_len: int = MAX_LEN
    compact_at: float = COMPACT_AT  # 1.0 compacts at every finish, like the torch reference
    ddi: DDIPolicy = DDIPolicy()  # the paper's decoding: off

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError("max_len must be >= 1")
        if not 0.0 < self.compact_at <= 1.0:
            raise ValueError("compact_at must be in (0, 1]")


@dataclass(frozen=True, eq=False)
class Visits:
    """The visits of one decoding call and what it returns beside each visit's answer: what
    beam search, set decoding and an ensemble's pass along together with the session, the
    memories and the driver's configuration (`cognet.core.decoding.plan` builds it)."""

    n: int  # visits to decode, whose memories come from `session.init`
    _: KW_ONLY
    keys: np.ndarray | None = None  # uint64 [n]: their random streams (set decoding's draws)
    prauc: bool = False  # beam search: the PRAUC scores too (set decoding's: its P(k in S))
    explain: bool = False  # the gates and copy distributions too
    attention: bool = False  # with `explain`: the diagnosis attention (`diag_attention`)
    # bool/0-1 [M, M]: the DDI pairs (symmetric, zero diagonal); needed by an active policy
    ddi_adj: np.ndarray | None = None

    def drawn_keys(self) -> np.ndarray:
        """The visits' keys, which set decoding draws from (ValueError when not given)."""
        if self.keys is None:
            raise ValueError("set decoding draws from the visits' keys: give Visits.keys")
        return self.keys


def run(session: DecoderSession, memories: Any, n: int, selector: Selector, cfg: LoopConfig) -> Any:
    """Decode the n visits whose memories come from `session.init` with `selector`'s rule
    (`session`: a `DecoderSession`; a `DeviceDecoderSession` for a selector on the device)."""
    if n == 0:
        return selector.empty()
    w = selector.width
    rows = np.arange(n)  # visit of each row of the current batch
    tokens = np.full((n, w), cfg.end + 1, np.int64)  # START
    parent = np.tile(np.arange(w, dtype=np.int64), (n, 1))
    done = np.zeros(n, bool)  # per row
    cache = session.empty_cache(n, w)
    selector.start(n)
    steps = 0
    for t in range(cfg.max_len):
        if selector.on_device:  # the log-probabilities stay where the step computed them
            device = cast(DeviceDecoderSession, session)
            logp, cache = device.step_log_probs(tokens, parent, cache, memories)
            out: Mapping[str, Any] = {"log_probs": logp}
        else:
            out, cache = session.step(tokens, parent, cache, memories, selector.outputs)
        steps += 1
        tokens, parent, over = selector.select(t, out, rows, parent)
        newly = ~done & (over if t < cfg.max_len - 1 else True)
        if not newly.any():
            continue
        selector.finish(t, newly, rows)
        done |= newly
        live = np.flatnonzero(~done)
        if live.size == 0:
            break
        if live.size < cfg.compact_at * done.size:
            rows, tokens, parent, done = (x[live] for x in (rows, tokens, parent, done))
            selector.keep(live)
            cache = session.take(cache, live)
            memories = session.take(memories, live)
    return selector.result(steps)


def step_outputs(explain: bool, attention: bool) -> tuple[str, ...]:
    """The host step outputs a selector asks for: the log-probabilities, and for
    explanations the gate, the copy distribution and (with `attention`) the diagnosis
    attention."""
    if not explain:
        return ("log_probs",)
    return ("log_probs", "gate", "copy_probs", *(("diag_attention",) if attention else ()))
