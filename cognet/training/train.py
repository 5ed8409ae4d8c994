"""Training: Adam with teacher forcing on the copy-or-predict mixture; a validation score
every epoch (teacher-forced NLL, or greedy Jaccard for the reference recipe), early stopping
on it, the weights chosen on validation (best epoch, or the average of the last epochs),
the set decoding's threshold tuned on validation; a safetensors checkpoint."""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cognet.core.dataset import DDI_FILE
from cognet.core.ddi import require_pairs
from cognet.core.decoding import DECODINGS, SAMPLES, Decoding
from cognet.core.decoding.ensemble import MAX_MEMBERS, member_seed
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.errors import InputError
from cognet.core.files import writable_folder
from cognet.core.metrics import evaluation_report, visit_results
from cognet.core.strict_json import finite
from cognet.core.vocab import Vocab
from cognet.model.batching import IGNORE, ddi_adjacency, ehr_adjacency, make_batch
from cognet.model.checkpoint import Graphs
from cognet.model.ensemble import Ensemble
from cognet.model.network import COGNet, ModelConfig
from cognet.model.torch_decoding import decode_patients
from cognet.training.loss import aux_loss, ddi_terms, ramp, teacher_forced
from cognet.training.members import RunRecord, Tuning, bar_of, finish, read_splits
from cognet.training.set_head import HeadRecipe
from cognet.training.tuning import choose_average, validation_nll

log = logging.getLogger(__name__)

# how far above --ddi-loss-target a batch's predicted DDI rate gives the DDI term its whole
# weight (SafeDrug's Kp)
DDI_RAMP = 0.05


# Training recipes (`cognet train --recipe`): overrides of TrainConfig's defaults.
# - default: what won on the synthetic validation split (user guide "Training recipe"):
#   embedding size 128 and the authors' embedding and attention dropout (compared on
#   validation), residual dropout 0.3, 2 heads, feed-forward 512; at most 36 epochs;
#   validation NLL every epoch, early stopping on it, the weights averaged over the last
#   epochs (the window of lowest validation NLL), and set decoding with a threshold and a
#   set rule chosen on validation; history dropout 0.6, chosen on the real MIMIC-III
#   validation split.
# - reference: the authors' architecture and regularisation (their public code): embedding
#   size 64, embedding dropout 0.3, attention dropout 0.2, 2 heads, feed-forward 2048 in the
#   encoders and 128 in the decoder, a GCN whose first layer both graphs share, with biases;
#   200 epochs without early stopping (cap them with --epochs), the epoch of best validation
#   Jaccard (greedy) kept, the paper's beam search.
RECIPES = {
    "default": {},
    "reference": {
        "epochs": 200,
        "patience": None,
        "dim": 64,
        "heads": 2,
        "ffn": 2048,
        "dec_ffn": 128,
        "dropout": 0.2,
        "emb_dropout": 0.3,
        "attn_dropout": 0.2,
        "shared_gcn": True,
        "select": "jaccard",
        "average": (1,),
        "decoding": "beam",
        "history_dropout": 0.0,
        "members": 1,
        "head": None,
    },
}


# The default recipe's network (ModelConfig's own defaults are the paper's: 64 / 4 / 128); its
# vocabulary sizes are placeholders, set from the data (`TrainConfig.model_config`).
DEFAULT_MODEL = ModelConfig(
    n_diag=1,
    n_proc=1,
    n_med=1,
    dim=128,  # the paper's 64 scored lower on the synthetic validation split
    heads=2,
    ffn=512,
    dropout=0.3,
    emb_dropout=0.3,  # the authors' values: better on validation at dim 128 too
    attn_dropout=0.2,
)
# the fields of ModelConfig that a recipe or `cognet train` may change
MODEL_FIELDS = {f.name for f in fields(ModelConfig)} - {"n_diag", "n_proc", "n_med"}


