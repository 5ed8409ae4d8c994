"""Fixtures shared by the test modules: small synthetic datasets (read-only, session-wide)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cognet.data.synth import generate

TINY_PATIENTS = 60
SMALL_PATIENTS = 1500


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 60-patient synthetic dataset directory (seed 0, with a split column). Do not modify."""
    return generate(tmp_path_factory.mktemp("tiny_dataset"), patients=TINY_PATIENTS, seed=0)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1,500-patient synthetic dataset directory (seed 0), for statistics. Do not modify."""
    return generate(tmp_path_factory.mktemp("small_dataset"), patients=SMALL_PATIENTS, seed=0)
