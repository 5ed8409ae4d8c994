"""`cognet data meds` on a MEDS dataset in the MIMIC-IV MEDS ETL's conventions (`cohort`):
the same patients as OMOP CSV files, as a DuckDB CDM and as MEDS give the same visits; every
dropped event is counted; the output trains and scores; bad input exits 2 naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from cdm_forms import typed, write_duckdb
from click.testing import CliRunner
from cohort import DRUGS, make_cohort, to_omop, token_pairs, write_mappings, write_meds
from omop_tables import write_table

from cognet.cli import main
from cognet.core.dataset import read_dataset
from cognet.core.errors import InputError
from cognet.data.meds import MedicationMaps, build_meds
from cognet.data.omop import build_omop

COHORT = make_cohort()


@pytest.fixture
def meds_dir(tmp_path: Path) -> Path:
    return write_meds(COHORT, tmp_path / "meds")


@pytest.fixture
def maps(tmp_path: Path) -> dict[str, Path]:
    return write_mappings(tmp_path / "maps")


def invoke(*args: object):
    return CliRunner().invoke(main, ["data", "meds", *map(str, args)])


def rows(out: Path) -> list[dict]:
    return pq.read_table(out / "visits.parquet").to_pylist()


def steps(out: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}


def test_three_forms_give_the_same_visits(meds_dir, maps, tmp_path):
    tables = to_omop(COHORT)
    folder = tmp_path / "cdm"
    folder.mkdir()
    for name, table in tables.items():
        write_table(folder / f"{name}.csv", table)
    db = write_duckdb(tmp_path / "cdm.duckdb", {n: typed(t) for n, t in tables.items()})
    build_omop(folder, tmp_path / "csv")
    build_omop(f"duckdb:///{db}", tmp_path / "db")
    build_meds(meds_dir, tmp_path / "meds_out", maps=MedicationMaps(**maps))
    name = "visits.parquet"
    assert (tmp_path / "db" / name).read_bytes() == (tmp_path / "csv" / name).read_bytes()
    to_omop_token = token_pairs()
    from_meds = []
    for row in rows(tmp_path / "meds_out"):
        assert row.pop("split") in ("train", "val", "test")
        for column in ("diagnoses", "procedures"):  # the MEDS prefix is kept in the token
            row[column] = sorted(to_omop_token[t] for t in row[column])
        from_meds.append(row)
    expected = rows(tmp_path / "csv")
    assert from_meds == expected
    admissions = sum(len(s.admissions) for s in COHORT)
    assert len(expected) == admissions - sum(len(s.admissions) > 2 for s in COHORT)
    assert any(r["medications"] is None for r in expected)  # Saline alone maps to nothing
    assert {m for r in expected for m in r["medications"] or []} == {
        atc[:4] for _, _, atc, _, _ in DRUGS.values() if atc
    }  # every mapping route: NDC parents, ATC parents, --medication-map


def test_every_dropped_event_is_counted(meds_dir, maps, tmp_path):
    report = invoke(
        "--meds-dir",
        meds_dir,
        "--out",
        tmp_path / "out",
        *[a for k, v in maps.items() for a in (f"--{k.replace('_', '-')}", v)],
    )
    assert report.exit_code == 0, report.output
    got = steps(tmp_path / "out")
    admissions = [a for s in COHORT for a in s.admissions]
    drugs = sum(len(a.drugs) for a in admissions)
    saline = sum("Saline" in a.drugs for a in admissions)
    # per admission: a lab, an ICU procedure, the STOP of each drug; and each subject's birth
    other = len(admissions) * 2 + drugs + len(COHORT)
    assert got["events"]["dropped"] == {
        "of other codes": other,
        "of a subject not in subject_splits": 0,
    }
    assert got["admissions"]["kept"] == len(admissions)
    assert got["medications"]["rows"] == drugs + len(admissions)  # + one after each discharge
    assert got["medications"]["dropped"] == {
        "outside every admission window": len(admissions),
        "with no ATC-3 mapping": saline,
    }
    assert got["diagnoses"]["kept"] == sum(len(a.diagnoses) for a in admissions)
    assert "admissions:" in report.output and "medications:" in report.output


def test_split_comes_from_subject_splits(meds_dir, maps, tmp_path):
    build_meds(meds_dir, tmp_path / "out", maps=MedicationMaps(**maps))
    split = {
        str(s.subject): {"train": "train", "tuning": "val", "held_out": "test"}[s.split]
        for s in COHORT
    }
    for row in rows(tmp_path / "out"):
        assert row["split"] == split[row["patient_id"]]


def test_without_subject_splits_the_split_is_seeded(meds_dir, maps, tmp_path):
    (meds_dir / "metadata" / "subject_splits.parquet").unlink()
    build_meds(meds_dir, tmp_path / "out", maps=MedicationMaps(**maps))
    assert "split" not in pq.read_schema(tmp_path / "out" / "visits.parquet").names
    dataset = read_dataset(tmp_path / "out", split_seed=0)
    assert dataset.visits.num_rows == len(rows(tmp_path / "out"))


def test_without_hadm_id_windows_hold_the_discharge_instant(meds_dir, maps, tmp_path):
    build_meds(meds_dir, tmp_path / "with", maps=MedicationMaps(**maps))
    for shard in sorted((meds_dir / "data").rglob("*.parquet")):
        pq.write_table(pq.read_table(shard).drop_columns(["hadm_id"]), shard)
    build_meds(meds_dir, tmp_path / "without", maps=MedicationMaps(**maps))
    by_time = rows(tmp_path / "without")
    for row in by_time:
        assert "@" in row.pop("visit_id")  # <subject_id>@<admission time>
    expected = [{k: v for k, v in r.items() if k != "visit_id"} for r in rows(tmp_path / "with")]
    assert by_time == expected  # diagnoses stamped at discharge still in their window


def test_trains_with_one_epoch_and_scores(meds_dir, maps, tmp_path):
    from tiny import run_pipeline

    build_meds(meds_dir, tmp_path / "data", maps=MedicationMaps(**maps))
    run_pipeline(tmp_path / "data", tmp_path)


def test_no_medication_is_refused_unless_allowed(meds_dir, tmp_path):
    out = tmp_path / "out"
    result = invoke("--meds-dir", meds_dir, "--out", out, "--medication", "RX//")
    assert result.exit_code == 2
    assert "no RX// event maps to ATC-3" in result.output and "--ndc-rxnorm" in result.output
    assert "--allow-no-medications" in result.output and not out.exists()
    result = invoke(
        "--meds-dir", meds_dir, "--out", out, "--medication", "RX//", "--allow-no-medications"
    )
    assert result.exit_code == 0, result.output
    assert pc.all(pc.is_null(pq.read_table(out / "visits.parquet")["medications"])).as_py()


def _rewrite_shard(meds_dir: Path, change) -> Path:
    shard = sorted((meds_dir / "data").rglob("*.parquet"))[0]
    pq.write_table(change(pq.read_table(shard)), shard)
    return shard


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: t.rename_columns(["patient_id", *t.column_names[1:]]),
            "Missing required columns: subject_id",
        ),
        (
            lambda t: t.set_column(2, "code", t["code"].cast(pa.large_string())),
            "code (want string, got large_string)",
        ),
    ],
    ids=["patient_id", "large_string"],
)
def test_data_failing_the_meds_schema_exits_2(meds_dir, tmp_path, change, message):
    shard = _rewrite_shard(meds_dir, change)
    result = invoke("--meds-dir", meds_dir, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert f"{shard}: not a MEDS DataSchema" in result.output and message in result.output


def test_null_code_names_file_column_and_row(meds_dir, tmp_path):
    schema = pa.schema(
        [
            f.with_nullable(True)
            for f in pq.read_schema(sorted((meds_dir / "data").rglob("*.parquet"))[0])
        ]
    )

    def null_code(table):
        codes = table["code"].to_pylist()
        codes[5] = None
        return table.cast(schema).set_column(2, "code", pa.array(codes, pa.string()))

    shard = _rewrite_shard(meds_dir, null_code)
    result = invoke("--meds-dir", meds_dir, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert f"{shard}: column 'code', row 5: empty" in result.output


@pytest.mark.parametrize("file", ["codes.parquet", "subject_splits.parquet"])
def test_bad_metadata_exits_2(meds_dir, tmp_path, file):
    path = meds_dir / "metadata" / file
    table = pq.read_table(path)
    if file == "codes.parquet":
        pq.write_table(table.drop_columns(["code"]), path)
        message = "not a MEDS CodeMetadataSchema (Missing required columns: code)"
    else:
        pq.write_table(table.set_column(1, "split", pa.array(["dev"] * table.num_rows)), path)
        message = "column 'split', row 0: 'dev' is not one of train, tuning, held_out"
    result = invoke("--meds-dir", meds_dir, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert f"{path}: {message}" in result.output


def test_missing_folders_exit_2(tmp_path):
    result = invoke("--meds-dir", tmp_path / "nope", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "folder not found" in result.output
    (tmp_path / "empty" / "data").mkdir(parents=True)
    result = invoke("--meds-dir", tmp_path / "empty", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "no MEDS data shards" in result.output


def test_cli_help_has_an_example():
    result = CliRunner().invoke(main, ["data", "meds", "--help"])
    assert result.exit_code == 0 and "Example:" in result.output


def test_subjects_missing_from_subject_splits_are_dropped_and_counted(meds_dir, maps, tmp_path):
    path = meds_dir / "metadata" / "subject_splits.parquet"
    pq.write_table(pq.read_table(path).slice(1), path)  # COHORT[0] has no split
    build_meds(meds_dir, tmp_path / "out", maps=MedicationMaps(**maps))
    gone = COHORT[0]
    used = sum(3 + len(a.diagnoses) + len(a.procedures) + len(a.drugs) for a in gone.admissions)
    events = steps(tmp_path / "out")["events"]["dropped"]
    assert events["of a subject not in subject_splits"] == used  # + after-discharge drug
    assert str(gone.subject) not in {r["patient_id"] for r in rows(tmp_path / "out")}


def test_output_onto_the_meds_folder_is_refused(meds_dir, maps):
    before = {p: p.read_bytes() for p in meds_dir.rglob("*.parquet")}
    with pytest.raises(InputError, match="the output would overwrite the input"):
        build_meds(meds_dir, meds_dir, maps=MedicationMaps(**maps))
    assert {p: p.read_bytes() for p in meds_dir.rglob("*.parquet")} == before
