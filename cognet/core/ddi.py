"""DDI-aware decoding: the policy and its rules, the one place they are written (torch-free).

Every decoding follows these rules (beam search in `cognet.core.decoding.beam`, set decoding
in `cognet.core.decoding.sampling`, both by `apply_step_penalty`; the search graphs of
`cognet.export.search_graphs` in ONNX), and the tests hold them equal; docs/DESIGN.md
points here.

The paper's decoding (`off`) recommends what doctors prescribe, interacting pairs included.
A policy lets whoever runs the model bound that risk at inference time, without retraining:

- `hard`: a medication that interacts with one already in the hypothesis cannot be emitted
  (its log-probability is -inf), so every recommendation has a DDI rate of 0.
- `soft`: its log-probability is lowered by `penalty` per interacting pair with the
  hypothesis (float32: the hypothesis score includes the penalties; the emitted
  probabilities and the PRAUC scores use the raw log-probabilities).
- `max_rate`: a visit is done when ALL its beams have finished (or at max_len), and its
  answer is the first beam in score order with a finite score and a DDI rate (float32)
  <= max_rate + RATE_TOLERANCE, else the beam with the lowest rate (a stable sort: the
  first beam among ties, beams with a -inf score last). Combines with any mode.
- `pair_price` (set decoding, the expected-Jaccard rule): the set read from P(k in S) is
  the one of highest expected Jaccard less `pair_price` per interacting pair it holds
  (`cognet.core.decoding.set_rules.priced_sets`): a selection, no step changes. One price
  for every visit trades Jaccard for pairs where they are cheapest, so it lowers the pooled
  DDI rate (the metric) far more cheaply than a per-set cap or a step penalty.

At each step, the clash count of every candidate medication is (medications of the
hypothesis) @ (DDI adjacency: `ddi_matrix`, symmetric 0/1 with a zero diagonal), [n, B, M];
it is applied to the step's log-probabilities after the mask of medications already used and
before the candidates are ranked. The default policy (`off`) adds no work to a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cognet.core.errors import InputError
from cognet.core.strict_json import finite
from cognet.core.vocab import Vocab

DDI_MODES = ("off", "soft", "hard")
# The soft penalty recommended by the trade-off on the synthetic test split: the largest
# within 0.01 Jaccard of `off` (docs/guide/ddi.md has the table).
RECOMMENDED_PENALTY = 0.25
# Added to max_rate before the comparison (float32 rates of small sets are exact ratios).
RATE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class DDIPolicy:
    """Inference-time control of drug-drug interactions (the paper's decoding is `off`)."""

    mode: str = "off"
    penalty: float = 0.0  # soft: log-probability removed per interacting pair
    max_rate: float | None = None  # pick the best finished beam with a DDI rate <= this
    # set decoding: expected Jaccard given up per interacting pair of the set (0: none)
    pair_price: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in DDI_MODES:
            raise ValueError(f"unknown DDI mode {self.mode!r}; choose from {DDI_MODES}")
        finite(self.penalty, "the DDI penalty")  # NaN passes every comparison below
        finite(self.pair_price, "the DDI pair price")
        if self.max_rate is not None:
            finite(self.max_rate, "the DDI max rate")
        if self.penalty < 0 or (self.max_rate is not None and not 0 <= self.max_rate <= 1):
            raise ValueError("the DDI penalty must be >= 0 and the max rate in [0, 1]")
        if not 0 <= self.pair_price <= 1:
            raise ValueError("the DDI pair price must be in [0, 1] (a share of Jaccard)")

    @property
    def active(self) -> bool:
        return self.mode != "off" or self.max_rate is not None or self.pair_price > 0

    @property
    def label(self) -> str:
        """Short name for tables: off, hard, soft 2, off, max-rate 0.05, pair price 0.002..."""
        name = f"soft {self.penalty:g}" if self.mode == "soft" else self.mode
        if self.pair_price:
            name = f"{name}, pair price {self.pair_price:g}"
        return name if self.max_rate is None else f"{name}, max-rate {self.max_rate:g}"

    def to_json(self) -> dict:
        out = {"mode": self.mode, "penalty": self.penalty, "max_rate": self.max_rate}
        if self.pair_price:  # written only when set: files without a price read as before
            out["pair_price"] = self.pair_price
        return out


@dataclass(frozen=True)
class DDITarget:
    """A DDI policy and set-decoding threshold chosen together on the validation split for
    the best validation Jaccard at a validation DDI rate <= `target` (`cognet.training.ddi_target`).
    Stored with a model (config.json and manifest.json "ddi_target"), it is the model's
    default policy: `cognet.core.decoding.request.with_target` says when it applies."""

    target: float  # R, the DDI rate asked for
    policy: DDIPolicy  # the soft penalty (or off) and per-set cap found; hard as a last resort
    threshold: float  # on P(k in S), with that policy (read by the threshold rule only)
    val_jaccard: float
    val_ddi: float
    rule: str = "threshold"  # the set rule found with it (targets saved before: threshold)
    # the decoding it was chosen for, and applies to: "set" (targets saved before) or
    # "marginal" (the set head's P(k in S): set rules only, no step policy)
    decoding: str = "set"

    def __post_init__(self) -> None:
        for name in ("target", "threshold", "val_jaccard", "val_ddi"):
            finite(getattr(self, name), f"the DDI target's {name}")
        if not 0 <= self.target <= 1 or not 0 < self.threshold <= 1:
            raise ValueError("the DDI target must be in [0, 1] and the threshold in (0, 1]")
        if self.rule not in ("threshold", "jaccard"):
            raise ValueError(
                f"the DDI target's set rule must be threshold or jaccard, not {self.rule!r}"
            )
        if self.policy.pair_price and self.rule != "jaccard":
            raise ValueError("a DDI pair price goes with the expected-Jaccard rule (jaccard)")
        if self.decoding not in ("set", "marginal"):
            raise ValueError(f"a DDI target is for set or marginal decoding, not {self.decoding!r}")
        if self.decoding == "marginal" and self.policy.mode == "soft":
            raise ValueError("a marginal decoding's DDI target has no soft penalty (no steps)")

    @property
    def rule_label(self) -> str:
        """'threshold 0.4' or 'expected-Jaccard rule': the set rule found."""
        if self.rule == "jaccard":
            return "expected-Jaccard rule"
        return f"threshold {self.threshold:g}"

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "policy": self.policy.to_json(),
            "threshold": self.threshold,
            "val_jaccard": self.val_jaccard,
            "val_ddi": self.val_ddi,
            "rule": self.rule,
            # written only for the head: targets of set decoding read and write as before
            **({"decoding": self.decoding} if self.decoding != "set" else {}),
        }

    @classmethod
    def from_json(cls, obj: dict | None) -> DDITarget | None:
        """None for None; ValueError/TypeError/KeyError on a malformed entry."""
        if obj is None:
            return None
        policy = obj["policy"]
        if not isinstance(policy["mode"], str):
            raise TypeError(f"policy.mode must be a string, not {policy['mode']!r}")
        return cls(  # a boolean or a string is no number (`finite`), not even true = 1.0
            target=finite(obj["target"], "target"),
            policy=DDIPolicy(
                policy["mode"],
                finite(policy["penalty"], "policy.penalty"),
                policy["max_rate"],
                finite(policy.get("pair_price", 0.0), "policy.pair_price"),
            ),
            threshold=finite(obj["threshold"], "threshold"),
            val_jaccard=finite(obj["val_jaccard"], "val_jaccard"),
            val_ddi=finite(obj["val_ddi"], "val_ddi"),
            rule=obj.get("rule", "threshold"),
            decoding=obj.get("decoding", "set"),
        )


