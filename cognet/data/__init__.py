"""Dataset builders: OMOP CDM, MIMIC-IV, ... -> the dataset contract (DESIGN.md §2)."""
