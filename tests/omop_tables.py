"""A tiny OMOP CDM v5.4 extract (tables, Athena vocabulary, DDI pairs) and its writers, shared by
the OMOP tests (test_omop, test_omop_cli, test_omop_db, test_meds).

The extract mixes what real ones hold: Athena vocabulary files (tab-separated, upper-case
CONCEPT.csv, dates YYYYMMDD, a concept name with a lone quote), comma-separated clinical
tables in lower case, visit_start_datetime sometimes empty, rows in no particular order.
"""

from __future__ import annotations

import csv
import gzip
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HTN, T2DM, MI, CABG = 320128, 201826, 4329847, 4336464  # standard (SNOMED) concepts
I10, E119, PCS = 35207668, 45576876, 2000001  # their source concepts (ICD10CM, ICD10PCS)
LISINOPRIL, AMLODIPINE, COMBO, SALINE = 1308216, 1332418, 1545958, 967823
C09, C09A, C08C, A10B, A10BA, A10BA02 = 21601664, 21601782, 21601744, 21600712, 21600713, 21600714
ATHENA_DATES = ["19700101", "20991231", ""]  # valid_start_date, valid_end_date, invalid_reason
CONCEPT = (
    ["concept_id", "concept_name", "domain_id", "vocabulary_id", "concept_class_id",
     "standard_concept", "concept_code", "valid_start_date", "valid_end_date", "invalid_reason"],
    [row + ATHENA_DATES for row in [
        [HTN, "Essential hypertension", "Condition", "SNOMED", "Clinical Finding", "S",
         "59621000"],
        [T2DM, "Type 2 diabetes mellitus", "Condition", "SNOMED", "Clinical Finding", "S",
         "44054006"],
        [MI, "Myocardial infarction", "Condition", "SNOMED", "Clinical Finding", "S", "22298006"],
        [CABG, "Coronary artery bypass graft", "Procedure", "SNOMED", "Procedure", "S",
         "232717009"],
        [I10, "Essential (primary) hypertension", "Condition", "ICD10CM", "3-char billing code",
         "", "I10"],
        [E119, "Type 2 diabetes mellitus without complications", "Condition", "ICD10CM",
         "Billable Code", "", "E11.9"],
        [PCS, "Bypass Coronary Artery, One Artery from Aorta", "Procedure", "ICD10PCS",
         "ICD10PCS", "", "02703ZZ"],
        [LISINOPRIL, "lisinopril 10 MG Oral Tablet", "Drug", "RxNorm", "Clinical Drug", "S",
         "314076"],
        [AMLODIPINE, "amlodipine 5 MG Oral Tablet", "Drug", "RxNorm", "Clinical Drug", "S",
         "197361"],
        [COMBO, "amlodipine 5 MG / benazepril 10 MG Oral Capsule", "Drug", "RxNorm",
         "Clinical Drug", "S", "898342"],
        [SALINE, 'sodium chloride 9 MG/ML "Baxter', "Drug", "RxNorm", "Branded Drug", "S",
         "1807627"],
        [C09, "AGENTS ACTING ON THE RENIN-ANGIOTENSIN SYSTEM", "Drug", "ATC", "ATC 2nd", "C",
         "C09"],
        [C09A, "ACE INHIBITORS, PLAIN", "Drug", "ATC", "ATC 3rd", "C", "C09A"],
        [C08C, "SELECTIVE CALCIUM CHANNEL BLOCKERS", "Drug", "ATC", "ATC 3rd", "C", "C08C"],
        [A10B, "BLOOD GLUCOSE LOWERING DRUGS, EXCL. INSULINS", "Drug", "ATC", "ATC 3rd", "C",
         "A10B"],
        [A10BA, "Biguanides", "Drug", "ATC", "ATC 4th", "C", "A10BA"],
        [A10BA02, "metformin; oral", "Drug", "ATC", "ATC 5th", "C", "A10BA02"],
    ]],
)  # fmt: skip
CONCEPT_ANCESTOR = (
    ["ancestor_concept_id", "descendant_concept_id", "min_levels_of_separation",
     "max_levels_of_separation"],
    [
        [C09A, LISINOPRIL, 2, 2], [C09, LISINOPRIL, 3, 3], [LISINOPRIL, LISINOPRIL, 0, 0],
        [C08C, AMLODIPINE, 2, 2], [C08C, COMBO, 2, 2], [C09A, COMBO, 2, 2], [C09, COMBO, 3, 3],
        [C09, C09A, 1, 1], [C09A, C09A, 0, 0], [SALINE, SALINE, 0, 0],
    ],
)  # fmt: skip
PERSON = (
    ["person_id", "gender_concept_id", "year_of_birth", "race_concept_id",
     "ethnicity_concept_id"],
    [[3, 8532, 1950, 0, 0], [1, 8507, 1940, 0, 0], [2, 8532, 1961, 0, 0]],
)  # fmt: skip
VISIT = (
    ["visit_occurrence_id", "person_id", "visit_concept_id", "visit_start_date",
     "visit_start_datetime", "visit_end_date", "visit_type_concept_id"],
    [
        [10, 1, 9201, "2020-03-01", "", "2020-03-04", 32817],
        [100, 2, 9201, "2021-06-01", "", "2021-06-02", 32817],  # ties with 21: 21 first
        [11, 1, 262, "2020-01-15", "2020-01-15 14:00:00", "2020-01-16", 32817],
        [13, 1, 9201, "2020-02-01", "", "2020-02-02", 32817],  # no code: dropped (gap)
        [12, 1, 9201, "2020-01-15", "2020-01-15 08:00:00", "2020-01-15", 32817],
        [30, 3, 262, "2019-07-04", "", "2019-07-05", 32817],
        [21, 2, 9201, "2021-06-01", "", "2021-06-03", 32817],
        [20, 2, 9202, "2021-05-01", "2021-05-01 10:30:00", "2021-05-01", 32817],  # outpatient
        [40, 4, 9201, "2020-01-01", "", "2020-01-02", 32817],  # person 4 not in person
    ],
)  # fmt: skip
CONDITION = (
    ["condition_occurrence_id", "person_id", "condition_concept_id", "condition_start_date",
     "condition_type_concept_id", "visit_occurrence_id", "condition_source_value",
     "condition_source_concept_id"],
    [
        [1, 1, HTN, "2020-01-15", 32817, 12, "I10", I10],
        [2, 1, T2DM, "2020-01-15", 32817, 12, "E11.9", E119],
        [3, 1, HTN, "2020-01-15", 32817, 12, "I10", I10],  # repeated: one code
        [4, 1, MI, "2020-01-15", 32817, 11, "I21", 0],  # no source concept
        [5, 1, HTN, "2020-03-01", 32817, 10, "I10", I10],
        [6, 1, 99999999, "2020-03-01", 32817, 10, "X", 0],  # not in concept
        [7, 1, 0, "2020-02-01", 32817, 13, "Z99", 0],  # concept_id 0
        [8, 2, HTN, "2021-05-01", 32817, 20, "I10", I10],
        [9, 2, T2DM, "2021-06-01", 32817, 21, "E11.9", E119],
        [10, 2, HTN, "2021-06-01", 32817, 100, "I10", I10],
        [11, 3, T2DM, "2019-07-04", 32817, 30, "E11.9", E119],
        [12, 4, HTN, "2020-01-01", 32817, 40, "I10", I10],  # visit of an unknown person
        [13, 1, HTN, "2020-01-01", 32817, "", "I10", I10],  # no visit
        [14, 1, HTN, "2020-01-01", 32817, 999, "I10", I10],  # not in visit_occurrence
    ],
)  # fmt: skip
PROCEDURE = (
    ["procedure_occurrence_id", "person_id", "procedure_concept_id", "procedure_date",
     "procedure_type_concept_id", "visit_occurrence_id", "procedure_source_value",
     "procedure_source_concept_id"],
    [
        [1, 1, CABG, "2020-01-15", 32817, 12, "02703ZZ", PCS],
        [2, 2, CABG, "2021-06-01", 32817, 21, "02703ZZ", PCS],
    ],
)  # fmt: skip
DRUG = (
    ["drug_exposure_id", "person_id", "drug_concept_id", "drug_exposure_start_date",
     "drug_exposure_end_date", "drug_type_concept_id", "visit_occurrence_id",
     "drug_source_value", "drug_source_concept_id"],
    [
        [1, 1, LISINOPRIL, "2020-01-15", "2020-01-20", 32817, 12, "lis", 0],
        [2, 1, A10BA02, "2020-01-15", "2020-01-20", 32817, 12, "met", 0],  # itself ATC 5th
        [3, 1, COMBO, "2020-01-15", "2020-01-16", 32817, 11, "amlo/bena", 0],  # two classes
        [4, 1, SALINE, "2020-03-01", "2020-03-01", 32817, 10, "NaCl", 0],  # no ATC ancestor
        [5, 2, AMLODIPINE, "2021-06-01", "2021-06-03", 32817, 21, "amlo", 0],
        [6, 2, C09A, "2021-06-01", "2021-06-03", 32817, 21, "ACE", 0],  # itself ATC 3rd
        [7, 2, AMLODIPINE, "2021-06-01", "2021-06-02", 32817, 100, "amlo", 0],
        [8, 2, 0, "2021-06-01", "2021-06-02", 32817, 100, "unknown", 0],  # concept_id 0
        [9, 2, AMLODIPINE, "2021-06-01", "2021-06-02", 32817, "", "amlo", 0],  # no visit
        [10, 2, AMLODIPINE, "2021-06-01", "2021-06-02", 32817, 999, "amlo", 0],  # unknown
        [11, 1, LISINOPRIL, "2020-01-15", "2020-01-20", 32817, 12, "lis", 0],  # repeated
    ],
)  # fmt: skip
DDI = (
    ["drug_a", "drug_b"],
    [["C09A", "C08C"], ["C08C", "C09A"], ["A10B", "A10B"], ["C09A", "N02B"]],
)


