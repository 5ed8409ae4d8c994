"""cognet: COGNet medication recommendation, trained in PyTorch and served from ONNX."""

from setuptools import find_packages, setup

# The installed package `cognet` and the top-level folders installed inside it; every folder
# with an __init__.py below them is a subpackage (`make lint` reads this mapping too).
PACKAGE_DIR = {
    "cognet": "cognet",
    "cognet.export": "export",
    "cognet.runtime": "runtime",
    "cognet.benchmarks": "benchmarks",
}
PACKAGES = [
    f"{package}.{sub}" if sub else package
    for package, folder in PACKAGE_DIR.items()
    for sub in ["", *find_packages(folder)]
]

setup(
    name="cognet",
    version="0.3.0",
    description="COGNet (copy-or-predict medication recommendation) training, ONNX export "
    "and a torch-free batch inference runtime",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    # the ICD-9-CM names that explanations print (tools/make_code_names.py derives them)
    package_data={"cognet.core": ["code_names.tsv.gz"]},
    install_requires=[
        "numpy>=1.24",
        "pyarrow>=14",
        "pandas>=2.0",
        "click>=8.1",
        "tqdm>=4.60",
    ],
    extras_require={
        # Training and export side. torch is not pinned here: the Makefile pins the CPU wheel.
        "train": ["torch>=2.4", "safetensors>=0.4", "onnx>=1.16", "onnxscript>=0.1"],
        # Mutually exclusive: onnxruntime and onnxruntime-gpu overwrite each other's module.
        "cpu": ["onnxruntime>=1.17"],
        "gpu": ["onnxruntime-gpu>=1.17"],
        "bench": ["matplotlib>=3.7"],
        "ray": ["ray[data]>=2.40"],  # --engine ray; tested with 2.40.0 and 2.60.0
        # dill: tests write vocabularies as the field's scripts do (cognet never imports it)
        "dev": ["pytest>=7.4", "ruff>=0.4", "matplotlib>=3.7", "dill>=0.4,<0.5"],
        # `cognet data omop --cdm` from a database: DuckDB in process, PostgreSQL through
        # ADBC's libpq driver (Arrow batches by binary COPY); docs/DESIGN.md "Data sources"
        "db": ["duckdb>=2.0", "adbc-driver-postgresql>=1.0"],
        "meds": ["meds>=0.4,<0.5"],  # `cognet data meds`: MEDS 0.4 schemas (subject_id)
    },
    entry_points={
        "console_scripts": [
            "cognet=cognet.cli:main",
            "cognet-export=cognet.export.cli:main",
            "cognet-batch=cognet.runtime.cli:main",
            "cognet-bench=cognet.benchmarks.cli:main",
        ]
    },
)
