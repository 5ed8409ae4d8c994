"""One small cohort written in three forms: OMOP CDM tables (for CSV files or a database) and
a MEDS dataset in the MIMIC-IV MEDS ETL's code conventions, checked by the `meds` schemas.

Each admission has ICD-10 diagnoses and procedures and prescriptions of drugs from `DRUGS`.
In OMOP a drug is an RxNorm concept under its ATC 3rd class in concept_ancestor; in MEDS it
is a ``MEDICATION//START//<name>`` event without hadm_id (as pharmacy events are) whose
parent code is an NDC (mapped by the SafeDrug files below), an ATC code, or nothing (mapped
by a --medication-map file). MEDS also carries what must be ignored: STOP events, labs, ICU
procedure events, birth, and a prescription after discharge.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

import meds
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# name: (NDC, RxCUI, ATC-4, OMOP concept id, how MEDS maps it)
DRUGS = {
    "Lisinopril": ("00002100101", "314076", "C09AA", 1308216, "ndc"),
    "Amlodipine": ("00002200201", "197361", "C08CA", 1332418, "ndc"),
    "Metformin": ("00002300301", "861007", "A10BA", 1503297, "ndc"),
    "Aspirin": ("00002400401", "243670", "N02BA", 1112807, "atc"),
    "Heparin": ("00002500501", "1361615", "B01AB", 1367571, "map"),
    "Saline": ("00002600601", "", "", 967823, "none"),  # maps to nothing, in both forms
}
DIAGNOSES = ["I10", "E119", "I214", "N179", "J189", "K219"]
PROCEDURES = ["02703ZZ", "0DTJ4ZZ", "5A1955Z"]
ATC3_CONCEPT = 21600000  # + index: the ATC 3rd class concepts
ICD_CONCEPT = {"diagnoses": 35200000, "procedures": 2000000}
SPLITS = ["train", "train", "tuning", "held_out"]


@dataclass
class Admission:
    hadm: int
    start: dt.datetime
    end: dt.datetime
    diagnoses: list[str]
    procedures: list[str]
    drugs: list[str]


@dataclass
class Subject:
    subject: int
    split: str
    admissions: list[Admission] = field(default_factory=list)


def make_cohort(n_subjects: int = 40, seed: int = 0) -> list[Subject]:
    rng = np.random.default_rng(seed)
    subjects = []
    for i in range(n_subjects):
        subject = Subject(10_000 + 7 * i, SPLITS[i % len(SPLITS)])
        day = dt.datetime(2150, 1, 1) + dt.timedelta(days=int(rng.integers(0, 300)))
        for k in range(int(rng.integers(1, 5))):
            start = day + dt.timedelta(hours=int(rng.integers(0, 24)), minutes=15 * k)
            end = start + dt.timedelta(days=int(rng.integers(1, 6)), hours=3)
            empty = k == 2  # no code: dropped in every form, leaving a gap in visit_seq
            subject.admissions.append(
                Admission(
                    hadm=20_000_000 + 100 * i + k,
                    start=start,
                    end=end,
                    diagnoses=[] if empty else sorted(set(rng.choice(DIAGNOSES, 2).tolist())),
                    procedures=[] if empty or k % 2 else [str(rng.choice(PROCEDURES))],
                    drugs=sorted(set(rng.choice(list(DRUGS), int(rng.integers(0, 4))).tolist())),
                )
            )
            day = end + dt.timedelta(days=int(rng.integers(10, 60)))
        subjects.append(subject)
    return subjects


def atc3_classes() -> list[str]:
    return sorted({atc[:4] for _, _, atc, _, _ in DRUGS.values() if atc})


def token_pairs() -> dict[str, str]:
    """MEDS token -> OMOP token of every diagnosis and procedure."""
    pairs = {f"DIAGNOSIS//ICD//10//{c}": f"ICD10CM/{c}" for c in DIAGNOSES}
    return pairs | {f"PROCEDURE//ICD//10//{c}": f"ICD10PCS/{c}" for c in PROCEDURES}


# ---------------------------------------------------------------- OMOP


def to_omop(cohort: list[Subject]) -> dict[str, tuple[list, list]]:
    """The CDM tables as (header, rows), as test_omop writes them to CSV."""
    day = "%Y-%m-%d"
    tables = {
        "person": (["person_id", "year_of_birth"], [[s.subject, 2100] for s in cohort]),
        "visit_occurrence": (
            [
                "visit_occurrence_id",
                "person_id",
                "visit_concept_id",
                "visit_start_date",
                "visit_start_datetime",
            ],
            [],
        ),
        "condition_occurrence": (["person_id", "condition_concept_id", "visit_occurrence_id"], []),
        "procedure_occurrence": (["person_id", "procedure_concept_id", "visit_occurrence_id"], []),
        "drug_exposure": (["person_id", "drug_concept_id", "visit_occurrence_id"], []),
    }
    for s in cohort:
        for a in s.admissions:
            tables["visit_occurrence"][1].append(
                [a.hadm, s.subject, 9201, a.start.strftime(day), a.start.isoformat(" ")]
            )
            for kind, table, codes in (
                ("diagnoses", "condition_occurrence", DIAGNOSES),
                ("procedures", "procedure_occurrence", PROCEDURES),
            ):
                for code in getattr(a, kind):
                    concept = ICD_CONCEPT[kind] + codes.index(code)
                    tables[table][1].append([s.subject, concept, a.hadm])
            for drug in a.drugs:
                tables["drug_exposure"][1].append([s.subject, DRUGS[drug][3], a.hadm])
    concept = [
        [ICD_CONCEPT["diagnoses"] + i, "ICD10CM", "ICD10 code", c] for i, c in enumerate(DIAGNOSES)
    ] + [
        [ICD_CONCEPT["procedures"] + i, "ICD10PCS", "ICD10PCS", c] for i, c in enumerate(PROCEDURES)
    ]
    classes = atc3_classes()
    concept += [[ATC3_CONCEPT + i, "ATC", "ATC 3rd", c] for i, c in enumerate(classes)]
    ancestor = []
    for _, _, atc, concept_id, _ in DRUGS.values():
        concept.append([concept_id, "RxNorm", "Clinical Drug", str(concept_id)])
        if atc:
            ancestor.append([ATC3_CONCEPT + classes.index(atc[:4]), concept_id])
    tables["concept"] = (
        ["concept_id", "vocabulary_id", "concept_class_id", "concept_code"],
        concept,
    )
    tables["concept_ancestor"] = (["ancestor_concept_id", "descendant_concept_id"], ancestor)
    return tables


# ---------------------------------------------------------------- MEDS

DATA_SCHEMA = pa.schema(
    [
        ("subject_id", pa.int64()),
        ("time", pa.timestamp("us")),
        ("code", pa.string()),
        ("numeric_value", pa.float32()),
        ("hadm_id", pa.int64()),
    ]
)


def _events(s: Subject) -> list[tuple]:
    """(time, code, numeric_value, hadm_id) of a subject, as the MIMIC-IV MEDS ETL codes them."""
    rows = [(dt.datetime(2100, 1, 1), "MEDS_BIRTH", None, None)]
    for a in s.admissions:
        rows.append((a.start, "HOSPITAL_ADMISSION//EW EMER.//EMERGENCY ROOM", None, a.hadm))
        rows.append((a.start + dt.timedelta(hours=1), "LAB//50912//mg/dL", 1.1, a.hadm))
        rows.append((a.start + dt.timedelta(hours=2), "PROCEDURE//START//225792", None, a.hadm))
        for code in a.diagnoses:  # stamped at discharge, as MIMIC-IV's
            rows.append((a.end, f"DIAGNOSIS//ICD//10//{code}", None, a.hadm))
        for code in a.procedures:
            rows.append(
                (a.start + dt.timedelta(hours=5), f"PROCEDURE//ICD//10//{code}", None, a.hadm)
            )
        for n, drug in enumerate(a.drugs):  # pharmacy: no hadm_id, assigned by time
            at = a.start + dt.timedelta(hours=3 + n)
            rows.append((at, f"MEDICATION//START//{drug}", None, None))
            rows.append((a.end + dt.timedelta(days=2), f"MEDICATION//STOP//{drug}", None, None))
        rows.append((a.end, "HOSPITAL_DISCHARGE//HOME", None, a.hadm))
        after = a.end + dt.timedelta(days=3)  # after discharge: in no window
        rows.append((after, "MEDICATION//START//Lisinopril", None, None))
    return sorted(rows, key=lambda r: r[0])


def write_meds(cohort: list[Subject], folder: Path, shards: int = 2) -> Path:
    """MEDS_DIR with data/<split>/<n>.parquet (a subject in one shard), codes.parquet and
    subject_splits.parquet, each validated by its `meds` schema."""
    for n in range(shards):
        rows = [(s.subject, *e) for s in cohort[n::shards] for e in _events(s)]
        table = pa.Table.from_pylist(
            [dict(zip(DATA_SCHEMA.names, r, strict=True)) for r in rows], DATA_SCHEMA
        )
        meds.DataSchema.validate(table)
        path = folder / "data" / ("train" if n == 0 else "held_out") / f"{n}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
    codes = [
        (
            f"MEDICATION//START//{name}",
            [f"NDC/{ndc}"] if how == "ndc" else [f"ATC/{atc}"] if how == "atc" else [],
        )
        for name, (ndc, _, atc, _, how) in DRUGS.items()
    ]
    codes += [(k, [v]) for k, v in token_pairs().items()]
    metadata = folder / "metadata"
    metadata.mkdir(parents=True)
    codes_table = pa.table(
        {
            "code": [c for c, _ in codes],
            "description": pa.nulls(len(codes), pa.string()),
            "parent_codes": pa.array([p for _, p in codes], pa.list_(pa.string())),
        }
    )
    meds.CodeMetadataSchema.validate(codes_table)
    pq.write_table(codes_table, metadata / "codes.parquet")
    splits = pa.table(
        {
            "subject_id": pa.array([s.subject for s in cohort], pa.int64()),
            "split": [s.split for s in cohort],
        }
    )
    meds.SubjectSplitSchema.validate(splits)
    pq.write_table(splits, metadata / "subject_splits.parquet")
    return folder


def write_mappings(folder: Path) -> dict[str, Path]:
    """The SafeDrug files for the NDC drugs and a --medication-map for the rest."""
    folder.mkdir(parents=True, exist_ok=True)
    ndc = {v[0]: v[1] for v in DRUGS.values() if v[4] == "ndc"}
    (folder / "ndc2rxnorm_mapping.txt").write_text(repr(ndc))
    lines = ["RXCUI,ATC4"] + [f"{v[1]},{v[2]}" for v in DRUGS.values() if v[4] == "ndc"]
    (folder / "rxnorm_atc4.csv").write_text("\n".join(lines) + "\n")
    lines = ["code,atc3"] + [
        f"MEDICATION//START//{k},{v[2][:4]}" for k, v in DRUGS.items() if v[4] == "map"
    ]
    (folder / "medication_map.csv").write_text("\n".join(lines) + "\n")
    return {
        "ndc_rxnorm": folder / "ndc2rxnorm_mapping.txt",
        "rxnorm_atc": folder / "rxnorm_atc4.csv",
        "medication_map": folder / "medication_map.csv",
    }
