"""`DecodingRequest`: the decoding a caller asks for, on top of a model's stored one.

One frozen value holds every option of every decoding (`--decoding`, `--beam`, `--samples`,
`--threshold`, `--estimator`, `--set-rule` and the DDI policy); None leaves the model's own.
`cognet evaluate` and `cognet-batch score` build it with one click decorator
(`cognet.core.commandline.decoding_options`), `EvalOptions` and `ScoreOptions` hold it whole,
and `resolve` is the one place it meets the stored decoding (DESIGN.md §3).

The rule, checked on creation and again against the stored decoding: `--decoding` names the
decoding; `--beam` alone asks for beam search; an option that does not apply to the asked
decoding is refused (ValueError, one line naming the options): `--beam` with set decoding or
with `--samples`/`--threshold`; `--samples`, `--threshold`, `--estimator` or `--set-rule`
with beam search; `--threshold` with `--set-rule jaccard`; `--beam`, `--samples` or
`--estimator` with the marginal decoding (it draws no sample), and a soft DDI penalty with it
(a step policy: the marginal decoding has no steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cognet.core.ddi import DDIPolicy, DDITarget
from cognet.core.decoding.defaults import DECODINGS, ESTIMATORS, LIMITS, SET_RULES, Decoding

# the request's fields that only set decoding reads, by their command-line option
SET_OPTIONS = {
    "samples": "--samples",
    "threshold": "--threshold",
    "estimator": "--estimator",
    "set_rule": "--set-rule",
}


@dataclass(frozen=True)
class DecodingRequest:
    """What a caller asks of the decoding; every None leaves the model's own."""

    decoding: str | None = None  # one of DECODINGS
    beam: int | None = None  # beam width (1 = greedy); alone, it asks for beam search
    samples: int | None = None  # set decoding: samples per visit
    threshold: float | None = None  # set decoding: on P(k in S); alone, the threshold rule
    estimator: str | None = None  # set decoding: how the samples are drawn (ESTIMATORS)
    set_rule: str | None = None  # set decoding: how the set is read (SET_RULES)
    # DDI-aware decoding; None: the model's (its DDI target's policy, else off)
    ddi: DDIPolicy | None = None

    def __post_init__(self) -> None:
        _choice("decoding", self.decoding, DECODINGS)
        _choice("estimator", self.estimator, ESTIMATORS)
        _choice("set rule", self.set_rule, SET_RULES)
        for key in ("beam", "samples"):
            value, top = getattr(self, key), LIMITS[key]
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top
            ):
                raise ValueError(f"{key} must be an integer in [1, {top}], not {value!r}")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], not {self.threshold}")
        if self.ddi is not None and not isinstance(self.ddi, DDIPolicy):
            raise ValueError(f"ddi must be a cognet.core.ddi.DDIPolicy, not {self.ddi!r}")
        self._check(self.name)

    @property
    def name(self) -> str | None:
        """The decoding asked for: `decoding` when given; a beam width alone asks for beam
        search; None leaves the model's own."""
        return "beam" if self.decoding is None and self.beam is not None else self.decoding

    @property
    def set_options(self) -> list[str]:
        """The set-decoding options given, as command-line options."""
        return [flag for key, flag in SET_OPTIONS.items() if getattr(self, key) is not None]

    def _check(self, name: str | None) -> None:
        """Refuse the options that do not apply to the decoding `name` (None: not known yet)."""
        given = self.set_options
        if self.beam is not None and (self.samples is not None or self.threshold is not None):
            others = [f for f in given if f in ("--samples", "--threshold")]
            raise ValueError(
                f"--beam is for beam search and {' and '.join(others)} for set decoding: "
                "give one or the other"
            )
        if name == "beam" and given:
            why = "--decoding beam" if self.decoding == "beam" else "beam search"
            raise ValueError(
                f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for set decoding, "
                f"not {why}"
            )
        if name == "set" and self.beam is not None:
            raise ValueError("--beam is for beam search, not set decoding")
        if name == "marginal":
            drawn = [f for f in given if f in ("--samples", "--estimator")]
            if self.beam is not None:
                drawn.insert(0, "--beam")
            if drawn:
                raise ValueError(
                    f"{' and '.join(drawn)} {'is' if len(drawn) == 1 else 'are'} for "
                    "decodings that step, not --decoding marginal (one pass: its options "
                    "are --threshold, --set-rule and the DDI set rules)"
                )
        if self.set_rule == "jaccard" and self.threshold is not None:
            raise ValueError("--threshold is for --set-rule threshold, not jaccard")

    def decoding_on(self, stored: Decoding) -> Decoding:
        """The decoding to run on a model whose stored decoding is `stored` (ValueError when
        an option given does not apply to it, or the result is no valid decoding)."""
        name = self.name or stored.name
        self._check(name)
        rule = self.set_rule if self.set_rule is not None or self.threshold is None else None
        if rule is None and self.threshold is not None:
            rule = "threshold"  # a threshold alone asks for the threshold rule
        if rule is None and self.ddi is not None and self.ddi.pair_price:
            rule = "jaccard"  # a pair price reads the expected-Jaccard set
        if name == "marginal":  # its own threshold and rule, tuned apart from set decoding's
            return stored.with_changes(name=name, head_threshold=self.threshold, head_rule=rule)
        return stored.with_changes(
            name=name,
            beam=self.beam,
            samples=self.samples,
            threshold=self.threshold,
            estimator=self.estimator,
            rule=rule,
        )

    def resolve(
        self, stored: Decoding, target: DDITarget | None = None
    ) -> tuple[Decoding, DDIPolicy]:
        """The decoding and the DDI policy to run on a model whose own are `stored` and
        `target` (its DDI target: used when no policy is asked; `cognet.core.ddi`). A policy
        with a pair price reads the expected-Jaccard set (`decoding_on` and a target's rule
        ask for it): refused with beam search or an asked threshold rule."""
        decoding, policy = with_target(self.ddi, target, stored, self.decoding_on, self.name)
        if policy.pair_price and decoding.name == "beam":
            raise ValueError("--ddi-pair-price is for set decoding, not beam search")
        if decoding.name == "marginal" and policy.mode == "soft":
            raise ValueError(
                "--ddi-mode soft acts at each decoding step and --decoding marginal has none: "
                "use --ddi-pair-price, --ddi-max-rate or --ddi-mode hard (set rules)"
            )
        if policy.pair_price and decoding.selection[1] != "jaccard":
            raise ValueError(
                "--ddi-pair-price reads the expected-Jaccard set: drop --threshold and "
                "--set-rule threshold"
            )
        return decoding, policy

    def to_json(self) -> dict:
        return {
            "decoding": self.decoding,
            "beam": self.beam,
            "samples": self.samples,
            "threshold": self.threshold,
            "estimator": self.estimator,
            "set_rule": self.set_rule,
            "ddi": None if self.ddi is None else self.ddi.to_json(),
        }


def with_target(
    asked: DDIPolicy | None,
    target: DDITarget | None,
    default: Decoding,
    resolve: Callable[[Decoding], Decoding],
    name: str | None = None,
) -> tuple[Decoding, DDIPolicy]:
    """The decoding and the policy to run: `resolve` (the caller's changes) on top of the
    model's `default` decoding, and the policy `asked` (None: none asked). A model's DDI
    target applies when no policy is asked and the decoding run (`name`, the one asked; None:
    the model's own) is the one it was chosen for (set, or marginal: `DDITarget.decoding`):
    its policy, its set rule and its threshold (read by the threshold rule), as the search
    chose them, unless the changes set them. Otherwise the asked policy, or off; a model
    without a target decodes as it always did."""
    if asked is None and target is not None and (name or default.name) == target.decoding:
        if target.decoding == "marginal":
            chosen = {"head_threshold": target.threshold, "head_rule": target.rule}
        else:
            chosen = {"threshold": target.threshold, "rule": target.rule}
        return resolve(default.with_changes(**chosen)), target.policy
    return resolve(default), asked or DDIPolicy()


def _choice(what: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose from {', '.join(choices)}")
