"""Fixtures shared by the test modules, built once per session and read-only (copy before
changing): small synthetic datasets and the tiny random model. Helpers are in tests/tiny.py;
no test module imports another."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny import make_tiny

from cognet.data.synth import generate

TINY_PATIENTS = 60
SMALL_PATIENTS = 1500
TINY_MODEL_PATIENTS = 80  # 248 visits
# How long Ray may take to start on a machine whose cores other work holds (its defaults
# assume an idle one): a bound that only catches a start that never ends.
RAY_START_S = 600
# Ray's own waits that read its system config: a worker's registration, and the GCS health
# checks that would declare a slow raylet dead.
RAY_SYSTEM_CONFIG = {
    "worker_register_timeout_seconds": RAY_START_S,
    "health_check_timeout_ms": 60_000,
    "health_check_failure_threshold": 20,
    # off: on a machine shared with other jobs, Ray's memory monitor kills the tests' workers
    # for the others' memory (a second, raylet line in a refusal's one-line output)
    "memory_monitor_refresh_ms": 0,
}


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 60-patient synthetic dataset directory (seed 0, with a split column). Do not modify."""
    return generate(tmp_path_factory.mktemp("tiny_dataset"), patients=TINY_PATIENTS, seed=0)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1,500-patient synthetic dataset directory (seed 0), for statistics. Do not modify."""
    return generate(tmp_path_factory.mktemp("small_dataset"), patients=SMALL_PATIENTS, seed=0)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model (tests/tiny.py `make_tiny`, 80 patients, 248 visits): a folder with
    `data/` (dataset with a split column), `ckpt/` (checkpoint) and `model/` (its export,
    unvalidated). Do not modify."""
    from cognet.export import ExportOptions, export

    root = tmp_path_factory.mktemp("tiny")
    _, ckpt = make_tiny(root, n_patients=TINY_MODEL_PATIENTS)
    export(ckpt, root / "model", ExportOptions(validate=False))
    return root


@pytest.fixture(scope="session")
def visits(tiny: Path) -> pa.Table:
    """The tiny model's `visits.parquet` (every visit with its medications)."""
    return pq.read_table(tiny / "data" / "visits.parquet")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of 2 CPUs for the module's tests (skipped without ray[data])."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    import logging

    with _patient_node_lookup(ray, RAY_START_S):
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            _system_config=RAY_SYSTEM_CONFIG,
        )
    yield ray
    ray.shutdown()


@contextlib.contextmanager
def _patient_node_lookup(ray, seconds: float):
    """While Ray starts, its lookup of the new node retries for up to `seconds`: Ray 2.60 polls
    it for a fixed 30 s (ray/_private/node.py, no setting), which a busy machine overruns
    ("The current node timed out during startup"). Nothing changes where the lookup is absent."""
    services = getattr(getattr(ray, "_private", None), "services", None)
    lookup = getattr(services, "get_node", None)
    if lookup is None:
        yield
        return

    def waiting(*args, **kwargs):
        end = time.monotonic() + seconds
        while True:
            try:
                return lookup(*args, **kwargs)
            except RuntimeError:  # not registered yet
                if time.monotonic() > end:
                    raise
                time.sleep(0.5)

    services.get_node = waiting
    try:
        yield
    finally:
        services.get_node = lookup


@pytest.fixture
def cdm(tmp_path: Path) -> Path:
    """The hand-made OMOP CDM extract of tests/omop_tables.py, as CSV files."""
    from omop_tables import write_extract

    return write_extract(tmp_path / "cdm")


@pytest.fixture
def ddi_file(tmp_path: Path) -> Path:
    """The DDI pairs of tests/omop_tables.py as an ATC-3 CSV file."""
    from omop_tables import DDI, write_table

    return write_table(tmp_path / "ddi_atc3.csv", DDI)
