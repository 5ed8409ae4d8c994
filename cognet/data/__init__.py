"""cognet.data: dataset builders. Each writes the dataset contract of DESIGN.md §2
(`cognet.core.dataset`: visits.parquet + ddi.parquet) from one source:

- `synth`: synthetic patients shaped like the processed MIMIC-III benchmark (its latent
  world in `synth_world`); `synth_omop`: synthetic OMOP CDM extracts of any size;
- `benchmark`: the papers' processed pickles, read by our own bounded reader
  (`pickles`, `pickle_reader`, `pickle_bounds`, `pickle_dill`): nothing in them runs;
- `mimic3`: MIMIC-III v1.4 CSVs with the SafeDrug / COGNet preprocessing;
- `mimic4`: MIMIC-IV `hosp` CSVs, the same pipeline, ICD codes as OMOP vocabulary tokens;
- `omop`: an OMOP CDM v5.4 extract (clinical tables + the Athena vocabulary), from files
  or a database (`omop_db`);
- `meds`: a MEDS 0.4 dataset;
- `stats`: the statistics table of any dataset (`cognet data stats`);
- `tables`: reading source extracts and reporting conversions, shared by the builders.

Torch-free; a builder imports `cognet.core` only, raises `InputError` for bad input and
leaves printing and exit codes to `cognet.cli.data`.
"""
