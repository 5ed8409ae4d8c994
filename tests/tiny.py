"""Tiny random datasets and checkpoints for fast tests (no training needed for parity).

`make_tiny(root)` writes `root/data` (a dataset directory with a split column) and
`root/ckpt` (a checkpoint of a randomly initialised COGNet whose END bias is lowered so that
beam search produces medication lists of varied lengths).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def tiny_visits(
    n_patients: int = 30,
    seed: int = 0,
    n_diag: int = 40,
    n_proc: int = 25,
    n_med: int = 20,
    max_visits: int = 5,
) -> pa.Table:
    rng = np.random.default_rng(seed)
    rows = {
        k: []
        for k in (
            "patient_id",
            "visit_id",
            "visit_seq",
            "diagnoses",
            "procedures",
            "medications",
            "split",
        )
    }
    splits = ["train", "val", "test"]
    for p in range(n_patients):
        split = splits[p % 3] if p >= 3 else splits[0]
        for s in range(int(rng.integers(1, max_visits + 1))):
            rows["patient_id"].append(f"P{p:04d}")
            rows["visit_id"].append(f"V{p:04d}-{s}")
            rows["visit_seq"].append(s)
            rows["diagnoses"].append(
                [f"D{i:03d}" for i in rng.choice(n_diag, rng.integers(0, 8), replace=False)]
            )
            rows["procedures"].append(
                [f"P{i:03d}" for i in rng.choice(n_proc, rng.integers(1, 4), replace=False)]
            )
            rows["medications"].append(
                [f"M{i:02d}X" for i in rng.choice(n_med, rng.integers(1, 9), replace=False)]
            )
            rows["split"].append(split)
    return pa.table(
        {
            "patient_id": pa.array(rows["patient_id"], pa.string()),
            "visit_id": pa.array(rows["visit_id"], pa.string()),
            "visit_seq": pa.array(rows["visit_seq"], pa.int32()),
            "diagnoses": pa.array(rows["diagnoses"], pa.list_(pa.string())),
            "procedures": pa.array(rows["procedures"], pa.list_(pa.string())),
            "medications": pa.array(rows["medications"], pa.list_(pa.string())),
            "split": pa.array(rows["split"], pa.string()),
        }
    )


def tiny_ddi(n_med: int = 20, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed + 1)
    pairs = {tuple(sorted(rng.choice(n_med, 2, replace=False))) for _ in range(15)}
    return pa.table(
        {"drug_a": [f"M{a:02d}X" for a, _ in pairs], "drug_b": [f"M{b:02d}X" for _, b in pairs]}
    )


def make_tiny(
    root: str | Path,
    seed: int = 0,
    n_patients: int = 30,
    ablation: str = "none",
    dim: int = 16,
    heads: int = 2,
) -> tuple[Path, Path]:
    """Write a tiny dataset and a random-weight checkpoint; returns (data_dir, ckpt_dir)."""
    root = Path(root)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    pq.write_table(tiny_visits(n_patients, seed), data / "visits.parquet")
    pq.write_table(tiny_ddi(seed=seed), data / "ddi.parquet")
    ckpt = random_checkpoint(data, root / "ckpt", seed, ablation, dim, heads)
    return data, ckpt


def random_checkpoint(
    data: str | Path,
    ckpt: str | Path,
    seed: int = 0,
    ablation: str = "none",
    dim: int = 16,
    heads: int = 2,
) -> Path:
    """A randomly initialised COGNet over the vocabulary of a dataset directory's train split
    (graphs from its train split and DDI pairs), saved as a checkpoint; returns its path."""
    import torch

    from cognet import checkpoint
    from cognet.batching import ddi_adjacency, ehr_adjacency
    from cognet.core.vocab import Vocab
    from cognet.evaluate import load_split, split_table
    from cognet.model import COGNet, ModelConfig

    visits = pq.read_table(Path(data) / "visits.parquet")
    ddi_table = pq.read_table(Path(data) / "ddi.parquet")
    train = split_table(visits, "train")
    vocab = Vocab.build(
        *(train.column(c).to_pylist() for c in ("diagnoses", "procedures", "medications"))
    )
    patients = load_split(visits, vocab, "train").patients
    pairs = list(
        zip(
            ddi_table.column("drug_a").to_pylist(),
            ddi_table.column("drug_b").to_pylist(),
            strict=True,
        )
    )
    ehr, ddi = ehr_adjacency(patients, vocab.n_med), ddi_adjacency(pairs, vocab)
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab.n_diag,
        vocab.n_proc,
        vocab.n_med,
        dim=dim,
        heads=heads,
        ffn=2 * dim,
        ablation=ablation,
    )
    model = COGNet(cfg, ehr, ddi).eval()
    with torch.no_grad():
        for p in model.parameters():  # livelier than the default init
            p.add_(torch.randn_like(p) * 0.3)
        model.gen_head.bias[vocab.end] = -0.5
    ckpt = Path(ckpt)
    checkpoint.save(ckpt, model, vocab, ehr, ddi, pairs, {"seed": seed, "tiny": True})
    return ckpt
