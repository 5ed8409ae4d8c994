"""The field's benchmark files (records_final, voc_final, ddi_A_final) as a cognet dataset.

GAMENet, SafeDrug, COGNet, MICRON, MoleRec and most later papers ship or expect three
pickles (read by `cognet.data.pickles`, where nothing in them runs):

- records: patients -> visits -> [diagnosis ids, procedure ids, medication ids], some
  versions with a fourth field per visit (a numpy float weight, dropped here);
- vocabularies: a dict of `diag_voc`, `pro_voc`, `med_voc`, each with `idx2word`;
- DDI: a 0/1 matrix over medication ids.

The records carry no ids, so they are made from list positions: patient i (0-based) is
`patient_id` "i", its visit j is `visit_id` "i-j" with `visit_seq` j. Codes become the
vocabularies' words. The papers' split is by patient position: the first two thirds train
(`int(n * 2 / 3)`), then half of the rest, rounded down, test and the remainder validation
(`test-first`, SafeDrug's and COGNet's order), or validation first (`val-first`).

The files are checked whole and refused at the first problem, so no visit is dropped; the
report (`tables.Report`, in ``OUT/summary.json``) counts the visits and the DDI matrix's
entries kept and dropped, and the dataset per split.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from cognet.core.dataset import CODE_COLUMNS, VISITS_SCHEMA
from cognet.core.errors import InputError
from cognet.data.pickle_bounds import printable, shown
from cognet.data.pickles import Voc, describe, load
from cognet.data.tables import Report, Step, dataset_counts, write_dataset

VOCABULARIES = ("diag_voc", "pro_voc", "med_voc")  # in the order of a visit's fields
SPLIT_ORDERS = ("test-first", "val-first")
MAX_ID = 1 << 31
# ICD-9 and ICD-10 diagnoses and procedures (4019, V5861, E119, 3961, 0210093), with or
# without a dot: checked by characters and length only
ICD = re.compile(r"[A-Z0-9][A-Z0-9.]{1,7}")
ATC_LEVELS = {  # medications: every code of med_voc at the level of its first
    3: re.compile(r"[A-Z][0-9]{2}[A-Z]"),
    4: re.compile(r"[A-Z][0-9]{2}[A-Z]{2}"),
    5: re.compile(r"[A-Z][0-9]{2}[A-Z]{2}[0-9]{2}"),
}


def build_benchmark(
    records: str | os.PathLike,
    voc: str | os.PathLike,
    ddi: str | os.PathLike,
    out: str | os.PathLike,
    split_order: str = "test-first",
) -> Report:
    """Read the three files, check them whole, then write OUT/visits.parquet, ddi.parquet and
    summary.json.

    Raises `InputError` naming the file and position (patient i, visit j, field) of the first
    problem, before anything is written."""
    if split_order not in SPLIT_ORDERS:
        raise ValueError(f"split_order {split_order!r}; expected one of {SPLIT_ORDERS}")
    words = read_vocabularies(voc)
    pairs, warnings, ddi_step = read_ddi_matrix(ddi, words["med_voc"])
    table = read_records(records, words, split_order)
    steps = [Step("records", table.num_rows, table.num_rows, "visits").ended(), ddi_step]
    splits = np.asarray(table["split"].to_pylist())
    patients = np.asarray(table["patient_id"].to_pylist())
    dataset = dataset_counts(table, len(pairs))
    for split in ("train", "val", "test"):
        dataset[f"{split}_patients"] = len(set(patients[splits == split]))
        dataset[f"{split}_visits"] = int((splits == split).sum())
    dataset.update({name: len(idx2word) for name, idx2word in words.items()})
    return write_dataset(Report("benchmark", Path(out), steps, dataset, warnings), table, pairs)


def _is_id(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def read_vocabularies(path: str | os.PathLike) -> dict[str, dict[int, str]]:
    """{diag_voc, pro_voc, med_voc: {id: word}} of voc_final.pkl, each checked: ids in
    [0, 2^31), distinct words of the vocabulary's form (`_check_words`), and `word2idx`
    (when there) the inverse of `idx2word`."""
    content = load(path)
    path = printable(str(path), 400)
    if not isinstance(content, dict):
        raise InputError(f"{path}: expected a dict of vocabularies, got {describe(content)}")
    words = {}
    for name in VOCABULARIES:
        voc = content.get(name)
        if not isinstance(voc, Voc) or not isinstance(voc.idx2word, dict):
            raise InputError(f"{path}: {name}: missing, or not a Voc with idx2word")
        idx2word = {}
        for index, word in voc.idx2word.items():
            if not (_is_id(index) and 0 <= index < MAX_ID) or not isinstance(word, str):
                raise InputError(
                    f"{path}: {name}: entry {shown(index)}: {shown(word)} is not id -> word"
                )
            idx2word[int(index)] = word
        _check_words(idx2word, f"{path}: {name}", name == "med_voc")
        _check_inverse(voc.word2idx, idx2word, f"{path}: {name}")
        words[name] = idx2word
    return words


def _check_inverse(word2idx: object, idx2word: dict[int, str], where: str) -> None:
    """InputError unless `word2idx` (when there) is the inverse of `idx2word`, its values
    ids: an array value would compare element by element and fail as a ValueError."""
    if word2idx is None:
        return
    if not isinstance(word2idx, dict):
        raise InputError(f"{where}: word2idx is {describe(word2idx)}, not a dict")
    for word, index in word2idx.items():
        if not isinstance(word, str) or not _is_id(index):
            raise InputError(
                f"{where}: word2idx entry {shown(word)}: {shown(index)} is not word -> id"
            )
    if {word: int(index) for word, index in word2idx.items()} != {
        word: index for index, word in idx2word.items()
    }:
        raise InputError(f"{where}: word2idx is not the inverse of idx2word")


def _check_words(idx2word: dict[int, str], where: str, medications: bool) -> None:
    """Codes by form: medications ATC codes all of one level (that of the lowest id's),
    diagnoses and procedures ICD codes by characters and length; no word twice."""
    form, kind = ICD, "an ICD code (2 to 8 capitals, digits or dots)"
    if medications and idx2word:
        first = idx2word[min(idx2word)]
        level = next((n for n, atc in ATC_LEVELS.items() if atc.fullmatch(first)), 3)
        form, kind = ATC_LEVELS[level], f"an ATC code of level {level}, as the file's first"
    for index, word in idx2word.items():
        if not form.fullmatch(word):
            raise InputError(f"{where}: id {index}: {shown(word)} is not {kind}")
    if len(set(idx2word.values())) != len(idx2word):
        raise InputError(f"{where}: a word appears under two ids")


def read_ddi_matrix(path: str | os.PathLike, meds: dict[int, str]) -> tuple[list, list[str], Step]:
    """The interacting pairs (word of a, word of b), a < b, of ddi_A_final.pkl, warnings, and
    the step: the matrix's marked entries and what became of them.

    The matrix is n x n over med_voc's ids 0..n-1, of 0s and 1s. An asymmetric entry counts
    as an interaction (the pair is unordered), a diagonal one is dropped; both are warned."""
    matrix = load(path)
    path = printable(str(path), 400)
    n = len(meds)
    if not isinstance(matrix, np.ndarray) or matrix.shape != (n, n):
        shape = matrix.shape if isinstance(matrix, np.ndarray) else describe(matrix)
        raise InputError(f"{path}: expected a {n} x {n} matrix (med_voc's size), got {shape}")
    if sorted(meds) != list(range(n)):
        raise InputError(f"{path}: med_voc's ids are not 0..{n - 1}, the matrix's rows")
    bad = np.argwhere((matrix != 0) & (matrix != 1))
    if len(bad):
        a, b = map(int, bad[0])
        raise InputError(f"{path}: row {a}, column {b}: value {matrix[a, b]}, expected 0 or 1")
    linked = matrix != 0
    warnings = []
    asymmetric = int(np.triu(linked != linked.T).sum())
    if asymmetric:
        warnings.append(
            f"{path}: {asymmetric} pair(s) marked in one direction only; kept as interacting"
        )
    if linked.diagonal().any():
        warnings.append(
            f"{path}: {int(linked.diagonal().sum())} diagonal entries (a drug with itself) dropped"
        )
    upper = np.argwhere(np.triu(linked | linked.T, k=1))
    dropped = {
        "the mirror of a pair's other entry": int(np.triu(linked & linked.T, k=1).sum()),
        "on the diagonal (a drug with itself)": int(linked.diagonal().sum()),
    }
    step = Step("ddi_A_final", int(linked.sum()), 0, "interacting pairs", dropped).close()
    return [(meds[int(a)], meds[int(b)]) for a, b in upper], warnings, step


def split_names(n_patients: int, split_order: str) -> list[str]:
    """The split of each patient position: the papers' order (see the module docstring)."""
    split_point = int(n_patients * 2 / 3)
    eval_len = int((n_patients - split_point) / 2)
    first, rest = ("test", "val") if split_order == "test-first" else ("val", "test")
    names = ["train"] * split_point + [first] * eval_len
    return names + [rest] * (n_patients - len(names))


def _codes(ids: object, words: dict[int, str], vocabulary: str, where: str) -> list[str]:
    if not isinstance(ids, (list, tuple)):
        raise InputError(f"{where}: expected a list of ids, got {describe(ids)}")
    codes = []
    for k, index in enumerate(ids):
        if not _is_id(index):
            raise InputError(f"{where}, item {k}: {describe(index)} {shown(index)} is not an id")
        word = words.get(int(index)) if -MAX_ID < index < MAX_ID else None
        if word is None:
            raise InputError(f"{where}, item {k}: id {shown(index)} is not in {vocabulary}")
        codes.append(word)
    seen: set[str] = set()
    for k, code in enumerate(codes):  # the field's files have none: see benchmark-files.md
        if code in seen:
            raise InputError(f"{where}, item {k}: id {int(ids[k])} appears twice in the visit")
        seen.add(code)
    return codes


def read_records(
    path: str | os.PathLike, words: dict[str, dict[int, str]], split_order: str
) -> pa.Table:
    """The visits of records_final.pkl in the contract's columns (VISITS_SCHEMA)."""
    patients = load(path)
    path = printable(str(path), 400)
    if not isinstance(patients, (list, tuple)) or not patients:
        raise InputError(f"{path}: expected a non-empty list of patients, got {describe(patients)}")
    splits = split_names(len(patients), split_order)
    columns: dict[str, list] = {name: [] for name in VISITS_SCHEMA.names}
    for i, visits in enumerate(patients):
        if not isinstance(visits, (list, tuple)) or not visits:
            raise InputError(f"{path}: patient {i}: expected a non-empty list of visits")
        for j, visit in enumerate(visits):
            _visit_row(columns, visit, words, f"{path}: patient {i}, visit {j}")
            columns["patient_id"].append(str(i))
            columns["visit_id"].append(f"{i}-{j}")
            columns["visit_seq"].append(j)
            columns["split"].append(splits[i])
    return pa.table(columns, schema=VISITS_SCHEMA)


def _visit_row(columns: dict[str, list], visit: object, words: dict, where: str) -> None:
    if not isinstance(visit, (list, tuple)) or len(visit) not in (3, 4):
        size = len(visit) if isinstance(visit, (list, tuple)) else describe(visit)
        raise InputError(
            f"{where}: expected [diagnoses, procedures, medications] (and an optional weight), "
            f"got {size}{' fields' if isinstance(size, int) else ''}"
        )
    fields: Sequence = visit[:3]  # a fourth field (a weight) is dropped
    codes = [
        _codes(ids, words[vocabulary], vocabulary, f"{where}, {column}")
        for column, vocabulary, ids in zip(CODE_COLUMNS, VOCABULARIES, fields, strict=True)
    ]
    if not codes[0] and not codes[1]:
        raise InputError(f"{where}: diagnoses and procedures are both empty")
    for column, values in zip(CODE_COLUMNS, codes, strict=True):
        columns[column].append(values)
