"""Synthetic OMOP CDM extracts shaped like a hospital's, of any size, written chunk by chunk.

`generate_extract` writes person, visit_occurrence, condition/procedure/drug_exposure,
concept and concept_ancestor tables (Parquet, or CSV: comma-separated clinical tables and an
Athena-style vocabulary, tab-separated with YYYYMMDD dates) in little memory. The extract:
about 4 visits per person, 5 condition and 2 procedure rows per visit, drug rows spread over
90% of the visits (the other visits are to be recommended for), Zipf-like code frequencies,
a 3,000-drug RxNorm-like vocabulary under 150 ATC 3rd classes (10% combination drugs, 3%
without ATC), 1% of event rows without visit_occurrence_id, 0.5% with concept_id 0.

The tests convert it end to end at a tiny size; `cognet.benchmarks.omop_convert` times
`cognet data omop` on it at a large one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

N_CONDITIONS, N_PROCEDURES, N_DRUGS, N_ATC3 = 2000, 500, 3000, 150
CONDITIONS_PER_VISIT, PROCEDURES_PER_VISIT, VISITS_PER_PERSON = 5, 2, 4
CHUNK = 1_000_000  # rows generated and written at a time
CONDITION, SOURCE, PROCEDURE, PCS, DRUG, ATC3, ATC2 = (
    1_000_000,
    2_000_000,
    3_000_000,
    4_000_000,
    5_000_000,
    6_000_000,
    6_500_000,
)
EVENTS = (  # kind, rows per visit (None: --drug-rows), codes, standard and source concepts
    ("condition", CONDITIONS_PER_VISIT, N_CONDITIONS, CONDITION, SOURCE),
    ("procedure", PROCEDURES_PER_VISIT, N_PROCEDURES, PROCEDURE, PCS),
    ("drug", None, N_DRUGS, DRUG, 0),
)
VISIT_TYPES, VISIT_TYPE_P = [9201, 9202, 262], [0.6, 0.3, 0.1]
DAY_2010 = 14610  # 2010-01-01, days since 1970-01-01


class _Writer:
    """One table written piece by piece, as Parquet, or as CSV (comma, or tab for Athena)."""

    def __init__(self, path: Path, schema: pa.Schema, fmt: str, athena: bool = False):
        self.path, self.schema, self.athena = path.with_suffix(f".{fmt}"), schema, athena
        if fmt == "parquet":
            self._writer = pq.ParquetWriter(self.path, schema)
            return
        if athena:  # tab-separated, nothing quoted: pyarrow refuses a lone quote unquoted
            self._handle = self.path.open("w", encoding="utf-8", newline="")
            self._handle.write("\t".join(schema.names) + "\n")
            self._writer = None
        else:
            self._writer = pacsv.CSVWriter(self.path, schema)

    def write(self, columns: dict) -> None:
        table = pa.table(columns, schema=self.schema)
        if self._writer is not None:
            self._writer.write_table(table)
            return
        for row in zip(*(table[name].to_pylist() for name in self.schema.names), strict=True):
            self._handle.write("\t".join("" if v is None else str(v) for v in row) + "\n")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if hasattr(self, "_handle"):
            self._handle.close()


def _zipf(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Indices in [0, n) with Zipf-like frequencies (rank r drawn with odds 1 / (r + 10))."""
    weights = 1.0 / (np.arange(n) + 10.0)
    return rng.choice(n, size=size, p=weights / weights.sum())


def _with_nulls(rng: np.random.Generator, values: np.ndarray, share: float) -> pa.Array:
    return pa.array(values, mask=rng.random(len(values)) < share)


