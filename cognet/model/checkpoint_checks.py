"""What `cognet.model.checkpoint.load` checks before it trusts a checkpoint directory, so that a
damaged or mixed-up checkpoint is refused with one line naming the file (InputError, exit 2)
instead of a raw exception or, worse, a model that silently answers differently.

- Every file parses (`read_json`, `read_graphs`, `read_weights`), and config.json holds what a
  model is rebuilt from.
- The sha256 of vocab.json, model.safetensors and graphs.npz, recorded in config.json under
  "sha256" when the checkpoint is saved (`file_hashes`), matches (`check_hashes`). config.json
  is not hashed: its notes (the decoding, the training log) may be added to later. A
  checkpoint saved before the hashes skips this check.
- The vocabulary's sizes match the model's (`check_sizes`) and every weight has the shape the
  model needs (`check_weights`): a vocabulary cut by a few codes would shift every id.
- Every field of config.json and vocab.json has the type and range of its schema
  (`cognet.core.file_schemas`: `CONFIG`, `VOCAB`; `check_config` adds what ties fields together)
  and the model's sizes fit the weights file before the model is built (`check_capacity`:
  `dim: 1e7` is refused, not allocated).
- Every file is a plain name inside the checkpoint directory once symlinks are resolved
  (`cognet.core.files.confined`), checked before it is opened.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from cognet.core import strict_json
from cognet.core.ddi import DDITarget
from cognet.core.decoding import Decoding
from cognet.core.decoding.ensemble import MAX_MEMBERS
from cognet.core.errors import InputError, one_line
from cognet.core.file_schemas import CONFIG, MEMBERS, VOCAB
from cognet.core.files import confined
from cognet.core.json_schema import FieldError, checked, show
from cognet.core.manifest import file_sha256
from cognet.core.vocab import Vocab

HASHED = ("vocab.json", "model.safetensors", "graphs.npz")
FILES = ("config.json", *HASHED)  # a checkpoint's files (the set head's aside)


def file_hashes(files: Mapping[str, Path]) -> dict[str, str]:
    """{name: sha256} of the files that config.json vouches for ({name: where it is now})."""
    return {name: file_sha256(where) for name, where in files.items()}


def members(path: Path, config: dict) -> int:
    """The number of networks a checkpoint's config.json declares (1 when it names none)."""
    count = config.get("members", 1)
    try:
        MEMBERS.check(count, "members")
    except FieldError:
        raise InputError(
            f"{path / 'config.json'}: members must be an integer in [1, {MAX_MEMBERS}], "
            f"not {show(count)}"
        ) from None
    return count


def read_json(path: Path) -> dict:
    try:
        obj = strict_json.loads(path.read_text())  # NaN and Infinity are refused
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{path}: unreadable ({_short(exc)})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}: unreadable (not a JSON object)")
    return obj


def check_hashes(path: Path, config: Mapping) -> None:
    """InputError naming the first hashed file that differs from config.json's record."""
    recorded = config.get("sha256")  # its form checked by `check_config`
    if recorded is None:
        return  # saved before the hashes
    for name in HASHED:
        if recorded[name] != file_sha256(path / name):
            raise InputError(
                f"{path / name}: sha256 differs from the one config.json recorded at training "
                "(file damaged or replaced); restore the checkpoint or train again"
            )


def check_config(path: Path, config: Mapping) -> None:
    """InputError naming config.json and the field unless every field has the type and range
    of its schema (`cognet.core.file_schemas.CONFIG`) and they agree: heads divide dim, the stored
    decoding and DDI target have their own ranges (`Decoding`, `DDITarget`)."""
    file = path / "config.json"
    checked(config, CONFIG, file)

    def bad(name: str, why: str) -> InputError:
        return InputError(f"{file}: field {name!r}: {why}")

    model = config["model"]
    heads, dim = model.get("heads", 1), model.get("dim", 1)
    if dim % heads:
        raise bad("model.heads", f"{heads} does not divide dim {dim}")
    try:
        Decoding.from_json(config.get("decoding"))
    except (TypeError, ValueError) as exc:
        raise bad("decoding", one_line(exc)) from None
    try:  # the stored DDI target, read again where it is used (`cognet.evaluation.evaluate`)
        DDITarget.from_json(config.get("ddi_target"))
    except (KeyError, TypeError, ValueError) as exc:
        raise bad("ddi_target", one_line(exc)) from None


