"""MIMIC-IV (``hosp`` module) -> a cognet dataset with the SafeDrug / COGNet preprocessing.

The steps of `cognet.data.mimic3` (its mapping readers, top-k ranking, join and DDI code are
reused), on MIMIC-IV's tables: admissions, diagnoses_icd, procedures_icd and prescriptions as
PhysioNet ships them (``.csv.gz``, lower-case names and columns; ``--mimic-dir`` may be the
release folder or its ``hosp/`` folder).

1. prescriptions: rows without hadm_id or with NDC "0" or empty are dropped (MIMIC-IV has no
   ICU stay column to forward-fill, and filling an NDC from the row above invents a
   prescription); NDC -> RxCUI -> ATC-4 -> ATC-3 with mimic3's mapping files; distinct
   (subject_id, hadm_id, day of starttime, ATC-3).
2. Keep the patients with prescriptions (a valid NDC) in 2+ admissions, counted before the
   mapping, as the reference does.
3. Keep the 300 most frequent ATC-3 classes; the 2000 most frequent diagnosis codes; every
   procedure code, in seq_num order.
4. Inner join on (subject_id, hadm_id); visits ordered by admittime; DDI pairs from TWOSIDES
   through drug-atc.csv, as for MIMIC-III.

ICD codes keep their version: each becomes the OMOP vocabulary token with OMOP's dotted code
(`icd_token`), so that a model trained here can score OMOP data converted with
``--source-codes``. Every dropped row is counted per step (`tables.Step`). The clinical tables
are read in record batches, and prescriptions (about 17 million rows in MIMIC-IV) are reduced
to mapped ATC-3 rows batch by batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cognet.core.errors import InputError
from cognet.data.mimic3 import (
    DDI_TYPES,
    KEY,
    SafeDrugFiles,
    _visits_table,
    combine,
    ddi_pairs,
    find_table,
    join_step,
    keep_multi_admission_patients,
    load_admit_times,
    read_cid_atc3,
    read_ndc_rxnorm,
    read_rxnorm_atc4,
    top_rows,
)
from cognet.data.tables import (
    Report,
    SourceTable,
    Step,
    check_output,
    dataset_counts,
    no_mapped_medications,
    write_dataset,
)

TABLES = ("ADMISSIONS", "DIAGNOSES_ICD", "PROCEDURES_ICD", "PRESCRIPTIONS")
TOKEN = "ICD_TOKEN"
US_PER_DAY = 86_400_000_000
NO_DAY = np.iinfo(np.int64).min  # a prescription without starttime: its own day

# vocabulary_id of each (kind, icd_version), as OMOP names the vocabularies
VOCABULARIES = {
    ("diagnoses", 9): "ICD9CM",
    ("diagnoses", 10): "ICD10CM",
    ("procedures", 9): "ICD9Proc",
    ("procedures", 10): "ICD10PCS",
}


def icd_token(code: str, version: int, kind: str) -> str:
    """``VOCAB/CODE`` with OMOP's dot: ICD-9-CM after 3 characters (4 for E codes), ICD-10-CM
    after 3, ICD-9 procedures after 2, ICD-10-PCS none. A code with a dot is kept as is.

    >>> icd_token("4019", 9, "diagnoses"), icd_token("E8798", 9, "diagnoses")
    ('ICD9CM/401.9', 'ICD9CM/E879.8')
    >>> icd_token("3606", 9, "procedures"), icd_token("02703ZZ", 10, "procedures")
    ('ICD9Proc/36.06', 'ICD10PCS/02703ZZ')
    """
    at = {
        ("diagnoses", 9): 4 if code.startswith("E") else 3,
        ("diagnoses", 10): 3,
        ("procedures", 9): 2,
    }.get((kind, version))
    if at is not None and "." not in code and len(code) > at:
        code = f"{code[:at]}.{code[at:]}"
    return f"{VOCABULARIES[kind, version]}/{code}"


def hosp_folder(mimic_dir: Path) -> Path:
    """``mimic_dir/hosp`` when the release folder is given, else ``mimic_dir``."""
    if not mimic_dir.is_dir():
        raise InputError(f"{mimic_dir}: folder not found")
    return mimic_dir / "hosp" if (mimic_dir / "hosp").is_dir() else mimic_dir


# ---------------------------------------------------------------- reading


def _keys(table: SourceTable, cols: dict, start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """subject_id (required), hadm_id and whether it is there."""
    subject = table.ints(cols["subject_id"], "subject_id", start, required=True)[0]
    hadm, has = table.ints(cols["hadm_id"], "hadm_id", start)
    return subject, hadm, has


def load_prescriptions(
    path: Path, ndc_rxcui: dict[str, str], rxcui_atc4: dict[str, str]
) -> tuple[pd.DataFrame, pd.DataFrame, Step]:
    """Distinct (SUBJECT_ID, HADM_ID, STARTDATE, ATC3) rows, the admissions with a valid NDC
    (SUBJECT_ID, HADM_ID), and the step; steps 1 and the input of 2."""
    table = SourceTable(path)
    step = Step.counting(
        "prescriptions",
        "mapped to ATC-3",
        [
            "without hadm_id",
            'with NDC "0" or empty',
            "with an NDC not mapped to ATC-3",
            "repeating an (admission, day, ATC-3)",
        ],
    )
    medications, admissions, mapped = [], [], 0
    for start, cols in table.batches(["subject_id", "hadm_id", "starttime", "ndc"]):
        subject, hadm, has = _keys(table, cols, start)
        micros, timed = table.times(cols["starttime"], "starttime", start)
        ndc = table.text(cols["ndc"]).to_numpy(zero_copy_only=False)
        usable = pd.notna(ndc) & (ndc != "0")
        step.rows += len(subject)
        step.dropped["without hadm_id"] += int((~has).sum())
        step.dropped['with NDC "0" or empty'] += int((has & ~usable).sum())
        keep = has & usable
        day = np.where(timed, micros // US_PER_DAY, NO_DAY)
        frame = pd.DataFrame(
            {
                "SUBJECT_ID": subject[keep],
                "HADM_ID": hadm[keep],
                "STARTDATE": day[keep],
                "NDC": ndc[keep],
            }
        )
        atc3 = frame["NDC"].map(ndc_rxcui).map(rxcui_atc4).str[:4]
        step.dropped["with an NDC not mapped to ATC-3"] += int(atc3.isna().sum())
        mapped += int(atc3.notna().sum())
        admissions.append(frame[KEY].drop_duplicates())
        rows = frame[[*KEY, "STARTDATE"]].assign(ATC3=atc3).dropna()
        medications.append(rows.drop_duplicates())  # per batch too: bounded memory
    medications = _concat(medications, [*KEY, "STARTDATE", "ATC3"]).drop_duplicates()
    step.dropped["repeating an (admission, day, ATC-3)"] = mapped - len(medications)
    return medications, _concat(admissions, KEY).drop_duplicates(), step.close()


def _concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def load_icd(path: Path, kind: str) -> tuple[pd.DataFrame, Step]:
    """(SUBJECT_ID, HADM_ID, ICD_TOKEN) rows in file order (procedures: seq_num order),
    repeats dropped; rows without hadm_id or code are counted."""
    table = SourceTable(path)
    step = Step.counting(
        path.name.split(".")[0].lower(),
        "distinct codes of admissions",
        ["without hadm_id or icd_code", "repeating an (admission, code)"],
    )
    columns = ["subject_id", "hadm_id", "icd_code", "icd_version"]
    if kind == "procedures":
        columns.append("seq_num")
    frames, tokens = [], {}
    for start, cols in table.batches(columns):
        subject, hadm, has = _keys(table, cols, start)
        code = table.text(cols["icd_code"]).to_numpy(zero_copy_only=False)
        version = table.ints(cols["icd_version"], "icd_version", start, required=True)[0]
        if not np.isin(version, (9, 10)).all():
            row = start + int(np.argmin(np.isin(version, (9, 10))))
            raise InputError(
                f"{table.where('icd_version', row)}: {version[row - start]} is "
                "not an ICD version (9 or 10)"
            )
        keep = has & pd.notna(code)
        step.rows += len(subject)
        step.dropped["without hadm_id or icd_code"] += int((~keep).sum())
        pairs = zip(code[keep], version[keep], strict=True)
        token = [
            tokens.get(p) or tokens.setdefault(p, icd_token(p[0], int(p[1]), kind)) for p in pairs
        ]
        frame = pd.DataFrame({"SUBJECT_ID": subject[keep], "HADM_ID": hadm[keep], TOKEN: token})
        if kind == "procedures":
            frame["SEQ_NUM"] = table.ints(cols["seq_num"], "seq_num", start)[0][keep]
        frames.append(frame)
    frame = _concat(frames, [*KEY, TOKEN, "SEQ_NUM"])
    if kind == "procedures":  # multi-key sorts are stable: ties keep file order
        frame = frame.sort_values([*KEY, "SEQ_NUM"], kind="stable")
    distinct = frame[[*KEY, TOKEN]].drop_duplicates()
    step.dropped["repeating an (admission, code)"] = len(frame) - len(distinct)
    return distinct, step.close()


# ---------------------------------------------------------------- the conversion


def build_mimic4(
    mimic_dir: str | Path,
    files: SafeDrugFiles,
    out: str | Path,
    ddi_types: str = "top40",
    *,
    top_medications: int = 300,
    top_diagnoses: int = 2000,
    ddi_top_k: int = 40,
) -> Report:
    """Write ``visits.parquet``, ``ddi.parquet`` and ``summary.json`` to ``out``, with the
    mapping files of `build_mimic3` (``files``).

    Raises InputError naming the file, column and line for a missing file or column or an
    unreadable value, and when OUT would overwrite an input.
    """
    if ddi_types not in DDI_TYPES:
        raise InputError(f"ddi_types must be one of {', '.join(DDI_TYPES)}, not {ddi_types!r}")
    hosp, out = hosp_folder(Path(mimic_dir)), Path(out)
    tables = {name: find_table(hosp, name) for name in TABLES}
    mappings = files.paths()
    for path in mappings:
        if not path.is_file():
            raise InputError(f"{path}: file not found")
    check_output(out, [Path(mimic_dir), hosp, *tables.values(), *mappings])

    medications, admissions, step = load_prescriptions(
        tables["PRESCRIPTIONS"], read_ndc_rxnorm(mappings[0]), read_rxnorm_atc4(mappings[1])
    )
    if medications.empty and not admissions.empty:
        raise InputError(no_mapped_medications(tables["PRESCRIPTIONS"], mappings[0], mappings[1]))
    steps = [step]
    multi = keep_multi_admission_patients(admissions)["SUBJECT_ID"].unique()
    step = Step("patients with 2+ admissions", len(medications), 0, "kept")
    medications = medications[medications["SUBJECT_ID"].isin(multi)]
    step.dropped = {"of a patient with one admission": step.rows - len(medications)}
    steps.append(step.close())
    step = Step(f"{top_medications} commonest ATC-3", 0, 0, "kept")
    medications = top_rows(medications, "ATC3", top_medications, step, "of a rarer class")
    steps.append(step.close())
    diagnoses, step = load_icd(tables["DIAGNOSES_ICD"], "diagnoses")
    steps.append(step)
    step = Step(f"{top_diagnoses} commonest diagnoses", 0, 0, "kept")
    diagnoses = top_rows(diagnoses, TOKEN, top_diagnoses, step, "of a rarer code")
    steps.append(step.close())
    procedures, step = load_icd(tables["PROCEDURES_ICD"], "procedures")
    steps.append(step)

    visits = combine(
        medications,
        diagnoses,
        procedures,
        load_admit_times(tables["ADMISSIONS"]),
        tables["ADMISSIONS"],
        code=TOKEN,
    )
    steps.append(join_step(medications, diagnoses, len(visits)))
    if visits.empty:
        raise InputError(
            f"{hosp}: no admission has diagnoses, procedures and mapped medications "
            f"(check that the NDC keys of {mappings[0]} match prescriptions.ndc)"
        )
    vocab = {code for codes in visits["medications"] for code in codes}
    pairs = ddi_pairs(mappings[3], read_cid_atc3(mappings[2], vocab), ddi_types, ddi_top_k)
    table = _visits_table(visits)
    report = Report("mimic4", out, steps, dataset_counts(table, len(pairs)))
    return write_dataset(report, table, pairs)
