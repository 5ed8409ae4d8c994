"""Vocabularies of diagnosis, procedure and medication codes, with special token ids.

Torch-free: the runtime reads the same `vocab.json` from a model's manifest.
Ids: medications 0..M-1, then END = M, START = M + 1, PAD = M + 2; diagnoses 0..D-1 with
PAD = D; procedures 0..P-1 with PAD = P. Codes are sorted so that a vocabulary built from
the same training rows is always the same.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

FORMAT_VERSION = 1
KINDS = ("diagnoses", "procedures", "medications")


@dataclass(frozen=True)
class Vocab:
    diagnoses: tuple[str, ...]
    procedures: tuple[str, ...]
    medications: tuple[str, ...]
    # Training-split prescription count of each medication id: defines the rare-first order.
    med_frequency: tuple[int, ...]
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.med_frequency) != len(self.medications):
            raise ValueError("med_frequency must have one count per medication")
        index = {kind: {c: i for i, c in enumerate(getattr(self, kind))} for kind in KINDS}
        object.__setattr__(self, "_index", index)

    # -- sizes and special ids -------------------------------------------------------
    @property
    def n_diag(self) -> int:
        return len(self.diagnoses)

    @property
    def n_proc(self) -> int:
        return len(self.procedures)

    @property
    def n_med(self) -> int:
        return len(self.medications)

    @property
    def end(self) -> int:
        return self.n_med

    @property
    def start(self) -> int:
        return self.n_med + 1

    @property
    def med_pad(self) -> int:
        return self.n_med + 2

    @property
    def diag_pad(self) -> int:
        return self.n_diag

    @property
    def proc_pad(self) -> int:
        return self.n_proc

    @property
    def out_size(self) -> int:
        """Size of the output distribution: medications + END."""
        return self.n_med + 1

    # -- building -----------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        diagnoses: Iterable[Sequence[str]],
        procedures: Iterable[Sequence[str]],
        medications: Iterable[Sequence[str] | None],
    ) -> Vocab:
        """Build from the code lists of the training visits (one list per visit)."""
        diag = sorted({c for codes in diagnoses for c in codes})
        proc = sorted({c for codes in procedures for c in codes})
        counts: Counter[str] = Counter()
        for codes in medications:
            if codes is not None:
                counts.update(set(codes))
        meds = sorted(counts)
        return cls(tuple(diag), tuple(proc), tuple(meds), tuple(counts[m] for m in meds))

    # -- encoding -------------------------------------------------------------------------
    def encode(self, kind: str, codes: Iterable[str]) -> tuple[list[int], int]:
        """Ids of the known codes (duplicates removed, first occurrence order) and the
        number of unknown codes that were dropped."""
        index = self._index[kind]
        ids: list[int] = []
        seen: set[int] = set()
        unknown = 0
        for code in codes:
            i = index.get(code)
            if i is None:
                unknown += 1
            elif i not in seen:
                seen.add(i)
                ids.append(i)
        return ids, unknown

    def rare_first(self, med_ids: Iterable[int]) -> list[int]:
        """Medication ids ordered rare-first by training frequency (ties by code)."""
        return sorted(set(med_ids), key=lambda i: (self.med_frequency[i], self.medications[i]))

    def med_codes(self, ids: Iterable[int]) -> list[str]:
        return [self.medications[i] for i in ids]

    # -- persistence ------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "diagnoses": list(self.diagnoses),
            "procedures": list(self.procedures),
            "medications": list(self.medications),
            "med_frequency": list(self.med_frequency),
            "special": {
                "END": self.end,
                "START": self.start,
                "PAD": self.med_pad,
                "DIAG_PAD": self.diag_pad,
                "PROC_PAD": self.proc_pad,
            },
        }

    @classmethod
    def from_json(cls, obj: dict) -> Vocab:
        if obj.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported vocab format version {obj.get('format_version')!r}")
        return cls(
            tuple(obj["diagnoses"]),
            tuple(obj["procedures"]),
            tuple(obj["medications"]),
            tuple(int(x) for x in obj["med_frequency"]),
        )
