"""Pieces of `make demo`: the file to score, and the closing report.

`python -m cognet.demo input DATA OUT.parquet` writes the test split with the medications of
each patient's last visit removed (null = to be recommended); `python -m cognet.demo report
SUMMARY.json RECS.parquet` prints the scoring summary and a few recommendations.
"""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from cognet.core.code_names import CodeNames
from cognet.core.dataset import read_dataset, split_rows
from cognet.core.decoding.attribution import COPIED_FROM
from cognet.core.files import atomic_path


def make_input(data_dir: str, out: str, split: str = "test") -> int:
    visits = read_dataset(data_dir).visits
    visits = split_rows(visits, split).drop_columns(["split"])
    pids = visits.column("patient_id").to_pylist()
    last = [i + 1 == len(pids) or pids[i + 1] != p for i, p in enumerate(pids)]
    meds = visits.column("medications").to_pylist()
    masked = pa.array(
        [None if is_last else m for m, is_last in zip(meds, last, strict=True)],
        pa.list_(pa.string()),
    )
    visits = visits.set_column(visits.schema.get_field_index("medications"), "medications", masked)
    with atomic_path(out) as tmp:
        pq.write_table(visits, tmp)
    return sum(last)


def report(summary_path: str, recs_path: str, n: int = 5) -> str:
    names = CodeNames.load()
    summary = json.loads(open(summary_path).read())
    recs = pq.read_table(recs_path).slice(0, n).to_pylist()
    lines = [
        "",
        "== cognet demo ==",
        f"rows read {summary['rows_read']}, scored {summary['rows_scored']}, "
        f"rejected {summary['rows_rejected']}, skipped {summary['rows_skipped']}, "
        f"{summary['visits_per_s']:.0f} visits/s on {', '.join(summary['providers'])}",
        "",
        "A few recommendations (medication: probability, copy share, source visit):",
    ]
    is_set = summary.get("decoding", {}).get("name") == "set"
    score = "set score (mean P(in set))" if is_set else "beam score"
    if is_set:
        lines[-1] = "A few recommendations (medication: P(in set), copy share, source visit):"
    for r in recs:
        lines.append(
            f"- patient {r['patient_id']} visit {r['visit_id']} ({score} {r['score']:.2f}):"
        )
        explain = r.get("explanations") or [None] * len(r["medications"])
        for med, prob, ex in zip(r["medications"], r["probabilities"], explain, strict=True):
            detail = ""
            if ex:
                share, source = ex.get("copy_share", 0), ex.get("source_visit")
                # a source visit only for what was copied (`explain`'s origin threshold)
                copied = source and share >= COPIED_FROM
                detail = f", copied {share:.0%}{' from visit ' + source if copied else ''}"
            lines.append(f"    {names.named('medication', med)}: {prob:.3f}{detail}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "input":
        n = make_input(argv[1], argv[2])
        print(f"wrote {argv[2]}: {n} visits to recommend for")
        return 0
    if len(argv) == 3 and argv[0] == "report":
        print(report(argv[1], argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