@dataclass(frozen=True)
class TrainConfig:
    # at most; early stopping ends the default recipe sooner (its epochs: docs/guide/results.md)
    epochs: int = 36
    lr: float = 1e-3  # the authors' code; 1e-4 (the paper's text) learns slower
    batch_size: int = 16  # patients per step (each brings all its visits)
    seed: int = 0
    patience: int | None = 4  # epochs without a better validation score before stopping
    weight_decay: float = 0.0
    grad_clip: float = 5.0
    lr_decay: float = 1.0  # the learning rate is multiplied by this after every epoch
    # weight of the auxiliary multi-label loss (`cognet.training.loss.aux_loss`); 0: off,
    # the head not even built
    aux_loss: float = 0.0
    # share of decoder input medications replaced by the model's own prediction
    # (`cognet.training.loss.teacher_forced`)
    scheduled_sampling: float = 0.0
    # share of the training visits with a history decoded without it, as first visits are,
    # each epoch anew: the no-history path then learns from every visit, not only from
    # each patient's first. 0.6 won on the real MIMIC-III validation split (user guide
    # "Training recipe")
    history_dropout: float = 0.6
    # weight of the DDI term (`cognet.training.loss.ddi_loss`: the expected interacting pairs
    # each step adds); 0: off
    ddi_loss: float = 0.0
    # SafeDrug's ramp: the DDI term's weight is `ddi_loss` times 0 while a batch's predicted
    # DDI rate is <= this, rising to 1 at DDI_RAMP above it (`cognet.training.loss.ramp`);
    # None: always `ddi_loss`
    ddi_loss_target: float | None = None
    # the network's hyper-parameters; its vocabulary sizes come from the data (`model_config`)
    model: ModelConfig = DEFAULT_MODEL
    max_history: int | None = None  # past visits used as history (None = all)
    device: str = "cpu"
    val_max_patients: int | None = 2000  # cap on validation patients scored each epoch
    # the validation score of an epoch: "nll" (teacher-forced, cheap) or "jaccard" (greedy)
    select: str = "nll"
    # sizes of the windows of consecutive epochs, ending at the best epoch or later, whose
    # averaged weights are tried (1 = one epoch); the lowest validation NLL wins
    average: tuple[int, ...] = (1, 3, 5, 7)
    # the checkpoint's default decoding: "marginal" (the set head's one pass, tuned; with a
    # head), "set" (tuned; the default without a head) or "beam". None: the default
    decoding: str | None = None
    set_samples: int = SAMPLES
    recipe: str = "default"
    # choose a DDI policy and threshold on validation for this DDI rate
    # (`cognet.training.ddi_target`)
    ddi_target: float | None = None
    # networks trained apart (member i with seed `member_seed(seed, i)`) and decoded as one
    # model (`cognet.core.decoding.ensemble`). 2 won on the real MIMIC-III validation split
    # (user guide "Training recipe"), at twice the training and decoding cost
    members: int = 2
    # the set head (`cognet.training.set_head`): learnt from the trained model's own
    # P(k in S) after the members, for the one-pass `marginal` decoding; None: no head
    head: HeadRecipe | None = HeadRecipe()

    def __post_init__(self) -> None:
        if self.decoding is None:  # the one-pass decoding when there is a head to read
            object.__setattr__(self, "decoding", "set" if self.head is None else "marginal")
        for name, kind in self.__annotations__.items():  # NaN passes every range check below
            value = getattr(self, name)
            if kind.startswith("float") and value is not None:
                finite(value, name)
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("epochs and batch_size must be >= 1 and lr > 0")
        if self.select not in ("nll", "jaccard") or self.decoding not in DECODINGS:
            raise ValueError(f"select must be nll or jaccard, decoding one of {DECODINGS}")
        if self.patience is not None and self.patience < 1:
            raise ValueError("patience must be >= 1 (or None: no early stopping)")
        if not 1 <= self.members <= MAX_MEMBERS:
            raise ValueError(f"members must be in [1, {MAX_MEMBERS}]")
        if not self.average or min(self.average) < 1:
            raise ValueError("average: window sizes >= 1")
        if not 0 < self.lr_decay <= 1 or self.aux_loss < 0 or self.ddi_loss < 0:
            raise ValueError("lr_decay must be in (0, 1], aux_loss and ddi_loss >= 0")
        ramp_target = self.ddi_loss_target
        if ramp_target is not None and (self.ddi_loss <= 0 or not 0 <= ramp_target <= 1):
            raise ValueError("--ddi-loss-target needs --ddi-loss > 0 and a DDI rate in [0, 1]")
        if not 0 <= self.history_dropout < 1 or not 0 <= self.scheduled_sampling <= 1:
            raise ValueError("history_dropout must be in [0, 1), scheduled_sampling in [0, 1]")
        target = self.ddi_target
        if target is not None and (self.decoding == "beam" or not 0 <= target <= 1):
            raise ValueError("--ddi-target needs set or marginal decoding, a DDI rate in [0, 1]")
        if self.head is not None and not isinstance(self.head, HeadRecipe):
            raise ValueError(f"head must be a HeadRecipe or None, not {self.head!r}")
        if self.decoding == "marginal" and self.head is None:
            raise ValueError("the marginal decoding reads the set head: train one")
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"model must be a ModelConfig, not {self.model!r}")

    @classmethod
    def from_recipe(cls, recipe: str = "default", **changes) -> TrainConfig:
        """The recipe's configuration with `changes` (None values ignored) on top; a change
        naming a field of ModelConfig (dim, heads, dropout, ...) goes to `model`."""
        if recipe not in RECIPES:
            raise ValueError(f"unknown recipe {recipe!r}; choose from {', '.join(RECIPES)}")
        asked = {**RECIPES[recipe], **{k: v for k, v in changes.items() if v is not None}}
        network = {k: asked.pop(k) for k in MODEL_FIELDS & asked.keys()}
        model = asked.pop("model", DEFAULT_MODEL)
        return cls(recipe=recipe, model=replace(model, **network), **asked)

    def model_config(self, vocab: Vocab) -> ModelConfig:
        """The model's configuration for a vocabulary."""
        return replace(self.model, n_diag=vocab.n_diag, n_proc=vocab.n_proc, n_med=vocab.n_med)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def batch_loss(
    model: COGNet,
    batch: dict,
    vocab: Vocab,
    cfg: TrainConfig,
    gen: torch.Generator | None = None,
    aux_head: torch.nn.Linear | None = None,
    ddi: torch.Tensor | None = None,
) -> torch.Tensor:
    """The training loss of a batch: teacher-forced NLL per target token, plus `cfg.aux_loss`
    times `aux_loss` when an auxiliary head is given, plus `cfg.ddi_loss` times `ddi_loss`
    when the DDI matrix [M, M] is given."""
    log_probs, hidden = teacher_forced(model, batch, vocab, cfg.scheduled_sampling, gen)
    target = batch["dec_target"]
    loss = F.nll_loss(log_probs.flatten(0, 1), target.flatten(), ignore_index=IGNORE)
    if aux_head is not None:
        loss = loss + cfg.aux_loss * aux_loss(aux_head, hidden, target)
    if ddi is not None:
        term, rate = ddi_terms(log_probs, batch["dec_input"], target, ddi)
        weight = cfg.ddi_loss
        if cfg.ddi_loss_target is not None:
            weight *= ramp(rate, cfg.ddi_loss_target, DDI_RAMP)
        loss = loss + weight * term
    return loss


