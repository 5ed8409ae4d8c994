"""Distillation (`cognet train --teacher`): the sets a teacher samples, the targets a student
is trained on, and the command that records how the student was made."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tiny import make_tiny, train_small

from cognet.core.decoding import Decoding
from cognet.core.decoding.draws import visit_keys
from cognet.core.decoding.sampling import SetConfig, set_marginals
from cognet.core.history import load_split
from cognet.model import checkpoint
from cognet.model.batching import IGNORE, make_batch
from cognet.model.session import TorchSession
from cognet.training.distill import (
    TEACHER_SEED,
    DistillConfig,
    TeacherTargets,
    sample_sets,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    data, ckpt = make_tiny(root, n_patients=40)
    model, vocab, _ = checkpoint.load(ckpt)
    patients = load_split(pq.read_table(data / "visits.parquet"), vocab, "train").patients
    return data, ckpt, model, vocab, patients


def test_the_sets_are_the_samples_behind_set_decodings_marginals(tiny):
    _, _, model, vocab, patients = tiny
    chunk = patients[:6]
    samples = 1024
    sets = np.stack(sample_sets(model, vocab, chunk, DistillConfig(samples=samples), False))
    n_visits = sum(map(len, chunk))
    assert sets.shape == (n_visits, samples, vocab.n_med) and sets.dtype == bool
    # set decoding's P(k in S) with the teacher's seed, from the same draws: the share of
    # samples holding k estimates it too. Their difference is a martingale (the emissions
    # less their step probabilities) of variance at most P(k in S) / samples.
    batch = make_batch(chunk, vocab, targets=False)
    session = TorchSession(model)
    keys = visit_keys([v.visit_id for p in chunk for v in p])
    set_cfg = SetConfig.of(
        Decoding(samples=samples, seed=TEACHER_SEED, rule="jaccard"), vocab.n_med
    )
    with torch.no_grad():
        marginals, _, _ = set_marginals(session, session.memories(batch), n_visits, set_cfg, keys)
    share = sets.mean(1)
    assert np.all(np.abs(share - marginals) < 6 * np.sqrt((marginals + 1e-3) / samples))
    assert share.sum() == pytest.approx(marginals.sum(), rel=0.01)
    assert 0.05 < share.mean() < 0.95  # the check sees sets neither empty nor full
    again = np.stack(sample_sets(model, vocab, chunk, DistillConfig(samples=samples), False))
    assert np.array_equal(sets, again)


def test_no_history_and_temperature_change_the_sets(tiny):
    _, _, model, vocab, patients = tiny
    later = [p for p in patients if len(p) > 1][:5]
    cfg = DistillConfig(samples=64)
    full = np.stack(sample_sets(model, vocab, later, cfg, no_history=False))
    bare = np.stack(sample_sets(model, vocab, later, cfg, no_history=True))
    firsts = [sum(map(len, later[:i])) for i in range(len(later))]  # no history either way
    assert np.array_equal(full[firsts], bare[firsts])
    assert not np.array_equal(np.delete(full, firsts, 0), np.delete(bare, firsts, 0))
    cold = np.stack(
        sample_sets(model, vocab, later, DistillConfig(samples=64, temperature=0.25), False)
    )

    def spread(s):  # 0 when every sample of a visit holds the same set
        p = s.mean(1)
        return float((p * (1 - p)).mean())

    assert spread(cold) < 0.5 * spread(full)


def test_the_share_of_targets_replaced_and_which_sets(tiny):
    _, _, _, vocab, patients = tiny
    chunk = patients[:8]
    visits = [v for p in chunk for v in p]
    rng = np.random.default_rng(0)
    m = vocab.n_med

    def one_set(meds):
        s = np.zeros((1, m), bool)
        s[0, meds] = True
        return s

    # each visit's teacher sets: {0, 1} with its history, {2} without; one sample each
    with_history = {v.visit_id: one_set([0, 1]) for v in visits}
    without = {v.visit_id: one_set([2]) for v in visits}
    batch = make_batch(chunk, vocab)
    dropped = [i % 2 == 0 for i in range(len(visits))]

    kept = TeacherTargets(vocab, DistillConfig(weight=0.0), with_history, without)
    same = kept.replace(batch, chunk, dropped, rng)
    assert torch.equal(same["dec_target"], batch["dec_target"])
    assert torch.equal(same["dec_input"], batch["dec_input"])

    taught = TeacherTargets(vocab, DistillConfig(weight=1.0), with_history, without)
    out = taught.replace(batch, chunk, dropped, rng)
    for row, drop in enumerate(dropped):
        meds = [2] if drop else vocab.rare_first([0, 1])
        target = out["dec_target"][row]
        assert target[target != IGNORE].tolist() == [*meds, vocab.end]
        assert out["dec_input"][row, : len(meds) + 1].tolist() == [vocab.start, *meds]
    for key in ("diagnoses", "medications", "hist_index", "slot_med"):  # history: the truth
        assert torch.equal(out[key], batch[key])

    half = TeacherTargets(vocab, DistillConfig(weight=0.5), with_history, without)
    changed = 0
    for _ in range(40):
        got = half.replace(batch, chunk, None, rng)["dec_target"]
        width = min(got.shape[1], batch["dec_target"].shape[1])
        same_rows = (got[:, :width] == batch["dec_target"][:, :width]).all(1)
        changed += int((~same_rows).sum())
    assert 0.35 < changed / (40 * len(visits)) < 0.65


def test_train_with_a_teacher_records_it_and_repeats_itself(tiny, tmp_path):
    data, _, _, _, _ = tiny
    teacher = tmp_path / "teacher"
    res = train_small(data, teacher)
    assert res.exit_code == 0, res.output
    outs = []
    for name in ("a", "b"):
        outs.append(tmp_path / name)
        args = ["--teacher", str(teacher), "--distill-weight", "0.7", "--distill-samples", "4"]
        res = train_small(data, outs[-1], *args)
        assert res.exit_code == 0, res.output
    config = json.loads((outs[0] / "config.json").read_text())
    record = config["train"]["distilled_from"]
    assert record["hash"] == checkpoint.checkpoint_hash(teacher)
    assert (record["weight"], record["samples"], record["temperature"]) == (0.7, 4, 1.0)
    assert record["members"] == 1 and record["seeds"] == [0]
    assert config["train"]["teacher"] == str(teacher)
    a, b = ((o / "model.safetensors").read_bytes() for o in outs)
    assert a == b  # seeded: the teacher's draws and which targets they replace
    plain = tmp_path / "plain"
    res = train_small(data, plain)
    assert res.exit_code == 0, res.output
    assert (plain / "model.safetensors").read_bytes() != a  # the teacher changed training


def test_a_teacher_of_another_dataset_or_the_teacher_as_output_is_refused(tiny, tmp_path):
    data, ckpt, _, _, _ = tiny
    _, other = make_tiny(tmp_path / "other", seed=5, n_patients=30)
    res = train_small(data, tmp_path / "s", "--teacher", str(other))
    assert res.exit_code == 2
    assert "another vocabulary" in res.output and str(other) in res.output
    assert not (tmp_path / "s" / "config.json").exists()
    res = train_small(data, ckpt, "--teacher", str(ckpt))
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1


def test_distillation_values_out_of_range_are_usage_errors(tiny, tmp_path):
    data = tiny[0]
    for option, value in (("--distill-weight", "1.5"), ("--distill-temperature", "0")):
        res = train_small(data, tmp_path / "x", "--teacher", str(tiny[1]), option, value)
        assert res.exit_code == 2 and option in res.output
