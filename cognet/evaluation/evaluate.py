"""Evaluation of a checkpoint (or a baseline) on a split: the checkpoint's decoding (or the
one asked, `DecodingRequest`) over whole patients, then the metrics of DESIGN.md §4 with
seeded bootstrap rounds."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from cognet.core.dataset import DDI_FILE, PREDICTIONS_SCHEMA, read_dataset
from cognet.core.ddi import DDIPolicy, DDITarget, ddi_matrix, require_pairs
from cognet.core.decoding import Decoding
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError
from cognet.core.files import atomic_path
from cognet.core.history import Visit, load_split, train_vocabulary
from cognet.core.metrics import (
    VisitResult,
    evaluation_report,
    format_table,
    summarize,
    visit_results,
)
from cognet.core.progress import progress
from cognet.core.vocab import Vocab
from cognet.evaluation.baselines import run_baseline
from cognet.evaluation.options import EvalOptions, ground_truth_ddi, stored_decoding
from cognet.model import checkpoint
from cognet.model.torch_decoding import decode_patients
from cognet.training.ddi_target import Validation, choose_target

log = logging.getLogger(__name__)


def predictions_table(
    patients: Sequence[Sequence[Visit]],
    predicted: Sequence[Sequence[int]],
    scores: Sequence[float],
    vocab: Vocab,
    probabilities: Sequence[Sequence[float]] | None = None,
) -> pa.Table:
    """The `cognet-batch score` output schema (`cognet.core.dataset.PREDICTIONS_SCHEMA`):
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
        name = f"COGNet ({beam.label})" if beam.name != "beam" else model_name(beam.beam)
    else:
        name = f"COGNet (beam {beam})" if beam > 1 else "COGNet (greedy)"
    return name if not ddi.active else f"{name[:-1]}, DDI {ddi.label})"


def run_evaluation(ckpt, data_dir, options: EvalOptions = EvalOptions()) -> dict:
    """What `cognet evaluate` does: returns {"report": dict, "table": str}."""
    split = options.split
    baseline = options.baseline
    seed = options.seed
    dataset = read_dataset(data_dir)
    asked = "--ddi-target" if options.ddi_target is not None else "the DDI policy"
    if options.ddi_target is not None or (options.request.ddi and options.request.ddi.active):
        require_pairs(dataset.ddi_pairs, Path(data_dir) / DDI_FILE, asked)
    ddi = options.request.ddi or DDIPolicy()
    target = None
    trials = None
    if ckpt:
        model, vocab, config = checkpoint.load(ckpt)
        target = DDITarget.from_json(config.get("ddi_target"))  # checked by checkpoint.load
        if options.ddi_target is not None:
            target, trials = _search_target(ckpt, model, vocab, dataset, config, options)
        plan = decoding_plan(config, options.request, vocab.end, target)
        decoding, ddi = plan.decoding, plan.ddi
        head = checkpoint.load_head(ckpt, config) if decoding.name == "marginal" else None
        if decoding.name == "marginal" and head is None:
            raise InputError(
                f"{ckpt}: --decoding marginal reads a set head and this checkpoint has none "
                f"(add one: cognet train --data DATA --teacher {ckpt} --out NEW)"
            )
    else:
        vocab = train_vocabulary(dataset.visits)
    data = load_split(dataset.visits, vocab, split)
    if not data.patients:
        raise InputError(f"{data_dir}: the {split} split has no labelled visit")
    ddi_adj = ddi_matrix(vocab, dataset.ddi_pairs)
    if baseline:
        results = run_baseline(baseline, vocab, dataset.visits, split=split, seed=seed)
        name = baseline
    else:
        results = _decode_split(model, vocab, data.patients, plan, options, head)
        name = model_name(decoding, ddi)
    rep = evaluation_report(results, ddi_adj, rounds=options.rounds, seed=seed)
    rep["by_history"] = by_history(results, ddi_adj)
    if not baseline:
        rep.update(_decoding_fields(decoding, ddi, target, trials, options))
    rep.update(
        model=name,
        split=split,
        ground_truth_ddi=ground_truth_ddi(data.patients, ddi_adj),
        unknown_codes=data.unknown_codes,
        unlabeled_visits=data.unlabeled_visits,
    )
    table = _summary_table(name, rep, split, data.unknown_codes)
    if "ddi_target" in rep:  # validation holding the target does not prove test does
        table += _target_line(target, rep["ddi"]["mean"], split)
    return {"report": rep, "table": table}


