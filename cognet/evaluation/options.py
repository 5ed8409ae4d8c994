"""What `cognet evaluate` (and its `--ddi-tradeoff`) evaluates and how (`EvalOptions`), a
checkpoint's stored decoding and a split's true DDI rate: torch-free, so that the command
line and the DDI trade-off import them at the top (`cognet.evaluation.evaluate` imports
torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cognet.core.decoding import Decoding
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError
from cognet.core.history import Visit
from cognet.core.metrics import ddi_rate_of_sets


@dataclass(frozen=True)
class EvalOptions:
    """What `cognet evaluate` (and `--ddi-tradeoff`) evaluates and how, in one value: the
    command builds it from its options, `cognet.evaluation.evaluate` and `ddi_tradeoff` take
    it whole."""

    split: str = "test"
    # the decoding and DDI policy asked on top of the checkpoint's own (`evaluate.decoding_plan`)
    request: DecodingRequest = DecodingRequest()
    # choose a DDI target's pair on the validation split for this rate
    # (`cognet.training.ddi_target`) and evaluate with it, instead of the checkpoint's own
    ddi_target: float | None = None
    rounds: int = 10  # bootstrap rounds of 80% of the patients (1: every patient, once)
    seed: int = 0
    baseline: str | None = None  # evaluate this baseline instead of the checkpoint
    predictions: str | Path | None = None  # write every visit's recommendation there
    quiet: bool = True  # no progress bar


def ground_truth_ddi(patients: Sequence[Sequence[Visit]], ddi_adj: np.ndarray) -> float:
    return float(ddi_rate_of_sets([v.meds or () for p in patients for v in p], ddi_adj))


def stored_decoding(config: dict) -> Decoding:
    """A checkpoint's own decoding (config.json "decoding"; beam 4 for a model from before
    set decoding); a bad one is an InputError."""
    try:
        return Decoding.from_json(config.get("decoding"))
    except ValueError as exc:
        raise InputError(str(exc)) from None
