"""Checkpoint directories: config.json, vocab.json, model.safetensors, graphs.npz, train_log.jsonl.

Loading never executes code: JSON, safetensors and a pickle-free npz.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file

from cognet.core.errors import InputError
from cognet.core.vocab import Vocab
from cognet.model import COGNet, ModelConfig

FORMAT_VERSION = 1
FILES = ("config.json", "vocab.json", "model.safetensors", "graphs.npz")


def save(
    out: str | Path,
    model: COGNet,
    vocab: Vocab,
    ehr_adj: np.ndarray,
    ddi_adj: np.ndarray,
    ddi_pairs: list[tuple[str, str]],
    train_config: dict,
    decoding: dict | None = None,
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "format_version": FORMAT_VERSION,
        "model": model.cfg.to_json(),
        "train": train_config,
        "ddi_pairs": [list(p) for p in ddi_pairs],
    }
    if decoding is not None:  # the model's default decoding (`cognet.core.decoding`)
        config["decoding"] = decoding
    _write_json(out / "config.json", config)
    _write_json(out / "vocab.json", vocab.to_json())
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors.tmp"))
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    np.savez(out / "graphs.tmp.npz", ehr=ehr_adj.astype(np.float32), ddi=ddi_adj.astype(np.float32))
    os.replace(out / "graphs.tmp.npz", out / "graphs.npz")
    return out


def load(path: str | Path, device: str = "cpu") -> tuple[COGNet, Vocab, dict]:
    """Rebuild the model from a checkpoint directory: (model in eval mode, vocab, config)."""
    path = Path(path)
    for name in FILES:
        if not (path / name).is_file():
            raise InputError(f"{path}: not a cognet checkpoint (missing {name})")
    config = json.loads((path / "config.json").read_text())
    if config.get("format_version") != FORMAT_VERSION:
        raise InputError(
            f"{path / 'config.json'}: unsupported checkpoint format version "
            f"{config.get('format_version')!r} (expected {FORMAT_VERSION})"
        )
    vocab = Vocab.from_json(json.loads((path / "vocab.json").read_text()))
    with np.load(path / "graphs.npz", allow_pickle=False) as graphs:
        ehr, ddi = graphs["ehr"], graphs["ddi"]
    model = COGNet(ModelConfig.from_json(config["model"]), ehr, ddi)
    model.load_state_dict(load_file(str(path / "model.safetensors"), device="cpu"))
    return model.to(device).eval(), vocab, config


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over the checkpoint's files, in a fixed order."""
    h = hashlib.sha256()
    for name in FILES:
        h.update(name.encode())
        h.update((Path(path) / name).read_bytes())
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
