"""CUDA checks (marked `gpu`, skipped without a GPU): the torch model and the reference
beam search give the CPU's answers on a GPU, and training runs there."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from tiny import make_tiny

from cognet import checkpoint
from cognet.evaluate import decode_patients, load_split

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_beam_search_on_cuda_equals_cpu(tmp_path):
    data, ckpt = make_tiny(tmp_path, n_patients=60)
    model, vocab, _ = checkpoint.load(ckpt)
    patients = load_split(pq.read_table(data / "visits.parquet"), vocab, "test").patients
    cpu = decode_patients(model, vocab, patients, beam=4)
    gpu = decode_patients(model.to("cuda"), vocab, patients, beam=4)
    assert [d.meds for d in gpu] == [d.meds for d in cpu]
    assert max(abs(a.score - b.score) for a, b in zip(gpu, cpu, strict=True)) < 1e-3


def test_training_on_cuda(tmp_path):
    from cognet.train import TrainConfig, train

    data, _ = make_tiny(tmp_path, n_patients=45)
    best = train(data, tmp_path / "ckpt", TrainConfig(epochs=2, device="cuda"))
    assert best["epoch"] in (1, 2)
    model, _, _ = checkpoint.load(tmp_path / "ckpt")
    assert next(model.parameters()).device.type == "cpu"
