"""OMOP CDM v5.4 -> a cognet dataset (DESIGN.md §2): one row per visit_occurrence.

Input: a folder with one file per table, found by table name in any case (``CONCEPT.csv``,
``visit_occurrence.csv.gz``, ``drug_exposure.parquet``; a table missing at the top level is
looked for one folder down), OHDSI column names in any case; the formats `tables.SourceTable`
reads. Only the columns used are required; visit_start_datetime is optional. Or a database
(a DuckDB file, PostgreSQL): `omop_db` reads its tables through the same steps below.

- Visits: patient_id = person_id, visit_id = visit_occurrence_id. visit_seq ranks a person's
  visits by visit_start_date, then visit_start_datetime, then the numeric visit_occurrence_id,
  among the visits of the kept types (``visit_concepts``) and of persons in ``person``; a visit
  dropped later (no condition and no procedure) leaves a gap.
- Codes: ``<vocabulary_id>/<concept_code>`` of condition_concept_id and procedure_concept_id
  (the OMOP-to-MEDS convention), or of the *_source_concept_id with ``source_codes``.
- Medications: the ``ATC 3rd`` concepts among the ancestors of drug_concept_id in
  concept_ancestor (a combination drug may give several), plus the drug concept itself when it
  is an ATC class. An ATC 4th / 5th class (as ancestor or as the drug itself) stands for its
  3rd-level class, the first four characters of its code: the same classes as a full
  concept_ancestor gives, and extracts that keep only the lowest ATC level work too.
  concept_class_id is matched in any case. A visit with no mapped drug gets medications =
  null: a visit to recommend for, not an empty prescription.
- Every row that gives nothing is counted under its reason (`tables.Step`): no
  visit_occurrence_id, a visit not in visit_occurrence, a visit dropped before, concept_id 0,
  a concept missing from concept, no ATC 3rd ancestor. Code lists are sorted; the output is
  deterministic whatever the row order of the files.

Memory: the clinical tables are streamed in record batches and reduced at once to integer
(visit, code) pairs; concept and concept_ancestor keep only the rows that matter (the concepts
in use, the ATC classes and their descendants). benchmarks/omop_convert.py measures it
(on an extract of `cognet.data.synth_omop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cognet.core.errors import InputError
from cognet.data.omop_db import DbOptions, open_cdm
from cognet.data.tables import (
    Report,
    SourceTable,
    Step,
    check_output,
    code_lists,
    dataset_counts,
    read_ddi_pairs,
    write_dataset,
)

CLINICAL = (
    "person",
    "visit_occurrence",
    "condition_occurrence",
    "procedure_occurrence",
    "drug_exposure",
)
VOCABULARY = ("concept", "concept_ancestor")
# concept_class_id (any case) of the ATC classes at or below the 3rd level: the first four
# characters of their code are their 3rd-level class
ATC_CLASSES = ("atc 3rd", "atc 4th", "atc 5th")
US_PER_DAY = 86_400_000_000
ROW_GROUP = 1 << 16
NO_DDI = "no --ddi file: ddi.parquet is empty, so the DDI graph and the DDI metrics will be empty"
NO_DRUGS = (
    "no drug_exposure row maps to an ATC 3rd class, so every visit would have medications = "
    "null and the dataset cannot train. The vocabulary needs the ATC classes and their "
    "descendants: download it from Athena (athena.ohdsi.org) with ATC selected, and include "
    "CONCEPT_ANCESTOR"
)


def parse_concept_ids(text: str | None) -> list[int] | None:
    """``"9201,262"`` -> [9201, 262]; None or blank -> None (every visit type)."""
    if text is None or not text.strip():
        return None
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if not item.isdigit()]
    if bad:
        raise InputError(f"--visit-concepts: {bad[0]!r} is not a concept id (e.g. 9201,262)")
    return sorted({int(item) for item in items})


# ---------------------------------------------------------------- visits


@dataclass
class Visits:
    """The kept visits in output order (person, then time), and a lookup from any
    visit_occurrence_id to its output position."""

    ids: np.ndarray  # int64 visit_occurrence_id
    persons: np.ndarray  # int64 person_id
    seq: np.ndarray  # int32 visit_seq
    every: np.ndarray  # every visit_occurrence_id of the table, sorted
    position: np.ndarray  # its output position, -1 when dropped (type, person)

    def locate(self, ids: np.ndarray) -> np.ndarray:
        """Output position of each id; -1 a dropped visit, -2 not in visit_occurrence."""
        if not len(self.every):
            return np.full(len(ids), -2, np.int64)
        at = np.minimum(np.searchsorted(self.every, ids), len(self.every) - 1)
        return np.where(self.every[at] == ids, self.position[at], -2)


def read_persons(table: SourceTable, steps: list[Step]) -> np.ndarray:
    ids = [
        table.ints(cols["person_id"], "person_id", start, required=True)[0]
        for start, cols in table.batches(["person_id"])
    ]
    ids = _cat(ids)
    persons = np.unique(ids)
    steps.append(
        Step(
            "person",
            len(ids),
            len(persons),
            "persons",
            {"repeating a person_id": len(ids) - len(persons)},
        ).ended()
    )
    return persons


def read_visits(
    table: SourceTable, persons: np.ndarray, visit_concepts: Sequence[int] | None, steps: list[Step]
) -> Visits:
    required = ["visit_occurrence_id", "person_id", "visit_start_date"]
    if visit_concepts is not None:
        required.append("visit_concept_id")
    parts: dict[str, list[np.ndarray]] = {}
    for start, cols in table.batches(required, ["visit_start_datetime"]):
        batch = {}
        for column, values in cols.items():
            read = table.times if "date" in column else table.ints
            batch[column], valid = read(values, column, start, required=column in required)
            if column == "visit_start_datetime":  # unknown: the start of its day
                batch[column] = np.where(valid, batch[column], batch["visit_start_date"])
            parts.setdefault(column, []).append(batch[column])
    cols = {c: _cat(parts.get(c, [])) for c in [*required, *parts]}  # none: no batch
    ids, person = cols["visit_occurrence_id"], cols["person_id"]
    order = np.argsort(ids, kind="stable")
    again = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if again.size:
        row, first = int(order[again[0] + 1]), int(order[again[0]])
        raise InputError(
            f"{table.where('visit_occurrence_id', row)}: visit_occurrence_id "
            f"{ids[row]} repeated (first at {table.row_name(first)})"
        )
    of_type = np.ones(len(ids), bool)
    if visit_concepts is not None:
        of_type = np.isin(cols["visit_concept_id"], np.asarray(visit_concepts, np.int64))
    known = np.isin(person, persons)
    day = cols["visit_start_date"] // US_PER_DAY
    time = cols.get("visit_start_datetime", np.zeros(len(ids), np.int64))
    kept = np.flatnonzero(of_type & known)
    kept = kept[np.lexsort((ids[kept], time[kept], day[kept], person[kept]))]
    first_of = np.ones(len(kept), bool)
    first_of[1:] = person[kept][1:] != person[kept][:-1]
    first_of = np.maximum.accumulate(np.where(first_of, np.arange(len(kept)), 0))
    position = np.full(len(ids), -1, np.int64)
    position[kept] = np.arange(len(kept))
    dropped = {
        "of other visit types (--visit-concepts)": int((~of_type).sum()),
        "of a person not in person": int((of_type & ~known).sum()),
    }
    steps.append(Step("visit_occurrence", len(ids), len(kept), "visits", dropped).ended())
    seq = (np.arange(len(kept)) - first_of).astype(np.int32)
    return Visits(ids[kept], person[kept], seq, ids[order], position[order])


VISIT_REASONS = (
    "without visit_occurrence_id",
    "of a visit not in visit_occurrence",
    "of a visit dropped above",
    "with concept_id 0",
)


def _rows(table: SourceTable, cols: dict, concept: str, visits: Visits, start: int, step: Step):
    """(visit positions, concept ids) of a batch's rows that name a kept visit and a
    concept; the others are counted in ``step``."""
    ids, has = table.ints(cols["visit_occurrence_id"], "visit_occurrence_id", start)
    concepts, known = table.ints(cols[concept], concept, start)
    pos = visits.locate(ids)
    zero = ~known | (concepts == 0)
    step.rows += len(ids)
    for reason, rows in zip(
        VISIT_REASONS,
        (~has, has & (pos == -2), has & (pos == -1), has & (pos >= 0) & zero),
        strict=True,
    ):
        step.dropped[reason] += int(rows.sum())
    live = has & (pos >= 0) & ~zero
    return pos[live], concepts[live]


def read_events(table: SourceTable, concept: str, visits: Visits, name: str):
    """(visit positions, concept ids) of a table's usable rows, and its step so far."""
    step = Step.counting(name, "coded", VISIT_REASONS)
    parts = [
        _rows(table, cols, concept, visits, start, step)
        for start, cols in table.batches(["visit_occurrence_id", concept])
    ]
    return _cat([p for p, _ in parts]), _cat([c for _, c in parts]), step


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


