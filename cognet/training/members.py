"""The end of a training run, and ensembles of runs: the decoding tuned on validation, the
checkpoint written (`finish`); and `combine`, the ensemble checkpoint of networks trained
apart (`cognet ensemble`), the same checkpoint `cognet train --members K` writes when its
members are those runs.

`cognet train --members K` trains member i exactly as a one-member run of seed
`member_seed(seed, i)` would, then tunes the decoding on the ensemble; `combine` loads such
runs and does the same tuning, so the two give the same checkpoint (tests/test_ensemble.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cognet.core import strict_json
from cognet.core.dataset import read_dataset
from cognet.core.decoding import Decoding
from cognet.core.decoding.ensemble import MAX_MEMBERS
from cognet.core.errors import InputError
from cognet.core.files import write_text
from cognet.core.history import load_split, train_vocabulary
from cognet.core.vocab import Vocab
from cognet.model import checkpoint
from cognet.model.batching import ddi_adjacency, ehr_adjacency
from cognet.model.checkpoint_checks import read_graphs
from cognet.model.ensemble import Ensemble, members_of
from cognet.model.network import COGNet
from cognet.training.ddi_target import Validation, choose_target
from cognet.training.set_head import HeadRecipe, teacher_marginals, train_head
from cognet.training.tuning import set_decoding_for

# what a member's training record may differ in from another member's: its seed and what
# its run gave (the rest is the recipe, which the members of one ensemble share)
RUN_FIELDS = (
    "seed",
    "best_epoch",
    "weights",
    "epochs_run",
    "data",
    "unknown_codes_val",
    "distilled_from",
)
# fields the training record gained after checkpoints of this format were first written, with
# the value such a checkpoint was trained with (its record lacks them)
ADDED_FIELDS = {
    "ddi_loss": 0.0,
    "ddi_loss_target": None,
    "members": 1,
    "teacher": None,
    "distill_weight": 0.5,
    "distill_samples": 16,
    "distill_temperature": 1.0,
    "head": None,
}
# what a member's record must hold (`cognet train` writes them)
TRAINED = ("seed", "best_epoch", "weights", "epochs_run", "decoding", "set_samples")


@dataclass(frozen=True)
class Tuning:
    """What the end of a run tunes on validation: the stored decoding ("set": threshold
    and set rule tuned; "marginal": the same, and the set head's; "beam"), with `samples`,
    and the DDI target rate or None; and the set head trained on `train_patients` when
    `head` is given (`cognet.training.set_head`, with the members' `history_dropout`)."""

    val_patients: Sequence
    decoding: str
    samples: int
    ddi_target: float | None
    head: HeadRecipe | None = None
    train_patients: Sequence = ()
    seed: int = 0
    history_dropout: float = 0.0
    max_history: int | None = None
    progress: Callable | None = None


@dataclass(frozen=True, eq=False)
class RunRecord:
    """What a training run recorded, for its checkpoint: config.json's "train" fields
    (`info`), each member's seed and chosen weights (`member_runs`, recorded for several
    members) and the epochs' log lines (`history`, train_log.jsonl)."""

    info: dict
    member_runs: list[dict]
    history: list[dict]


def finish(
    out: Path,
    model: COGNet | Ensemble,
    vocab: Vocab,
    graphs: checkpoint.Graphs,
    record: RunRecord,
    tuning: Tuning,
    progress=None,
) -> tuple[Decoding, dict | None]:
    """Tune the decoding (and the DDI target) of `model` on validation and write the
    checkpoint of `model` on `graphs` with its training `record` and train_log.jsonl.
    `progress`: an optional bar factory (`cognet.training.train.train`'s). Returns
    (decoding, target JSON)."""
    info, member_runs, history = record.info, record.member_runs, record.history
    ddi = graphs.ddi_adj
    bars = progress or tuning.progress
    decoding, tuned, target = stored_decoding(model, vocab, ddi > 0, tuning, bars)
    if len(member_runs) > 1:
        info["members"] = len(member_runs)
        info["member_runs"] = member_runs
    info.update(tuned)
    head = None
    if tuning.head is not None:
        head, decoding = _train_head(model, vocab, tuning, decoding)
        if tuning.decoding == "marginal" and tuning.ddi_target is not None:
            target = _target_of(model, vocab, ddi > 0, tuning, decoding, head[0], bars)
    model = model.cpu()
    json = decoding.to_json()
    checkpoint.save(out, model, vocab, graphs, info, checkpoint.Tuned(json, target, head))
    write_text(out / "train_log.jsonl", "".join(strict_json.dumps(r) + "\n" for r in history))
    return decoding, target


def stored_decoding(model, vocab: Vocab, ddi_bool: np.ndarray, tuning: Tuning, progress=None):
    """(the decoding the checkpoint stores, its tuning record, the DDI target as JSON or
    None): beam, or set decoding with its threshold and rule tuned on validation; each
    phase with a bar over the validation visits it decodes when `progress` is given."""
    val = tuning.val_patients
    n_visits = sum(map(len, val))
    decoding = Decoding(name="beam")
    record = {}
    if tuning.decoding in ("set", "marginal"):
        with bar_of(progress, n_visits, "tuning the set decoding") as bar:
            decoding, record = set_decoding_for(model, vocab, val, tuning.samples, bar.update)
    target = None
    if tuning.ddi_target is not None and tuning.decoding != "marginal":  # the head's: after it
        target = _target_of(model, vocab, ddi_bool, tuning, decoding, None, progress)
    return decoding, record, target


def _target_of(model, vocab, ddi_bool, tuning: Tuning, decoding: Decoding, head, progress):
    """The model's default DDI policy and set rule for `tuning.ddi_target`, chosen on
    validation for `decoding` (marginal: over the set `head`'s P(k in S)), as JSON."""
    # no total: the search decodes validation once per policy it tries, as many as needed
    with bar_of(progress, None, f"DDI target {tuning.ddi_target:g} search") as bar:
        target, _ = choose_target(
            model,
            vocab,
            Validation(tuning.val_patients, ddi_bool),
            decoding,
            tuning.ddi_target,
            on_batch=bar.update,
            head=head,
        )
    return target.to_json()


def _train_head(model, vocab: Vocab, tuning: Tuning, decoding: Decoding):
    """(the set head learnt from `model`'s P(k in S) and its record, the stored decoding with
    the head's tuned threshold and rule, named "marginal" when that is the default)."""
    recipe = tuning.head
    patients = tuning.train_patients
    taught = teacher_marginals(
        model, vocab, patients, tuning.samples, tuning.max_history, tuning.progress
    )
    with bar_of(tuning.progress, recipe.epochs, "set head", unit="epoch") as bar:
        head, tuned, record = train_head(
            recipe,
            vocab,
            patients,
            taught,
            tuning.val_patients,
            tuning.seed,
            tuning.history_dropout,
            tuning.max_history,
            on_epoch=lambda _: bar.update(1),
        )
    teacher = {"members": len(members_of(model)), "samples": tuning.samples}
    record["teacher"] = {**teacher, "weights_sha256": weights_digest(model)}
    name = "marginal" if tuning.decoding == "marginal" else decoding.name
    threshold, rule = tuned.selection
    return (head, record), decoding.with_changes(
        name=name, head_threshold=threshold, head_rule=rule
    )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def bar_of(progress, total: int | None, desc: str, unit: str = "visit"):
    """A bar from the factory `progress` (one that does nothing without), closed after."""
    bar = progress(total=total, desc=desc, unit=unit) if progress else _NoBar()
    try:
        yield bar
    finally:
        bar.close()


def combine(checkpoints: Sequence[str | Path], data_dir: str | Path, out: str | Path) -> dict:
    """Write to `out` the ensemble of the one-network checkpoints `checkpoints`, trained
    apart on the dataset `data_dir` with one recipe: the decoding tuned on its validation
    split as `cognet train` tunes it. InputError (exit 2) when there are fewer than two or
    more than MAX_MEMBERS, when one is itself an ensemble, when two hold the same weights
    (`weights_digest`: one run given twice, by any path), or when they differ in anything
    but their seed and what their runs gave (vocabulary, network, graphs, recipe), naming
    the checkpoint and what differs. Returns the stored decoding and DDI target."""
    if not 2 <= len(checkpoints) <= MAX_MEMBERS:
        raise InputError(
            f"an ensemble needs 2 to {MAX_MEMBERS} checkpoints, not {len(checkpoints)}"
        )
    dataset, vocab, train_data, val_data = read_splits(data_dir)
    ehr = ehr_adjacency(train_data.patients, vocab.n_med)
    ddi = ddi_adjacency(dataset.ddi_pairs, vocab)
    nets, runs, history = [], [], []
    first: dict | None = None
    last: dict = {}
    seen: dict[str, str | Path] = {}  # the members' weights digests
    for i, path in enumerate(checkpoints):
        model, member_vocab, config = checkpoint.load(path)
        if len(members_of(model)) > 1:
            raise InputError(f"{path}: already an ensemble ({config['members']} members)")
        digest = weights_digest(model)
        if digest in seen:  # the same path twice, a link to it or a copy: one run, not two
            raise InputError(
                f"{path}: the same weights as {seen[digest]} (one run given twice); the "
                "members of an ensemble are runs trained apart (other seeds)"
            )
        seen[digest] = path
        train = {**ADDED_FIELDS, **_untuned(config["train"])}
        lacking = [k for k in TRAINED if k not in train]
        if lacking:
            raise InputError(f"{path}: not a run of cognet train (config.json lacks {lacking[0]})")
        recipe = {k: v for k, v in train.items() if k not in RUN_FIELDS}
        first = recipe if first is None else first
        _same(path, "training recipe", recipe, first, checkpoints[0])
        _same(path, "vocabulary", member_vocab.to_json(), vocab.to_json(), data_dir)
        _same(
            path,
            "DDI pairs",
            config.get("ddi_pairs", []),
            [list(p) for p in dataset.ddi_pairs],
            data_dir,
        )
        graphs = read_graphs(Path(path), vocab.n_med)
        for name, have, want in zip(("EHR graph", "DDI graph"), graphs, (ehr, ddi), strict=True):
            if not np.array_equal(have, want):
                raise InputError(f"{path}: its {name} is not that of {data_dir}'s train split")
        last = config["train"]  # as written: the fields filled in above only compare
        nets.append(model)
        runs.append({k: train[k] for k in ("seed", "best_epoch", "weights", "epochs_run")})
        history += [{**r, "member": i} for r in _log(Path(path))]
    assert first is not None
    # the last member's record, as `cognet train` keeps (without its own tuning's)
    info = _untuned(last)
    info.update(seed=runs[0]["seed"], data=str(data_dir), unknown_codes_val=val_data.unknown_codes)
    limit = first.get("val_max_patients")
    val = val_data.patients[:limit] if limit else val_data.patients
    recipe = first.get("head")
    tuning = Tuning(
        val,
        first["decoding"],
        first["set_samples"],
        first.get("ddi_target"),
        head=None if recipe is None else HeadRecipe(**recipe),
        train_patients=train_data.patients,
        seed=runs[0]["seed"],
        history_dropout=first.get("history_dropout", 0.0),
        max_history=first.get("max_history"),
    )
    graphs = checkpoint.Graphs(ehr, ddi, dataset.ddi_pairs)
    record = RunRecord(info, runs, history)
    decoding, target = finish(Path(out), Ensemble(nets), vocab, graphs, record, tuning)
    return {"decoding": decoding.to_json(), "ddi_target": target, "members": runs}


def attach_head(
    teacher: str | Path,
    data_dir: str | Path,
    out: str | Path,
    recipe: HeadRecipe,
    decoding: str,
    progress: Callable | None = None,
) -> dict:
    """Write to `out` the checkpoint `teacher` (trained by `cognet train` or `cognet
    ensemble` on the dataset `data_dir`) with a set head learnt from it, as `cognet train`
    trains one after its members: the same members, the decoding tuned again on validation
    (`decoding`: the default to store). InputError when the checkpoint is not one of that
    dataset's train split. Returns the stored decoding and DDI target."""
    dataset, vocab, train_data, val_data = read_splits(data_dir)
    model, have, config = checkpoint.load(teacher)
    _same(teacher, "vocabulary", have.to_json(), vocab.to_json(), data_dir)
    ehr = ehr_adjacency(train_data.patients, vocab.n_med)
    ddi = ddi_adjacency(dataset.ddi_pairs, vocab)
    graphs = read_graphs(Path(teacher), vocab.n_med)
    for name, got, want in zip(("EHR graph", "DDI graph"), graphs, (ehr, ddi), strict=True):
        if not np.array_equal(got, want):
            raise InputError(f"{teacher}: its {name} is not that of {data_dir}'s train split")
    train = {**ADDED_FIELDS, **_untuned(config["train"])}
    lacking = [k for k in TRAINED if k not in train]
    if lacking:
        raise InputError(f"{teacher}: not a run of cognet train (config.json lacks {lacking[0]})")
    runs = train.pop("member_runs", None) or [
        {k: train[k] for k in ("seed", "best_epoch", "weights", "epochs_run")}
    ]
    info = {**train, "head": asdict(recipe)}
    limit = train.get("val_max_patients")
    val = val_data.patients[:limit] if limit else val_data.patients
    tuning = Tuning(
        val,
        decoding,
        train["set_samples"],
        train.get("ddi_target"),
        head=recipe,
        train_patients=train_data.patients,
        seed=train["seed"],
        history_dropout=train.get("history_dropout", 0.0),
        max_history=train.get("max_history"),
        progress=progress,
    )
    graphs = checkpoint.Graphs(ehr, ddi, dataset.ddi_pairs)
    record = RunRecord(info, runs, _log(Path(teacher)))
    stored, target = finish(Path(out), model, vocab, graphs, record, tuning)
    return {"decoding": stored.to_json(), "ddi_target": target}


def weights_digest(model) -> str:
    """sha256 over a network's tensors (names, types, shapes, values) in name order: the
    same for a checkpoint, a link to it and a copy, whatever their paths or files' bytes."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        h.update(data.numpy().tobytes())
    return h.hexdigest()


def read_splits(data_dir: str | Path):
    """(dataset, train vocabulary, train split, val split); an InputError when either split
    has no visit with known medications, said before any epoch."""
    dataset = read_dataset(data_dir)
    vocab = train_vocabulary(dataset.visits)
    train_data = load_split(dataset.visits, vocab, "train")
    val_data = load_split(dataset.visits, vocab, "val")
    for split, data in (("train", train_data), ("val", val_data)):
        if not data.patients:  # said before any epoch
            raise InputError(
                f"{data_dir}: the {split} split has no visit with known medications "
                "(training learns on train and keeps the best epoch on val)"
            )
    return dataset, vocab, train_data, val_data


def _untuned(train: dict) -> dict:
    """A training record without what the run's own decoding tuning added (`finish`
    records the ensemble's)."""
    return {k: v for k, v in train.items() if not k.startswith("val_jaccard")}


def _same(path, what: str, have, want, other) -> None:
    if have != want:
        if isinstance(have, dict) and isinstance(want, dict):
            key = next(k for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k))
            what = f"{what} ({key}: {have.get(key)!r:.60} against {want.get(key)!r:.60})"
        raise InputError(f"{path}: not the same {what} as {other}; members must share it")


def _log(path: Path) -> list[dict]:
    """The epoch records of a checkpoint's train_log.jsonl (none when it has none)."""
    log = path / "train_log.jsonl"
    if not log.is_file():
        return []
    records = []
    for n, line in enumerate(log.read_text().splitlines(), 1):
        try:
            record = strict_json.loads(line)
        except ValueError as exc:
            raise InputError(f"{log}: line {n}: not a JSON record ({exc})") from None
        if not isinstance(record, dict):
            raise InputError(f"{log}: line {n}: not a JSON object")
        records.append(record)
    return records
