"""Ensembles of networks trained apart, on the torch side: the decoding rules
(`cognet.core.decoding.ensemble`), the checkpoint of several members, `cognet train
--members` and `cognet ensemble` (the same checkpoint from runs trained apart)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tiny import make_case, make_tiny, random_checkpoint

from cognet.cli import main
from cognet.core.decoding import Decoding
from cognet.core.decoding.beam import BeamConfig, beam_search, mixed_top_k, top_k_stable
from cognet.core.decoding.draws import visit_keys
from cognet.core.decoding.driver import Visits
from cognet.core.decoding.ensemble import (
    MEMBER_LOG_PROBS,
    EnsembleSession,
    member_config,
    member_seed,
    mix_log_probs,
)
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.decoding.sampling import SetConfig, set_marginals
from cognet.model import checkpoint
from cognet.model.batching import make_batch
from cognet.model.ensemble import Ensemble, members_of
from cognet.model.session import TorchSession
from cognet.model.torch_decoding import decode_patients, set_marginals_of

TINY = ["--epochs", "2", "--dim", "16", "--threads", "1", "--quiet"]
TIMINGS = ("train_s", "epoch_s")


def _other(model, seed: int):
    """A second member: the same network shape and graphs, other weights."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return other.eval()


@pytest.fixture(scope="module")
def case():
    model, vocab, patients = make_case(n_med=12, n_patients=10, seed=3)
    return Ensemble([model, _other(model, 1)]).eval(), vocab, patients


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_mix_log_probs_is_the_log_of_the_mean_probability():
    a = np.log(np.array([[0.7, 0.2, 0.1, 0.0]], np.float32))
    b = np.log(np.array([[0.1, 0.1, 0.4, 0.0]], np.float32))
    with np.errstate(divide="ignore"):
        mixed = mix_log_probs([a, b])
    assert mixed.dtype == np.float32
    np.testing.assert_allclose(np.exp(mixed[0, :3]), [0.4, 0.15, 0.25], rtol=1e-6)
    assert mixed[0, 3] == -np.inf  # every member gives it nothing: still nothing
    one = np.log(np.array([[0.5, 0.5, 0.0, 0.0]], np.float32))
    assert np.isfinite(mix_log_probs([one, b])[0, 2])  # one member's -inf is not the mix's
    three = mix_log_probs([a, b, one])  # any number of members: the mean of the three
    np.testing.assert_allclose(np.exp(three[0, :3]), [1.3 / 3, 0.8 / 3, 0.5 / 3], rtol=1e-6)
    assert three[0, 3] == -np.inf
    np.testing.assert_array_equal(mix_log_probs([a]), a)  # one member: itself


@pytest.mark.parametrize("members,shape", [(2, (3, 4, 9)), (2, (64, 4, 132)), (3, (16, 16, 40))])
def test_mix_log_probs_equals_the_running_logaddexp(members, shape):
    """The sum of exponentials gives what a running logaddexp gives, value for value (at most
    1 ulp of float32), with the model's floor, -inf, and values beyond float64's exp (which
    are taken again by logaddexp)."""
    rng = np.random.default_rng(members)
    parts = [np.log(rng.dirichlet(np.full(shape[-1], 0.3), shape[:-1])) for _ in range(members)]
    parts = [np.maximum(x, np.log(1e-20)).astype(np.float32) for x in parts]
    parts[0][0, 0, :3] = -np.inf  # one member's -inf, and every member's
    parts[1][0, 0, :2] = -np.inf
    parts[-1][0, 0, :2] = -np.inf
    for i, x in enumerate(parts):  # exp gives 0 for every member
        x[0, 1, 0] = -800.0 - 100 * i
    wide = [x.astype(np.float64) for x in parts]
    want = np.logaddexp(wide[0], wide[1])
    for x in wide[2:]:
        want = np.logaddexp(want, x)
    want = (want - np.log(members)).astype(np.float32)
    got = mix_log_probs(parts)
    assert got.dtype == np.float32 and got.shape == shape
    assert (got[0, 0, :2] == -np.inf).all() and np.isfinite(got[0, 0, 2])
    assert got[0, 1, 0] == pytest.approx(-800.0 - np.log(members), abs=1e-3)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    ulps = np.abs(got[finite].view(np.int32).astype(np.int64) - want[finite].view(np.int32))
    assert ulps.max() <= 1


def test_member_seeds_and_draws():
    assert [member_seed(7, i) for i in range(3)] == [7, 1007, 2007]
    cfg = SetConfig(end=5, samples=4, threshold=0.5, seed=3)
    assert member_config(cfg, 0) == cfg and member_config(cfg, 2).seed == 5


