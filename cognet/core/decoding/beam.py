"""Beam search on the host: the paper's decoding as a selector of the one decoding loop
(`cognet.core.decoding.driver.run`), in numpy over any decoder session (torch-free).

The rules are those of `cognet.model.torch_decoding.beam_search` (docs/DESIGN.md "Beam search"):
scores start at 0 for beam 0 and -inf for the others; medications already in a hypothesis
get -inf; a finished beam proposes only END with log-probability 0; the B best candidates
of each visit are taken in a stable descending order (ties -> smaller flat index
b * V1 + v); a visit is done once its beam 0 has finished or after `max_len` steps.

How the work is kept small:
- The session holds the per-visit memories (decoder init, once per visit) and the
  self-attention cache (the token prefix of each row; the torch model's own step, its keys
  and values); the step reorders the cache itself through its `parent` input, so the driver
  never gathers the cache between steps. Finished visits leave the batch by
  the driver's compaction rule (`cognet.core.decoding.driver`).
- Top-k is B passes of `argmax` (the first maximum, i.e. the smallest flat index among
  ties: exactly a stable descending sort) with a stable argsort fallback for the rare rows
  where a chosen candidate is -inf (fewer than B finite candidates): B passes over a row
  cost far less than sorting it.
- Each step only records (parent, token, chosen log-prob) per beam (`BeamStep`); the best
  hypothesis is traced back once per batch at the end, along with the optional PRAUC
  scores (mean step probabilities) and explanations (gate, copy distribution and diagnosis
  attention at each step). The device selector (`cognet.runtime.device_selectors`) shares the trace.

DDI-aware decoding (`cfg.ddi`) follows the rules written in `cognet.core.ddi`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cognet.core.ddi import (
    RATE_TOLERANCE,
    DDIPolicy,
    apply_step_penalty,
    check_adjacency,
    ddi_rates,
)
from cognet.core.decoding import BEAM, Decoding, driver
from cognet.core.decoding.attribution import beam_shares
from cognet.core.decoding.driver import (
    COMPACT_AT,
    DecoderSession,
    LoopConfig,
    Visits,
    step_outputs,
)
from cognet.core.decoding.ensemble import MEMBER_LOG_PROBS, mix_log_probs

NEG_INF = np.float32(-np.inf)


@dataclass(frozen=True)
class BeamConfig(LoopConfig):
    """Beam search's driver configuration (`LoopConfig`: end, max_len, compact_at, ddi)."""

    beam: int = BEAM

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beam < 1:
            raise ValueError("beam and max_len must be >= 1")

    @classmethod
    def of(
        cls,
        decoding: Decoding,
        end: int,
        ddi: DDIPolicy = DDIPolicy(),
        compact_at: float = COMPACT_AT,
    ) -> BeamConfig:
        """The driver configuration of a `Decoding`'s beam search (`cognet.core.decoding`)."""
        return cls(
            end=end, beam=decoding.beam, max_len=decoding.max_len, compact_at=compact_at, ddi=ddi
        )


@dataclass
class BeamResult:
    """The best hypothesis of each of N visits."""

    meds: list[np.ndarray]  # per visit: medication ids in generation order (END excluded)
    score: np.ndarray  # float32 [N]: sum of log-probabilities, END included
    med_probs: list[np.ndarray]  # per visit: probability of each medication at its step
    # float32 [N, M] (see `cognet.model.torch_decoding.Decoded`)
    prauc_scores: np.ndarray | None = None
    gates: list[np.ndarray] | None = None  # per visit: w_g at each medication's step
    copies: list[np.ndarray] | None = None  # per visit: [meds, S] copy distribution
    # per visit: [meds, S] copy share by slot (`attribution.copy_share_by_slot`)
    shares: list[np.ndarray] | None = None
    # per visit: [meds, Ld] diagnosis cross-attention (mean over heads), with `attention`
    attention: list[np.ndarray] | None = None
    steps: int = 0  # decoder steps run


