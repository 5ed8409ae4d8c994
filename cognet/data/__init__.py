"""cognet.data: dataset builders. Each writes the dataset contract of DESIGN.md §2
(`cognet.core.schema`: visits.parquet + ddi.parquet) from one source:

- `synth`: synthetic patients shaped like the processed MIMIC-III benchmark;
- `mimic3`: MIMIC-III v1.4 CSVs with the SafeDrug / COGNet preprocessing;
- `mimic4`: MIMIC-IV `hosp` CSVs, the same pipeline, ICD codes as OMOP vocabulary tokens;
- `omop`: an OMOP CDM v5.4 extract (clinical tables + the Athena vocabulary);
- `stats`: the statistics table of any dataset (`cognet data stats`).

Torch-free; a builder imports `cognet.core` only, raises `InputError` for bad input and
leaves printing and exit codes to `cognet.cli.data`.
"""