def write_table(path: Path, table: tuple[list, list], delimiter: str = ",") -> Path:
    header, rows = table
    with path.open("w", newline="", encoding="utf-8") as handle:
        if delimiter == "\t":  # Athena: no quoting at all
            handle.writelines("\t".join(map(str, row)) + "\n" for row in [header, *rows])
        else:
            writer = csv.writer(handle, delimiter=delimiter)
            writer.writerows([header, *rows])
    return path


TABLES = {
    "person": PERSON,
    "visit_occurrence": VISIT,
    "condition_occurrence": CONDITION,
    "procedure_occurrence": PROCEDURE,
    "drug_exposure": DRUG,
}


def write_extract(folder: Path) -> Path:
    """The extract above: clinical tables as comma CSV, vocabulary as Athena writes it."""
    folder.mkdir(parents=True)
    for name, table in TABLES.items():
        write_table(folder / f"{name}.csv", table)
    write_table(folder / "CONCEPT.csv", CONCEPT, "\t")
    write_table(folder / "CONCEPT_ANCESTOR.csv", CONCEPT_ANCESTOR, "\t")
    return folder


ALL_TABLES = {**TABLES, "concept": CONCEPT, "concept_ancestor": CONCEPT_ANCESTOR}


def rewrite_tables(folder: Path, suffix: str, delimiter: str = ",") -> None:
    """Rewrite every table in ``folder`` as ``NAME`` + ``suffix`` (.parquet, .csv.gz, or .csv
    with ``delimiter``), upper-case names, rows shuffled."""
    rng = random.Random(0)
    for path in sorted(folder.iterdir()):
        path.unlink()
    for name, (header, body) in ALL_TABLES.items():
        body = list(body)
        rng.shuffle(body)
        target = folder / (name.upper() + suffix)
        if suffix == ".parquet":
            columns = [[None if v == "" else v for v in col] for col in zip(*body, strict=True)]
            pq.write_table(pa.table(dict(zip(header, columns, strict=True))), target)
        elif suffix == ".csv.gz":
            plain = write_table(folder / "plain.txt", (header, body), delimiter)
            with plain.open("rb") as src, gzip.open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            plain.unlink()
        else:
            write_table(target, (header, body), delimiter)
