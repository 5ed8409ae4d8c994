"""The mapping files (NDC -> RxCUI -> ATC-4, STITCH CID -> ATC) and TWOSIDES interactions of
the tiny MIMIC fixtures, and CSV writers, shared by the MIMIC-III and MIMIC-IV tests
(test_mimic3, test_mimic4, test_data_pipeline).
"""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

N1, N2, N3, N4, N5, N6, N7, N8 = (f"0000{i}00000{i}" for i in range(1, 9))


# Python-dict text as SafeDrug ships it (single quotes: not JSON); an int value and an
# empty RxCUI as in the real file.
NDC_RXNORM = (
    f"{{'{N1}': '1001', '{N2}': '1002', '{N3}': '1003', '{N4}': '', "
    f"'{N5}': '1005', '{N6}': '1006', '{N7}': 1007}}\n"
)
RXNORM_ATC = (
    ["YEAR", "MONTH", "NDC", "RXCUI", "ATC4"],
    [
        [2008, 1, 1, 1001, "A02BC"],
        [2008, 1, 2, 1001, "B01AC"],  # a second ATC-4 of RxCUI 1001: the first row wins
        [2008, 1, 3, 1002, "B01AC"],
        [2008, 1, 4, 1003, "A02BA"],
        [2008, 1, 5, 1005, "N02BE"],
        [2008, 1, 6, 1006, "C07AB"],
        [2008, 1, 7, 1007, "C03CA"],
    ],
)
DRUG_ATC = """CID000000001,A02BC05,A02BA02
CID000000002,B01AC06
CID000000003,N02BE01
CID000000004,C07AB02
CID000000005,A02BC01
CID000000006,C03CA01,B01AC04
"""
SE = ["STITCH 1", "STITCH 2", "Polypharmacy Side Effect", "Side Effect Name"]
DDI = (
    SE,
    [
        # C0000001, 4 rows: A02B-B01A (twice), nothing (CID 4 is C07A, not a medication),
        # C03C-A02B and B01A-A02B
        ["CID000000001", "CID000000002", "C0000001", "hypermagnesemia"],
        ["CID000000005", "CID000000002", "C0000001", "hypermagnesemia"],
        ["CID000000001", "CID000000004", "C0000001", "hypermagnesemia"],
        ["CID000000006", "CID000000001", "C0000001", "hypermagnesemia"],
        # C0000002, 2 rows: B01A-N02B, A02B-A02B (a self pair: dropped)
        ["CID000000002", "CID000000003", "C0000002", "atelectasis"],
        ["CID000000001", "CID000000005", "C0000002", "atelectasis"],
        # C0000003, 1 row: N02B-A02B
        ["CID000000003", "CID000000001", "C0000003", "alkalosis"],
    ],
)
ALL_PAIRS = [("A02B", "B01A"), ("A02B", "C03C"), ("A02B", "N02B"), ("B01A", "N02B")]


def write_csv(path: Path, table: tuple[list, list]) -> Path:
    header, rows = table
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_gz(path: Path, table: tuple[list, list]) -> Path:
    text = io.StringIO()
    csv.writer(text).writerows([table[0], *table[1]])
    path.write_bytes(gzip.compress(text.getvalue().encode()))
    return path