def test_set_decoding_averages_the_members_marginals(case):
    """P(k in S) of the ensemble = the mean of each member's own set decoding, member i
    drawing with seed + i."""
    model, vocab, patients = case
    decoding = Decoding(name="set", samples=8, threshold=0.3, estimator="stratified", seed=5)
    plan = DecodingPlan(decoding, vocab.end)
    got = np.stack([d.scores for d in decode_patients(model, vocab, patients, plan)])
    batch = make_batch(patients, vocab, targets=False)
    keys = visit_keys([v.visit_id for p in patients for v in p])
    cfg = SetConfig.of(decoding, vocab.n_med)
    want = []
    for i, net in enumerate(members_of(model)):
        session = TorchSession(net)
        visits = Visits(len(keys), keys=keys)
        m, _, _ = set_marginals(session, session.memories(batch), member_config(cfg, i), visits)
        want.append(m)
    np.testing.assert_allclose(got, np.mean(want, 0), rtol=1e-6, atol=1e-7)
    one = np.stack([d.scores for d in decode_patients(members_of(model)[0], vocab, patients, plan)])
    assert not np.allclose(got, one)  # the second member counts


@pytest.mark.parametrize("members, batch_patients", [(1, 3), (2, 4), (2, 128)])
def test_teacher_marginals_are_set_decodings_scores(case, members, batch_patients):
    """`set_marginals_of` (the set head's teacher) gives the P(k in S) that set decoding's
    answers carry, without reading their sets, batched alike."""
    model, vocab, patients = case
    model = model if members == 2 else members_of(model)[0]
    decoding = Decoding(name="set", samples=8, threshold=0.3, estimator="stratified", seed=5)
    plan = DecodingPlan(decoding, vocab.end)
    decoded = decode_patients(model, vocab, patients, plan, batch_patients=batch_patients)
    want = np.stack([d.scores for d in decoded])
    seen = []
    got = set_marginals_of(model, vocab, patients, plan, seen.append, batch_patients)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert sum(seen) == len(want) and len(seen) == -(-len(patients) // batch_patients)
    with pytest.raises(ValueError, match="set decoding"):
        set_marginals_of(model, vocab, patients, DecodingPlan(Decoding(), vocab.end))


def test_beam_search_of_identical_members_is_the_member(case):
    """The token-level mixture of K copies of one network is that network: the same lists
    and scores at beam 1 and 4."""
    model, vocab, patients = case
    net = members_of(model)[0]
    twins = Ensemble([net, copy.deepcopy(net)]).eval()
    for beam in (1, 4):
        plan = DecodingPlan(Decoding(beam=beam), vocab.end)
        alone = decode_patients(net, vocab, patients, plan)
        mixed = decode_patients(twins, vocab, patients, plan)
        assert [d.meds for d in mixed] == [d.meds for d in alone]
        np.testing.assert_allclose([d.score for d in mixed], [d.score for d in alone], atol=1e-5)


def test_beam_search_steps_on_the_mixture(case):
    """Greedy decoding of an ensemble takes, at every step, the argmax of the mean of the
    members' step probabilities (followed here by hand for the first two steps)."""
    model, vocab, patients = case
    batch = make_batch(patients[:3], vocab, targets=False)
    sessions = [TorchSession(net) for net in members_of(model)]
    ens = EnsembleSession(sessions)
    n = len(batch["target"])
    memories = tuple(s.memories(batch) for s in sessions)
    cache = ens.empty_cache(n, 1)
    tokens = np.full((n, 1), vocab.n_med + 1, np.int64)
    parent = np.zeros((n, 1), np.int64)
    out, cache = ens.step(tokens, parent, cache, memories, ("log_probs", "gate"))
    probs = [
        np.exp(s.step(tokens, parent, s.empty_cache(n, 1), m, ("log_probs",))[0]["log_probs"])
        for s, m in zip(sessions, memories, strict=True)
    ]
    np.testing.assert_allclose(np.exp(out["log_probs"]), np.mean(probs, 0), rtol=1e-5, atol=1e-7)
    first = np.argmax(out["log_probs"][:, 0], -1)
    greedy = decode_patients(model, vocab, patients[:3], DecodingPlan(Decoding(beam=1), vocab.end))
    assert [d.meds[0] if d.meds else vocab.n_med for d in greedy] == first.tolist()


def _log_softmax_rows(rng, shape, ties: bool) -> np.ndarray:
    x = rng.standard_normal(shape) * 3
    if ties:
        x = np.round(x)  # many equal log-probabilities
    x = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return np.maximum(x, np.log(1e-20)).astype(np.float32)


def _mixed_candidates(members, scores, used, finished, end):
    """BeamSelector's candidates from the fully mixed log-probabilities (the reference)."""
    cand = scores[:, :, None] + mix_log_probs(members)
    np.copyto(cand, np.float32(-np.inf), where=used)
    cand[finished] = -np.inf
    cand[finished, end] = scores[finished]
    return cand.reshape(cand.shape[0], -1)


@pytest.mark.parametrize("members", [2, 3])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("ties", [False, True])
def test_mixed_top_k_equals_the_top_k_of_the_whole_mixture(members, k, ties):
    """Mixing only the candidates that can be among the k best changes nothing: the same
    picks, in the same order, with the same float32 scores, for held medications, finished
    beams, ties (identical members too), members giving -inf, beams still at -inf (the first
    step), rows with fewer than k finite candidates, a NaN, and scores far below 0."""
    rng = np.random.default_rng(10 * members + k + ties)
    r, v1, end = 60, 13, 12
    parts = [_log_softmax_rows(rng, (r, k, v1), ties) for _ in range(members)]
    parts[1][:10] = parts[0][:10]  # members that agree
    parts[-1][10:15, :, 3] = -np.inf  # a member that rules a token out
    scores = -np.round(np.abs(rng.standard_normal((r, k))) * 5, 1 if ties else 6)
    scores = scores.astype(np.float32)
    scores[15:20, 1:] = -np.inf  # the first step: beam 0 alone
    scores[20:25] *= 400  # long hypotheses: about -2,000
    used = rng.random((r, k, v1)) < 0.3
    used[25:30] = True  # nothing left but END...
    used[25:30, :, end] = False
    used[30:33] = True  # ...or nothing at all: fewer than k finite candidates
    finished = rng.random((r, k)) < 0.2
    finished[30:33] = False
    finished[:15] = False
    parts[0][33, 0, 5] = np.nan  # a broken step: the row is ranked as the whole mixture's
    with np.errstate(invalid="ignore"):  # the NaN
        want_idx, want_val = top_k_stable(_mixed_candidates(parts, scores, used, finished, end), k)
        got_idx, got_val = mixed_top_k(tuple(parts), scores, used, finished, end, k)
    np.testing.assert_array_equal(got_idx, want_idx)
    np.testing.assert_array_equal(got_val, want_val)
    assert np.isneginf(got_val[30:33]).all()  # the rows without a finite candidate
    assert np.isfinite(got_val[:15]).all()


def test_beam_search_of_an_ensemble_mixes_lazily_and_decides_alike(case):
    """An ensemble's step leaves its mixture unmixed until read; beam search without PRAUC
    scores selects from the members' log-probabilities (`mixed_top_k`) and finds what it
    finds from the whole mixture (with PRAUC scores, which read every token)."""
    model, vocab, patients = case
    batch = make_batch(patients, vocab, targets=False)
    sessions = [TorchSession(net) for net in members_of(model)]
    ens = EnsembleSession(sessions)
    memories = tuple(s.memories(batch) for s in sessions)
    n = len(batch["target"])
    tokens = np.full((n, 1), vocab.n_med + 1, np.int64)
    out, _ = ens.step(
        tokens, np.zeros((n, 1), np.int64), ens.empty_cache(n, 1), memories, ("log_probs",)
    )
    assert "log_probs" not in out and len(out[MEMBER_LOG_PROBS]) == 2
    np.testing.assert_array_equal(out["log_probs"], mix_log_probs(out[MEMBER_LOG_PROBS]))
    cfg = BeamConfig(end=vocab.n_med, max_len=20, beam=4)
    lazy = beam_search(ens, memories, cfg, Visits(n))
    whole = beam_search(ens, memories, cfg, Visits(n, prauc=True))
    assert [m.tolist() for m in lazy.meds] == [m.tolist() for m in whole.meds]
    np.testing.assert_array_equal(lazy.score, whole.score)
    for a, b in zip(lazy.med_probs, whole.med_probs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_round_trip_and_a_bad_member_count(tmp_path):
    data, first = make_tiny(tmp_path)
    nets = [checkpoint.load(c)[0] for c in (first, random_checkpoint(data, tmp_path / "c1", 1))]
    ckpt = tmp_path / "ens"
    n_med = nets[0].cfg.n_med
    graphs = np.zeros((n_med, n_med), np.float32)
    tiny_vocab = checkpoint.load(first)[1]
    empty = checkpoint.Graphs(graphs, graphs, [])
    checkpoint.save(ckpt, Ensemble(nets), tiny_vocab, empty, {"tiny": True})
    loaded, _, config = checkpoint.load(ckpt)
    assert config["members"] == 2 and isinstance(loaded, Ensemble)
    for a, b in zip(members_of(loaded), nets, strict=True):
        assert _same_weights(a, b)
    for bad in (0, 17, "2", 1.5, True):
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["members"] = bad
        (ckpt / "config.json").write_text(json.dumps(cfg))
        res = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(ckpt), "--data", str(data)])
        assert res.exit_code == 2, res.output
        assert f"{ckpt / 'config.json'}: members must be an integer in [1, 16]" in res.output
    cfg["members"] = 1  # one network's weights cannot be read as two, nor two as one
    (ckpt / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(ckpt), "--data", str(data)])
    assert res.exit_code == 2 and "Traceback" not in res.output


