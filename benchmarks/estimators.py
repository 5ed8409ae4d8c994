"""The set decoding's estimators measured on the validation split (user guide "Set decoding").

    python -m cognet.benchmarks.estimators --model MODEL --data DATA [--visits 200]
        [--reference 4096] [--samples 8,16,32,64] [--estimators plain,stratified]

For each number of samples and estimator (`cognet.core.decoding.draws.uniforms`):
- the mean absolute error of P(k in S), over every medication of a fixed subset of
  validation visits (the first `--visits` scored visits of the split, in file order),
  against a reference of `--reference` plain samples drawn with another seed;
- the validation Jaccard of the model's set decoding with that estimator (every visit of
  the split scored with `--all`: patient-averaged, as `cognet evaluate`), read by the
  model's set rule (its tuned threshold, or expected-Jaccard sets).
Runs the runtime on the CPU provider, one thread; prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cognet.core import strict_json
from cognet.core.dataset import split_rows
from cognet.core.decoding.draws import visit_keys
from cognet.core.decoding.driver import Visits
from cognet.core.decoding.ensemble import EnsembleSession, ensemble_marginals
from cognet.core.decoding.sampling import SetConfig, set_marginals
from cognet.core.manifest import load_manifest
from cognet.core.metrics import summary_of
from cognet.runtime import ScoreOptions, Scorer, reader
from cognet.runtime.batches import encoder_budget
from cognet.runtime.encoder import encode_plan, init_memories
from cognet.runtime.plan import Assembler
from cognet.runtime.session import OrtModel

REFERENCE_SEED = 104729  # the reference's draws share no stream with the measured ones


def split_table(data: Path, split: str) -> pa.Table:
    visits = pq.read_table(data / "visits.parquet")
    return split_rows(visits, split).drop(["split"])


def marginals(model_dir: Path, table: pa.Table, visits: int, configs, batch: int = 32) -> list:
    """P(k in S) [visits, M] of the first `visits` targets of `table` under each SetConfig."""
    manifest = load_manifest(model_dir)
    model = OrtModel(manifest, device="cpu", threads=1, selection="host")
    vocab = manifest.vocabulary()
    cast = reader.cast_input(table, "<table>")
    cast = cast.append_column(reader.ROW, pa.array(np.arange(len(cast), dtype=np.int64)))
    plan = Assembler(vocab, score_all=True).plan(cast)
    batch, cells = encoder_budget(gpu=False)
    enc = encode_plan(model.encoder, plan, vocab, cells, batch)
    pick = np.arange(min(visits, plan.targets.size))
    ids = plan.table.column("visit_id").take(plan.targets[pick]).to_pylist()
    out = []
    for cfg in configs:
        rows = []
        step = max(1, batch * 16 // cfg.samples)  # about the same decoder rows per call
        for lo in range(0, pick.size, step):
            part = pick[lo : lo + step]
            targets, histories = plan.targets[part], plan.histories.take(part)
            memories, _ = init_memories(model.decoder, plan, enc, targets, histories)
            visits = Visits(part.size, keys=visit_keys(ids[lo : lo + step]))
            if isinstance(model.decoder, EnsembleSession):  # the mean of its members'
                members = model.decoder.members
                est, _, _ = ensemble_marginals(members, memories, cfg, visits)
            else:
                est, _, _ = set_marginals(model.decoder, memories, cfg, visits)
            rows.append(est)
        out.append(np.concatenate(rows))
    return out


def jaccard(model_dir: Path, table: pa.Table, samples: int, estimator: str) -> float:
    scorer = Scorer(
        model_dir, ScoreOptions.of(device="cpu", threads=1, samples=samples, estimator=estimator)
    )
    rows = [c.patient_metrics for c in scorer.score_table(table, score_all=True)]
    return summary_of(np.concatenate(rows))["jaccard"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--split", default="val")
    parser.add_argument("--visits", type=int, default=200)
    parser.add_argument("--reference", type=int, default=4096)
    parser.add_argument("--samples", default="8,16,32,64")
    parser.add_argument("--estimators", default="plain,stratified")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    samples = [int(s) for s in args.samples.split(",")]
    estimators = args.estimators.split(",")
    decoding = load_manifest(args.model).default_decoding()
    rule = f"threshold {decoding.threshold:g}" if decoding.rule == "threshold" else decoding.rule
    table = split_table(args.data, args.split)
    end = len(load_manifest(args.model).vocabulary().medications)
    grid = [(s, e) for s in samples for e in estimators]
    configs = [SetConfig(end=end, samples=args.reference, seed=REFERENCE_SEED)]
    configs += [SetConfig(end=end, samples=s, seed=decoding.seed, estimator=e) for s, e in grid]
    started = time.perf_counter()
    ref, *ests = marginals(args.model, table, args.visits, configs)
    results = []
    for (s, e), est in zip(grid, ests, strict=True):
        mae = float(np.abs(est - ref).mean())
        score = jaccard(args.model, table, s, e)
        results.append({"samples": s, "estimator": e, "mae": mae, "val_jaccard": score})
    print(
        f"{args.split} split: MAE of P(k in S) over {ref.shape[0]} visits x {ref.shape[1]} "
        f"medications against {args.reference} plain samples; Jaccard over the whole split "
        f"with the model's set rule ({rule}) ({time.perf_counter() - started:.0f} s)"
    )
    print("| samples | estimator | MAE of P(k in S) | val Jaccard |")
    print("|---:|---|---:|---:|")
    for r in results:
        print(f"| {r['samples']} | {r['estimator']} | {r['mae']:.5f} | {r['val_jaccard']:.4f} |")
    if args.json:
        args.json.write_text(strict_json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
