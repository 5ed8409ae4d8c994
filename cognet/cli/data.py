"""`cognet data ...`: make, ingest and describe datasets (DESIGN.md §2 and §7)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import click

from cognet.core import strict_json
from cognet.core.commandline import count_option, db_timeout_options, handle_errors, setup_logging
from cognet.core.dataset import read_dataset
from cognet.core.files import DATASET_FILES, Reads, guarded
from cognet.data.benchmark import build_benchmark
from cognet.data.meds import MedicationMaps, MedsCodes, build_meds
from cognet.data.mimic3 import DDI_TYPES, SafeDrugFiles, build_mimic3
from cognet.data.mimic4 import build_mimic4
from cognet.data.omop import build_omop, parse_concept_ids
from cognet.data.omop_db import DbOptions, Timeouts, database_file
from cognet.data.stats import compute_stats, format_stats
from cognet.data.synth import generate
from cognet.data.tables import Report


def converter_outputs(func):
    """--out (the dataset folder, with summary.json) and --ddi (a file of interacting ATC-3
    pairs): the options every converter of hospital data shares."""
    func = click.option(
        "--ddi",
        type=click.Path(path_type=Path),
        default=None,
        help="Interacting ATC-3 pairs, CSV or Parquet with columns drug_a, drug_b. "
        "Without it ddi.parquet is empty.",
    )(func)
    return click.option(
        "--out",
        required=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="Dataset folder to write (visits.parquet, ddi.parquet, summary.json).",
    )(func)


def verbose_option(func):
    """-v / --verbose of every converter: each step's line on stderr as it ends."""
    return click.option(
        "-v", "--verbose", is_flag=True, help="Log each step on stderr as it ends."
    )(func)


# every converter writes one folder, checked and locked before the work, built aside and moved
# into place whole when the run succeeds (`cognet.core.files.guarded`)
FOLDER = {"--out": DATASET_FILES}


def convert(
    command: str, out: Path, reads: Reads, verbose: bool, build: Callable[[Path], Report]
) -> None:
    """Run a converter the one way: `build(folder)` writes the dataset and summary.json into
    the folder staged for --out; then each step's kept and dropped rows, the dataset written,
    and warnings on stderr."""
    setup_logging(verbose)
    with guarded(command, {"--out": out}, reads, FOLDER) as stage:
        report = build(stage["--out"])
    for line in report.lines():
        click.echo(line)
    for warning in report.warnings:
        click.echo(f"Warning: {warning}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def data() -> None:
    """Make, ingest and describe datasets.

    A dataset is a directory with visits.parquet and ddi.parquet (see the README).

    \b
    Example:
      cognet data synth --out data --patients 2000 --seed 0
      cognet data stats data
    """


@data.command()
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write visits.parquet and ddi.parquet into.",
)
@count_option("--patients", default=6350, help="Number of patients (about 2.4 visits each).")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Random seed: the same seed and size give the same files.",
)
@handle_errors
def synth(out_dir: Path, patients: int, seed: int) -> None:
    """Generate a synthetic dataset shaped like the paper's MIMIC-III benchmark.

    Patients carry latent chronic and acute conditions that emit ICD-9 diagnosis and
    procedure codes and ATC-3 medications; the defaults reproduce the paper's statistics
    (see `cognet data stats`). visits.parquet includes a train/val/test split column.

    \b
    Example:
      cognet data synth --out data --patients 6350 --seed 0
    """
    start = time.perf_counter()
    with guarded("cognet data synth", {"--out": out_dir}, Reads(), FOLDER) as stage:
        generate(stage["--out"], patients=patients, seed=seed)
    click.echo(
        f"wrote {out_dir} ({patients:,} patients, seed {seed}) "
        f"in {time.perf_counter() - start:.1f}s"
    )