def _same_weights(a, b) -> bool:
    x, y = a.state_dict(), b.state_dict()
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _train(data: Path, out: Path, *extra: str) -> None:
    res = CliRunner().invoke(main, ["train", "--data", str(data), "--out", str(out), *TINY, *extra])
    assert res.exit_code == 0, res.output


def _log(ckpt: Path) -> list[dict]:
    lines = (ckpt / "train_log.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMINGS} for x in lines]


def test_train_members_is_the_ensemble_of_runs_trained_apart(tmp_path):
    """`cognet train --members 2 --seed 4` = `cognet ensemble` of the one-network runs of
    seeds 4 and 1004: the same config.json (weights' hashes included) and epoch records."""
    data, _ = make_tiny(tmp_path)
    _train(data, tmp_path / "both", "--seed", "4", "--members", "2")
    for seed in (4, 1004):
        _train(data, tmp_path / f"s{seed}", "--seed", str(seed), "--members", "1")
    res = CliRunner().invoke(
        main,
        [
            "ensemble",
            str(tmp_path / "s4"),
            str(tmp_path / "s1004"),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "combined"),
        ],
    )
    assert res.exit_code == 0, res.output
    both = json.loads((tmp_path / "both" / "config.json").read_text())
    combined = json.loads((tmp_path / "combined" / "config.json").read_text())
    assert both["members"] == 2 and both == combined
    assert [r["seed"] for r in both["train"]["member_runs"]] == [4, 1004]
    assert _log(tmp_path / "both") == _log(tmp_path / "combined")
    assert "members" not in json.loads((tmp_path / "s4" / "config.json").read_text())
    # the first member is the one-network run of the same seed, weight for weight
    ens, _, _ = checkpoint.load(tmp_path / "both")
    alone, _, _ = checkpoint.load(tmp_path / "s4")
    assert _same_weights(members_of(ens)[0], alone)


