"""`cognet-batch score` keeps its memory bounded: one visit holding a whole vocabulary of
diagnoses (user guide "Failure behaviour") costs at most twice the peak memory of the same run
without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]

# -- bounded memory -----------------------------------------------------------------------
RSS = """
import resource, sys
from cognet.runtime.cli import main
try:
    main(sys.argv[1:])
finally:
    print("maxrss_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """A tiny model whose vocabulary holds 3,000 diagnoses (one training visit has them all),
    and `base.parquet`: 4,500 visits; `wide.parquet`: the same plus one visit holding every
    diagnosis code twice."""
    from tiny import random_checkpoint, tiny_ddi, tiny_visits

    from cognet.export import ExportOptions, export

    root = tmp_path_factory.mktemp("wide")
    data = root / "data"
    data.mkdir()
    table = tiny_visits(30, seed=1)
    codes = [f"W{i:04d}" for i in range(3000)]
    row = {**table.slice(0, 1).to_pylist()[0], "patient_id": "WIDE", "visit_id": "WIDE-0"}
    rows = table.to_pylist() + [{**row, "diagnoses": codes}]
    pq.write_table(pa.Table.from_pylist(rows, table.schema), data / "visits.parquet")
    pq.write_table(tiny_ddi(), data / "ddi.parquet")
    export(random_checkpoint(data, root / "ckpt"), root / "model", ExportOptions(validate=False))
    copies = []
    for k in range(50):
        ids = {
            c: pa.compute.binary_join_element_wise(table[c], pa.scalar(f"-{k}"), "")
            for c in ("patient_id", "visit_id")
        }
        copies.append(
            table.set_column(0, "patient_id", ids["patient_id"]).set_column(
                1, "visit_id", ids["visit_id"]
            )
        )
    base = pa.concat_tables(copies).drop_columns(["split"])
    pq.write_table(base, root / "base.parquet")
    big = {**row, "patient_id": "BIG", "visit_id": "BIG-0", "diagnoses": codes * 2}
    big.pop("split")
    pq.write_table(
        pa.concat_tables([base, pa.Table.from_pylist([big], base.schema)]), root / "wide.parquet"
    )
    return root


def test_one_wide_visit_keeps_memory_bounded(wide, tmp_path):
    rss = {}
    for name in ("base", "wide"):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                RSS,
                "score",
                str(wide / f"{name}.parquet"),
                "--model",
                str(wide / "model"),
                "--out",
                str(tmp_path / f"{name}.parquet"),
                "--all",
                "--batch-size",
                "4096",
                "--threads",
                "1",
                "--max-codes-per-visit",
                "3000",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr
        rss[name] = int(done.stderr.split("maxrss_kb")[-1])
    scored = pq.read_table(tmp_path / "wide.parquet")["visit_id"].to_pylist()
    assert "BIG-0" in scored  # the 3,000 codes (each twice) were scored as a set of 3,000
    assert rss["wide"] <= 2 * rss["base"], rss