def write_vocabulary(folder: Path, rng: np.random.Generator, fmt: str) -> None:
    """concept and concept_ancestor: conditions and procedures with their source concepts,
    drugs, ATC 3rd classes (and the ATC 2nd above them)."""
    letters = np.array(list("ABCDGHJLMNPRSV"))
    atc3 = [f"{letters[i % 14]}{i // 14 % 100:02d}{'ABCDE'[i // 1400 % 5]}" for i in range(N_ATC3)]
    atc2 = sorted({code[:3] for code in atc3})
    rows = [  # concept_id, vocabulary_id, concept_class_id, concept_code
        *(
            (CONDITION + i, "SNOMED", "Clinical Finding", str(100000 + i))
            for i in range(N_CONDITIONS)
        ),
        *((SOURCE + i, "ICD10CM", "Billable Code", f"R{i:03d}") for i in range(N_CONDITIONS)),
        *((PROCEDURE + i, "SNOMED", "Procedure", str(700000 + i)) for i in range(N_PROCEDURES)),
        *((PCS + i, "ICD10PCS", "ICD10PCS", f"0{i:05d}Z") for i in range(N_PROCEDURES)),
        *((DRUG + i, "RxNorm", "Clinical Drug", str(300000 + i)) for i in range(N_DRUGS)),
        *((ATC3 + i, "ATC", "ATC 3rd", code) for i, code in enumerate(atc3)),
        *((ATC2 + i, "ATC", "ATC 2nd", code) for i, code in enumerate(atc2)),
    ]
    ids, vocabularies, classes, codes = (list(column) for column in zip(*rows, strict=True))
    schema = pa.schema(
        [
            ("concept_id", pa.int64()),
            ("concept_name", pa.string()),
            ("domain_id", pa.string()),
            ("vocabulary_id", pa.string()),
            ("concept_class_id", pa.string()),
            ("standard_concept", pa.string()),
            ("concept_code", pa.string()),
            ("valid_start_date", pa.string()),
            ("valid_end_date", pa.string()),
            ("invalid_reason", pa.string()),
        ]
    )
    writer = _Writer(folder / "CONCEPT", schema, fmt, athena=True)
    writer.write(
        {
            "concept_id": ids,
            "concept_name": [f'name "{c}' for c in codes],
            "domain_id": ["Drug" if v in ("RxNorm", "ATC") else "Condition" for v in vocabularies],
            "vocabulary_id": vocabularies,
            "concept_class_id": classes,
            "standard_concept": ["" if v in ("ICD10CM", "ICD10PCS") else "S" for v in vocabularies],
            "concept_code": codes,
            "valid_start_date": ["19700101"] * len(ids),
            "valid_end_date": ["20991231"] * len(ids),
            "invalid_reason": [""] * len(ids),
        }
    )
    writer.close()
    drugs = np.arange(N_DRUGS)
    first = rng.integers(0, N_ATC3, N_DRUGS)
    combo = rng.random(N_DRUGS) < 0.10
    second = (first + rng.integers(1, N_ATC3, N_DRUGS)) % N_ATC3
    mapped = rng.random(N_DRUGS) >= 0.03
    parent = np.array([atc2.index(code[:3]) for code in atc3])
    pairs = [
        (ATC3 + first[mapped], DRUG + drugs[mapped]),
        (ATC3 + second[mapped & combo], DRUG + drugs[mapped & combo]),
        (ATC2 + parent[first[mapped]], DRUG + drugs[mapped]),
        (DRUG + drugs, DRUG + drugs),
        (ATC3 + np.arange(N_ATC3), ATC3 + np.arange(N_ATC3)),
    ]
    up, down = (np.concatenate(side) for side in zip(*pairs, strict=True))
    schema = pa.schema(
        [
            ("ancestor_concept_id", pa.int64()),
            ("descendant_concept_id", pa.int64()),
            ("min_levels_of_separation", pa.int64()),
            ("max_levels_of_separation", pa.int64()),
        ]
    )
    writer = _Writer(folder / "CONCEPT_ANCESTOR", schema, fmt, athena=True)
    levels = np.where(up == down, 0, 2)
    writer.write(
        {
            "ancestor_concept_id": up,
            "descendant_concept_id": down,
            "min_levels_of_separation": levels,
            "max_levels_of_separation": levels,
        }
    )
    writer.close()


def _events(folder, rng, fmt, event: tuple, rows, visit_ids, persons) -> None:
    """``rows`` event rows (condition, procedure or drug) on visits drawn from ``visit_ids``;
    ``event``: its row of EVENTS (kind, rows per visit, codes, first standard and source
    concept ids)."""
    kind, _, n_codes, standard, source = event
    name = "drug_exposure" if kind == "drug" else f"{kind}_occurrence"
    schema = pa.schema(
        [
            (f"{name}_id", pa.int64()),
            ("person_id", pa.int64()),
            (f"{kind}_concept_id", pa.int64()),
            ("visit_occurrence_id", pa.int64()),
            (f"{kind}_source_concept_id", pa.int64()),
        ]
    )
    writer = _Writer(folder / name, schema, fmt)
    for start in range(0, rows, CHUNK):
        n = min(CHUNK, rows - start)
        code = _zipf(rng, n_codes, n)
        concept = np.where(rng.random(n) < 0.005, 0, standard + code)
        visit = visit_ids[rng.integers(0, len(visit_ids), n)]
        writer.write(
            {
                f"{name}_id": np.arange(start, start + n) + 1,
                "person_id": (visit - 1) % persons + 1,
                f"{kind}_concept_id": concept,
                "visit_occurrence_id": _with_nulls(rng, visit, 0.01),
                f"{kind}_source_concept_id": source + code if source else np.zeros(n, np.int64),
            }
        )
    writer.close()


def generate_extract(
    folder: Path, visits: int, drug_rows: int, seed: int = 0, fmt: str = "parquet"
) -> Path:
    """Write an OMOP CDM extract of ``visits`` visits and ``drug_rows`` drug_exposure rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_vocabulary(folder, rng, fmt)
    persons = max(1, visits // VISITS_PER_PERSON)
    writer = _Writer(
        folder / "person",
        pa.schema([("person_id", pa.int64()), ("year_of_birth", pa.int64())]),
        fmt,
    )
    writer.write(
        {"person_id": np.arange(1, persons + 1), "year_of_birth": rng.integers(1930, 2000, persons)}
    )
    writer.close()
    schema = pa.schema(
        [
            ("visit_occurrence_id", pa.int64()),
            ("person_id", pa.int64()),
            ("visit_concept_id", pa.int64()),
            ("visit_start_date", pa.date32()),
            ("visit_start_datetime", pa.timestamp("s")),
        ]
    )
    writer = _Writer(folder / "visit_occurrence", schema, fmt)
    for start in range(0, visits, CHUNK):
        ids = np.arange(start, min(start + CHUNK, visits)) + 1
        day = DAY_2010 + rng.integers(0, 3650, len(ids))
        seconds = day.astype(np.int64) * 86400 + rng.integers(0, 86400, len(ids))
        writer.write(
            {
                "visit_occurrence_id": ids,
                "person_id": (ids - 1) % persons + 1,
                "visit_concept_id": rng.choice(VISIT_TYPES, len(ids), p=VISIT_TYPE_P),
                "visit_start_date": pa.array(day.astype(np.int32), pa.date32()),
                "visit_start_datetime": _with_nulls(rng, seconds, 0.2).cast(pa.timestamp("s")),
            }
        )
    writer.close()
    every = np.arange(1, visits + 1)
    for event in EVENTS:
        per_visit = event[1]
        rows = drug_rows if per_visit is None else per_visit * visits
        on = every if per_visit else every[every % 10 != 0]  # 10% of visits get no drug
        _events(folder, rng, fmt, event, rows, on, persons)
    return folder
