"""cognet.core.decoding: every decoding of cognet, torch-free.

`defaults` (the decodings, their defaults and the stored `Decoding`), `request` (what a
caller asks on top of it), `plan` (the request resolved once into what runs, and the one
dispatch of a batch), `driver` (the one decoding loop and the interfaces it drives),
`beam` (beam search's host selector and trace back), `sampling` (set decoding's sampler),
`draws` (its counter-based random draws), `set_rules` (the set read from P(k in S)),
`attribution` (what each medication took from the history, for every decoding),
`open_samples` (set decoding's loop over the open samples only). The defaults
are re-exported here.
"""

from cognet.core.decoding.defaults import (
    BEAM,
    DECODINGS,
    DEFAULT_DECODING,
    ESTIMATOR,
    ESTIMATORS,
    LIMITS,
    MAX_LEN,
    SAMPLES,
    SET_RULES,
    Decoding,
)

__all__ = [
    "BEAM",
    "DECODINGS",
    "DEFAULT_DECODING",
    "ESTIMATOR",
    "ESTIMATORS",
    "LIMITS",
    "MAX_LEN",
    "SAMPLES",
    "SET_RULES",
    "Decoding",
]
