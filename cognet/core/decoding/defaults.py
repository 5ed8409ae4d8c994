"""Decodings and their defaults, shared by the torch reference, the exporter and the runtime
(torch-free).

- `beam`: the paper's decoding: beam search, beam 4, at most 45 steps (DESIGN.md §3; the
  rules: docs/DESIGN.md "Beam search"). It stays available exactly as it is.
- `marginal`: the set rules read from the P(k in S) that a set head (`cognet.model.set_head`)
  learnt from the model's own set decoding, in one pass with no decoding loop; its
  threshold and rule (`head_threshold`, `head_rule`) are tuned on validation apart from
  set decoding's.
- `set`: cognet's set decoding (`cognet.core.decoding.sampling`): from each medication's probability
  of being in the model's own decoded set, P(k in S), estimated from seeded samples, the
  set returned by a set rule (SET_RULES): those reaching a threshold tuned on the
  validation split, or the set of highest expected Jaccard. `cognet train` tunes the
  threshold, then keeps the rule that scores better on validation.

A checkpoint records its default `Decoding` in config.json ("decoding") and an exported
model in its manifest; `cognet evaluate`, `cognet-batch score` and the benchmarks use it
unless told otherwise. DECODINGS names every decoding a caller may ask for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

BEAM = 4  # beam width; 1 = greedy
MAX_LEN = 45  # decoder steps at most (medications + END)
SAMPLES = 16  # samples per visit of the set decoding (see user guide "Set decoding": cost)
DECODINGS = ("beam", "set", "marginal")
DEFAULT_DECODING = "beam"  # of a model that has no tuned set threshold
# The largest value each count may take (samples x visits x steps bounds the memory)
LIMITS = {"beam": 64, "samples": 1024, "max_len": 1000}
# How the set decoding draws its samples (`cognet.core.decoding.draws.uniforms`): "plain", each
# draw its own uniform; "stratified", at each step the samples of a visit take the strata
# 1/S apart of (0, 1) in a random order; "tree", the same within each group of samples
# that share their prefix. All give exact samples of the model and an unbiased P(k in S);
# stratified draws give it less variance at the same cost (user guide "Set decoding": the
# estimator table). `Decoding` and a stored decoding that names none draw "plain" samples;
# `cognet train` tunes and stores its models with ESTIMATOR.
ESTIMATORS = ("plain", "stratified", "tree")
ESTIMATOR = "stratified"  # of models trained by this version
# How the set is read from P(k in S) (`cognet.core.decoding.set_rules.select_sets`):
# "threshold", the medications with P(k in S) >= the tuned threshold; "jaccard", the
# medications of highest P(k in S) up to the count that maximises the set's expected
# Jaccard, sum of P inside / (size + sum of P outside), a size chosen per visit with no
# parameter. A stored decoding that names none (a model from before the rules) uses
# "threshold".
SET_RULES = ("threshold", "jaccard")


@dataclass(frozen=True)
class Decoding:
    """One decoding with its parameters (those of the other decoding are carried along)."""

    name: str = DEFAULT_DECODING
    beam: int = BEAM
    samples: int = SAMPLES
    threshold: float | None = None  # set decoding: tuned on validation; None = untuned
    seed: int = 0  # set decoding: the draws are keyed by (seed, visit_id, sample, step)
    max_len: int = MAX_LEN
    estimator: str = "plain"  # set decoding: how the samples are drawn (ESTIMATORS)
    rule: str = "threshold"  # set decoding: how the set is read from P(k in S) (SET_RULES)
    head_threshold: float | None = None  # marginal decoding's threshold (tuned); None = untuned
    head_rule: str = "jaccard"  # marginal decoding's set rule (SET_RULES)

    def __post_init__(self) -> None:
        if self.name not in DECODINGS:
            raise ValueError(f"unknown decoding {self.name!r}; choose from {', '.join(DECODINGS)}")
        for key, top in LIMITS.items():  # a value read from a file is trusted no more
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise ValueError(f"{key} must be an integer in [1, {top}], not {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, not {self.seed!r}")
        for value in (self.threshold, self.head_threshold):
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool)
            ):
                raise ValueError(f"the set threshold must be a number, not {value!r}")
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"the set threshold must be in (0, 1], not {value}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"unknown estimator {self.estimator!r}; choose from {', '.join(ESTIMATORS)}"
            )
        for rule in (self.rule, self.head_rule):
            if rule not in SET_RULES:
                raise ValueError(f"unknown set rule {rule!r}; choose from {', '.join(SET_RULES)}")
        if self.name == "set" and self.threshold is None and self.rule == "threshold":
            raise ValueError(
                "set decoding needs a threshold: models trained by this version store one; "
                "give --threshold or --set-rule jaccard for an older model, or use --decoding beam"
            )
        untuned = self.head_threshold is None and self.head_rule == "threshold"
        if self.name == "marginal" and untuned:
            raise ValueError("the marginal decoding's threshold rule needs a threshold")

    @property
    def selection(self) -> tuple[float | None, str]:
        """(threshold, set rule) that read the set from P(k in S): set decoding's, or
        marginal decoding's own."""
        if self.name == "marginal":
            return self.head_threshold, self.head_rule
        return self.threshold, self.rule

    @property
    def label(self) -> str:
        if self.name == "marginal":
            threshold, rule = self.selection
            read = "expected-Jaccard sets" if rule == "jaccard" else f"threshold {threshold:g}"
            return f"marginal (set head, one pass), {read}"
        if self.name == "set":
            drawn = "" if self.estimator == "plain" else f", {self.estimator} draws"
            if self.rule == "jaccard":
                rule = "expected-Jaccard sets"
            else:
                rule = f"threshold {self.threshold:g}"
            return f"set, {self.samples} samples, {rule}{drawn}"
        return f"beam {self.beam}" if self.beam > 1 else "greedy"

    def to_json(self) -> dict:
        out = asdict(self)
        if self.head_threshold is None and self.head_rule == "jaccard":
            del out["head_threshold"], out["head_rule"]  # a model without a head: as before
        return out

    @classmethod
    def from_json(cls, obj: dict | None) -> Decoding:
        """A stored decoding; None (a model from before set decoding) = the paper's beam; one
        that names no estimator (a model from before them) draws plain samples."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):  # `k in "x"` would test substrings, and find none
            raise TypeError(f"a decoding is an object, not {type(obj).__name__}")
        known = {k: obj[k] for k in cls.__dataclass_fields__ if k in obj}
        return cls(**known)

    def with_changes(self, **changes) -> Decoding:
        """This decoding with the given fields changed (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})
