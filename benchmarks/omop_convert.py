"""Time and peak memory of `cognet data omop` on a generated OMOP CDM extract.

    python -m cognet.benchmarks.omop_convert --visits 1000000 --drug-rows 20000000 \\
        --work /tmp/omop_bench [--format parquet|csv|duckdb] [--keep]

Writes an extract of the given size under WORK/cdm (`cognet.data.synth_omop`, shaped like a
hospital's and written chunk by chunk, so generating it needs little memory), then runs
`cognet data omop` on it in a child process and reports the command's wall time and the
child's peak resident memory (``ru_maxrss``), as JSON on stdout and in WORK/result.json.
``--format csv`` writes the clinical tables as comma-separated CSV and the vocabulary as
Athena does (tab-separated, YYYYMMDD).
``--format duckdb`` loads the Parquet extract into a DuckDB file (WORK/omop.duckdb, schema
``cdm``, the types the Parquet files have) and converts from ``duckdb:///WORK/omop.duckdb``;
loading happens in this process, so the child's peak memory is the conversion's alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cognet.core import strict_json
from cognet.core.files import write_text
from cognet.data.synth_omop import generate_extract


def load_duckdb(cdm: Path, path: Path) -> Path:
    """The Parquet tables of ``cdm`` as tables of schema ``cdm`` in a new DuckDB file."""
    import duckdb

    path.unlink(missing_ok=True)
    con = duckdb.connect(str(path))
    catalog = con.execute("SELECT current_database()").fetchone()[0]
    con.execute(f'CREATE SCHEMA "{catalog}".cdm')
    for table in sorted(cdm.glob("*.parquet")):
        name = table.name[: -len(".parquet")].lower()
        source = str(table).replace("'", "''")
        con.execute(
            f"CREATE TABLE \"{catalog}\".cdm.{name} AS SELECT * FROM read_parquet('{source}')"
        )
    con.close()
    return path


def run(work: Path, visits: int, drug_rows: int, fmt: str, keep: bool) -> dict:
    cdm, out = work / "cdm", work / "out"
    shutil.rmtree(cdm, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    generate_extract(cdm, visits, drug_rows, fmt="parquet" if fmt == "duckdb" else fmt)
    source = str(cdm)
    if fmt == "duckdb":
        source = f"duckdb:///{load_duckdb(cdm, work / 'omop.duckdb').resolve()}"
    generated = time.perf_counter() - start
    command = [
        sys.executable,
        "-c",
        "from cognet.cli import main; main()",
        "data",
        "omop",
        "--cdm",
        source,
        "--out",
        str(out),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"cognet data omop failed ({done.returncode}): {done.stderr.strip()}")
    summary = json.loads((out / "summary.json").read_text())
    result = {
        "visits": visits,
        "drug_rows": drug_rows,
        "format": fmt,
        "input_mb": round(
            (work / "omop.duckdb").stat().st_size / 2**20
            if fmt == "duckdb"
            else sum(p.stat().st_size for p in cdm.iterdir()) / 2**20,
            1,
        ),
        "generate_s": round(generated, 1),
        "convert_s": round(seconds, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        "drug_rows_per_s": round(drug_rows / seconds),
        "dataset": summary["dataset"],
    }
    if not keep:
        shutil.rmtree(cdm)
        (work / "omop.duckdb").unlink(missing_ok=True)
    write_text(work / "result.json", strict_json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--visits", type=int, default=1_000_000)
    parser.add_argument("--drug-rows", type=int, default=20_000_000)
    parser.add_argument("--work", type=Path, required=True, help="folder for the extract")
    parser.add_argument("--format", choices=["parquet", "csv", "duckdb"], default="parquet")
    parser.add_argument("--keep", action="store_true", help="keep the generated extract")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    print(
        strict_json.dumps(
            run(args.work, args.visits, args.drug_rows, args.format, args.keep), indent=2
        )
    )


if __name__ == "__main__":
    main()
