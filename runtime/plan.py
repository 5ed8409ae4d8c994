"""Row planning, the first stage of scoring (plan -> encode -> decode -> emit): which rows of
a chunk are scored, rejected or skipped, their code ids and histories (numpy, vectorised).

A visit's history is its patient's earlier rows with known medications (the last
`max_history` of them when set). Every row that is scored or serves as history is encoded
once (`encode_rows`: `cognet.runtime.encoder`); the decoder-init inputs of each batch are
gathered from those encodings (`encoder.init_index`).

Row statuses, checked in this order (the first that applies):
- rejected `missing_key`: null patient_id, visit_id or visit_seq;
- rejected `duplicate_visit_id`: a visit_id seen earlier in the input (the first is kept);
- rejected `too_many_codes`: more than `max_codes` distinct known codes of one kind
  (diagnoses, procedures or medications), asked for or not: such a row is no history either;
- skipped: not asked for (medications known, without `score_all`; outside `--split`);
- rejected `no_codes`: neither a diagnosis nor a procedure;
- rejected `unknown_codes`: none of its diagnoses or procedures is in the vocabulary;
- scored.
Rejected and skipped rows with known medications and a valid key still serve as history,
but those with too many codes. Code lists are sets: duplicates collapse (the first stays)
before anything counts them. Unknown codes of kept rows are dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cognet.core.ragged import Ragged
from cognet.core.vocab import Vocab
from cognet.runtime.reader import ASKED, HashSet, patient_starts, string_hashes

SCORED, REJECTED, SKIPPED = 0, 1, 2
REASONS = ("missing_key", "duplicate_visit_id", "no_codes", "unknown_codes", "too_many_codes")


@dataclass(frozen=True)
class Spans:
    """Per item i, the slice rows[start[i]:end[i]] of one array: each target's history, a
    run of the chunk's history rows (kept as bounds, not one array per target)."""

    rows: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def __len__(self) -> int:
        return self.start.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows[self.start[i] : self.end[i]]

    def __iter__(self):
        bounds = zip(self.start.tolist(), self.end.tolist(), strict=True)
        return (self.rows[a:b] for a, b in bounds)

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start

    def take(self, items: np.ndarray) -> Ragged:
        """The spans of `items`, in that order, as one ragged array."""
        lengths = self.lengths[items]
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        at = np.repeat(self.start[items] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Ragged(self.rows[at], offsets)

    def sums(self, weights: np.ndarray) -> np.ndarray:
        """Per item: the sum of weights[row] over its rows (prefix sums, no loop)."""
        prefix = np.zeros(self.rows.size + 1, weights.dtype)
        np.cumsum(weights[self.rows], out=prefix[1:])
        return prefix[self.end] - prefix[self.start]

    def covered(self) -> np.ndarray:
        """The rows some span holds."""
        depth = np.cumsum(
            np.bincount(self.start, minlength=self.rows.size + 1)
            - np.bincount(self.end, minlength=self.rows.size + 1)
        )
        return self.rows[depth[:-1] > 0]


def encode_codes(
    column: pa.ChunkedArray | pa.Array, codes: tuple[str, ...], order: np.ndarray | None = None
) -> tuple[Ragged, np.ndarray, np.ndarray]:
    """Vocabulary ids of a list<string> column, as `Vocab.encode` per row (known codes,
    duplicates dropped, first occurrence order) or sorted by `order[id]` when given.

    Returns (ids, unknown [rows] codes dropped, given [rows] codes in the input); null lists
    and null or empty codes count as empty lists / unknown codes.
    """
    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(lists)
    flat = pc.list_flatten(lists)
    parent = pc.list_parent_indices(lists).to_numpy().astype(np.int64)
    ids = pc.index_in(flat, value_set=pa.array(codes, pa.string())).fill_null(-1)
    ids = ids.to_numpy(zero_copy_only=False).astype(np.int64)
    given = np.bincount(parent, minlength=n)
    known = ids >= 0
    unknown = given - np.bincount(parent[known], minlength=n)
    parent, ids = parent[known], ids[known]
    # one stable sort on (row, id), or (row, rank) when ordered: far faster than np.lexsort;
    # a repeated (row, id) lands right after its first occurrence, which stays
    key = (
        parent * (len(codes) + 1) + ids if order is None else parent * (order.size + 1) + order[ids]
    )
    by = np.argsort(key, kind="stable")
    ranked = key[by]
    repeat = np.zeros(key.size, bool)
    repeat[1:] = ranked[1:] == ranked[:-1]
    if order is None:  # first occurrence order
        dropped = np.zeros(key.size, bool)
        dropped[by[repeat]] = True
        keep = np.flatnonzero(~dropped)
    else:
        keep = by[~repeat]
    parent, ids = parent[keep], ids[keep]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(parent, minlength=n), out=offsets[1:])
    return Ragged(ids, offsets), unknown, given