def test_ensemble_refuses_what_cannot_be_one_model(tmp_path):
    data, _ = make_tiny(tmp_path)
    _train(data, tmp_path / "a", "--members", "1")
    _train(data, tmp_path / "wide", "--members", "1", "--seed", "1", "--dim", "32")
    _train(data, tmp_path / "pair", "--members", "2", "--epochs", "1")

    def refused(*checkpoints: Path) -> str:
        argv = [
            "ensemble",
            *map(str, checkpoints),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o"),
        ]
        res = CliRunner().invoke(main, argv)
        assert res.exit_code == 2, res.output
        assert "Traceback" not in res.output and not (tmp_path / "o" / "config.json").exists()
        return res.output

    assert "needs 2 to 16 checkpoints, not 1" in refused(tmp_path / "a")
    assert "training recipe (model:" in refused(tmp_path / "a", tmp_path / "wide")
    assert "already an ensemble (2 members)" in refused(tmp_path / "a", tmp_path / "pair")
    untrained = random_checkpoint(data, tmp_path / "random")  # not written by cognet train
    assert "not a run of cognet train (config.json lacks" in refused(tmp_path / "a", untrained)


@pytest.mark.parametrize("bad", ["0", "17", "two"])
def test_members_option_is_checked(tmp_path, bad):
    data, _ = make_tiny(tmp_path)
    res = CliRunner().invoke(
        main, ["train", "--data", str(data), "--out", str(tmp_path / "c"), "--members", bad]
    )
    assert res.exit_code == 2 and "members" in res.output
