"""MIMIC-III ingestion: the SafeDrug / COGNet preprocessing, written as a cognet dataset.

Re-implements the steps of ``data/processing.py`` in the SafeDrug and COGNet
repositories (read, not copied) for users who hold credentialed MIMIC-III v1.4 CSVs:

1. PRESCRIPTIONS: drop rows whose NDC is "0", forward-fill empty fields from the row
   above (file order, as the reference does), drop the leading rows still incomplete,
   order by (SUBJECT_ID, HADM_ID, ICUSTAY_ID, STARTDATE), dedupe
   (SUBJECT_ID, HADM_ID, STARTDATE, NDC).
2. Keep the patients with 2+ admissions among those prescriptions. Like the reference,
   this is counted before the code mapping and the joins, so a patient can end with one
   visit.
3. NDC -> RxCUI (``ndc2rxnorm_mapping.txt``, a Python dict literal read with
   ``ast.literal_eval``: a mapping file is never executed) -> ATC-4 (first row per RXCUI
   of ``RXCUI2atc4.csv`` / ``ndc2atc_level4.csv``) -> ATC-3 (first 4 characters); dedupe
   (SUBJECT_ID, HADM_ID, STARTDATE, ATC3).
4. Keep the 300 most frequent ATC-3 codes (frequency = rows of step 3).
5. DIAGNOSES_ICD: dedupe, keep the 2000 most frequent codes (counted over the whole table).
6. PROCEDURES_ICD: every code, in SEQ_NUM order.
7. Inner join on (SUBJECT_ID, HADM_ID): a visit needs codes of all three kinds.
8. DDI: TWOSIDES pairs (``drug-DDI.csv``) whose side-effect type is among the 40 most
   frequent, STITCH CID -> ATC-3 through ``drug-atc.csv``, restricted to the dataset's
   medications, self pairs dropped.

Where we differ from the reference, on purpose:

- Visits are ordered by ADMISSIONS.ADMITTIME. The reference orders them by HADM_ID, which
  is not chronological in MIMIC-III.
- ``ddi_types="top40"`` keeps the 40 most frequent side-effect types. The reference sorts
  the counts in descending order and then takes the *last* 40 rows, i.e. the 40 least
  frequent types; ``ddi_types="reference"`` reproduces that for comparisons.
- Ties in every top-k are broken by the code string (the reference's order is unspecified).
- Codes are read as strings, so ICD-9 codes keep their leading zeros.
- No molecule filter: SafeDrug / COGNet also drop ATC-3 codes without a SMILES string
  (DrugBank), which is why their vocabulary has 131 medications; we have no molecule data.

Every step counts the rows it read, kept and dropped (`tables.Step`); the report
(`tables.Report`) is written to ``OUT/summary.json`` beside the dataset.
"""

from __future__ import annotations

import ast
import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa

from cognet.core.dataset import VISITS_SCHEMA
from cognet.core.errors import InputError, one_line, where
from cognet.data.tables import (
    Report,
    Step,
    check_output,
    dataset_counts,
    no_mapped_medications,
    write_dataset,
)

DDI_TYPES = ("top40", "reference")
KEY = ["SUBJECT_ID", "HADM_ID"]
SIDE_EFFECT = "Polypharmacy Side Effect"


@dataclass(frozen=True)
class SafeDrugFiles:
    """The SafeDrug / COGNet mapping files that `build_mimic3` and `build_mimic4` read beside
    the tables: NDC -> RxCUI (``ndc2rxnorm_mapping.txt``), RxCUI -> ATC-4
    (``RXCUI2atc4.csv``), STITCH CID -> ATC (``drug-atc.csv``) and the TWOSIDES pairs
    (``drug-DDI.csv``)."""

    ndc_rxnorm: str | os.PathLike
    rxnorm_atc: str | os.PathLike
    drug_atc: str | os.PathLike
    ddi: str | os.PathLike

    def paths(self) -> list[Path]:
        """The four files as paths, in field order."""
        return [Path(p) for p in (self.ndc_rxnorm, self.rxnorm_atc, self.drug_atc, self.ddi)]


