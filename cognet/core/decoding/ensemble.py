"""Decoding with an ensemble of K networks trained apart (torch-free): the rules shared by
the torch reference and the runtime, so that they differ only by the float32 rounding of
each member's step.

- Set decoding: the ensemble is the *sequence-level* mixture of its members, each chosen
  with probability 1/K, so P(k in S) is the mean of the members' P(k in S)
  (`ensemble_marginals`). Each member decodes its own samples, member i with the draws of
  seed `seed + i` (`member_config`): its samples stay exact samples of that member, and the
  members' draws are independent. The set rule then reads the mean.
- Beam search: a sequence-level mixture has no step distribution to search, so beam search
  decodes the *token-level* mixture, log (1/K sum_i Pr_i[k]) at each step
  (`EnsembleSession`, the usual ensemble of sequence models), mixed on the host or, on a
  GPU, by the exported mixture graph where the steps ran.

Why both: averaged P(k in S) read more accurately than the token-level mixture sampled
with the same number of decoder steps, and than one network with twice the samples (the
readings: docs/guide/results-mimic3.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from cognet.core.decoding.driver import DecoderSession, Visits
from cognet.core.decoding.sampling import (
    Marginals,
    SetConfig,
    SetResult,
    set_marginals,
    set_result,
)
from cognet.core.graphspec import MIX_GRAPH, MIX_OUTPUT, mix_inputs

# An ensemble step's outputs carry its members' log-probabilities under this name, beside their
# mixture (`StepOutputs`): beam search selects from them without mixing every token.
MEMBER_LOG_PROBS = "member_log_probs"
MEMBER_SEED_STRIDE = 1000  # member i of a run with seed S trains with seed S + 1000 i
MAX_MEMBERS = 16  # networks in one checkpoint or model directory at most (counts read are checked)


def member_seed(seed: int, member: int) -> int:
    """The training seed of member `member` of a run with seed `seed` (member 0: `seed`
    itself, so a one-member run is the single network of that seed)."""
    return seed + MEMBER_SEED_STRIDE * member


def member_config(cfg: SetConfig, member: int) -> SetConfig:
    """Member `member`'s set decoding: the same, with the draws of seed `cfg.seed + member`."""
    return replace(cfg, seed=cfg.seed + member)


def mix_log_probs(log_probs: Sequence[np.ndarray]) -> np.ndarray:
    """float32 [...]: log of the mean of the members' probabilities, in float64 (a token
    every member gives -inf stays -inf), rounded once to float32.

    Computed as the log of the summed exponentials, without a max shift: a step's
    log-probabilities lie in [log 1e-20, 0] (the model's floor) or are -inf, so no exponential
    overflows or underflows in float64, and numpy's vectorised exp and log are several times
    faster than a running `logaddexp`, with the same float32 results (BENCHMARKS.md "What
    was tried"). Entries whose sum is not a finite positive number (every member -inf, or
    values outside that range) are taken again by `logaddexp`."""
    if len(log_probs) == 1:
        return np.asarray(log_probs[0], np.float64).astype(np.float32)
    # each exponential and the last subtraction cast on the fly (no float64 copies of the
    # inputs, no float64 result to convert): the same bits, less memory traffic
    total = np.exp(log_probs[0], dtype=np.float64)
    spare = np.empty_like(total)
    for part in log_probs[1:]:
        total += np.exp(part, out=spare, dtype=np.float64)
    with np.errstate(divide="ignore"):
        mixed = np.log(total, out=total)
    redo = np.flatnonzero(~np.isfinite(mixed))
    if redo.size:
        flat = [np.asarray(part, np.float64).reshape(-1)[redo] for part in log_probs]
        again = np.logaddexp(flat[0], flat[1])
        for part in flat[2:]:
            np.logaddexp(again, part, out=again)
        mixed.reshape(-1)[redo] = again
    out = np.empty(mixed.shape, np.float32)
    np.subtract(mixed, math.log(len(log_probs)), out=out, dtype=np.float64, casting="same_kind")
    return out


class StepOutputs(dict):
    """An ensemble step's outputs: the members' log-probabilities (`MEMBER_LOG_PROBS`, a
    tuple) and, on first reading of "log_probs", their mixture (`mix_log_probs`), kept. Beam
    search without PRAUC scores or a DDI penalty never reads it (`beam.mixed_top_k`)."""

    def __missing__(self, key: str) -> np.ndarray:
        if key != "log_probs" or MEMBER_LOG_PROBS not in self:
            raise KeyError(key)
        mixed = self["log_probs"] = mix_log_probs(self[MEMBER_LOG_PROBS])
        return mixed