def require_pairs(pairs: Sequence | np.ndarray, where: object, asked: str) -> None:
    """InputError naming `where` (the DDI file or the model's manifest) when `asked` (a DDI
    policy or target) meets no interacting pair: a target "held" at DDI 0 and a policy that
    never acts say nothing, so they are refused rather than reported as met."""
    if not len(pairs):
        raise InputError(
            f"{where}: no DDI pair (drug_a, drug_b) to act on, so {asked} would hold "
            f"trivially; give the dataset a ddi.parquet with pairs, or drop {asked}"
        )


def ddi_matrix(vocab: Vocab, pairs: Iterable[Sequence[str]]) -> np.ndarray:
    """bool [M, M]: the DDI adjacency over the vocabulary's medication ids, symmetric with a
    zero diagonal; pairs naming a code the vocabulary does not know are ignored.

    The one place that turns DDI pairs (codes) into the matrix that decoding, the DDI rate
    and the model's DDI graph (`cognet.model.batching.ddi_adjacency`, float32) use."""
    index = {code: i for i, code in enumerate(vocab.medications)}
    adj = np.zeros((vocab.n_med, vocab.n_med), bool)
    for a, b in pairs:
        i, j = index.get(a), index.get(b)
        if i is not None and j is not None and i != j:
            adj[i, j] = adj[j, i] = True
    return adj