def build_mimic3(
    mimic_dir: str | os.PathLike,
    files: SafeDrugFiles,
    out: str | os.PathLike,
    ddi_types: str = "top40",
    *,
    top_medications: int = 300,
    top_diagnoses: int = 2000,
    ddi_top_k: int = 40,
) -> Report:
    """Write ``visits.parquet`` and ``ddi.parquet`` (DESIGN.md §2, no split column) and
    ``summary.json`` to ``out``.

    ``mimic_dir`` holds PRESCRIPTIONS, DIAGNOSES_ICD, PROCEDURES_ICD and ADMISSIONS as
    ``.csv`` or ``.csv.gz``; ``files`` are the mapping files. Raises ``InputError`` for a
    missing file or column or an unreadable value, naming the file, column and line, and
    when OUT would overwrite an input.
    """
    if ddi_types not in DDI_TYPES:
        raise InputError(f"ddi_types must be one of {', '.join(DDI_TYPES)}, not {ddi_types!r}")
    for name, k in (
        ("top_medications", top_medications),
        ("top_diagnoses", top_diagnoses),
        ("ddi_top_k", ddi_top_k),
    ):
        if k < 1:
            raise InputError(f"{name} must be at least 1, not {k}")
    mimic_dir = Path(mimic_dir)
    tables = {
        name: find_table(mimic_dir, name)
        for name in ("PRESCRIPTIONS", "DIAGNOSES_ICD", "PROCEDURES_ICD", "ADMISSIONS")
    }
    ndc_rxnorm, rxnorm_atc, drug_atc, ddi = files.paths()
    for path in (ndc_rxnorm, rxnorm_atc, drug_atc, ddi):
        _require_file(path)
    out = Path(out)
    check_output(out, [mimic_dir, *tables.values(), ndc_rxnorm, rxnorm_atc, drug_atc, ddi])

    prescriptions, step = load_prescriptions(tables["PRESCRIPTIONS"])
    steps = [step]
    step = Step("patients with 2+ admissions", len(prescriptions), 0, "kept")
    prescriptions = keep_multi_admission_patients(prescriptions)
    step.dropped = {"of a patient with one admission": step.rows - len(prescriptions)}
    steps.append(step.close())
    medications, step = prescriptions_to_atc3(
        prescriptions, read_ndc_rxnorm(ndc_rxnorm), read_rxnorm_atc4(rxnorm_atc)
    )
    steps.append(step)
    if medications.empty and not prescriptions.empty:
        raise InputError(no_mapped_medications(tables["PRESCRIPTIONS"], ndc_rxnorm, rxnorm_atc))
    step = Step(f"{top_medications} commonest ATC-3", 0, 0, "kept")
    medications = top_rows(medications, "ATC3", top_medications, step, "of a rarer class")
    steps.append(step.close())
    diagnoses, step = load_diagnoses(tables["DIAGNOSES_ICD"])
    steps.append(step)
    step = Step(f"{top_diagnoses} commonest diagnoses", 0, 0, "kept")
    diagnoses = top_rows(diagnoses, "ICD9_CODE", top_diagnoses, step, "of a rarer code")
    steps.append(step.close())
    procedures, step = load_procedures(tables["PROCEDURES_ICD"])
    steps.append(step)
    visits = combine(
        medications,
        diagnoses,
        procedures,
        load_admit_times(tables["ADMISSIONS"]),
        tables["ADMISSIONS"],
    )
    steps.append(join_step(medications, diagnoses, len(visits)))
    if visits.empty:
        raise InputError(
            f"{mimic_dir}: no admission has diagnoses, procedures and mapped medications "
            f"(check that the NDC keys of {ndc_rxnorm} match PRESCRIPTIONS.NDC)"
        )
    vocab = {code for codes in visits["medications"] for code in codes}
    pairs = ddi_pairs(ddi, read_cid_atc3(drug_atc, vocab), ddi_types, ddi_top_k)
    table = _visits_table(visits)
    report = Report("mimic3", out, steps, dataset_counts(table, len(pairs)))
    return write_dataset(report, table, pairs)