# ---------------------------------------------------------------- vocabulary


@dataclass
class Vocabulary:
    """The concept rows that matter: the concepts in use (their tokens) and the ATC classes."""

    ids: np.ndarray  # int64 concept ids in use, sorted
    tokens: np.ndarray  # "<vocabulary_id>/<concept_code>" of each (object)
    atc_ids: np.ndarray  # int64 ATC 3rd / 4th / 5th concept ids
    atc_codes: np.ndarray  # the ATC-3 code of each: its concept_code, cut to 4 characters


def read_concepts(table: SourceTable, needed: np.ndarray, steps: list[Step]) -> Vocabulary:
    columns = ["concept_id", "vocabulary_id", "concept_class_id", "concept_code"]
    parts: dict[str, list] = {c: [] for c in columns}
    rows = 0
    for start, cols in table.batches(columns):
        ids = table.ints(cols["concept_id"], "concept_id", start, required=True)[0]
        text = {c: table.text(cols[c]) for c in columns[1:]}
        text["concept_class_id"] = pc.utf8_lower(text["concept_class_id"])
        atc = pc.is_in(text["concept_class_id"], pa.array(ATC_CLASSES))
        want = np.isin(ids, needed) | atc.to_numpy(zero_copy_only=False)
        take = pa.array(np.flatnonzero(want))
        for column in ("vocabulary_id", "concept_code"):  # required of the rows used
            table.require(pc.if_else(pa.array(want), text[column], "-"), column, start)
        parts["concept_id"].append(ids[want])
        for column, values in text.items():
            parts[column].append(values.take(take).to_numpy(zero_copy_only=False))
        rows += len(ids)
    ids, first = np.unique(_cat(parts["concept_id"]), return_index=True)  # first row wins
    vocab, klass, code = (np.concatenate(parts[c])[first] for c in columns[1:])
    used = np.isin(ids, needed)
    atc = np.isin(klass, ATC_CLASSES) & (np.array([len(c) for c in code], int) >= 4)
    rows = table.rows_read(rows)
    steps.append(Step("concept", rows, int((used | atc).sum()), "kept (codes in use, ATC)").ended())
    tokens = np.array([f"{v}/{c}" for v, c in zip(vocab[used], code[used], strict=True)], object)
    atc_codes = np.array([c[:4] for c in code[atc]], object)
    return Vocabulary(ids[used], tokens, ids[atc], atc_codes)


