"""The synthetic EHR generator (cognet.data.synth) and `cognet data synth`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from cognet.cli.data import data
from cognet.core.dataset import VISITS_SCHEMA, read_dataset
from cognet.data.synth import MEDICATIONS, generate

ICD9_DIAGNOSIS = re.compile(r"(\d{3}(\.\d{1,2})?|V\d{2}(\.\d{1,2})?|E\d{3}(\.\d)?)")
ICD9_PROCEDURE = re.compile(r"\d{2}\.\d{1,2}")
ATC3 = re.compile(r"[A-Z]\d{2}[A-Z]")


def test_same_seed_same_bytes(tmp_path, tiny_dataset):
    again = generate(tmp_path / "again", patients=60, seed=0)
    for name in ("visits.parquet", "ddi.parquet"):
        assert (again / name).read_bytes() == (tiny_dataset / name).read_bytes()


def test_same_bytes_in_another_process(tmp_path, tiny_dataset):
    """String hashing differs between processes: nothing may depend on set order."""
    code = "import sys; from cognet.data.synth import generate; generate(sys.argv[1], 60, 0)"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=True)
    for name in ("visits.parquet", "ddi.parquet"):
        assert (tmp_path / name).read_bytes() == (tiny_dataset / name).read_bytes()


def test_other_seed_other_data(tmp_path, tiny_dataset):
    other = generate(tmp_path / "other", patients=60, seed=1)
    assert not pq.read_table(other / "visits.parquet").equals(
        pq.read_table(tiny_dataset / "visits.parquet")
    )
    assert pq.read_table(other / "ddi.parquet") != pq.read_table(tiny_dataset / "ddi.parquet")


def test_patients_do_not_depend_on_cohort_size(tmp_path, tiny_dataset):
    fewer = pq.read_table(generate(tmp_path / "fewer", patients=20, seed=0) / "visits.parquet")
    more = pq.read_table(tiny_dataset / "visits.parquet")
    columns = ["patient_id", "visit_id", "diagnoses", "procedures", "medications"]
    assert fewer.select(columns).equals(more.select(columns).slice(0, fewer.num_rows))


def test_valid_dataset_with_realistic_codes(tiny_dataset):
    ds = read_dataset(tiny_dataset)
    assert pq.read_schema(tiny_dataset / "visits.parquet").names == VISITS_SCHEMA.names
    assert ds.visits.num_rows > 60 and set(ds.visits["split"].to_pylist()) == {
        "train",
        "val",
        "test",
    }
    flat = {
        name: pc.list_flatten(ds.visits[name]).to_pylist()
        for name in ("diagnoses", "procedures", "medications")
    }
    assert all(ICD9_DIAGNOSIS.fullmatch(c) for c in flat["diagnoses"])
    assert all(ICD9_PROCEDURE.fullmatch(c) for c in flat["procedures"])
    assert all(ATC3.fullmatch(c) for c in flat["medications"])
    assert len(MEDICATIONS) == len(set(MEDICATIONS)) == 131
    assert len(ds.ddi_pairs) == 448
    assert all(a in MEDICATIONS and b in MEDICATIONS for a, b in ds.ddi_pairs)


def test_row_groups_hold_whole_patients(tmp_path):
    out = generate(tmp_path, patients=40, seed=0, row_group_size=25)
    file = pq.ParquetFile(out / "visits.parquet")
    assert file.num_row_groups > 2
    owner = {}
    for g in range(file.num_row_groups):
        for pid in file.read_row_group(g, columns=["patient_id"])["patient_id"].to_pylist():
            assert owner.setdefault(pid, g) == g


def test_cli_synth_writes_a_dataset(tmp_path):
    result = CliRunner().invoke(
        data, ["synth", "--out", str(tmp_path / "d"), "--patients", "30", "--seed", "2"]
    )
    assert result.exit_code == 0, result.output
    assert read_dataset(tmp_path / "d").visits["patient_id"].unique().to_pylist()[:2] == [
        "P0000000",
        "P0000001",
    ]


@pytest.mark.parametrize("args", [["--patients", "0"], ["--seed", "-1"], []])
def test_cli_synth_rejects_bad_options(tmp_path, args):
    out = [] if not args else ["--out", str(tmp_path)]
    result = CliRunner().invoke(data, ["synth", *out, *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", [[], ["synth"], ["stats"]])
def test_help_has_an_example(command):
    result = CliRunner().invoke(data, [*command, "--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output