@dataclass
class BeamStep:
    """What one step decided, for the trace back (arrays over the rows of that step)."""

    rows: np.ndarray  # [R] visit index of each row
    parent: np.ndarray  # [R, B] beam of the previous step each new beam continues
    token: np.ndarray  # [R, B]
    live: np.ndarray  # [R, B] the beam was not finished before this step
    chosen: np.ndarray  # [R, B] raw log-probability of the chosen token
    log_probs: np.ndarray | None  # [R, B, V1] (for PRAUC scores)
    gate: np.ndarray | None  # [R, B]
    copy: np.ndarray | None  # [R, B, S]
    attention: np.ndarray | None  # [R, H, B, Ld]


def top_k_stable(cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest values of each row of `cand` [n, m] in the order of a stable
    descending sort (ties -> smaller index): (indices int64 [n, k], values [n, k]).
    `cand` is overwritten.

    k passes of argmax take the first maximum each time; taken entries are set to -inf, so
    the result is exact whenever every chosen value is finite. Rows where one is not (fewer
    than k finite candidates) are redone with a stable argsort.
    """
    n = cand.shape[0]
    rows = np.arange(n)
    idx = np.empty((n, k), np.int64)
    val = np.empty((n, k), cand.dtype)
    for j in range(k):
        i = cand.argmax(axis=1)
        idx[:, j] = i
        val[:, j] = cand[rows, i]
        cand[rows, i] = NEG_INF
    bad = np.flatnonzero(~(val[:, -1] > NEG_INF))  # -inf (or NaN) among the chosen
    if bad.size:
        sub = cand[bad]
        for j in range(k - 1, -1, -1):  # restore the rows (an index may repeat: first wins)
            sub[np.arange(bad.size), idx[bad, j]] = val[bad, j]
        order = np.argsort(-sub, axis=1, kind="stable")[:, :k]
        idx[bad] = order
        val[bad] = np.take_along_axis(sub, order, 1)
    return idx, val


def mixed_top_k(
    members: tuple[np.ndarray, ...],
    scores: np.ndarray,
    used: np.ndarray | None,
    finished: np.ndarray,
    end: int,
    k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """`top_k_stable` of the candidates `BeamSelector` builds from the token-level mixture of
    the members' log-probabilities [R, B, V1] (no DDI penalty), with the same result, while
    mixing only the candidates that can be among the k best.

    The mixture log(1/K sum_i exp(a_i)) lies in [max_i a_i - log K, max_i a_i]. A
    candidate's score bounded above by its members' maximum that falls more than log K
    below the k-th largest such bound is below k others whatever the mixture: only the rest
    are mixed (about 1% of the tokens at beam 4), by `mix_log_probs` itself (the same bits),
    and ranked in flat order, so that ties break alike. The margin (log K + 0.007, and
    1e-6 of the bound) covers the float32 roundings of the bounds and of the scores' sums.
    A row with fewer than k finite bounds, or a NaN, keeps every candidate."""
    r, b, v1 = members[0].shape
    width = b * v1
    bound = members[0].copy() if len(members) == 1 else np.maximum(members[0], members[1])
    for part in members[2:]:
        np.maximum(bound, part, out=bound)
    bound += scores[:, :, None]
    if used is not None:
        np.copyto(bound, NEG_INF, where=used)
    if finished.any():  # a finished beam proposes only END, with its frozen score
        bound[finished] = NEG_INF
        bound[finished, end] = scores[finished]
    flat = bound.reshape(r, width)
    kth = _kth_largest(flat, k)
    cut = kth - (np.float32(np.log(len(members)) + 0.007) + np.abs(kth) * np.float32(1e-6))
    cut[~(np.isfinite(kth) | (kth == NEG_INF))] = NEG_INF  # a NaN, +inf: keep every candidate
    keep = flat >= cut[:, None]
    keep[cut == NEG_INF] = True  # every candidate, NaN too
    idx = np.flatnonzero(keep)  # row-major: each row's in flat order
    at, beam = idx // width, idx // v1  # row, and row * B + beam, of each candidate
    value = scores.reshape(-1)[beam] + mix_log_probs([m.reshape(-1)[idx] for m in members])
    if used is not None:
        value[used.reshape(-1)[idx]] = NEG_INF
    done = finished.reshape(-1)[beam]
    if done.any():
        token = idx[done] % v1
        value[done] = np.where(token == end, scores.reshape(-1)[beam[done]], NEG_INF)
    counts = np.bincount(at, minlength=r)
    pos = np.arange(idx.size) - (np.cumsum(counts) - counts)[at]
    packed = np.full((r, max(int(counts.max(initial=0)), k)), NEG_INF, np.float32)
    where = np.zeros(packed.shape, np.int64)
    packed[at, pos], where[at, pos] = value, idx - at * width
    chosen, best = top_k_stable(packed, k)
    return np.take_along_axis(where, chosen, 1), best


def _kth_largest(values: np.ndarray, k: int) -> np.ndarray:
    """[n]: the k-th largest of each row of values [n, m], NaN for a row holding a NaN (k
    passes of argmax, each taking its maximum out, the first of them a NaN where there is
    one; the row restored: faster than np.partition at a step's sizes)."""
    rows = np.arange(values.shape[0])
    taken = np.empty((k, rows.size), np.int64)
    kept = np.empty((k, rows.size), values.dtype)
    for j in range(k):
        taken[j] = i = values.argmax(axis=1)
        kept[j] = values[rows, i]
        values[rows, i] = NEG_INF
    for j in range(k - 1, -1, -1):
        values[rows, taken[j]] = kept[j]
    return np.where(np.isnan(kept[0]), kept[0], kept[-1])


class BeamRule:
    """What the host and the device beam selectors share (`cognet.core.decoding.driver.Selector`
    less `select` and `keep`): the scores and finished flags of every beam on the host, the
    trace of each step's decisions, and each visit's answer, chosen when it is over (by
    score, or under `max_rate` by DDI rate) and traced back at the end."""

    on_device = False
    outputs: tuple[str, ...] = ("log_probs",)

    def __init__(self, cfg: BeamConfig, ddi_adj: np.ndarray | None = None):
        self.cfg, self.width, self.ddi_adj = cfg, cfg.beam, ddi_adj
        self.prauc = self.explain = False

    def start(self, n: int) -> None:
        self.scores = np.full((n, self.width), NEG_INF, np.float32)
        self.scores[:, 0] = 0.0
        self.finished = np.zeros((n, self.width), bool)
        self.trace: list[BeamStep] = []
        self.end_step = np.full(n, -1, np.int64)  # per visit: the step at which it was done
        self.end_beam = np.zeros(n, np.int64)  # per visit: the beam holding its answer
        self.final_score = np.zeros(n, np.float32)

    def over(self) -> np.ndarray:
        """bool [R]: the best hypothesis is final once beam 0 is finished; choosing by DDI
        rate needs every beam finished."""
        return self.finished[:, 0] if self.cfg.ddi.max_rate is None else self.finished.all(1)

    def held(self, newly: np.ndarray) -> np.ndarray:
        """bool [k, B, M]: the medications of each beam of the rows `newly`."""
        raise NotImplementedError

    def finish(self, t: int, newly: np.ndarray, rows: np.ndarray) -> None:
        choice = 0
        if self.cfg.ddi.max_rate is not None:
            choice = within_rate(
                self.held(newly), self.scores[newly], self.ddi_adj, self.cfg.ddi.max_rate
            )
            self.end_beam[rows[newly]] = choice
        self.end_step[rows[newly]] = t
        self.final_score[rows[newly]] = self.scores[newly, choice]

    def result(self, steps: int) -> BeamResult:
        return trace_back(
            self.trace,
            self.end_step,
            self.end_beam,
            self.final_score,
            self.cfg.end,
            self.prauc,
            self.explain,
        )

    def empty(self) -> BeamResult:
        return BeamResult([], np.zeros(0, np.float32), [])


class BeamSelector(BeamRule):
    """Beam search's selection in numpy: masks, DDI policy, stable top-B, per beam."""

    def __init__(
        self,
        cfg: BeamConfig,
        prauc: bool = False,
        explain: bool = False,
        ddi_adj: np.ndarray | None = None,
        attention: bool = False,
    ):
        if cfg.ddi.active:
            ddi_adj = check_adjacency(cfg.ddi, ddi_adj, cfg.end)
        super().__init__(cfg, ddi_adj)
        self.prauc, self.explain = prauc, explain
        self.outputs = step_outputs(explain, attention)

    def start(self, n: int) -> None:
        super().start(n)
        self.used: np.ndarray | None = None  # bool [R, B, V1]: medications in each hypothesis

    def select(self, t, out, rows, parent):
        b, end = self.width, self.cfg.end
        finished, used = self.finished, self.used
        # an ensemble's members, mixed where they can matter (PRAUC scores and the DDI
        # penalty read the whole mixture)
        members = out.get(MEMBER_LOG_PROBS)
        lazy = members is not None and not self.prauc and self.cfg.ddi.mode == "off"
        if lazy:
            raw, v1 = None, members[0].shape[2]
            pick, self.scores = mixed_top_k(members, self.scores, used, finished, end, b)
        else:
            raw = out["log_probs"]  # [R, B, V1]
            v1 = raw.shape[2]
            pick, self.scores = top_k_stable(self._candidates(raw), b)
        r = pick.shape[0]
        parent, tokens = np.divmod(pick, v1)
        row_ix = np.arange(r)[:, None]
        live = ~finished[row_ix, parent]
        if lazy:
            chosen = mix_log_probs([m[row_ix, parent, tokens] for m in members])
        else:
            chosen = raw[row_ix, parent, tokens]
        used = np.zeros((r, b, v1), bool) if used is None else used[row_ix, parent]
        used[row_ix, np.arange(b), tokens] = True
        self.used, self.finished = used, ~live | (tokens == end)
        self.trace.append(
            BeamStep(
                rows,
                parent,
                tokens,
                live,
                chosen,
                raw if self.prauc else None,
                out.get("gate"),
                out.get("copy_probs"),
                out.get("diag_attention"),
            )
        )
        return tokens, parent, self.over()

    def _candidates(self, raw: np.ndarray) -> np.ndarray:
        """float32 [R, B * V1]: each hypothesis's score after each token (held medications
        -inf, the DDI policy applied; a finished beam proposes only END, at its score)."""
        scores, used, finished, policy = self.scores, self.used, self.finished, self.cfg.ddi
        if policy.mode != "off" and used is not None:
            cand = scores[:, :, None] + _penalise(raw, used, self.ddi_adj, policy)
        else:
            cand = scores[:, :, None] + raw
        if used is not None:
            np.copyto(cand, NEG_INF, where=used)
        if finished.any():  # a finished beam proposes only END, with its frozen score
            cand[finished] = NEG_INF
            cand[finished, self.cfg.end] = scores[finished]
        return cand.reshape(cand.shape[0], -1)

    def held(self, newly: np.ndarray) -> np.ndarray:
        return self.used[newly, :, : self.cfg.end]

    def keep(self, live: np.ndarray) -> None:
        self.scores, self.finished, self.used = (
            x[live] for x in (self.scores, self.finished, self.used)
        )


def beam_search(
    session: DecoderSession, memories: Any, cfg: BeamConfig, visits: Visits
) -> BeamResult:
    """Decode the `visits.n` visits whose memories come from `session.init`, with what
    `visits` asks beside the answers: the PRAUC scores (`prauc`), the gates and copy
    distributions along the best hypothesis (`explain`), with `attention` the diagnosis
    attention (the step output `diag_attention`); `ddi_adj` is needed when `cfg.ddi` is
    active.
    """
    selector = BeamSelector(cfg, visits.prauc, visits.explain, visits.ddi_adj, visits.attention)
    return driver.run(session, memories, visits.n, selector, cfg)


def _penalise(
    raw: np.ndarray, used: np.ndarray, ddi_adj: np.ndarray, policy: DDIPolicy
) -> np.ndarray:
    """A copy of the log-probabilities raw [R, B, V1] with the DDI policy's step rule
    applied (`cognet.core.ddi.apply_step_penalty`) for the hypotheses `used` [R, B, V1]."""
    logp = raw.copy()
    apply_step_penalty(logp, used, ddi_adj, policy)
    return logp


def within_rate(
    used: np.ndarray, scores: np.ndarray, ddi_adj: np.ndarray, max_rate: float
) -> np.ndarray:
    """int64 [k]: per visit, the first beam (score order) with a finite score and a DDI rate
    <= max_rate, else the beam of lowest rate (first in beam order among ties)."""
    rate = ddi_rates(used, ddi_adj)  # [k, B]
    ok = (rate <= np.float32(max_rate + RATE_TOLERANCE)) & (scores > NEG_INF)
    lowest = np.argsort(np.where(scores == NEG_INF, np.float32(2), rate), 1, kind="stable")[:, 0]
    return np.where(ok.any(1), ok.argmax(1), lowest)


def trace_back(
    trace: list[BeamStep],
    end_step: np.ndarray,
    end_beam: np.ndarray,
    final_score: np.ndarray,
    end: int,
    prauc: bool,
    explain: bool,
) -> BeamResult:
    """Follow each visit's answer (beam `end_beam` at `end_step`) back to the first step."""
    n = end_step.size
    length = int(end_step.max()) + 1
    token = np.full((n, length), -1, np.int64)
    live = np.zeros((n, length), bool)
    chosen = np.zeros((n, length), np.float32)
    prob_sum = np.zeros((n, end + 1), np.float64) if prauc else None
    gate = np.ones((n, length), np.float32) if explain else None
    copy = att = None
    beam = end_beam.copy()  # beam of each visit's hypothesis after step t
    position: dict[int, np.ndarray] = {}  # id(rows) -> visit -> row
    for t in range(length - 1, -1, -1):
        s = trace[t]
        pos = position.get(id(s.rows))
        if pos is None:
            pos = position[id(s.rows)] = np.full(n, -1, np.int64)
            pos[s.rows] = np.arange(s.rows.size)
        vis = np.flatnonzero(end_step >= t)
        row, b = pos[vis], beam[vis]
        par = s.parent[row, b]
        token[vis, t] = s.token[row, b]
        live[vis, t] = s.live[row, b]
        chosen[vis, t] = s.chosen[row, b]
        if prob_sum is not None:
            p = np.exp(s.log_probs[row, par].astype(np.float64))
            prob_sum[vis] += p * live[vis, t, None]
        if explain:
            gate[vis, t] = s.gate[row, par]
            if copy is None:
                copy = np.zeros((n, length, s.copy.shape[2]), np.float32)
            copy[vis, t] = s.copy[row, par]
            if s.attention is not None:
                if att is None:
                    att = np.zeros((n, length, s.attention.shape[3]), np.float32)
                att[vis, t] = s.attention[row, :, par].mean(1)  # over heads
        beam[vis] = par
    is_med = live & (token != end)
    meds = _kept_rows(token, is_med)
    med_probs = _kept_rows(np.exp(chosen), is_med)
    result = BeamResult(meds, final_score, med_probs, steps=len(trace))
    if prob_sum is not None:
        steps = np.maximum(live.sum(1), 1)[:, None]
        mean = (prob_sum[:, :end] / steps).astype(np.float32)
        for i in range(n):
            mean[i, meds[i]] = med_probs[i]
        result.prauc_scores = mean
    if explain:
        result.gates = _kept_rows(gate, is_med)
        result.copies = _kept_rows(copy, is_med)
        result.shares = beam_shares(result.gates, result.copies, med_probs)
        if att is not None:
            result.attention = _kept_rows(att, is_med)
    return result


def _kept_rows(values: np.ndarray, keep: np.ndarray) -> list[np.ndarray]:
    """[values[i][keep[i]] for every row i]: one gather, then slices of it (a gather per row
    costs a call per row)."""
    flat = values[keep]
    counts = keep.sum(1)
    ends = np.cumsum(counts)
    starts = ends - counts
    return [flat[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