def resolve_codes(
    positions: np.ndarray, concepts: np.ndarray, vocab: Vocabulary, step: Step
) -> tuple[np.ndarray, list[str]]:
    """Sorted distinct keys ``position * len(tokens) + token`` of the rows whose concept is
    in concept (the others are counted in ``step``), and the tokens, sorted."""
    tokens, rank = np.unique(vocab.tokens.astype(str), return_inverse=True)
    at = np.minimum(np.searchsorted(vocab.ids, concepts), max(len(vocab.ids) - 1, 0))
    found = vocab.ids[at] == concepts if len(vocab.ids) else np.zeros(len(concepts), bool)
    step.dropped["with a concept_id not in concept"] = int((~found).sum())
    step.close()
    keys = positions[found] * max(len(tokens), 1) + rank[at[found]]
    return np.unique(keys), [str(t) for t in tokens]


def read_atc_map(
    table: SourceTable, vocab: Vocabulary, steps: list[Step]
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(concept ids, medication index) pairs sorted by concept, and the medications (ATC-3
    codes, sorted): the 3rd-level class of each ATC ancestor of a concept (its ATC 3rd
    ancestors, in a full concept_ancestor), and of the ATC classes themselves."""
    medications = sorted(set(vocab.atc_codes))
    index = {code: i for i, code in enumerate(medications)}
    order = np.argsort(vocab.atc_ids)
    atc_ids = vocab.atc_ids[order]
    atc_med = np.array([index[c] for c in vocab.atc_codes[order]], np.int64)
    ancestors, descendants, rows = [], [], 0
    for start, cols in table.batches(["ancestor_concept_id", "descendant_concept_id"]):
        up, down = (table.ints(cols[c], c, start, required=True)[0] for c in cols)
        hit = np.isin(up, atc_ids)
        ancestors.append(up[hit])
        descendants.append(down[hit])
        rows += len(up)
    ancestors, descendants = _cat(ancestors), _cat(descendants)
    rows = table.rows_read(rows)
    steps.append(Step("concept_ancestor", rows, len(ancestors), "with an ATC ancestor").ended())
    concepts = np.concatenate([atc_ids, descendants])
    meds = np.concatenate([atc_med, atc_med[np.searchsorted(atc_ids, ancestors)]])
    pairs = np.unique(np.stack([concepts, meds], axis=1), axis=0)  # sorted by concept
    return pairs[:, 0], pairs[:, 1], medications


def read_drugs(
    table: SourceTable, visits: Visits, concepts: np.ndarray, meds: np.ndarray, n_med: int
) -> tuple[np.ndarray, Step]:
    """Sorted distinct keys ``position * n_med + medication`` of the drug_exposure rows."""
    step = Step.counting("drug_exposure", "mapped to ATC-3", VISIT_REASONS)
    step.dropped["with no ATC 3rd ancestor"] = 0
    keys = []
    for start, cols in table.batches(["visit_occurrence_id", "drug_concept_id"]):
        pos, drugs = _rows(table, cols, "drug_concept_id", visits, start, step)
        left = np.searchsorted(concepts, drugs, "left")
        count = np.searchsorted(concepts, drugs, "right") - left
        step.dropped["with no ATC 3rd ancestor"] += int((count == 0).sum())
        ends = np.cumsum(count)
        at = np.repeat(left - (ends - count), count) + np.arange(ends[-1] if len(ends) else 0)
        keys.append(np.unique(np.repeat(pos, count) * n_med + meds[at]))
    return np.unique(_cat(keys)), step.close()


# ---------------------------------------------------------------- the conversion


def build_omop(
    cdm: str | Path,
    out: str | Path,
    ddi: str | Path | None = None,
    visit_concepts: Sequence[int] | None = None,
    source_codes: bool = False,
    *,
    database: DbOptions = DbOptions(),
    allow_no_medications: bool = False,
) -> Report:
    """Convert the OMOP CDM in ``cdm`` into ``out`` (visits.parquet, ddi.parquet,
    summary.json). ``cdm`` is a folder of table files or a database (`omop_db`: a DuckDB file
    or URL, a PostgreSQL URL, read as ``database`` says: its schemas and the longest waits on
    the server, by default the schema cdm for every table, 30 s to connect and an hour per
    statement). Raises InputError, naming the file or table, column and row, for a missing
    table or column or an unreadable value, when OUT would overwrite an input, and when no drug
    maps to ATC-3 (unless ``allow_no_medications``)."""
    column = "_source_concept_id" if source_codes else "_concept_id"
    cdm_schema = database.cdm_schema
    vocab_schema = database.vocab_schema or cdm_schema
    schemas = dict.fromkeys(CLINICAL, cdm_schema) | dict.fromkeys(VOCABULARY, vocab_schema)
    events = {f"{k}_occurrence": k + column for k in ("condition", "procedure")}
    timeouts = database.timeouts
    with open_cdm(cdm, CLINICAL + VOCABULARY, schemas, events, ATC_CLASSES, timeouts) as source:
        return _convert(source, Path(out), ddi, visit_concepts, column, allow_no_medications)


def _convert(source, out, ddi, visit_concepts, column, allow_no_medications) -> Report:
    """`build_omop` on the opened tables; ``column`` is the suffix of the event concepts."""
    tables, cdm = source.tables, source.shown
    inputs = list(source.inputs)
    if ddi is not None:
        inputs.append(SourceTable(Path(ddi)).path)
    check_output(out, inputs)
    steps: list[Step] = []
    persons = read_persons(tables["person"], steps)
    visits = read_visits(tables["visit_occurrence"], persons, visit_concepts, steps)
    events = {
        kind: read_events(tables[f"{kind}_occurrence"], kind + column, visits, f"{kind}_occurrence")
        for kind in ("condition", "procedure")
    }
    vocab = read_concepts(
        tables["concept"], np.unique(_cat([e[1] for e in events.values()])), steps
    )
    lists = {}
    for kind, name in (("condition", "diagnoses"), ("procedure", "procedures")):
        positions, concepts, step = events.pop(kind)  # the rows go once reduced to keys
        lists[name] = resolve_codes(positions, concepts, vocab, step)
        steps.append(step)
    del positions, concepts
    concepts, meds, medications = read_atc_map(tables["concept_ancestor"], vocab, steps)
    keys, step = read_drugs(tables["drug_exposure"], visits, concepts, meds, len(medications))
    source.release()  # every table is read: a database's memory goes before the peak below
    steps.append(step)
    lists["medications"] = (keys, medications)
    table = visits_table(visits, lists)
    steps.append(
        Step(
            "visits",
            len(visits.ids),
            table.num_rows,
            "written",
            {"without a condition or procedure": len(visits.ids) - table.num_rows},
        ).ended()
    )
    if table.num_rows == 0:
        raise InputError(
            f"{cdm}: no visit has a condition or procedure code; "
            + "; ".join(s.line() for s in steps)
        )
    used = set(pc.unique(pc.list_flatten(table["medications"])).to_pylist())
    warnings, pairs = [], []
    if not used:
        if not allow_no_medications:
            raise InputError(
                f"{cdm}: {NO_DRUGS}; or pass --allow-no-medications to write the "
                "dataset anyway, for scoring only"
            )
        warnings.append(NO_DRUGS)
    if ddi is None:
        warnings.append(NO_DDI)
    else:
        pairs, step = read_ddi_pairs(Path(ddi), used)
        steps.append(step)
    report = Report("omop", out, steps, dataset_counts(table, len(pairs)), warnings)
    return write_dataset(report, table, pairs, row_group_size=ROW_GROUP)


def visits_table(visits: Visits, lists: dict[str, tuple[np.ndarray, list[str]]]) -> pa.Table:
    """The contract columns (no split) of the visits with a condition or procedure code."""
    columns = {
        "patient_id": pa.array(visits.persons).cast(pa.string()),
        "visit_id": pa.array(visits.ids).cast(pa.string()),
        "visit_seq": pa.array(visits.seq, pa.int32()),
    }
    counts = {}
    for name, (keys, codes) in lists.items():
        columns[name], counts[name] = code_lists(
            keys, codes, len(visits.ids), name == "medications"
        )
    coded = (counts["diagnoses"] + counts["procedures"]) > 0
    return pa.table(columns).filter(pa.array(coded))