def policy_from_options(
    mode: str = "off",
    penalty: float | None = None,
    max_rate: float | None = None,
    pair_price: float | None = None,
) -> DDIPolicy:
    """The policy of `--ddi-mode/--ddi-penalty/--ddi-max-rate/--ddi-pair-price`; ValueError
    on a bad mix.

    soft without a penalty takes RECOMMENDED_PENALTY; a penalty needs `soft`."""
    if penalty is not None and mode != "soft":
        raise ValueError("--ddi-penalty applies to --ddi-mode soft only")
    if mode == "soft" and penalty is None:
        penalty = RECOMMENDED_PENALTY
    return DDIPolicy(mode, penalty or 0.0, max_rate, pair_price or 0.0)


def check_adjacency(policy: DDIPolicy, ddi_adj: np.ndarray | None, end: int) -> np.ndarray:
    """The [end, end] DDI adjacency as float32; ValueError when a policy needs it and it is
    missing or of another shape."""
    if ddi_adj is None or np.shape(ddi_adj) != (end, end):
        raise ValueError(f"DDI policy {policy.label!r} needs the [{end}, {end}] adjacency")
    return np.asarray(ddi_adj, np.float32)


def pair_counts(used: np.ndarray, ddi_adj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(interacting pairs, all unordered pairs), float32 [...], of each medication set:
    used bool [..., M]; ddi_adj float32 [M, M], symmetric 0/1 with a zero diagonal
    (`ddi_matrix`). The one count behind the decoders' DDI rates and the metrics'."""
    u = used.astype(np.float32)
    pairs = ((u @ ddi_adj) * u).sum(-1) / 2
    k = u.sum(-1)
    return pairs, k * (k - 1) / 2


def apply_step_penalty(
    logp: np.ndarray,
    used: np.ndarray,
    ddi_adj: np.ndarray,
    policy: DDIPolicy,
    clashes: np.ndarray | None = None,
) -> None:
    """The step rule of `soft` and `hard`, in place: the log-probabilities logp [..., V1] of
    the medications that interact with a row's medications (used bool [..., V1]) lowered by
    penalty x pairs (the product in float32) or set to -inf; `off` leaves them. Beam search
    (`cognet.core.decoding.beam`) and the set sampler (`cognet.core.decoding.sampling`)
    both apply it. `clashes` float32 [..., M]: those counts when the caller keeps them
    (the set sampler adds a row of the adjacency per emitted medication: the same integers,
    without a product per step)."""
    if policy.mode not in ("soft", "hard"):
        return
    m = ddi_adj.shape[0]
    if clashes is None:
        clashes = used[..., :m].astype(np.float32) @ ddi_adj  # [..., M] interacting pairs
    if policy.mode == "hard":
        np.copyto(logp[..., :m], -np.inf, where=clashes > 0)
    else:
        logp[..., :m] -= np.float32(policy.penalty) * clashes


def ddi_rates(used: np.ndarray, ddi_adj: np.ndarray) -> np.ndarray:
    """float32 [...]: DDI rate of each medication set, used bool [..., M], ddi_adj [M, M]
    (`pair_counts`); 0 for a set of fewer than two medications."""
    pairs, total = pair_counts(used, ddi_adj)
    return np.where(total > 0, pairs / np.maximum(total, 1), np.float32(0))
