"""Evaluation of a checkpoint (or a baseline) on a split: beam search over whole patients,
then the metrics of DESIGN.md §4 with seeded bootstrap rounds."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from cognet.batching import make_batch
from cognet.core.ddi import DDIPolicy, DDITarget, ddi_matrix, require_pairs, with_target
from cognet.core.decoding import Decoding
from cognet.core.files import atomic_path
from cognet.core.history import Visit, patients_from_table
from cognet.core.metrics import VisitResult, bootstrap_report, ddi_rate_of_sets, summarize
from cognet.core.schema import DDI_FILE, PREDICTIONS_SCHEMA
from cognet.core.vocab import Vocab
from cognet.decode import Decoded, beam_search
from cognet.decode_set import set_decode
from cognet.model import COGNet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalOptions:
    """What `cognet evaluate` (and `--ddi-tradeoff`) evaluates and how, in one value: the
    command builds it from its options, the functions below take it whole."""

    split: str = "test"
    # None: the checkpoint's own decoding (config.json "decoding"; beam 4 for a model from
    # before set decoding); a dict changes fields of it; a Decoding is used as it is
    decoding: Decoding | dict | None = None
    # DDI-aware decoding; None: the checkpoint's (its DDI target's policy, else off)
    ddi: DDIPolicy | None = None
    # choose a DDI target's pair on the validation split for this rate (`cognet.ddi_target`)
    # and evaluate with it, instead of the checkpoint's own
    ddi_target: float | None = None
    rounds: int = 10  # bootstrap rounds of 80% of the patients (1: every patient, once)
    seed: int = 0
    baseline: str | None = None  # evaluate this baseline instead of the checkpoint
    predictions: str | Path | None = None  # write every visit's recommendation there
    quiet: bool = True  # no progress bar


@dataclass
class SplitData:
    patients: list[list[Visit]]
    unknown_codes: int  # codes of the split that the vocabulary does not know (dropped)
    unlabeled_visits: int  # visits without medications, neither decoded nor used as history


def split_table(visits: pa.Table, split: str) -> pa.Table:
    import pyarrow.compute as pc

    return visits.filter(pc.equal(visits.column("split"), split))


def load_split(visits: pa.Table, vocab: Vocab, split: str) -> SplitData:
    """The labelled visits of a split grouped into patients (unknown codes dropped)."""
    patients, unknown, unlabeled = [], 0, 0
    for p in patients_from_table(split_table(visits, split), vocab):
        unknown += sum(v.unknown_codes for v in p)
        kept = [v for v in p if v.meds is not None]
        unlabeled += len(p) - len(kept)
        if kept:
            patients.append(kept)
    return SplitData(patients, unknown, unlabeled)


def decode_patients(
    model: COGNet,
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    decoding: Decoding = Decoding(),
    ddi: DDIPolicy = DDIPolicy(),
    on_batch: Callable[[int], None] | None = None,
    batch_patients: int = 128,
) -> list[Decoded]:
    """Decode every visit of `patients` (history: the earlier visits' true medications) with
    `decoding` (default: the paper's beam search, beam 4) under the DDI policy `ddi`."""
    out: list[Decoded] = []
    with torch.no_grad():
        for i in range(0, len(patients), batch_patients):
            chunk = patients[i : i + batch_patients]
            batch = make_batch(chunk, vocab, targets=False)
            if decoding.name == "beam":
                beam, max_len = decoding.beam, decoding.max_len
                out.extend(beam_search(model, batch, beam=beam, max_len=max_len, ddi=ddi))
            else:
                ids = [v.visit_id for p in chunk for v in p]
                out.extend(set_decode(model, batch, ids, decoding, ddi=ddi))
            if on_batch:
                on_batch(sum(map(len, chunk)))
    return out


def visit_results(
    patients: Sequence[Sequence[Visit]], decoded: Sequence[Decoded]
) -> list[VisitResult]:
    visits = [v for p in patients for v in p]
    return [
        VisitResult(v.patient_id, d.meds, tuple(v.meds or ()), d.scores)
        for v, d in zip(visits, decoded, strict=True)
    ]


def report(
    results: Sequence[VisitResult], ddi_adj: np.ndarray, rounds: int = 10, seed: int = 0
) -> dict:
    if rounds <= 1:
        return bootstrap_report(results, ddi_adj, rounds=1, fraction=1.0, seed=seed)
    return bootstrap_report(results, ddi_adj, rounds=rounds, fraction=0.8, seed=seed)


def ground_truth_ddi(patients: Sequence[Sequence[Visit]], ddi_adj: np.ndarray) -> float:
    return float(ddi_rate_of_sets([v.meds or () for p in patients for v in p], ddi_adj))


def predictions_table(
    patients: Sequence[Sequence[Visit]],
    predicted: Sequence[Sequence[int]],
    scores: Sequence[float],
    vocab: Vocab,
    probabilities: Sequence[Sequence[float]] | None = None,
) -> pa.Table:
    """The `cognet-batch score` output schema (`cognet.core.schema.PREDICTIONS_SCHEMA`):
    patient_id, visit_id, medications, score and probabilities (each medication's; a
    baseline's are null)."""
    visits = [v for p in patients for v in p]
    probs = [None] * len(visits) if probabilities is None else [list(p) for p in probabilities]
    columns = [
        [v.patient_id for v in visits],
        [v.visit_id for v in visits],
        [vocab.med_codes(m) for m in predicted],
        list(scores),
        probs,
    ]
    return pa.Table.from_arrays(
        [pa.array(c, f.type) for c, f in zip(columns, PREDICTIONS_SCHEMA, strict=True)],
        schema=PREDICTIONS_SCHEMA,
    )


def model_name(beam: int | Decoding, ddi: DDIPolicy = DDIPolicy()) -> str:
    if isinstance(beam, Decoding):
        name = f"COGNet ({beam.label})" if beam.name == "set" else model_name(beam.beam)
    else:
        name = f"COGNet (beam {beam})" if beam > 1 else "COGNet (greedy)"
    return name if not ddi.active else f"{name[:-1]}, DDI {ddi.label})"


def run_evaluation(ckpt, data_dir, options: EvalOptions = EvalOptions()) -> dict:
    """What `cognet evaluate` does: returns {"report": dict, "table": str}."""
    from cognet import checkpoint
    from cognet.core.clitools import progress
    from cognet.core.metrics import format_table
    from cognet.core.schema import read_dataset

    split, baseline, seed = options.split, options.baseline, options.seed
    dataset = read_dataset(data_dir)
    asked = "--ddi-target" if options.ddi_target is not None else "the DDI policy"
    if options.ddi_target is not None or (options.ddi and options.ddi.active):
        require_pairs(dataset.ddi_pairs, Path(data_dir) / DDI_FILE, asked)
    ddi, target, trials = options.ddi or DDIPolicy(), None, None
    if ckpt:
        model, vocab, config = checkpoint.load(ckpt)
        target = DDITarget.from_json(config.get("ddi_target"))  # checked by checkpoint.load
        if options.ddi_target is not None:
            target, trials = _search_target(model, vocab, dataset, config, options)
        decoding, ddi = with_target(
            options.ddi,
            target,
            resolve_decoding(config, None),
            lambda base: resolve_decoding({"decoding": base.to_json()}, options.decoding),
        )
    else:
        train_rows = split_table(dataset.visits, "train")
        vocab = Vocab.build(
            *(train_rows.column(c).to_pylist() for c in ("diagnoses", "procedures", "medications"))
        )
    data = load_split(dataset.visits, vocab, split)
    if not data.patients:
        from cognet.core.errors import InputError

        raise InputError(f"{data_dir}: the {split} split has no labelled visit")
    ddi_adj = ddi_matrix(vocab, dataset.ddi_pairs)
    if baseline:
        from cognet.baselines import run_baseline

        results = run_baseline(baseline, vocab, dataset.visits, split=split, seed=seed)
        name = baseline
    else:
        n_visits = sum(map(len, data.patients))
        with progress(total=n_visits, desc="decoding", unit="visit", quiet=options.quiet) as bar:
            decoded = decode_patients(model, vocab, data.patients, decoding, ddi, bar.update)
        results = visit_results(data.patients, decoded)
        name = model_name(decoding, ddi)
        if options.predictions:
            _write_parquet(
                options.predictions,
                predictions_table(
                    data.patients,
                    [d.meds for d in decoded],
                    [d.score for d in decoded],
                    vocab,
                    [d.med_probs for d in decoded],
                ),
            )
    rep = report(results, ddi_adj, rounds=options.rounds, seed=seed)
    rep["by_history"] = by_history(results, ddi_adj)
    if not baseline:
        rep["ddi_policy"] = ddi.to_json()
        rep["decoding"] = decoding.to_json()
        if target is not None and options.ddi is None and decoding.name == "set":  # its pair
            rep["ddi_target"] = target.to_json()
        if trials is not None:  # every (policy, threshold) the search scored on validation
            rep["ddi_target_search"] = [t.to_json() for t in trials]
    rep.update(
        model=name,
        split=split,
        ground_truth_ddi=ground_truth_ddi(data.patients, ddi_adj),
        unknown_codes=data.unknown_codes,
        unlabeled_visits=data.unlabeled_visits,
    )
    parts = rep["by_history"]
    table = (
        format_table({name: rep}) + f"\nground-truth DDI rate of the {split} split: "
        f"{rep['ground_truth_ddi']:.4f}  ({rep['n_patients']} patients, "
        f"{rep['n_visits']} visits, {data.unknown_codes} unknown codes dropped)\n"
        + "; ".join(
            f"{label}: Jaccard {parts[key]['jaccard']:.4f} ({parts[key]['n_visits']} visits)"
            for key, label in (("first", "first visits (no history)"), ("later", "later visits"))
            if parts[key]
        )
    )
    if "ddi_target" in rep:  # validation holding the target does not prove test does
        test_ddi = rep["ddi"]["mean"]
        table += (
            f"\nDDI target {target.target:g}, chosen on validation: {target.policy.label}, "
            f"threshold {target.threshold:g} (validation Jaccard {target.val_jaccard:.4f}, DDI "
            f"{target.val_ddi:.4f}); {split} DDI {test_ddi:.4f} "
            + ("<=" if test_ddi <= target.target else "> (not held)")
            + f" target {target.target:g}"
        )
    return {"report": rep, "table": table}


def _search_target(model, vocab, dataset, config: dict, options: EvalOptions) -> tuple:
    """The DDI target's pair for `options.ddi_target`, chosen on the validation split
    (`cognet.ddi_target`), with the decoding that `options` asks on the checkpoint's, and
    the search's trials."""
    from cognet.core.errors import InputError
    from cognet.ddi_target import choose_target

    decoding = resolve_decoding(config, options.decoding)
    val = load_split(dataset.visits, vocab, "val").patients
    if decoding.name != "set" or not val:
        raise InputError("--ddi-target needs set decoding and a labelled validation split")
    adj = ddi_matrix(vocab, dataset.ddi_pairs)
    return choose_target(model, vocab, val, adj, decoding, options.ddi_target)


def resolve_decoding(config: dict, decoding: Decoding | dict | None) -> Decoding:
    """The decoding to run (`EvalOptions.decoding`) on top of a checkpoint's `config`; a bad
    combination is an InputError."""
    from cognet.core.errors import InputError

    if isinstance(decoding, Decoding):
        return decoding
    try:
        stored = Decoding.from_json(config.get("decoding"))
        return stored.with_changes(**(decoding or {}))
    except ValueError as exc:
        raise InputError(str(exc)) from None


def by_history(results: Sequence[VisitResult], ddi_adj: np.ndarray) -> dict:
    """The metrics (`summarize`, all patients) of the first evaluated visit of every patient
    (no history: COGNet generates only) and of the later ones, each with its `n_visits`;
    None for an empty part. `results` hold each patient's visits together, in order."""
    first = [i == 0 or r.patient_id != results[i - 1].patient_id for i, r in enumerate(results)]
    parts = {}
    for key, want in (("first", True), ("later", False)):
        subset = [r for r, f in zip(results, first, strict=True) if f == want]
        parts[key] = {**summarize(subset, ddi_adj), "n_visits": len(subset)} if subset else None
    return parts


def _write_parquet(path, table: pa.Table) -> None:
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