def _decode_split(model, vocab: Vocab, patients, plan, options: EvalOptions, head=None):
    """Decode every patient (with a progress bar) into VisitResults; write the predictions
    Parquet file when `options.predictions` asks for it."""
    n_visits = sum(map(len, patients))
    with progress(total=n_visits, desc="decoding", unit="visit", quiet=options.quiet) as bar:
        decoded = decode_patients(model, vocab, patients, plan, bar.update, head=head)
    results = visit_results(patients, decoded)
    if options.predictions:
        _write_parquet(
            options.predictions,
            predictions_table(
                patients,
                [d.meds for d in decoded],
                [d.score for d in decoded],
                vocab,
                [d.med_probs for d in decoded],
            ),
        )
    return results


def _decoding_fields(decoding, ddi, target, trials, options: EvalOptions) -> dict:
    """The report's record of how the model decoded: the DDI policy, the decoding, the
    target's pair when it decided the policy, and the search's trials when one ran."""
    fields = {"ddi_policy": ddi.to_json(), "decoding": decoding.to_json()}
    # the target's pair, when it decided the policy
    if target is not None and options.request.ddi is None and decoding.name == target.decoding:
        fields["ddi_target"] = target.to_json()
    if trials is not None:  # every (policy, threshold) the search scored on validation
        fields["ddi_target_search"] = [t.to_json() for t in trials]
    return fields


def _summary_table(name: str, rep: dict, split: str, unknown_codes: int) -> str:
    """The metrics table, the split's ground-truth DDI rate and sizes, and the Jaccard of
    first and later visits."""
    parts = rep["by_history"]
    return (
        format_table({name: rep}) + f"\nground-truth DDI rate of the {split} split: "
        f"{rep['ground_truth_ddi']:.4f}  ({rep['n_patients']} patients, "
        f"{rep['n_visits']} visits, {unknown_codes} unknown codes dropped)\n"
        + "; ".join(
            f"{label}: Jaccard {parts[key]['jaccard']:.4f} ({parts[key]['n_visits']} visits)"
            for key, label in (("first", "first visits (no history)"), ("later", "later visits"))
            if parts[key]
        )
    )


def _target_line(target: DDITarget, test_ddi: float, split: str) -> str:
    """Whether the DDI target chosen on validation held on `split`."""
    return (
        f"\nDDI target {target.target:g}, chosen on validation: {target.policy.label}, "
        f"{target.rule_label} (validation Jaccard {target.val_jaccard:.4f}, DDI "
        f"{target.val_ddi:.4f}); {split} DDI {test_ddi:.4f} "
        + ("<=" if test_ddi <= target.target else "> (not held)")
        + f" target {target.target:g}"
    )


def _search_target(ckpt, model, vocab, dataset, config: dict, options: EvalOptions) -> tuple:
    """The DDI target's pair for `options.ddi_target`, chosen on the validation split
    (`cognet.training.ddi_target`), with the decoding that `options` asks on the checkpoint's, and
    the search's trials."""
    decoding = _asked(lambda: options.request.decoding_on(stored_decoding(config)))
    val = load_split(dataset.visits, vocab, "val").patients
    if decoding.name == "beam" or not val:
        raise InputError(
            "--ddi-target needs set or marginal decoding and a labelled validation split"
        )
    head = checkpoint.load_head(ckpt, config) if decoding.name == "marginal" else None
    adj = ddi_matrix(vocab, dataset.ddi_pairs)

    # no total: the search decodes validation once per policy it tries, as many as needed
    desc = f"DDI target {options.ddi_target:g} search"
    with progress(desc=desc, unit="visit", quiet=options.quiet) as bar:
        split = Validation(val, adj)
        return choose_target(
            model, vocab, split, decoding, options.ddi_target, on_batch=bar.update, head=head
        )


def decoding_plan(
    config: dict, request: DecodingRequest, end: int, target: DDITarget | None = None
) -> DecodingPlan:
    """The decoding plan to run: `request` on top of a checkpoint's `config` and its DDI
    `target` (`DecodingPlan.of`; `end`: the END id of its vocabulary); a request that does
    not apply is an InputError."""
    stored = stored_decoding(config)
    return _asked(lambda: DecodingPlan.of(request, stored, target, end=end))


def _asked(get: Callable):
    try:
        return get()
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