class EnsembleSession:
    """A `cognet.core.decoding.driver.DecoderSession` over K member sessions that decodes
    their token-level mixture: every member steps on the same tokens and parents with its
    own cache and memories (handles are K-tuples); the log-probabilities are mixed
    (`mix_log_probs`, when read: `StepOutputs`), the explanation outputs (gate, copy
    distribution, diagnosis attention) averaged. Selection runs on the host, or, where the
    runtime gives the ensemble the search graphs (`search`: a model exported with the
    mixture graph, `graphspec.MIX_GRAPH`), where the members' steps ran (`step_log_probs`)."""

    search = None
    prefix_cache = False  # set decoding runs each member's own session

    def __init__(self, members: Sequence[DecoderSession]):
        if len(members) < 2:
            raise ValueError("an ensemble needs at least two member sessions")
        self.members = tuple(members)
        first = self.members[0].step_outputs
        self.step_outputs = tuple(o for o in first if all(o in m.step_outputs for m in members))

    def init(self, inputs: Sequence[Mapping[str, np.ndarray]]) -> tuple:
        """Memories from each member's own decoder-init inputs (one mapping per member: the
        members encode the history with their own encoders)."""
        if len(inputs) != len(self.members):
            raise ValueError(f"{len(self.members)} members but {len(inputs)} sets of inputs")
        return tuple(m.init(x) for m, x in zip(self.members, inputs, strict=True))

    def empty_cache(self, n: int, width: int) -> tuple:
        return tuple(m.empty_cache(n, width) for m in self.members)

    def step(self, tokens, parent, cache, memories, outputs):
        got, caches = [], []
        for member, c, mem in zip(self.members, cache, memories, strict=True):
            out, c = member.step(tokens, parent, c, mem, outputs)
            got.append(out)
            caches.append(c)
        mixed = StepOutputs()
        for name in outputs:
            parts = [g[name] for g in got]
            if name == "log_probs":
                mixed[MEMBER_LOG_PROBS] = tuple(parts)  # mixed when read
            else:
                mixed[name] = np.mean(np.stack(parts), 0).astype(parts[0].dtype)
        return mixed, tuple(caches)

    def step_log_probs(self, tokens, parent, cache, memories) -> tuple[Any, tuple]:
        """(the members' token-level mixture [n, W, V1] left where the steps ran, the next
        caches): each member's `step_log_probs`, mixed by the mixture graph of `search`
        (float64 like `mix_log_probs`, so the selection sees the host's values)."""
        got, caches = [], []
        for member, c, mem in zip(self.members, cache, memories, strict=True):
            logp, c = member.step_log_probs(tokens, parent, c, mem)
            got.append(logp)
            caches.append(c)
        feeds = dict(zip(mix_inputs(len(got)), got, strict=True))
        _, mixed = self.search.run(MIX_GRAPH, feeds, (), (MIX_OUTPUT,))
        return mixed[MIX_OUTPUT], tuple(caches)

    def take(self, value: tuple, rows: np.ndarray) -> tuple:
        return tuple(m.take(v, rows) for m, v in zip(self.members, value, strict=True))


def member_sessions(session: DecoderSession) -> tuple[DecoderSession, ...]:
    """The sessions of a decoder: an `EnsembleSession`'s members, or the one session."""
    return session.members if isinstance(session, EnsembleSession) else (session,)


def ensemble_marginals(
    sessions: Sequence[DecoderSession],
    memories: Sequence[Any],
    cfg: SetConfig,
    visits: Visits,
    marginals: Marginals = set_marginals,
) -> tuple[np.ndarray, dict | None, int]:
    """(P(k in S) float64 [n, M], the explanation sums or None, decoder steps run) of the
    members' sequence-level mixture: the mean of each member's `marginals` (`set_marginals`,
    or the runtime's search graphs; member i with `member_config(cfg, i)`); the explanation
    sums are pooled (their counts add). One member gives its own marginals exactly."""
    total, pooled, steps = None, None, 0
    for i, (session, mem) in enumerate(zip(sessions, memories, strict=True)):
        m, sums, s = marginals(session, mem, member_config(cfg, i), visits)
        total = m if total is None else total + m
        pooled = _pool(pooled, sums)
        steps += s
    assert total is not None
    return total / len(sessions), pooled, steps


def decode_ensemble_sets(
    sessions: Sequence[DecoderSession],
    memories: Sequence[Any],
    cfg: SetConfig,
    visits: Visits,
    marginals: Marginals = set_marginals,
) -> SetResult:
    """The set of each of the n visits under the ensemble (`ensemble_marginals`), with what
    `sampling.decode_sets` gives for one network."""
    mean, sums, steps = ensemble_marginals(sessions, memories, cfg, visits, marginals)
    explained = (sums or {}) if visits.explain else None
    return set_result(mean, steps, cfg, visits.ddi_adj, explained)


def _pool(a: dict | None, b: dict | None) -> dict | None:
    """Explanation sums of two members added key by key (`attribution.add_emissions`)."""
    if a is None or b is None:
        return a if b is None else b
    return {k: a[k] + b[k] if k in b else a[k] for k in a} | {k: b[k] for k in b if k not in a}