# ---------------------------------------------------------------- reading


def find_table(mimic_dir: Path, name: str) -> Path:
    """``mimic_dir/NAME.csv``, or ``.csv.gz`` as PhysioNet ships it, or lower-case."""
    for stem in (name, name.lower()):
        for suffix in (".csv", ".csv.gz"):
            if (mimic_dir / (stem + suffix)).is_file():
                return mimic_dir / (stem + suffix)
    raise InputError(f"{mimic_dir / (name + '.csv')}: file not found (nor {name}.csv.gz)")


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise InputError(f"{path}: file not found")


def read_csv_columns(path: Path, columns: Sequence[str]) -> pd.DataFrame:
    """Read ``columns`` (matched case-insensitively) of a CSV as stripped strings.

    Only empty fields are missing (no "NA"/"NULL" guessing); the index is the data row
    (0 = the line after the header), so errors can name the line.
    """
    _require_file(path)
    try:
        header = pd.read_csv(path, nrows=0)
        actual = {str(c).strip().upper(): c for c in header.columns}
        missing = [c for c in columns if c.upper() not in actual]
        if missing:
            raise InputError(f"{where(path, missing[0])}: missing column")
        usecols = [actual[c.upper()] for c in columns]
        frame = pd.read_csv(path, usecols=usecols, dtype=str, keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as exc:
        raise InputError(f"{path}: not a readable CSV ({one_line(exc)})") from None
    frame = frame.rename(columns={actual[c.upper()]: c for c in columns})[list(columns)]
    for column in columns:
        values = frame[column].str.strip()
        frame[column] = values.where(values != "")
    return frame


def _line(index: object) -> int:
    return int(index) + 2  # 1-based, after the header line


def _int_ids(frame: pd.DataFrame, column: str, path: Path) -> pd.Series:
    """``column`` as int64; a missing or non-integer value raises InputError naming its line."""
    values = pd.to_numeric(frame[column], errors="coerce")
    bad = values.isna() | (values != values.round())
    if bad.any():
        row = bad.idxmax()
        raise InputError(
            f"{where(path, column)}, line {_line(row)}: "
            f"{frame.at[row, column]!r} is not an integer id"
        )
    return values.astype("int64")


def _timestamps(frame: pd.DataFrame, column: str, path: Path) -> pd.Series:
    values = pd.to_datetime(frame[column], errors="coerce", format="ISO8601")
    if values.isna().any():
        row = values.isna().idxmax()
        raise InputError(
            f"{where(path, column)}, line {_line(row)}: "
            f"{frame.at[row, column]!r} is not a date-time"
        )
    return values


def _ids(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    return frame.assign(**{column: _int_ids(frame, column, path) for column in KEY})


def ranked_codes(codes: pd.Series) -> list[str]:
    """Distinct values, most frequent first; ties by the value (deterministic)."""
    counts = codes.value_counts()
    return [code for code, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]


def top_rows(frame: pd.DataFrame, column: str, k: int, step: Step, reason: str) -> pd.DataFrame:
    """The rows of the ``k`` commonest values of ``column`` (ties by value); step counts."""
    kept = frame[frame[column].isin(ranked_codes(frame[column])[:k])]
    step.rows, step.dropped = len(frame), {reason: len(frame) - len(kept)}
    return kept


# ---------------------------------------------------------------- medications


def load_prescriptions(path: Path) -> tuple[pd.DataFrame, Step]:
    """PRESCRIPTIONS as distinct (SUBJECT_ID, HADM_ID, STARTDATE, NDC) rows, and the step;
    step 1."""
    frame = read_csv_columns(path, [*KEY, "ICUSTAY_ID", "STARTDATE", "NDC"])
    step = Step("prescriptions", len(frame), 0, "distinct (admission, start date, NDC)")
    # NDC "0" goes before the forward fill, so an empty NDC is filled from a real one.
    zero = frame["NDC"] == "0"
    filled = frame[~zero].ffill()
    frame = filled.dropna()
    frame = _ids(frame, path).assign(
        ICUSTAY_ID=_int_ids(frame, "ICUSTAY_ID", path),
        STARTDATE=_timestamps(frame, "STARTDATE", path),
    )
    frame = frame.sort_values([*KEY, "ICUSTAY_ID", "STARTDATE"])  # multi-key sorts are stable
    distinct = frame[[*KEY, "STARTDATE", "NDC"]].drop_duplicates()
    step.dropped = {
        'with NDC "0"': int(zero.sum()),
        "incomplete after the forward fill": len(filled) - len(frame),
        "repeating an (admission, start date, NDC)": len(frame) - len(distinct),
    }
    return distinct, step.close()


def keep_multi_admission_patients(prescriptions: pd.DataFrame) -> pd.DataFrame:
    """The rows of patients with prescriptions in 2+ admissions, step 2."""
    admissions = prescriptions.groupby("SUBJECT_ID")["HADM_ID"].transform("nunique")
    return prescriptions[admissions >= 2]


def _rxcui(value: object) -> str:
    """One spelling for an RxCUI read from text, JSON or a float-typed CSV column."""
    return str(value).strip().removesuffix(".0")


def read_ndc_rxnorm(path: Path) -> dict[str, str]:
    """NDC -> RxCUI from a JSON object or a Python dict literal; empty RxCUIs are dropped."""
    text = path.read_text(encoding="utf-8")
    try:
        mapping = json.loads(text)
    except ValueError:
        try:
            mapping = ast.literal_eval(text)  # literals only: the file is never executed
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
            raise InputError(
                f"{path}: not a dict literal of NDC -> RxCUI "
                f"({type(exc).__name__}: {one_line(exc)})"
            ) from None
    if not isinstance(mapping, dict):
        raise InputError(f"{path}: expected a dict of NDC -> RxCUI, got {type(mapping).__name__}")
    pairs = ((str(ndc).strip(), _rxcui(rxcui)) for ndc, rxcui in mapping.items() if rxcui)
    return {ndc: rxcui for ndc, rxcui in pairs if rxcui}


def read_rxnorm_atc4(path: Path) -> dict[str, str]:
    """RxCUI -> ATC-4 from the RXCUI and ATC4 columns; the first row of each RxCUI wins."""
    frame = read_csv_columns(path, ["RXCUI", "ATC4"]).dropna()
    frame = frame.assign(RXCUI=frame["RXCUI"].map(_rxcui)).drop_duplicates("RXCUI")
    return dict(zip(frame["RXCUI"], frame["ATC4"], strict=True))


def prescriptions_to_atc3(
    prescriptions: pd.DataFrame, ndc_rxcui: dict[str, str], rxcui_atc4: dict[str, str]
) -> tuple[pd.DataFrame, Step]:
    """Distinct (SUBJECT_ID, HADM_ID, STARTDATE, ATC3) rows, unmapped NDCs dropped, and the
    step; step 3."""
    atc4 = prescriptions["NDC"].map(ndc_rxcui).map(rxcui_atc4)
    frame = prescriptions[[*KEY, "STARTDATE"]].assign(ATC3=atc4.str[:4])
    mapped = frame.dropna(subset=["ATC3"])
    distinct = mapped.drop_duplicates()
    dropped = {
        "with an NDC not mapped to ATC-3": len(frame) - len(mapped),
        "repeating an (admission, start date, ATC-3)": len(mapped) - len(distinct),
    }
    step = Step("NDC to ATC-3", len(frame), 0, "mapped to ATC-3", dropped)
    return distinct, step.close()


# ---------------------------------------------------------------- diagnoses, procedures, visits


def _code_step(path: Path, read: int, complete: int, distinct: int) -> Step:
    """The step of DIAGNOSES_ICD or PROCEDURES_ICD: rows read, complete, distinct."""
    dropped = {
        "without an id or icd9_code": read - complete,
        "repeating an (admission, code)": complete - distinct,
    }
    name = path.name.split(".")[0].lower()
    return Step(name, read, 0, "distinct codes of admissions", dropped).close()


def load_diagnoses(path: Path) -> tuple[pd.DataFrame, Step]:
    """Distinct (SUBJECT_ID, HADM_ID, ICD9_CODE) rows and the step; step 5 before its top-k."""
    read = read_csv_columns(path, [*KEY, "ICD9_CODE"])
    frame = read.dropna()
    distinct = _ids(frame, path).drop_duplicates()
    return distinct, _code_step(path, len(read), len(frame), len(distinct))


def load_procedures(path: Path) -> tuple[pd.DataFrame, Step]:
    """Distinct (SUBJECT_ID, HADM_ID, ICD9_CODE) rows in SEQ_NUM order and the step, step 6."""
    read = read_csv_columns(path, [*KEY, "SEQ_NUM", "ICD9_CODE"])
    frame = read.dropna(subset=[*KEY, "ICD9_CODE"])
    frame = _ids(frame, path).assign(SEQ_NUM=pd.to_numeric(frame["SEQ_NUM"], errors="coerce"))
    frame = frame.sort_values([*KEY, "SEQ_NUM"])
    distinct = frame[[*KEY, "ICD9_CODE"]].drop_duplicates()
    return distinct, _code_step(path, len(read), len(frame), len(distinct))


def load_admit_times(path: Path) -> pd.DataFrame:
    """(SUBJECT_ID, HADM_ID, ADMITTIME), one row per admission."""
    frame = read_csv_columns(path, [*KEY, "ADMITTIME"])
    frame = _ids(frame, path).assign(ADMITTIME=_timestamps(frame, "ADMITTIME", path))
    return frame.drop_duplicates(KEY)


def _code_lists(frame: pd.DataFrame, column: str, name: str) -> pd.DataFrame:
    """One row per visit with the visit's distinct codes in first-seen order."""
    frame = frame.drop_duplicates([*KEY, column])
    return frame.groupby(KEY, sort=False)[column].agg(list).rename(name).reset_index()


def combine(
    medications: pd.DataFrame,
    diagnoses: pd.DataFrame,
    procedures: pd.DataFrame,
    admissions: pd.DataFrame,
    admissions_path: Path,
    code: str = "ICD9_CODE",
) -> pd.DataFrame:
    """Visits with all three code kinds, ordered by patient then admission time, step 7.

    Columns: SUBJECT_ID, HADM_ID, visit_seq, diagnoses, procedures, medications. ``code``
    names the code column of ``diagnoses`` and ``procedures``.
    """
    keys = medications[KEY].drop_duplicates()
    for other in (diagnoses, procedures):
        keys = keys.merge(other[KEY].drop_duplicates(), on=KEY)
    visits = keys.merge(admissions, on=KEY, how="left")
    unknown = visits["ADMITTIME"].isna()
    if unknown.any():
        first = visits[unknown].iloc[0]
        raise InputError(
            f"{where(admissions_path, 'HADM_ID')}: no admission row for "
            f"HADM_ID {first['HADM_ID']} of SUBJECT_ID {first['SUBJECT_ID']}"
        )
    visits = visits.sort_values(["SUBJECT_ID", "ADMITTIME", "HADM_ID"]).reset_index(drop=True)
    visits["visit_seq"] = visits.groupby("SUBJECT_ID").cumcount().astype("int32")
    for frame, column, name in (
        (diagnoses, code, "diagnoses"),
        (procedures, code, "procedures"),
        (medications, "ATC3", "medications"),
    ):
        visits = visits.merge(_code_lists(frame, column, name), on=KEY, how="left")
    return visits[[*KEY, "visit_seq", "diagnoses", "procedures", "medications"]]


def join_step(medications: pd.DataFrame, diagnoses: pd.DataFrame, visits: int) -> Step:
    """Admissions with medications, and those left without diagnoses or procedures (step 7)."""
    with_meds = medications[KEY].drop_duplicates()
    with_diag = with_meds.merge(diagnoses[KEY].drop_duplicates(), on=KEY)
    dropped = {
        "without a diagnosis": len(with_meds) - len(with_diag),
        "without a procedure": len(with_diag) - visits,
    }
    return Step("admissions with medications", len(with_meds), visits, "visits", dropped).ended()


# ---------------------------------------------------------------- drug-drug interactions


def read_cid_atc3(path: Path, vocabulary: set[str]) -> pd.DataFrame:
    """(CID, ATC3) pairs from ``drug-atc.csv`` lines ``CID,ATC,ATC,...``, kept in ``vocabulary``."""
    _require_file(path)
    rows = []
    with path.open(newline="", encoding="utf-8") as handle:
        for fields in csv.reader(handle):
            if not fields:
                continue
            cid, *atcs = (field.strip() for field in fields)
            rows.extend((cid, atc[:4]) for atc in atcs if atc[:4] in vocabulary)
    return pd.DataFrame(rows, columns=["CID", "ATC3"], dtype=str).drop_duplicates()


def select_side_effects(types: pd.Series, ddi_types: str, top_k: int) -> list[str]:
    """The side-effect types whose pairs count: the ``top_k`` commonest, or for
    ``"reference"`` the ``top_k`` rarest (the reference script's descending sort + tail)."""
    ranked = ranked_codes(types)
    return ranked[:top_k] if ddi_types == "top40" else ranked[-top_k:]


def ddi_pairs(
    path: Path, cid_atc3: pd.DataFrame, ddi_types: str, top_k: int
) -> list[tuple[str, str]]:
    """Sorted unordered ATC-3 pairs (a < b) from TWOSIDES rows of the selected side effects."""
    frame = read_csv_columns(path, ["STITCH 1", "STITCH 2", SIDE_EFFECT]).dropna()
    chosen = select_side_effects(frame[SIDE_EFFECT], ddi_types, top_k)
    frame = frame[frame[SIDE_EFFECT].isin(chosen)][["STITCH 1", "STITCH 2"]].drop_duplicates()
    for side, drug in (("STITCH 1", "drug_a"), ("STITCH 2", "drug_b")):
        frame = frame.merge(cid_atc3.rename(columns={"CID": side, "ATC3": drug}), on=side)
    frame = frame[["drug_a", "drug_b"]].drop_duplicates()
    pairs = zip(frame["drug_a"], frame["drug_b"], strict=True)
    return sorted({(min(a, b), max(a, b)) for a, b in pairs if a != b})


# ---------------------------------------------------------------- writing


def _visits_table(visits: pd.DataFrame) -> pa.Table:
    """The contract columns, without split (the dataset reader splits by patient, seeded)."""
    columns = {
        "patient_id": visits["SUBJECT_ID"].astype(str).tolist(),
        "visit_id": visits["HADM_ID"].astype(str).tolist(),
        "visit_seq": visits["visit_seq"].tolist(),
        "diagnoses": visits["diagnoses"].tolist(),
        "procedures": visits["procedures"].tolist(),
        "medications": visits["medications"].tolist(),
    }
    schema = pa.schema([VISITS_SCHEMA.field(name) for name in columns])
    return pa.Table.from_pydict(columns, schema=schema)