@data.command()
@click.argument("dataset", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@handle_errors
def stats(dataset: Path, as_json: bool) -> None:
    """Validate a dataset and print its statistics.

    Prints the paper's statistics table (patients, visits, vocabulary sizes, codes per
    visit, DDI pairs) plus the ground-truth DDI rate and how much of each visit's
    medications the patient's earlier visits already had. Exits with code 2 and a one-line
    message naming the file, column and row when the dataset breaks the contract.

    \b
    Example:
      cognet data stats data
      cognet data stats data --json > stats.json
    """
    figures = compute_stats(read_dataset(dataset))
    click.echo(strict_json.dumps(figures, indent=2) if as_json else format_stats(figures))


@data.command()
@click.option(
    "--records",
    required=True,
    type=click.Path(path_type=Path),
    help="records_final.pkl: patients -> visits -> [diagnosis, procedure, "
    "medication ids] (a fourth field per visit is dropped).",
)
@click.option(
    "--voc",
    required=True,
    type=click.Path(path_type=Path),
    help="voc_final.pkl: diag_voc, pro_voc, med_voc (dill-pickled Voc objects).",
)
@click.option(
    "--ddi",
    required=True,
    type=click.Path(path_type=Path),
    help="ddi_A_final.pkl: the 0/1 DDI matrix over medication ids.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Dataset folder to write (visits.parquet, ddi.parquet, summary.json).",
)
@click.option(
    "--split-order",
    type=click.Choice(["test-first", "val-first"]),
    default="test-first",
    show_default=True,
    help="After the first two thirds (train): test-first takes the next half of "
    "the rest as test (SafeDrug, COGNet), val-first as validation.",
)
@verbose_option
@handle_errors
def benchmark(
    records: Path, voc: Path, ddi: Path, out: Path, split_order: str, verbose: bool
) -> None:
    """Build a dataset from the papers' processed files (GAMENet, SafeDrug, COGNet, ...).

    Reads the pickles with a restricted unpickler: no code in them runs, dill is never
    imported, and a pickle asking for anything but the names these files use exits 2.
    Patient i becomes patient_id "i", its visit j visit_id "i-j" (visit_seq j); codes are
    the vocabularies' words. Prints the counts per split, and writes them to
    OUT/summary.json. See docs/guide/benchmark-files.md.

    \b
    Example:
      cognet data benchmark --records records_final.pkl --voc voc_final.pkl \\
        --ddi ddi_A_final.pkl --out data/benchmark
    """

    def build(folder: Path) -> Report:
        return build_benchmark(records, voc, ddi, folder, split_order)

    reads = Reads(files=[records, voc, ddi])
    convert("cognet data benchmark", out, reads, verbose, build)


def mimic_options(mimic_dir_help: str):
    """--mimic-dir (described by `mimic_dir_help`), the SafeDrug mapping files, --out,
    --ddi-types and --verbose: the options of `mimic3` and `mimic4`."""
    path = click.Path(path_type=Path)
    options = [
        click.option("--mimic-dir", required=True, type=path, help=mimic_dir_help),
        click.option(
            "--ndc-rxnorm",
            required=True,
            type=path,
            help="ndc2rxnorm_mapping.txt: a dict literal NDC -> RxCUI (parsed, never run).",
        ),
        click.option(
            "--rxnorm-atc",
            required=True,
            type=path,
            help="RXCUI2atc4.csv / ndc2atc_level4.csv with columns RXCUI and ATC4.",
        ),
        click.option(
            "--drug-atc",
            required=True,
            type=path,
            help="drug-atc.csv: lines 'STITCH CID,ATC,ATC,...'.",
        ),
        click.option(
            "--ddi",
            required=True,
            type=path,
            help="TWOSIDES drug-DDI.csv ('STITCH 1', 'STITCH 2', 'Polypharmacy Side Effect').",
        ),
        click.option(
            "--out",
            required=True,
            type=click.Path(file_okay=False, path_type=Path),
            help="Dataset folder to write (visits.parquet, ddi.parquet, summary.json).",
        ),
        click.option(
            "--ddi-types",
            type=click.Choice(DDI_TYPES),
            default="top40",
            show_default=True,
            help="top40: pairs of the 40 most frequent side-effect types. reference: "
            "the 40 least frequent, as the SafeDrug/COGNet script keeps because "
            "of a sort bug (bug-compatible, to compare with published numbers).",
        ),
        verbose_option,
    ]

    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def convert_mimic(
    command: str,
    build: Callable[..., Report],
    *,
    mimic_dir: Path,
    out: Path,
    ddi_types: str,
    verbose: bool,
    **files: Path,
) -> None:
    """`cognet data mimic3` and `mimic4`, which differ by their builder only; `files`: the
    mapping files (`SafeDrugFiles`) by name."""
    mappings = SafeDrugFiles(**files)
    reads = Reads(files=mappings.paths(), folders=[mimic_dir])

    def build_into(folder: Path) -> Report:
        return build(mimic_dir, mappings, folder, ddi_types)

    convert(command, out, reads, verbose, build_into)


@data.command("mimic3")
@mimic_options(
    "MIMIC-III v1.4 folder: PRESCRIPTIONS, DIAGNOSES_ICD, PROCEDURES_ICD, "
    "ADMISSIONS (.csv or .csv.gz)."
)
@handle_errors
def mimic3_command(**options) -> None:
    """Build a dataset from MIMIC-III CSVs with the SafeDrug / COGNet preprocessing.

    Keeps patients with 2+ admissions, maps NDC -> RxCUI -> ATC-3 (300 commonest), the 2000
    commonest ICD-9 diagnoses and every procedure, orders visits by admission time, and
    takes DDI pairs from TWOSIDES through STITCH CID -> ATC. Prints what each step kept and
    dropped, and writes it to OUT/summary.json.

    About --ddi-types: the reference script sorts the side-effect counts in descending
    order and then keeps the last 40 rows, i.e. the 40 LEAST frequent types (a sort bug).
    The default, top40, keeps the 40 most frequent as the papers describe; 'reference'
    reproduces the bug.

    \b
    Example:
      cognet data mimic3 --mimic-dir mimic-iii-clinical-database-1.4 \\
        --ndc-rxnorm ndc2rxnorm_mapping.txt --rxnorm-atc ndc2atc_level4.csv \\
        --drug-atc drug-atc.csv --ddi drug-DDI.csv --out data/mimic3
    """
    convert_mimic("cognet data mimic3", build_mimic3, **options)


def allow_no_medications_option(func):
    """--allow-no-medications of the converters that refuse a dataset without medications."""
    return click.option(
        "--allow-no-medications",
        is_flag=True,
        help="Write the dataset even when no drug maps to ATC-3 (every visit's medications "
        "null): for scoring only, it cannot train.",
    )(func)


@data.command()
@click.option(
    "--cdm",
    required=True,
    metavar="FOLDER|URL",
    help="The OMOP CDM v5.4 tables person, visit_occurrence, condition_occurrence, "
    "procedure_occurrence, drug_exposure, concept and concept_ancestor: a folder of files "
    "(.csv comma or tab, .csv.gz or .parquet, any case), a DuckDB file (cdm.duckdb, or "
    "duckdb:///relative/cdm.duckdb, duckdb:////absolute/cdm.duckdb) or a PostgreSQL URL "
    "(postgresql://USER@HOST:PORT/DB; the password from PGPASSWORD or ~/.pgpass).",
)
@click.option(
    "--cdm-schema",
    default="cdm",
    show_default=True,
    help="Database only: the schema of the clinical tables.",
)
@click.option(
    "--vocab-schema",
    default=None,
    help="Database only: the schema of concept and concept_ancestor [default: --cdm-schema].",
)
@converter_outputs
@click.option(
    "--visit-concepts",
    default=None,
    metavar="IDS",
    help="Keep only visits of these visit_concept_ids, e.g. 9201,262 (inpatient).",
)
@click.option(
    "--source-codes",
    is_flag=True,
    help="Code conditions and procedures by their source concept (ICD10CM/I10) "
    "instead of the standard one (SNOMED/38341003).",
)
@allow_no_medications_option
@db_timeout_options
@verbose_option
@handle_errors
def omop(
    cdm: str,
    cdm_schema: str,
    vocab_schema: str | None,
    out: Path,
    ddi: Path | None,
    visit_concepts: str | None,
    source_codes: bool,
    allow_no_medications: bool,
    connect_timeout: float,
    statement_timeout: float,
    verbose: bool,
) -> None:
    """Build a dataset from an OMOP CDM extract.

    One visit per visit_occurrence, ordered by visit_start_date within a person; diagnoses
    and procedures as VOCABULARY/CODE of their concepts; medications as the ATC 3rd classes
    among each drug's ancestors in concept_ancestor (null for a visit with no drug that
    maps; when no drug maps at all it exits 2, unless --allow-no-medications). From a
    database, columns and the concept filters are chosen in the database and the rows
    streamed. Prints what each step kept and dropped, and writes it to OUT/summary.json.

    \b
    Example:
      cognet data omop --cdm omop_extract --out data/omop --ddi ddi_atc3.csv \\
        --visit-concepts 9201,262
      cognet data omop --cdm duckdb:///cdm.duckdb --cdm-schema main --out data/omop
      PGPASSWORD=... cognet data omop --cdm postgresql://ohdsi@db.example.org/cdm \\
        --cdm-schema cdm --vocab-schema vocab --out data/omop
    """
    concepts = parse_concept_ids(visit_concepts)

    def build(folder: Path) -> Report:
        timeouts = Timeouts(connect_timeout, statement_timeout)
        return build_omop(
            cdm,
            folder,
            ddi,
            concepts,
            source_codes,
            database=DbOptions(cdm_schema, vocab_schema, timeouts),
            allow_no_medications=allow_no_medications,
        )

    folder = Path(cdm) if Path(cdm).is_dir() else None  # else a database
    reads = Reads(files=[ddi, database_file(cdm)], folders=[folder])
    convert("cognet data omop", out, reads, verbose, build)


@data.command()
@mimic_options(
    "MIMIC-IV folder (or its hosp/ folder): admissions, diagnoses_icd, "
    "procedures_icd, prescriptions (.csv.gz as shipped, or .csv)."
)
@handle_errors
def mimic4(**options) -> None:
    """Build a dataset from MIMIC-IV (hosp module) with the mimic3 preprocessing.

    The SafeDrug / COGNet steps of `cognet data mimic3` with the same mapping files; ICD
    codes keep their version as OMOP vocabulary tokens with OMOP's dots: ICD9CM/401.9,
    ICD10CM/I10, ICD9Proc/36.06, ICD10PCS/02703ZZ. Prints what each step kept and dropped,
    and writes it to OUT/summary.json.

    \b
    Example:
      cognet data mimic4 --mimic-dir mimiciv/3.1 --ndc-rxnorm ndc2rxnorm_mapping.txt \\
        --rxnorm-atc ndc2atc_level4.csv --drug-atc drug-atc.csv --ddi drug-DDI.csv \\
        --out data/mimic4
    """
    convert_mimic("cognet data mimic4", build_mimic4, **options)


@data.command()
@click.option(
    "--meds-dir",
    required=True,
    type=click.Path(path_type=Path),
    help="MEDS 0.4 dataset: data/**/*.parquet, metadata/codes.parquet and, if "
    "there, metadata/subject_splits.parquet.",
)
@converter_outputs
@click.option(
    "--visit-start",
    default="HOSPITAL_ADMISSION//",
    show_default=True,
    help="Code prefix of the events that open a visit.",
)
@click.option(
    "--visit-end",
    default="HOSPITAL_DISCHARGE//",
    show_default=True,
    help="Code prefix of the events that close it (the instant included).",
)
@click.option(
    "--diagnosis", default="DIAGNOSIS//ICD//", show_default=True, help="Code prefix of diagnoses."
)
@click.option(
    "--procedure", default="PROCEDURE//ICD//", show_default=True, help="Code prefix of procedures."
)
@click.option(
    "--medication",
    default="MEDICATION//START//",
    show_default=True,
    help="Code prefix of the medication events (one kind: never their STOP events).",
)
@click.option(
    "--ndc-rxnorm",
    type=click.Path(path_type=Path),
    default=None,
    help="ndc2rxnorm_mapping.txt, for medications with NDC/... parent codes.",
)
@click.option(
    "--rxnorm-atc",
    type=click.Path(path_type=Path),
    default=None,
    help="RXCUI2atc4.csv / ndc2atc_level4.csv (columns RXCUI, ATC4), with --ndc-rxnorm.",
)
@click.option(
    "--medication-map",
    type=click.Path(path_type=Path),
    default=None,
    help="CSV or Parquet with columns code, atc3: the ATC-3 classes of medication "
    "codes (it wins over parent codes).",
)
@allow_no_medications_option
@verbose_option
@handle_errors
def meds(
    meds_dir: Path,
    out: Path,
    ddi: Path | None,
    visit_start: str,
    visit_end: str,
    diagnosis: str,
    procedure: str,
    medication: str,
    ndc_rxnorm: Path | None,
    rxnorm_atc: Path | None,
    medication_map: Path | None,
    allow_no_medications: bool,
    verbose: bool,
) -> None:
    """Build a dataset from a MEDS dataset (e.g. the MIMIC-IV MEDS ETL's output).

    One visit per admission window: from an admission event to its discharge event,
    inclusive. Events join a window by hadm_id when they have one, else by time. Diagnoses
    and procedures are the codes with their prefix (kept in the token); medications are
    the --medication events mapped to ATC-3 (NDC or ATC parent codes, or --medication-map).
    The split comes from subject_splits.parquet (train/tuning/held_out -> train/val/test).
    Prints what each step kept and dropped, and writes it to OUT/summary.json.

    \b
    Example:
      cognet data meds --meds-dir MIMIC-IV_MEDS --out data/meds \\
        --ndc-rxnorm ndc2rxnorm_mapping.txt --rxnorm-atc ndc2atc_level4.csv \\
        --ddi ddi_atc3.csv
    """
    codes = MedsCodes(visit_start, visit_end, diagnosis, procedure, medication)
    maps = MedicationMaps(ndc_rxnorm, rxnorm_atc, medication_map)

    def build(folder: Path) -> Report:
        return build_meds(meds_dir, folder, ddi, codes, maps, allow_no_medications)

    reads = Reads(files=[ddi, ndc_rxnorm, rxnorm_atc, medication_map], folders=[meds_dir])
    convert("cognet data meds", out, reads, verbose, build)
