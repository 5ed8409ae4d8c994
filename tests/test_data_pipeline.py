"""Converted OMOP and MIMIC-IV datasets run through the whole pipeline unchanged:
`cognet data stats`, `cognet train --epochs 1`, `cognet-export`, `cognet-batch score`."""

from __future__ import annotations

import numpy as np
import pytest
from mimic_tables import (
    DDI,
    DRUG_ATC,
    N1,
    N2,
    N3,
    N5,
    N7,
    NDC_RXNORM,
    RXNORM_ATC,
    write_csv,
    write_gz,
)
from tiny import run_pipeline

from cognet.data.mimic3 import SafeDrugFiles
from cognet.data.mimic4 import build_mimic4
from cognet.data.omop import build_omop
from cognet.data.synth_omop import generate_extract

pytestmark = pytest.mark.slow


def test_omop_dataset_trains_and_scores(tmp_path):
    cdm = generate_extract(tmp_path / "cdm", visits=400, drug_rows=4000, fmt="csv")
    report = build_omop(cdm, tmp_path / "data", visit_concepts=[9201, 262])
    assert report.dataset["medications_null"] > 0  # visits to recommend for
    run_pipeline(tmp_path / "data", tmp_path)


def test_mimic4_dataset_trains_and_scores(tmp_path):
    rng = np.random.default_rng(0)
    hosp = tmp_path / "mimiciv" / "hosp"
    hosp.mkdir(parents=True)
    tables = {
        name: [] for name in ("admissions", "diagnoses_icd", "procedures_icd", "prescriptions")
    }
    for patient in range(60):
        for k in range(int(rng.integers(1, 5))):
            hadm = 1000 * patient + k
            day = f"2150-{k + 1:02d}-{int(rng.integers(1, 28)):02d}"
            tables["admissions"].append([patient, hadm, f"{day} 08:00:00"])
            for seq in range(int(rng.integers(1, 6))):
                version = int(rng.integers(9, 11)) if seq else 9 + k % 2
                code = f"{int(rng.integers(0, 40)) + 400}{seq}" if version == 9 else f"I{seq}{k}"
                tables["diagnoses_icd"].append([patient, hadm, seq + 1, code, version])
            tables["procedures_icd"].append([patient, hadm, 1, f"{int(rng.integers(10, 30))}60", 9])
            for ndc in rng.choice([N1, N2, N3, N5, N7], int(rng.integers(1, 4)), replace=False):
                tables["prescriptions"].append([patient, hadm, f"{day} 09:00:00", ndc])
    headers = {
        "admissions": ["subject_id", "hadm_id", "admittime"],
        "diagnoses_icd": ["subject_id", "hadm_id", "seq_num", "icd_code", "icd_version"],
        "procedures_icd": ["subject_id", "hadm_id", "seq_num", "icd_code", "icd_version"],
        "prescriptions": ["subject_id", "hadm_id", "starttime", "ndc"],
    }
    for name, rows in tables.items():
        write_gz(hosp / f"{name}.csv.gz", (headers[name], rows))
    (tmp_path / "ndc.txt").write_text(NDC_RXNORM)
    (tmp_path / "drug-atc.csv").write_text(DRUG_ATC)
    mappings = SafeDrugFiles(
        tmp_path / "ndc.txt",
        write_csv(tmp_path / "atc4.csv", RXNORM_ATC),
        tmp_path / "drug-atc.csv",
        write_csv(tmp_path / "ddi.csv", DDI),
    )
    report = build_mimic4(tmp_path / "mimiciv", mappings, tmp_path / "data")
    assert report.dataset["visits"] > 60 and report.dataset["ddi_pairs"] > 0
    run_pipeline(tmp_path / "data", tmp_path)
