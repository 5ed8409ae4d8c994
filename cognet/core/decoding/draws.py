"""The random draws of set decoding: counter-based, so that a visit's samples depend on
neither its batch-mates, its row, the engine nor the device.

The uniform of (seed, visit, sample, step) is a hash of those four numbers (`uniforms`); a
visit is named by a hash of its id (`visit_key`). The estimators (`ESTIMATORS` of
`cognet.core.decoding.defaults`) spread the draws over a visit's samples: "plain", each its
own uniform; "stratified", at each step the samples take the strata 1/S apart of (0, 1) in
a random order; "tree", the same within each group of samples that share their prefix
(`Draws` keeps the prefix hashes). docs/DESIGN.md "Set decoding" has the rules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from cognet.core.decoding.defaults import ESTIMATORS

_SEED = np.uint64(0x9E3779B97F4A7C15)
_SAMPLE = np.uint64(0xD1B54A32D192ED03)
_STEP = np.uint64(0x8CB92BA72F3D8DD7)
_STRATUM = np.uint64(0xA0761D6478BD642F)
_TOKEN = np.uint64(0xE7037ED1A0B428DB)


def visit_key(visit_id: str) -> int:
    """A visit's random stream: 64 bits of blake2b of its id."""
    return int.from_bytes(hashlib.blake2b(visit_id.encode(), digest_size=8).digest(), "little")


def visit_keys(visit_ids: Sequence[str]) -> np.ndarray:
    return np.fromiter((visit_key(v) for v in visit_ids), np.uint64, len(visit_ids))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64 with full avalanche), wrapping."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(
    seed: int,
    keys: np.ndarray,
    samples: int,
    step: int,
    estimator: str = "plain",
    prefix: np.ndarray | None = None,
) -> np.ndarray:
    """float64 [n, samples], strictly inside (0, 1): the draws of step `step` of every
    sample of the visits with these keys.

    - "plain": each draw a hash of (seed, visit, sample, step).
    - "stratified": the samples of a visit take the strata [j/S, (j+1)/S) of (0, 1),
      j = 0..S-1, in a random order at each step (the ranks of a second hash), each draw
      uniform inside its stratum.
    - "tree": the same within each group of samples that share their prefix (`prefix`
      [n, samples]: a hash of each sample's tokens so far, `Draws`): g samples that reached
      the same node of the prefix tree, and so draw from the same distribution, take the g
      strata of (0, 1) in a random order. Their children then get g x their probability of
      the samples, give or take one, instead of a binomial count.
    Marginally every draw is uniform whatever the estimator: each sample is an exact sample
    of the model and P(k in S) stays unbiased; stratified draws cover (0, 1) evenly, so
    samples that share a distribution spread over it instead of clumping (less variance at
    the same cost)."""
    with np.errstate(over="ignore"):
        base = _mix(np.asarray(keys, np.uint64) ^ _mix(np.uint64(seed % 2**64) * _SEED))
        sample = np.arange(1, samples + 1, dtype=np.uint64) * _SAMPLE
        x = _mix(_mix(base[:, None] ^ sample[None, :]) ^ (np.uint64(step + 1) * _STEP))
        u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        if estimator == "plain":
            return u
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}")
        order_key = _mix(x ^ _STRATUM)
    n = u.shape[0]
    if estimator == "stratified" or prefix is None:
        # one group per visit: its samples' ranks by the random key (a sort per visit, as
        # the general path's sort by visit and key orders them; keys never tie in practice,
        # and a stable sort breaks a tie by sample as that one does)
        order = np.argsort(order_key, axis=1, kind="stable")
        rank = np.empty((n, samples), np.float64)
        np.put_along_axis(rank, order, np.arange(samples, dtype=np.float64)[None, :], axis=1)
        return (rank + u) / samples
    row = np.repeat(np.arange(n), samples)
    group = prefix.ravel()
    order = np.lexsort((order_key.ravel(), group, row))  # by visit, prefix, random key
    first = np.ones(order.size, bool)
    first[1:] = (group[order][1:] != group[order][:-1]) | (row[order][1:] != row[order][:-1])
    starts = np.flatnonzero(first)
    which = np.cumsum(first) - 1
    rank = np.empty(order.size, np.float64)
    size = np.empty(order.size, np.float64)
    rank[order] = np.arange(order.size) - starts[which]
    size[order] = np.diff(np.append(starts, order.size))[which]
    return (rank.reshape(n, samples) + u) / size.reshape(n, samples)


class Draws:
    """The draws of a set decoding's samples, step by step (`uniforms`), and the prefix
    hash of every sample that the "tree" estimator groups them by (kept per row; `keep`
    compacts it with the batch)."""

    def __init__(self, cfg: Any, keys: np.ndarray, n: int):  # cfg: a sampling.SetConfig
        self.cfg, self.keys = cfg, keys
        tree = cfg.estimator == "tree"
        self.prefix = np.zeros((n, cfg.samples), np.uint64) if tree else None

    def at(self, t: int, rows: np.ndarray) -> np.ndarray:
        """float64 [R, S]: the draws of step t of the visits `rows`."""
        cfg = self.cfg
        return uniforms(cfg.seed, self.keys[rows], cfg.samples, t, cfg.estimator, self.prefix)

    def drawn(self, tokens: np.ndarray) -> None:
        """Step the prefixes by the tokens [R, S] just drawn."""
        if self.prefix is not None:
            with np.errstate(over="ignore"):
                step = (np.asarray(tokens, np.uint64) + np.uint64(1)) * _TOKEN
                self.prefix = _mix(self.prefix ^ step)

    def keep(self, live: np.ndarray) -> None:
        if self.prefix is not None:
            self.prefix = self.prefix[live]