def check_files(path: Path, names: Sequence[str]) -> None:
    """InputError unless each file is a plain name inside the checkpoint directory."""
    for name in names:
        confined(path, name, f"{path}: checkpoint file")


def check_capacity(path: Path, model_cfg) -> None:
    """InputError naming config.json unless model.safetensors holds at least the weights the
    model's sizes imply (its embeddings and feed-forward layers), read from the file's
    header: sizes that do not fit are refused before the model is allocated."""
    from safetensors import safe_open

    file = path / "model.safetensors"
    try:
        with safe_open(str(file), framework="np") as f:
            stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
        raise InputError(f"{file}: unreadable weights ({_short(exc)})") from None
    c = model_cfg
    ffn = c.ffn + (c.dec_ffn or c.ffn)
    needed = c.dim * (c.n_diag + c.n_proc + c.n_med + ffn)
    if needed > stored:
        raise InputError(
            f"{path / 'config.json'}: field 'model.dim': dim {c.dim}, ffn {c.ffn} and the "
            f"vocabulary need at least {needed:,} weights; {file.name} holds {stored:,}"
        )


def read_vocab(path: Path) -> Vocab:
    file = path / "vocab.json"
    try:
        return Vocab.from_json(checked(read_json(file), VOCAB, file))
    except InputError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{file}: malformed vocabulary ({_short(exc)})") from None


def check_sizes(path: Path, vocab: Vocab, model_cfg) -> None:
    """InputError naming vocab.json when its code lists and the model's sizes differ."""
    for kind, size, want in (
        ("diagnoses", vocab.n_diag, model_cfg.n_diag),
        ("procedures", vocab.n_proc, model_cfg.n_proc),
        ("medications", vocab.n_med, model_cfg.n_med),
    ):
        if size != want:
            raise InputError(
                f"{path / 'vocab.json'}: {size} {kind}, but the model was built for {want} "
                "(vocabulary and weights of different trainings?)"
            )


def read_graphs(path: Path, n_med: int) -> tuple[np.ndarray, np.ndarray]:
    """The EHR and DDI adjacency [M, M] of graphs.npz (pickle-free)."""
    file = path / "graphs.npz"
    try:
        with np.load(file, allow_pickle=False) as graphs:
            ehr, ddi = graphs["ehr"], graphs["ddi"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        # a file cut short or garbled: checkpoints older than their sha256 record meet it here
        raise InputError(f"{file}: unreadable ({_short(exc)})") from None
    for name, graph in (("ehr", ehr), ("ddi", ddi)):
        if graph.shape != (n_med, n_med):
            raise InputError(
                f"{file}: {name} graph is {graph.shape}, the model needs ({n_med}, {n_med})"
            )
    return ehr, ddi


def read_weights(path: Path, name: str = "model.safetensors") -> dict:
    """The tensors of model.safetensors, or of `name` (a truncated or garbled file:
    InputError)."""
    from safetensors.torch import load_file

    file = path / name
    try:
        return load_file(str(file), device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
        raise InputError(f"{file}: unreadable weights ({_short(exc)})") from None


def check_weights(
    path: Path, expected: Mapping, weights: Mapping, name: str = "model.safetensors"
) -> None:
    """InputError unless `weights` (of the file `name`) holds exactly the tensors of
    `expected` (a model's state_dict), shape for shape, every value finite."""
    file = path / name
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has an unknown tensor {extra[0]}"
        raise InputError(f"{file}: {what} (not the weights of this model's config.json)")
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise InputError(
                f"{file}: {name} has shape {tuple(weights[name].shape)}, config.json and "
                f"vocab.json need {tuple(tensor.shape)}"
            )
        if weights[name].is_floating_point() and not weights[name].isfinite().all():
            raise InputError(
                f"{file}: {name} holds values that are not finite numbers (NaN or infinity): "
                "a diverged training; train again"
            )


def _short(exc: BaseException) -> str:
    return one_line(exc)[:200]