def train_epoch(
    model: COGNet,
    optim: torch.optim.Optimizer,
    patients: list,
    vocab: Vocab,
    cfg: TrainConfig,
    rng: random.Random,
    bar=None,
    aux_head: torch.nn.Linear | None = None,
    ddi: torch.Tensor | None = None,
) -> float:
    """One pass over the patients (shuffled in place) with teacher forcing; mean loss. `ddi`:
    the DDI matrix when the loss has a DDI term."""
    model.train()
    rng.shuffle(patients)
    gen = torch.Generator().manual_seed(rng.getrandbits(63)) if cfg.scheduled_sampling else None
    total, count = 0.0, 0
    for i in range(0, len(patients), cfg.batch_size):
        chunk = patients[i : i + cfg.batch_size]
        dropped = None
        if cfg.history_dropout:
            dropped = [rng.random() < cfg.history_dropout for p in chunk for _ in p]
        batch = make_batch(chunk, vocab, cfg.max_history, no_history=dropped)
        batch = {k: v.to(cfg.device) for k, v in batch.items()}
        loss = batch_loss(model, batch, vocab, cfg, gen, aux_head, ddi)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for group in optim.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optim.step()
        total, count = total + float(loss.detach()), count + 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{total / count:.4f}")
    if bar is not None:
        bar.close()
    return total / max(count, 1)