def rare_first_rank(vocab: Vocab) -> np.ndarray:
    """rank[id]: position of each medication in the rare-first order (`Vocab.rare_first`)."""
    order = sorted(range(vocab.n_med), key=lambda i: (vocab.med_frequency[i], vocab.medications[i]))
    rank = np.empty(vocab.n_med, np.int64)
    rank[order] = np.arange(vocab.n_med)
    return rank


# The history-slot buckets of the candidate decoding orders (`Plan.decode_orders`): None,
# exact slot counts; k, floor(k log2(1 + slots)) (buckets 2^(1/k) wide: 19% at 4, 41% at 2).
# Short histories (many equal slot counts) pad least by buckets (BENCHMARKS.md "What was tried").
SLOT_BUCKETS = (None, 4, 2)


@dataclass
class Plan:
    """What to do with the rows of one chunk (row = position in the chunk)."""

    table: pa.Table  # the chunk (reader.INPUT_SCHEMA + ROW)
    status: np.ndarray  # int8 [rows]: SCORED, REJECTED or SKIPPED
    reason: np.ndarray  # int8 [rows]: index into REASONS for rejected rows, else -1
    diag: Ragged
    proc: Ragged
    meds: Ragged  # known medications, rare-first (empty when unknown)
    has_meds: np.ndarray  # bool [rows]
    targets: np.ndarray  # int64: rows to score, in chunk order
    histories: Spans  # per target: history rows, oldest first
    encode_rows: np.ndarray  # int64: rows to run through the encoder (targets + histories)
    unknown_codes: int  # codes dropped from kept rows
    codes_given: int  # codes of those rows, known or not (the share unknown: a warning)

    @property
    def rows(self) -> int:
        return len(self.table)

    def counts(self) -> dict[str, int]:
        return {
            "scored": int((self.status == SCORED).sum()),
            "rejected": int((self.status == REJECTED).sum()),
            "skipped": int((self.status == SKIPPED).sum()),
        }

    def reject_reasons(self) -> dict[str, int]:
        found = np.bincount(self.reason[self.reason >= 0], minlength=len(REASONS))
        return {r: int(c) for r, c in zip(REASONS, found, strict=True) if c}

    def decode_orders(self) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        """Candidate orders of the targets (indices into `targets`) for cutting the decoder's
        batches, each with the padded widths of its visits in that order (history slots,
        diagnoses, procedures): by history slots, exactly or in buckets (`SLOT_BUCKETS`),
        then by code count. A batch pads every visit's memories to its longest on each
        axis; exact slots leave the code lists unsorted among visits of close histories,
        buckets sort them at the price of some slots (`batches.least_padded` chooses)."""
        slots = self.histories.sums(self.meds.lengths)
        diag, proc = self.diag.lengths[self.targets], self.proc.lengths[self.targets]
        orders = []
        for k in SLOT_BUCKETS:
            key = slots if k is None else np.floor(np.log2(1 + slots) * k).astype(np.int64)
            order = np.lexsort((diag + proc, key))
            orders.append((order, [slots[order], diag[order], proc[order]]))
        return orders


