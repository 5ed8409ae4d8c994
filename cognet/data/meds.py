"""MEDS (Medical Event Data Standard 0.4) -> a cognet dataset (DESIGN.md §2): one row per
admission window.

Input: ``MEDS_DIR/data/**/*.parquet`` (``subject_id``, ``time``, ``code``; a ``hadm_id`` column
is used when there), ``metadata/codes.parquet`` (``code``, ``parent_codes``) and, optionally,
``metadata/subject_splits.parquet``; each is checked against the `meds` package's schema
first. The defaults follow the MIMIC-IV MEDS ETL's codes (`MedsCodes`).

- Visits: an admission event (``HOSPITAL_ADMISSION//...``) opens a window that the discharge
  event (``HOSPITAL_DISCHARGE//...``) closes, the discharge instant included (MIMIC-IV stamps
  diagnoses at discharge). A discharge pairs with its admission by ``hadm_id``, else it is the
  subject's first discharge at or after the admission and before the next one. patient_id =
  subject_id; visit_id = the admission's hadm_id, else ``<subject_id>@<admission time>``;
  visit_seq ranks a subject's windows by time (a window dropped later leaves a gap).
- Events go to the window of their ``hadm_id`` when it names one, else to the window their
  time falls in (pharmacy events have no hadm_id).
- Codes: diagnoses and procedures by code prefix, the code kept whole as the token
  (``DIAGNOSIS//ICD//10//I10``); medications are the events of one prefix (prescription
  starts, never their STOP events) mapped to ATC-3: by ``--medication-map`` (code, atc3) when
  it lists the code, else through the code's ``parent_codes``: ``NDC/<ndc>`` with the SafeDrug
  files of `cognet data mimic3` (NDC -> RxCUI -> ATC-4), or ``ATC/<code>`` (level 3 or below).
- Split: subject_splits' train / tuning / held_out become train / val / test; without the file
  the dataset has no split column and readers seed one, as for OMOP.

Memory: each shard is read in record batches, and only the rows whose code has one of the
prefixes are kept, so a shard costs its visits and coded events, not its labs. A subject is
in one shard (MEDS), so windows are built shard by shard. Every dropped row is counted under
its reason (`tables.Step`), and the report is written to ``OUT/summary.json``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cognet.core.atc import atc3
from cognet.core.errors import InputError, one_line, where
from cognet.data.mimic3 import read_ndc_rxnorm, read_rxnorm_atc4
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

SPLIT_NAMES = {"train": "train", "tuning": "val", "held_out": "test"}  # MEDS -> cognet
BATCH = 1 << 18  # rows per record batch of a shard
NO_MEDICATIONS = (
    "no {prefix} event maps to ATC-3 ({rows:,} events): map them through their NDC "
    "parent codes with --ndc-rxnorm and --rxnorm-atc, through ATC parent codes, or with "
    "--medication-map CODE,ATC3; or pass --allow-no-medications to write the dataset "
    "anyway, for scoring only"
)
OUTSIDE = "outside every admission window"


@dataclass(frozen=True)
class MedsCodes:
    """The code prefixes that choose each kind of event (MIMIC-IV MEDS ETL defaults)."""

    visit_start: str = "HOSPITAL_ADMISSION//"
    visit_end: str = "HOSPITAL_DISCHARGE//"
    diagnosis: str = "DIAGNOSIS//ICD//"
    procedure: str = "PROCEDURE//ICD//"
    medication: str = "MEDICATION//START//"

    def prefixes(self) -> list[str]:
        """In the order a code is matched: the first prefix it starts with decides."""
        return [self.visit_start, self.visit_end, self.diagnosis, self.procedure, self.medication]


@dataclass(frozen=True)
class MedicationMaps:
    """What maps medication codes to ATC-3 beyond their ATC parent codes: the SafeDrug files
    for NDC parent codes (``ndc2rxnorm_mapping.txt`` and ``RXCUI2atc4.csv``, together) and a
    file of code -> atc3 rows, which wins over parent codes. None: not used."""

    ndc_rxnorm: str | Path | None = None
    rxnorm_atc: str | Path | None = None
    medication_map: str | Path | None = None

    def paths(self) -> list[Path]:
        """The files given, as paths."""
        given = (self.ndc_rxnorm, self.rxnorm_atc, self.medication_map)
        return [Path(p) for p in given if p is not None]


START, END, DIAGNOSIS, PROCEDURE, MEDICATION = range(5)
LISTS = {DIAGNOSIS: "diagnoses", PROCEDURE: "procedures", MEDICATION: "medications"}


# ---------------------------------------------------------------- input files


def _validate(schema_class, path: Path, file: pq.ParquetFile) -> None:
    """InputError naming the file and the columns the `meds` schema refuses."""
    try:
        schema_class.validate(file.schema_arrow)
    except Exception as exc:  # noqa: BLE001 - flexible_schema's errors: the message is the point
        raise InputError(f"{path}: not a MEDS {schema_class.__name__} ({one_line(exc)})") from None


def _open(path: Path, schema_class) -> pq.ParquetFile:
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
    _validate(schema_class, path, file)
    return file


def find_meds(meds_dir: Path) -> tuple[list[Path], Path, Path | None]:
    """The data shards (sorted), codes.parquet and subject_splits.parquet (None if absent)."""
    if not meds_dir.is_dir():
        raise InputError(f"{meds_dir}: folder not found")
    shards = sorted((meds_dir / "data").rglob("*.parquet"))
    if not shards:
        raise InputError(f"{meds_dir / 'data'}: no MEDS data shards (data/**/*.parquet)")
    splits = meds_dir / "metadata" / "subject_splits.parquet"
    return shards, meds_dir / "metadata" / "codes.parquet", splits if splits.exists() else None


def read_splits(path: Path) -> pd.Series:
    """subject_id -> cognet split, from subject_splits.parquet."""
    import meds

    file = _open(path, meds.SubjectSplitSchema)
    table = file.read(columns=["subject_id", "split"])
    splits = table.to_pandas().drop_duplicates("subject_id")
    unknown = ~splits["split"].isin(list(SPLIT_NAMES))
    if unknown.any():
        row = int(np.flatnonzero(unknown.to_numpy())[0])
        raise InputError(
            f"{where(path, 'split', row)}: {splits['split'].iloc[row]!r} is not one of "
            f"{', '.join(SPLIT_NAMES)}"
        )
    return splits.set_index("subject_id")["split"].map(SPLIT_NAMES)


def read_medication_map(
    codes_path: Path,
    prefix: str,
    ndc_rxnorm: Path | None = None,
    rxnorm_atc: Path | None = None,
    medication_map: Path | None = None,
) -> dict[str, tuple[str, ...]]:
    """Medication code -> its ATC-3 classes (sorted); codes that map to none are absent."""
    import meds

    ndc_rxcui = read_ndc_rxnorm(Path(ndc_rxnorm)) if ndc_rxnorm else {}
    rxcui_atc4 = read_rxnorm_atc4(Path(rxnorm_atc)) if rxnorm_atc else {}
    found: dict[str, set[str]] = {}
    file = _open(codes_path, meds.CodeMetadataSchema)
    names = file.schema_arrow.names
    columns = ["code", "parent_codes"] if "parent_codes" in names else ["code"]
    for batch in file.iter_batches(batch_size=BATCH, columns=columns):
        batch = batch.filter(pc.fill_null(pc.starts_with(batch.column("code"), prefix), False))
        if "parent_codes" not in names:
            continue
        for code, parents in zip(*(batch.column(c).to_pylist() for c in columns), strict=True):
            for parent in parents or []:
                vocabulary, _, value = parent.partition("/")
                atc = value if vocabulary == "ATC" else None
                if vocabulary == "NDC":
                    atc = rxcui_atc4.get(ndc_rxcui.get(value.strip(), ""))
                if atc3(atc):  # an ATC code by its form, not its length
                    found.setdefault(code, set()).add(atc3(atc))
    if medication_map is not None:
        for code, classes in _read_map(Path(medication_map)).items():
            found[code] = classes
    return {code: tuple(sorted(classes)) for code, classes in found.items()}


def _read_map(path: Path) -> dict[str, set[str]]:
    """code -> ATC-3 classes of a CSV or Parquet file with columns code, atc3."""
    table, mapping = SourceTable(path), {}
    for start, cols in table.batches(["code", "atc3"]):
        codes, atc = (table.text(cols[c]) for c in ("code", "atc3"))
        for column, values in (("code", codes), ("atc3", atc)):
            table.require(values, column, start)
        for row, (code, klass) in enumerate(zip(codes.to_pylist(), atc.to_pylist(), strict=True)):
            if atc3(klass) is None:
                raise InputError(
                    f"{table.where('atc3', start + row)}: {klass!r} is not an ATC code of "
                    "level 3 or below (a letter, two digits, a letter: A10B, A10BA02)"
                )
            mapping.setdefault(code, set()).add(klass[:4])
    return mapping


# ---------------------------------------------------------------- one shard


def scan_shard(path: Path, codes: MedsCodes, subjects: pd.Index | None, step: Step) -> pd.DataFrame:
    """The events of the kinds used: subject, time (int64 us, NA when null), code, hadm
    (nullable), kind; the other rows are counted in ``step``."""
    import meds

    file = _open(path, meds.DataSchema)
    columns = ["subject_id", "time", "code"]
    hadm = "hadm_id" in file.schema_arrow.names
    parts = []
    start = 0
    for batch in file.iter_batches(batch_size=BATCH, columns=columns + ["hadm_id"] * hadm):
        for column in ("subject_id", "code"):  # non-null in the MEDS schema
            if batch.column(column).null_count:
                row = int(np.argmin(batch.column(column).is_valid().to_numpy(False)))
                raise InputError(f"{where(path, column, start + row)}: empty")
        code = batch.column("code")
        kind = np.full(batch.num_rows, -1, np.int8)
        for index, prefix in reversed(list(enumerate(codes.prefixes()))):
            kind[pc.starts_with(code, prefix).to_numpy(False)] = index
        used = kind >= 0
        step.rows += batch.num_rows
        step.dropped["of other codes"] += int((~used).sum())
        if subjects is not None:
            known = np.isin(batch.column("subject_id").to_numpy(False), subjects)
            step.dropped["of a subject not in subject_splits"] += int((used & ~known).sum())
            used &= known
        take = pa.array(np.flatnonzero(used))
        frame = {
            "subject": batch.column("subject_id").take(take).to_numpy(False),
            "time": _nullable(batch.column("time").take(take)),
            "code": batch.column("code").take(take).to_numpy(False),
            "kind": kind[used],
        }
        frame["hadm"] = _nullable(pa.nulls(len(take), pa.int64()))
        if hadm:
            try:
                frame["hadm"] = _nullable(batch.column("hadm_id").take(take))
            except pa.ArrowException as exc:
                raise InputError(
                    f"{where(path, 'hadm_id')}: not integer ids ({one_line(exc)})"
                ) from None
        parts.append(pd.DataFrame(frame))
        start += batch.num_rows
    step.close()
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _nullable(values: pa.Array) -> pd.arrays.IntegerArray:
    """An integer or timestamp Arrow array as pandas Int64 (timestamps as their int64)."""
    ints = values.cast(pa.int64())
    valid = ints.is_valid().to_numpy(False)
    return pd.arrays.IntegerArray(ints.fill_null(0).to_numpy(False), ~valid)


def admissions(events: pd.DataFrame, step: Step) -> pd.DataFrame:
    """One row per window, in output order (subject, start time, hadm): subject, start,
    end, hadm, visit_id, seq; the admissions that open none are counted in ``step``."""
    adm = events[events["kind"] == START][["subject", "time", "hadm"]]
    step.rows += len(adm)
    timed = adm["time"].notna().to_numpy(bool)
    step.dropped["without a time"] += int((~timed).sum())
    adm = adm[timed].astype({"time": "int64"})
    adm = adm.sort_values(["subject", "time", "hadm"], kind="stable", na_position="last")
    again = adm["hadm"].notna() & adm.duplicated(["subject", "hadm"])
    step.dropped["repeating an admission's hadm_id"] += int(again.sum())
    adm = adm[~again.to_numpy(bool)].rename(columns={"time": "start"}).reset_index(drop=True)
    ends = events[(events["kind"] == END) & events["time"].notna()][["subject", "time", "hadm"]]
    ends = ends.astype({"time": "int64"})
    by_hadm = ends.dropna(subset=["hadm"]).groupby(["subject", "hadm"])["time"].min()
    adm = adm.join(by_hadm.rename("end_hadm"), on=["subject", "hadm"])
    later = ends[["subject", "time"]].rename(columns={"time": "end"}).sort_values("end")
    adm["order"] = np.arange(len(adm))
    adm = pd.merge_asof(
        adm.sort_values("start"),
        later,
        left_on="start",
        right_on="end",
        by="subject",
        direction="forward",
    ).sort_values("order")
    following = adm.groupby("subject")["start"].shift(-1)
    adm.loc[adm["end"] > following, "end"] = np.nan  # that discharge closes a later window
    adm["end"] = adm["end_hadm"].where(adm["end_hadm"].notna(), adm["end"])
    closed = adm["end"].notna().to_numpy(bool)
    step.dropped["without a discharge event"] += int((~closed).sum())
    adm = adm[closed].astype({"end": "int64"}).reset_index(drop=True)
    adm["seq"] = adm.groupby("subject").cumcount().astype(np.int32)
    stamp = pd.to_datetime(adm["start"], unit="us").dt.strftime("%Y-%m-%dT%H:%M:%S")
    adm["visit_id"] = adm["hadm"].astype("string").fillna(adm["subject"].astype(str) + "@" + stamp)
    return adm[["subject", "start", "end", "hadm", "visit_id", "seq"]]


def assign(events: pd.DataFrame, adm: pd.DataFrame) -> np.ndarray:
    """The window (row of ``adm``) of each event: its hadm_id's, else the one its time falls
    in (start <= time <= end); -1 when none."""
    window = adm.assign(v=np.arange(len(adm)))
    known = window.dropna(subset=["hadm"])[["subject", "hadm", "v"]]
    by_hadm = events[["subject", "hadm"]].merge(known, on=["subject", "hadm"], how="left")["v"]
    out = by_hadm.fillna(-1).to_numpy(np.int64)
    loose = np.flatnonzero((out < 0) & events["time"].notna().to_numpy(bool))
    if len(loose) and len(window):
        left = pd.DataFrame(
            {
                "subject": events["subject"].to_numpy()[loose],
                "time": events["time"].to_numpy("int64", na_value=0)[loose],
                "row": loose,
            }
        ).sort_values("time")
        right = window[["subject", "start", "end", "v"]].sort_values("start")
        hit = pd.merge_asof(left, right, left_on="time", right_on="start", by="subject")
        hit = hit[hit["v"].notna() & (hit["time"] <= hit["end"])]
        out[hit["row"].to_numpy(np.int64)] = hit["v"].to_numpy(np.int64)
    return out


def shard_visits(
    events: pd.DataFrame,
    med_map: dict[str, tuple[str, ...]],
    steps: dict[int, Step],
    splits: pd.Series | None,
) -> pa.Table:
    """The shard's visits with a diagnosis or procedure (the contract columns, + split when
    ``splits``), in (subject, seq) order, and a ``_subject`` column to sort shards by."""
    adm = admissions(events, steps[START])
    coded = events[events["kind"].isin(list(LISTS))].reset_index(drop=True)
    visit = assign(coded, adm) if len(coded) else np.zeros(0, np.int64)
    columns = {
        "_subject": pa.array(adm["subject"].to_numpy(np.int64)),
        "patient_id": pa.array(adm["subject"].astype(str).to_numpy(object), pa.string()),
        "visit_id": pa.array(adm["visit_id"].astype(str).to_numpy(object), pa.string()),
        "visit_seq": pa.array(adm["seq"].to_numpy(np.int32)),
    }
    counts = {}
    for kind, name in LISTS.items():
        rows = np.flatnonzero(coded["kind"].to_numpy() == kind)
        step = steps[kind]
        step.rows += len(rows)
        inside = rows[visit[rows] >= 0]
        step.dropped[OUTSIDE] += len(rows) - len(inside)
        positions, tokens = visit[inside], coded["code"].to_numpy(object)[inside]
        if kind == MEDICATION:
            classes = [med_map.get(code, ()) for code in tokens]
            n = np.array([len(c) for c in classes], np.int64)
            step.dropped["with no ATC-3 mapping"] += int((n == 0).sum())
            positions = np.repeat(positions, n)
            tokens = np.array([c for group in classes for c in group], object)
        step.close()
        vocab, rank = np.unique(tokens.astype(str), return_inverse=True)
        keys = np.unique(positions * max(len(vocab), 1) + rank.reshape(-1))
        columns[name], counts[name] = code_lists(
            keys, [str(t) for t in vocab], len(adm), kind == MEDICATION
        )
    if splits is not None:
        columns["split"] = pa.array(adm["subject"].map(splits).to_numpy(object), pa.string())
    kept = (counts["diagnoses"] + counts["procedures"]) > 0
    return pa.table(columns).filter(pa.array(kept))


# ---------------------------------------------------------------- the conversion


def build_meds(
    meds_dir: str | Path,
    out: str | Path,
    ddi: str | Path | None = None,
    codes: MedsCodes = MedsCodes(),
    maps: MedicationMaps = MedicationMaps(),
    allow_no_medications: bool = False,
) -> Report:
    """Convert the MEDS dataset in ``meds_dir`` into ``out`` (visits.parquet, ddi.parquet,
    summary.json), medications mapped to ATC-3 by their parent codes and ``maps``. Raises
    InputError naming the file and column for input that fails the MEDS schemas, and when
    no visit or no medication is left (the latter unless ``allow_no_medications``)."""
    meds_dir, out = Path(meds_dir), Path(out)
    shards, codes_path, splits_path = find_meds(meds_dir)
    extra = ([Path(ddi)] if ddi is not None else []) + maps.paths()
    check_output(out, [meds_dir, *shards, codes_path, *([splits_path] * bool(splits_path)), *extra])
    med_map = read_medication_map(
        codes_path, codes.medication, maps.ndc_rxnorm, maps.rxnorm_atc, maps.medication_map
    )
    splits = read_splits(splits_path) if splits_path else None
    scan = Step.counting("events", "of the kinds used", ["of other codes"])
    if splits is not None:
        scan.dropped["of a subject not in subject_splits"] = 0
    steps = {
        START: Step.counting(
            "admissions",
            "visits",
            ["without a time", "repeating an admission's hadm_id", "without a discharge event"],
        ),
        DIAGNOSIS: Step.counting("diagnoses", "coded", [OUTSIDE]),
        PROCEDURE: Step.counting("procedures", "coded", [OUTSIDE]),
        MEDICATION: Step.counting(
            "medications", "mapped to ATC-3", [OUTSIDE, "with no ATC-3 mapping"]
        ),
    }
    subjects = None if splits is None else splits.index
    parts = [
        shard_visits(events, med_map, steps, splits)
        for events in _shards(shards, codes, subjects, scan)
    ]
    if not parts:
        raise InputError(f"{meds_dir}: no event has one of the codes {', '.join(codes.prefixes())}")
    table = pa.concat_tables(parts)
    table = table.take(
        pc.sort_indices(table, [("_subject", "ascending"), ("visit_seq", "ascending")])
    )
    table = table.drop_columns(["_subject"])
    windows = steps[START].close().kept
    written = Step(
        "visits",
        windows,
        table.num_rows,
        "written",
        {"without a diagnosis or procedure": windows - table.num_rows},
    ).ended()
    report_steps = [scan, *steps.values(), written]
    for kind, option, prefix in (
        (DIAGNOSIS, "--diagnosis", codes.diagnosis),
        (PROCEDURE, "--procedure", codes.procedure),
    ):
        if steps[kind].rows == 0:  # a prefix that matches nothing: a typo, not "no codes"
            raise InputError(
                f"{meds_dir}: no event code starts with {option} {prefix!r}; "
                + "; ".join(s.line() for s in report_steps)
            )
    if table.num_rows == 0:
        raise InputError(
            f"{meds_dir}: no admission window has a diagnosis or procedure; "
            + "; ".join(s.line() for s in report_steps)
        )
    used = set(pc.unique(pc.list_flatten(table["medications"])).to_pylist())
    warnings, pairs = [], []
    if not used:
        message = NO_MEDICATIONS.format(prefix=codes.medication, rows=steps[MEDICATION].rows)
        if not allow_no_medications:
            raise InputError(f"{meds_dir}: {message}")
        warnings.append(message.split(";")[0])
    if ddi is None:
        warnings.append("no --ddi file: ddi.parquet is empty")
    else:
        pairs, step = read_ddi_pairs(Path(ddi), used)
        report_steps.append(step)
    report = Report("meds", out, report_steps, dataset_counts(table, len(pairs)), warnings)
    return write_dataset(report, table, pairs)


def _shards(
    shards: list[Path], codes: MedsCodes, subjects: pd.Index | None, step: Step
) -> Iterator[pd.DataFrame]:
    for path in shards:
        events = scan_shard(path, codes, subjects, step)
        if len(events):
            yield events