def check_finite(model: COGNet, epoch: int, loss: float, val_nll: float, lr: float) -> None:
    """InputError (exit 2, before anything is saved) when the loss, the validation NLL or a
    weight is no longer a finite number: a model of NaNs would pass every later check."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if math.isfinite(loss) and math.isfinite(val_nll) and not bad:
        return
    what = f"weight {bad[0]}" if bad else f"loss {loss:g}, val nll {val_nll:g}"
    raise InputError(
        f"epoch {epoch}: training diverged ({what} not finite); no checkpoint was written. "
        f"Try a smaller --lr (this run: {lr:g}) or another --seed"
    )


def train(
    data_dir: str | Path,
    out: str | Path,
    cfg: TrainConfig = TrainConfig(),
    on_epoch: Callable[[dict], None] | None = None,
    progress=None,
) -> dict:
    """Train on the dataset directory's train split, select on val, save to `out`.

    With `cfg.members` > 1, member i is the network a one-member run of seed
    `member_seed(cfg.seed, i)` trains (the same epochs, early stopping and weights), and the
    checkpoint holds the `Ensemble` of them; the decoding is tuned on the ensemble.
    `on_epoch` receives each epoch's record (loss, validation metrics, time; "member" with
    several members); `progress` is an optional factory `progress(total=..., desc=...)`
    returning a tqdm-like bar. Returns the record of the best epoch (the last member's,
    with every member's chosen weights under "members").
    """
    seed_everything(cfg.seed)
    dataset, vocab, train_data, val_data = read_splits(data_dir)
    if cfg.ddi_target is not None:
        require_pairs(dataset.ddi_pairs, Path(data_dir) / DDI_FILE, "--ddi-target")
    if cfg.ddi_loss > 0:
        require_pairs(dataset.ddi_pairs, Path(data_dir) / DDI_FILE, "--ddi-loss")
    val_patients = (
        val_data.patients[: cfg.val_max_patients] if cfg.val_max_patients else val_data.patients
    )
    ehr = ehr_adjacency(train_data.patients, vocab.n_med)
    ddi = ddi_adjacency(dataset.ddi_pairs, vocab)
    out = Path(out)
    writable_folder(out, out)  # now, not after the epochs (checkpoint.save makes it)
    nets, runs, history, bests = [], [], [], []
    for i in range(cfg.members):
        member = replace(cfg, seed=member_seed(cfg.seed, i))
        tag = {"member": i} if cfg.members > 1 else {}

        def report(record: dict, tag=tag) -> None:
            record.update(tag)
            history.append(record)
            if on_epoch:
                on_epoch(record)

        if i > 0:  # a later member: the generators seeded anew (the first was, above)
            seed_everything(member.seed)
        net, best, chosen, epochs_run = _train_network(
            member, vocab, train_data, val_patients, (ehr, ddi), report, progress
        )
        nets.append(net)
        run = {"seed": member.seed, "best_epoch": best["epoch"], "weights": chosen}
        runs.append({**run, "epochs_run": epochs_run})
        bests.append(best)
    model = nets[0] if cfg.members == 1 else Ensemble(nets)
    best, chosen = bests[-1], runs[-1]["weights"]
    info = _train_info(cfg, nets[0], best, chosen, runs[-1]["epochs_run"], data_dir, val_data)
    tuned = Tuning(
        val_patients,
        cfg.decoding,
        cfg.set_samples,
        cfg.ddi_target,
        head=cfg.head,
        train_patients=train_data.patients,
        seed=cfg.seed,
        history_dropout=cfg.history_dropout,
        max_history=cfg.max_history,
        progress=progress,
    )
    graphs = Graphs(ehr, ddi, dataset.ddi_pairs)
    record = RunRecord(info, runs, history)
    decoding, target = finish(out, model, vocab, graphs, record, tuned, progress)
    return {
        **best,
        "weights": chosen,
        "decoding": decoding.to_json(),
        "ddi_target": target,
        "members": [r["weights"] for r in runs],
    }


def _train_network(
    cfg: TrainConfig,
    vocab,
    train_data,
    val_patients,
    graphs: tuple[np.ndarray, np.ndarray],
    report,
    progress,
):
    """One network trained with `cfg` (its seed; the caller seeds the generators): (the
    network in eval mode with the weights chosen on validation, the best epoch's record,
    which weights, epochs run). `graphs`: the EHR and DDI adjacency matrices [M, M].
    """
    ehr, ddi = graphs
    model = COGNet(cfg.model_config(vocab), ehr, ddi).to(cfg.device)
    optim, decay, aux_head = _optimiser(model, cfg, vocab)
    rng = random.Random(cfg.seed)
    ddi_bool = ddi > 0
    ddi_term = torch.from_numpy(ddi).to(cfg.device) if cfg.ddi_loss > 0 else None
    best, epochs_run, stale = None, 0, 0
    snapshots: dict[int, dict] = {}  # epoch -> weights (the last max(average) and the best)
    keep = max(cfg.average)
    patients = list(train_data.patients)
    n_val = sum(map(len, val_patients))
    for epoch in range(1, cfg.epochs + 1):
        start = time.perf_counter()
        bar = _epoch_bar(progress, len(patients), cfg.batch_size, epoch)
        lr = optim.param_groups[0]["lr"]
        loss = train_epoch(model, optim, patients, vocab, cfg, rng, bar, aux_head, ddi_term)
        decay.step()
        train_s = time.perf_counter() - start
        record = {"epoch": epoch, "loss": loss, "train_s": train_s, "lr": lr}
        # a bar over the greedy decoding of validation (select=jaccard; the NLL is quick)
        decoding = progress if cfg.select == "jaccard" else None
        with bar_of(decoding, n_val, f"epoch {epoch} validation") as bar:
            record.update(_validation(model, vocab, val_patients, ddi_bool, cfg.select, bar))
        check_finite(model, epoch, loss, record["val_nll"], cfg.lr)
        record["epoch_s"] = time.perf_counter() - start
        epochs_run = epoch
        improved = _improved(record, best, cfg.select)
        record["best"] = improved
        report(record)
        best, stale = (record, 0) if improved else (best, stale + 1)
        _keep_snapshot(snapshots, epoch, model, best["epoch"] - keep)
        if cfg.patience is not None and stale >= cfg.patience:
            log.info("early stopping after %d epochs without improvement", stale)
            break

    def val_nll(net: COGNet) -> float:
        return validation_nll(net, vocab, val_patients)

    chosen = _load_final_weights(model, snapshots, best, epochs_run, cfg, val_nll, progress)
    return model, best, chosen, epochs_run


def _epoch_bar(progress, n_patients: int, batch_size: int, epoch: int):
    """The epoch's progress bar over its batches, or None without a `progress` factory."""
    if not progress:
        return None
    return progress(total=-(-n_patients // batch_size), desc=f"epoch {epoch}")


def _train_info(cfg: TrainConfig, model: COGNet, best, chosen, epochs_run, data_dir, val_data):
    """What the checkpoint records of its training (the tuning's record is added after)."""
    return {
        **asdict(replace(cfg, model=model.cfg)),  # the network with its vocabulary sizes
        "best_epoch": best["epoch"],
        "weights": chosen,
        "epochs_run": epochs_run,
        "data": str(data_dir),
        "unknown_codes_val": val_data.unknown_codes,
    }


def _optimiser(model: COGNet, cfg: TrainConfig, vocab: Vocab):
    """(Adam, its exponential learning-rate decay, the auxiliary head or None)."""
    params = list(model.parameters())
    aux_head = None
    if cfg.aux_loss > 0:  # built after the model: the model's initialisation stays the same
        aux_head = torch.nn.Linear(cfg.model.dim, vocab.n_med).to(cfg.device)
        params += list(aux_head.parameters())
    optim = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    decay = torch.optim.lr_scheduler.ExponentialLR(optim, cfg.lr_decay)
    return optim, decay, aux_head


def _validation(model: COGNet, vocab: Vocab, val_patients, ddi_bool, select: str, bar=None) -> dict:
    """The epoch's validation metrics: the NLL, and for select="jaccard" the metrics of
    greedy decoding too (`bar` counts the visits decoded)."""
    record = {"val_nll": validation_nll(model, vocab, val_patients)}
    if select == "jaccard":
        on_batch = bar.update if bar is not None else None
        greedy = DecodingPlan(Decoding(beam=1), vocab.end)
        decoded = decode_patients(model, vocab, val_patients, greedy, on_batch=on_batch)
        val = evaluation_report(visit_results(val_patients, decoded), ddi_bool, rounds=1)
        for k in ("jaccard", "f1", "prauc", "ddi", "avg_drugs"):
            record[f"val_{k}"] = val[k]["mean"]
    return record


def _improved(record: dict, best: dict | None, select: str) -> bool:
    """Whether the epoch beats the best so far: a lower val NLL, or a higher val Jaccard."""
    return best is None or (
        record["val_nll"] < best["val_nll"]
        if select == "nll"
        else record["val_jaccard"] > best["val_jaccard"]
    )


def _keep_snapshot(snapshots: dict, epoch: int, model: COGNet, drop_until: int) -> None:
    """Store the epoch's weights; drop those of epochs up to `drop_until` (windows to
    average end at the best epoch or later)."""
    snapshots[epoch] = copy.deepcopy(model.state_dict())
    for old in [e for e in snapshots if e <= drop_until]:
        del snapshots[old]  # windows end at the best epoch or later


def _load_final_weights(
    model: COGNet,
    snapshots: dict,
    best: dict,
    epochs_run: int,
    cfg: TrainConfig,
    val_nll: Callable[[COGNet], float],
    progress=None,
) -> dict:
    """Load the best epoch's weights, or the average of epochs ending at or after it when
    that has a lower val NLL (`val_nll` of a model: its validation NLL), into `model` (in
    eval mode); returns which were chosen. A bar from `progress` counts the averages
    scored."""
    chosen = {"epochs": [best["epoch"]], "val_nll": best["val_nll"]}
    state = snapshots[best["epoch"]]
    sizes = [s for s in cfg.average if s > 1]  # single epochs: their NLL is in `history`
    if sizes:
        ends = range(best["epoch"], epochs_run + 1)
        windows = len(ends) * len(set(sizes))  # at most: a window must fit in the snapshots
        with bar_of(progress, windows, "averaging weights", "average") as bar:

            def nll(m) -> float:
                bar.update(1)
                return val_nll(m)

            averaged, info = choose_average(model, snapshots, sizes, ends, nll)
        if info is not None and info["val_nll"] < chosen["val_nll"]:
            state, chosen = averaged, info
    model.load_state_dict(state)
    model.eval()
    return chosen