class Assembler:
    """Plans chunks in stream order; remembers visit_ids across chunks (duplicates)."""

    def __init__(
        self,
        vocab: Vocab,
        score_all: bool = False,
        max_history: int | None = None,
        max_codes: int | None = None,
    ):
        if max_history is not None and max_history < 0:
            raise ValueError("max_history must be >= 0")
        self.vocab = vocab
        self.score_all = score_all
        self.max_history = max_history
        self.max_codes = max_codes
        self._visit_ids = HashSet()
        self._rank = rare_first_rank(vocab)

    def keys(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(missing key, duplicate visit_id) bool [rows]; remembers the visit_ids."""
        missing = ~np.asarray(
            pc.and_(
                pc.and_(table["patient_id"].is_valid(), table["visit_id"].is_valid()),
                table["visit_seq"].is_valid(),
            )
        )
        duplicate = np.zeros(len(table), bool)
        ok = np.flatnonzero(~missing)
        if ok.size:
            vid = table["visit_id"].take(pa.array(ok))
            duplicate[ok] = self._visit_ids.add(string_hashes(vid))
        return missing, duplicate

    def plan(self, table: pa.Table) -> Plan:
        vocab = self.vocab
        n = len(table)
        missing, duplicate = self.keys(table)
        diag, unk_d, given_d = encode_codes(table["diagnoses"], vocab.diagnoses)
        proc, unk_p, given_p = encode_codes(table["procedures"], vocab.procedures)
        meds, unk_m, given_m = encode_codes(table["medications"], vocab.medications, self._rank)
        has_meds = table["medications"].is_valid().to_numpy(zero_copy_only=False)

        reason = np.full(n, -1, np.int8)
        unusable = missing | duplicate
        if self.max_codes is not None:
            most = np.maximum(np.maximum(diag.lengths, proc.lengths), meds.lengths)
            too_many = ~unusable & (most > self.max_codes)
            reason[too_many] = REASONS.index("too_many_codes")
            unusable |= too_many  # neither scored nor history
        reason[duplicate] = REASONS.index("duplicate_visit_id")
        reason[missing] = REASONS.index("missing_key")
        asked = ~unusable & (self.score_all | ~has_meds)
        if ASKED in table.column_names:  # --split: the other splits are history only
            asked &= table[ASKED].to_numpy(zero_copy_only=False)
        no_codes = asked & (given_d + given_p == 0)
        unknown = asked & ~no_codes & (diag.lengths + proc.lengths == 0)
        reason[no_codes] = REASONS.index("no_codes")
        reason[unknown] = REASONS.index("unknown_codes")
        status = np.full(n, SKIPPED, np.int8)
        status[reason >= 0] = REJECTED
        status[asked & (reason < 0)] = SCORED
        kept = ~unusable
        counted = kept & (status != REJECTED)
        dropped = int((unk_d + unk_p + np.where(has_meds, unk_m, 0))[counted].sum())
        given = int((given_d + given_p + np.where(has_meds, given_m, 0))[counted].sum())

        patient = np.cumsum(patient_starts(table)) - 1  # patient number of each row
        history_rows = kept & has_meds
        targets = np.flatnonzero(status == SCORED)
        histories = self._histories(patient, history_rows, targets)
        used = np.zeros(n, bool)
        used[targets] = True
        used[histories.covered()] = True
        return Plan(
            table=table,
            status=status,
            reason=reason,
            diag=diag,
            proc=proc,
            meds=meds,
            has_meds=has_meds,
            targets=targets,
            histories=histories,
            encode_rows=np.flatnonzero(used),
            unknown_codes=dropped,
            codes_given=given,
        )

    def _histories(
        self, patient: np.ndarray, history_rows: np.ndarray, targets: np.ndarray
    ) -> Spans:
        """Per target: the earlier history rows of its patient (the last max_history)."""
        known = np.flatnonzero(history_rows)
        before = np.searchsorted(known, targets)  # known rows strictly before each target
        first_row = np.searchsorted(patient, patient[targets])  # first row of the patient
        since = np.searchsorted(known, first_row)
        if self.max_history is not None:
            since = np.maximum(since, before - self.max_history)
        return Spans(known, since, before)
