"""Distillation: one network trained on the sets a teacher model samples.

What an ensemble adds over one network lives in its averaged set marginals P(k in S), the
mean of its members' (`cognet.core.decoding.ensemble`), not in its steps: mixing the members
token by token keeps only part of it. So the student learns the teacher's distribution over
*sets*: each training visit's target is, with probability `weight`, one of the sets the
teacher sampled for it (its members' set decoding, `samples` each), in the rare-first order
of every target, instead of the prescribed set. A student that decodes the teacher's
sequence-level mixture has the teacher's P(k in S), at the cost of one network.

The teacher samples each training visit twice: with its history, and without it (as a
first visit is), so that a visit whose history training drops (`history_dropout`) gets the
teacher's no-history sets. First visits are sampled once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from cognet.core.decoding import Decoding, driver, open_samples
from cognet.core.decoding.draws import visit_keys
from cognet.core.decoding.ensemble import member_config
from cognet.core.decoding.sampling import SetConfig, SetSampler
from cognet.core.errors import InputError
from cognet.core.history import Visit, pad
from cognet.core.vocab import Vocab
from cognet.model import checkpoint
from cognet.model.batching import IGNORE, make_batch
from cognet.model.ensemble import Ensemble, members_of
from cognet.model.network import COGNet
from cognet.model.session import TorchSession

# the teacher's sampling streams: apart from the seeds of set decoding's own draws (0)
TEACHER_SEED = 7919


@dataclass(frozen=True)
class DistillConfig:
    """How a student learns from its teacher (recorded in the student's checkpoint)."""

    weight: float = 0.5  # share of training targets drawn from the teacher's sets
    samples: int = 16  # sets the teacher samples per visit and member
    temperature: float = 1.0  # the teacher's step log-probabilities divided by this

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError("the distillation weight must be in [0, 1]")
        if self.samples < 1:
            raise ValueError("the teacher's samples must be >= 1")
        if not 0.0 < self.temperature <= 10.0:
            raise ValueError("the teacher's temperature must be in (0, 10]")


class _RecordingSampler(SetSampler):
    """Set decoding's sampler that also keeps every sample's set: bool [n, samples, M]."""

    def __init__(self, cfg: SetConfig, keys: np.ndarray, temperature: float):
        super().__init__(cfg, keys)
        self.temperature = temperature

    def start(self, n: int) -> None:
        super().start(n)
        self.sets = np.zeros((n, self.cfg.samples, self.cfg.end), bool)

    def select(self, t, got, rows, parent):
        if self.temperature != 1.0:  # the sampler renormalises what it is given
            got = {**got, "log_probs": got["log_probs"] / np.float32(self.temperature)}
        return super().select(t, got, rows, parent)

    def finish(self, t, newly, rows) -> None:
        super().finish(t, newly, rows)
        self.sets[rows[newly]] = self.used[newly][..., : self.cfg.end]


@torch.no_grad()
def sample_sets(
    teacher: COGNet | Ensemble,
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    cfg: DistillConfig,
    no_history: bool,
    batch_patients: int = 128,
    on_batch: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """Per visit of `patients` (in order): bool [members x samples, M], the sets the
    teacher samples for it, each member with its own draws; `no_history`: every visit
    decoded without its history."""
    teacher.eval()
    end = teacher.cfg.n_med
    base = SetConfig.of(Decoding(samples=cfg.samples, seed=TEACHER_SEED, rule="jaccard"), end)
    out: list[np.ndarray] = []
    for i in range(0, len(patients), batch_patients):
        chunk = patients[i : i + batch_patients]
        visits = [v for p in chunk for v in p]
        dropped = [True] * len(visits) if no_history else None
        batch = make_batch(chunk, vocab, targets=False, no_history=dropped)
        keys = visit_keys([v.visit_id for v in visits])
        sets = []
        for k, member in enumerate(members_of(teacher)):
            session = TorchSession(member)
            sampler = _RecordingSampler(member_config(base, k), keys, cfg.temperature)
            loop = open_samples.run if open_samples.applies(session, sampler) else driver.run
            loop(session, session.memories(batch), len(visits), sampler, sampler.cfg)
            sets.append(sampler.sets)
        out.extend(np.concatenate(sets, axis=1))
        if on_batch:
            on_batch(len(visits))
    return out


class TeacherTargets:
    """The teacher's sets of every training visit, and the draw of each batch's targets."""

    def __init__(
        self,
        vocab: Vocab,
        cfg: DistillConfig,
        with_history: dict[str, np.ndarray],
        without_history: dict[str, np.ndarray],
    ):
        self.vocab, self.cfg = vocab, cfg
        self.with_history, self.without_history = with_history, without_history

    @classmethod
    def of(
        cls,
        teacher: COGNet | Ensemble,
        vocab: Vocab,
        patients: Sequence[Sequence[Visit]],
        cfg: DistillConfig,
        on_batch: Callable[[int], None] | None = None,
    ) -> TeacherTargets:
        """Sample the teacher's sets of every visit of `patients` (later visits twice)."""
        bare = sample_sets(teacher, vocab, patients, cfg, True, on_batch=on_batch)
        later = [p for p in patients if len(p) > 1]
        full = sample_sets(teacher, vocab, later, cfg, False, on_batch=on_batch)
        ids = [v.visit_id for p in patients for v in p]
        without = dict(zip(ids, bare, strict=True))
        with_history = {p[0].visit_id: without[p[0].visit_id] for p in patients}
        with_history.update(zip([v.visit_id for p in later for v in p], full, strict=True))
        return cls(vocab, cfg, with_history, without)

    def replace(
        self,
        batch: dict,
        patients: Sequence[Sequence[Visit]],
        dropped: Sequence[bool] | None,
        rng: np.random.Generator,
    ) -> dict:
        """The training batch with a share `weight` of its targets replaced by one of the
        teacher's sets for that visit (drawn uniformly), the no-history sets where the
        visit's history is dropped; `dec_input` and `dec_target` rebuilt as `make_batch`
        builds them."""
        visits = [v for p in patients for v in p]
        meds = []
        for row, v in enumerate(visits):
            m = list(v.meds or ())
            if v.meds is not None and rng.random() < self.cfg.weight:  # a known target only
                table = self.without_history if dropped and dropped[row] else self.with_history
                sets = table[v.visit_id]
                drawn = np.flatnonzero(sets[rng.integers(len(sets))])
                m = self.vocab.rare_first(int(k) for k in drawn)
            meds.append(m)
        vocab = self.vocab
        dec_input = pad([[vocab.start, *m] for m in meds], vocab.med_pad)
        dec_target = pad([[*m, vocab.end] for m in meds], IGNORE)
        return {
            **batch,
            "dec_input": torch.from_numpy(dec_input),
            "dec_target": torch.from_numpy(dec_target),
        }


def teacher_targets(
    path: str, vocab: Vocab, patients: Sequence[Sequence[Visit]], cfg: DistillConfig, progress
) -> tuple[TeacherTargets, dict]:
    """(the teacher's sets of the training visits, what the student's checkpoint records of
    its teacher) for the checkpoint at `path`; InputError when it was trained on another
    vocabulary (another dataset or split)."""
    teacher, teacher_vocab, config = checkpoint.load(path)
    if teacher_vocab != vocab:
        raise InputError(
            f"{path}: the teacher was trained on another vocabulary than this dataset's "
            "train split; train the student on the teacher's dataset"
        )
    total = sum(map(len, patients)) + sum(len(p) for p in patients if len(p) > 1)
    bar = progress(total=total, desc="teacher sets") if progress else None
    targets = TeacherTargets.of(teacher, vocab, patients, cfg, bar.update if bar else None)
    if bar is not None:
        bar.close()
    trained = config.get("train", {})
    runs = trained.get("member_runs") or [{"seed": trained.get("seed")}]
    record = {
        "checkpoint": str(path),
        "hash": checkpoint.checkpoint_hash(path),
        "members": len(members_of(teacher)),
        "seeds": [r.get("seed") for r in runs],
        "dim": teacher.cfg.dim,
        **asdict(cfg),
    }
    return targets, record
