"""Checkpoint directories: config.json, vocab.json, model.safetensors, graphs.npz, train_log.jsonl.

Loading never executes code: JSON, safetensors and a pickle-free npz. `load` checks what it
reads (`cognet.model.checkpoint_checks`): files, hashes, vocabulary sizes, weight shapes.

A checkpoint may also hold a set head (`cognet.model.set_head`, the one-pass decoding):
head.safetensors, its configuration and training record under config.json "head", its
sha256 beside the others'. `load` ignores it; `load_head` reads it.

An ensemble (`cognet.model.ensemble.Ensemble`) is one checkpoint: config.json says how many
members (`"members"`, absent for one network), model.safetensors holds member i's weights
under `members.<i>.`, and the members share the configuration, vocabulary and graphs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

from cognet.core import strict_json
from cognet.core.errors import InputError, one_line, writing
from cognet.core.file_schemas import HEAD_FILE
from cognet.core.files import atomic_path
from cognet.core.vocab import Vocab
from cognet.model import checkpoint_checks as checks
from cognet.model.ensemble import Ensemble
from cognet.model.network import COGNet, ModelConfig
from cognet.model.set_head import HeadConfig, SetHead

FORMAT_VERSION = 1
FILES = checks.FILES  # defined there, torch-free, for the command lines


@dataclass(frozen=True, eq=False)
class Graphs:
    """The graphs a model is built on, saved with it: the EHR and DDI adjacencies, [M, M]
    (graphs.npz), and the DDI pairs the DDI adjacency comes from (config.json "ddi_pairs")."""

    ehr_adj: np.ndarray
    ddi_adj: np.ndarray
    ddi_pairs: Sequence[tuple[str, str]]


@dataclass(frozen=True, eq=False)
class Tuned:
    """What tuning on validation adds to a checkpoint: the model's default decoding and DDI
    target as JSON (None: none stored), and a set head with its training record (written to
    head.safetensors)."""

    decoding: dict | None = None
    ddi_target: dict | None = None
    head: tuple[SetHead, dict] | None = None


def save(
    out: str | Path,
    model: COGNet | Ensemble,
    vocab: Vocab,
    graphs: Graphs,
    train_config: dict,
    tuned: Tuned = Tuned(),
) -> Path:
    """Write the checkpoint: every file atomically (`cognet.core.files.atomic_path`), the
    weights first, config.json (holding the sha256 of the others: `checkpoint_checks`) last,
    so a checkpoint is complete once config.json is there. A failed write (a full disk)
    raises OutputError naming the file and leaves no new file behind."""
    ehr_adj, ddi_adj, ddi_pairs = graphs.ehr_adj, graphs.ddi_adj, graphs.ddi_pairs
    decoding, ddi_target, head = tuned.decoding, tuned.ddi_target, tuned.head
    out = Path(out)
    created = not out.is_dir()
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    state = _state(model)
    done = False
    try:
        # FILES holds config.json first: the stack renames it into place last
        with ExitStack() as stack:
            names = (*FILES, HEAD_FILE) if head is not None else FILES
            tmp = {name: stack.enter_context(atomic_path(out / name)) for name in names}
            with writing(out / "vocab.json"):  # each failure names its own file
                write_json(tmp["vocab.json"], vocab.to_json())
            with writing(out / "model.safetensors"):
                save_file(state, str(tmp["model.safetensors"]))
            with writing(out / "graphs.npz"), open(tmp["graphs.npz"], "wb") as f:
                np.savez(f, ehr=ehr_adj.astype(np.float32), ddi=ddi_adj.astype(np.float32))
            hashed = list(checks.HASHED)
            if head is not None:
                with writing(out / HEAD_FILE):
                    save_file(_state(head[0]), str(tmp[HEAD_FILE]))
                hashed.append(HEAD_FILE)
            config = {
                "format_version": FORMAT_VERSION,
                "model": model.cfg.to_json(),
                "train": train_config,
                "ddi_pairs": [list(p) for p in ddi_pairs],
                "sha256": checks.file_hashes({n: tmp[n] for n in hashed}),
            }
            if isinstance(model, Ensemble):
                config["members"] = len(model.members)
            if decoding is not None:  # the model's default decoding (`cognet.core.decoding`)
                config["decoding"] = decoding
            if ddi_target is not None:  # the model's default DDI policy (`DDITarget`)
                config["ddi_target"] = ddi_target
            if head is not None:
                config["head"] = {"config": head[0].cfg.to_json(), "training": head[1]}
            with writing(out / "config.json"):
                write_json(tmp["config.json"], config)
        done = True
    finally:
        if created and not done and not any(out.iterdir()):
            out.rmdir()
    return out


def load(path: str | Path, device: str = "cpu") -> tuple[COGNet | Ensemble, Vocab, dict]:
    """Rebuild the model from a checkpoint directory: (model in eval mode: a `COGNet`, or
    an `Ensemble` for a checkpoint of several members; vocab; config).

    The one loader of `cognet evaluate`, `cognet-export` and the benchmarks: a missing,
    damaged or mismatched file raises InputError naming it (`checkpoint_checks`)."""
    path = Path(path)
    for name in FILES:
        if not (path / name).is_file():
            raise InputError(f"{path}: not a cognet checkpoint (missing {name})")
    checks.check_files(path, FILES)
    config = checks.read_json(path / "config.json")
    if config.get("format_version") != FORMAT_VERSION:
        raise InputError(
            f"{path / 'config.json'}: unsupported checkpoint format version "
            f"{config.get('format_version')!r} (expected {FORMAT_VERSION})"
        )
    count = checks.members(path, config)  # its own line, before the other fields
    checks.check_config(path, config)  # every field, before any is used
    checks.check_hashes(path, config)
    vocab = checks.read_vocab(path)
    try:
        cfg = ModelConfig.from_json(config["model"])
    except (KeyError, TypeError, ValueError) as exc:
        detail = one_line(exc)
        raise InputError(f"{path / 'config.json'}: malformed model entry ({detail})") from None
    checks.check_sizes(path, vocab, cfg)
    checks.check_capacity(path, cfg)
    ehr, ddi = checks.read_graphs(path, cfg.n_med)
    nets = [COGNet(cfg, ehr, ddi) for _ in range(count)]
    model = nets[0] if count == 1 else Ensemble(nets)
    weights = checks.read_weights(path)
    checks.check_weights(path, model.state_dict(), weights)
    model.load_state_dict(weights)
    return model.to(device).eval(), vocab, config


def load_head(path: str | Path, config: dict) -> SetHead | None:
    """The set head of a checkpoint that `load` read (its `config`), or None when it has
    none; a missing, damaged or mismatched head.safetensors raises InputError naming it."""
    if "head" not in config:
        return None
    path = Path(path)
    checks.check_files(path, (HEAD_FILE,))
    file = path / HEAD_FILE
    if not file.is_file():
        raise InputError(f"{path}: config.json names a set head but {HEAD_FILE} is missing")
    recorded = (config.get("sha256") or {}).get(HEAD_FILE)
    if recorded is not None and recorded != checks.file_sha256(file):
        raise InputError(
            f"{file}: sha256 differs from the one config.json recorded at training "
            "(file damaged or replaced); restore the checkpoint or train again"
        )
    try:
        cfg = HeadConfig.from_json(config["head"]["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path / 'config.json'}: malformed head ({one_line(exc)})") from None
    head = SetHead(cfg)
    weights = checks.read_weights(path, HEAD_FILE)
    checks.check_weights(path, head.state_dict(), weights, HEAD_FILE)
    head.load_state_dict(weights)
    return head.eval()


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over the checkpoint's files (its set head's too, when it has one), in a
    fixed order."""
    h = hashlib.sha256()
    head = (Path(path) / HEAD_FILE).is_file()
    for name in (*FILES, HEAD_FILE) if head else FILES:
        h.update(name.encode())
        h.update((Path(path) / name).read_bytes())
    return h.hexdigest()


def _state(module) -> dict:
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}


def write_json(path: Path, obj: dict) -> None:
    path.write_text(strict_json.dumps(obj, indent=1) + "\n")
