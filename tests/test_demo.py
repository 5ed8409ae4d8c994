"""`make demo`'s closing report (`cognet.demo report`): a source visit only beside a
medication that was copied."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from cognet.demo import report
from cognet.runtime.outputs import output_schema


def test_the_report_names_a_source_visit_only_for_what_was_copied(tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(
        json.dumps(
            {
                "rows_read": 3,
                "rows_scored": 1,
                "rows_rejected": 0,
                "rows_skipped": 2,
                "visits_per_s": 10.0,
                "providers": ["CPUExecutionProvider"],
                "decoding": {"name": "set"},
            }
        )
    )
    row = {
        "patient_id": "P1",
        "visit_id": "P1-2",
        "medications": ["A06A", "C03C"],
        "score": 0.7,
        "probabilities": [0.9, 0.5],
        "explanations": [
            {"copy_share": 0.92, "source_visit": "P1-0", "top_diagnoses": None},
            {"copy_share": 0.16, "source_visit": "P1-1", "top_diagnoses": None},
        ],
    }
    recs = tmp_path / "recs.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=output_schema(True)), recs)
    lines = report(str(summary), str(recs)).splitlines()
    assert "    A06A: 0.900, copied 92% from visit P1-0" in lines
    assert "    C03C: 0.500, copied 16%" in lines  # generated: no visit named
