"""Agreement of the runtime with the torch reference (user guide "Set decoding").

    cognet evaluate --checkpoint CKPT --data DATA --predictions ref.parquet
    cognet-batch score test.parquet --model MODEL --all --out run.parquet ...
    python -m cognet.benchmarks.agreement ref.parquet run-7.parquet run-4096.parquet

For each run, the share of the reference's visits whose medication list the run returns
identically (same medications in the same order), and the visits missing from the run. Both
files have the `cognet-batch score` output schema; visits match by visit_id. Exit status 1
when a run falls under `--min` (default 0.995) or misses a visit; 2 (one line) when a file
cannot be read as a scoring output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq


def medication_lists(path: Path) -> dict[str, tuple[str, ...]]:
    """visit_id -> its medication list; ValueError naming the file when it has no such
    columns (a rejects file, say)."""
    names = pq.read_schema(path).names
    missing = [c for c in ("visit_id", "medications") if c not in names]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)} (not a scoring output)")
    table = pq.read_table(path, columns=["visit_id", "medications"])
    ids, meds = table.column("visit_id").to_pylist(), table.column("medications").to_pylist()
    return {v: tuple(m or ()) for v, m in zip(ids, meds, strict=True)}


def agreement(reference: dict, run: dict) -> dict:
    """{"visits", "identical", "missing", "share"} of `run` against `reference`."""
    missing = [v for v in reference if v not in run]
    same = sum(run.get(v) == meds for v, meds in reference.items())
    return {
        "visits": len(reference),
        "identical": same,
        "missing": len(missing),
        "share": same / len(reference) if reference else 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path, help="cognet evaluate --predictions output")
    parser.add_argument("runs", type=Path, nargs="+", help="cognet-batch score outputs")
    parser.add_argument("--min", type=float, default=0.995, help="least share identical")
    args = parser.parse_args(argv)
    try:
        reference = medication_lists(args.reference)
        runs = [(path, medication_lists(path)) for path in args.runs]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ok = True
    print("| run | visits | identical | share | missing |\n|---|---|---|---|---|")
    for path, run in runs:
        a = agreement(reference, run)
        ok &= a["share"] >= args.min and a["missing"] == 0
        cells = (path.name, a["visits"], a["identical"], f"{a['share']:.4f}", a["missing"])
        print("| " + " | ".join(map(str, cells)) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
