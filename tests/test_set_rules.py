"""Set rules (`cognet.core.decoding.set_rules.select_sets`, `cognet.core.decoding.SET_RULES`): the
expected-Jaccard sizes against brute force, the rule stored and asked for, and the choice
`cognet train` makes on validation."""

from __future__ import annotations

import numpy as np
import pytest

from cognet.core.ddi import DDIPolicy, DDITarget
from cognet.core.decoding import Decoding
from cognet.core.decoding.request import DecodingRequest, with_target
from cognet.core.decoding.sampling import SetConfig, set_probabilities, set_result
from cognet.core.decoding.set_rules import jaccard_sizes, select_sets, threshold_sets
from cognet.core.history import Visit
from cognet.core.metrics import VisitResult, bootstrap_report
from cognet.training.tuning import choose_set_rule, validation_jaccard


def _expected_jaccard(p: np.ndarray, chosen: np.ndarray) -> float:
    inside = p[chosen].sum()
    return inside / (chosen.sum() + p[~chosen].sum())


def test_jaccard_sizes_maximise_the_expected_jaccard_over_every_size():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = np.sort(rng.beta(0.4, 0.6, size=rng.integers(1, 12)))[::-1]
        size = jaccard_sizes(p[None])[0]
        values = [_expected_jaccard(p, np.arange(p.size) < k) for k in range(1, p.size + 1)]
        assert size == int(np.argmax(values)) + 1  # the first (smallest) of equal sizes


def test_jaccard_sizes_by_hand_and_edge_cases():
    # k=1: 0.9/1.8 = 0.5; k=2: 1.5/2.2 = 0.68; k=3: 1.7/3 = 0.57; k=4: 1.7/4
    assert jaccard_sizes(np.array([[0.9, 0.6, 0.2, 0.0]])).tolist() == [2]
    assert jaccard_sizes(np.zeros((2, 5))).tolist() == [0, 0]  # nothing likely: empty set
    assert jaccard_sizes(np.zeros((3, 0))).tolist() == [0, 0, 0]
    assert jaccard_sizes(np.array([[1.0, 1.0, 1.0]])).tolist() == [3]


def test_select_sets_reads_the_rule_in_probability_order_under_ddi():
    marg = np.array([[0.2, 0.6, 0.9, 0.6, 0.0], [0.3, 0.3, 0.3, 0.3, 0.3]])
    # row 0: sizes 1 (0.9/2.4), 2 (1.5/2.8), 3 (2.1/3.2), 4 (2.3/4): 3
    # row 1: 0.3 k / (k + 0.3 (5 - k)) grows with k: all 5
    assert [s.tolist() for s in select_sets(marg, 0.99, rule="jaccard")] == [
        [2, 1, 3],
        [0, 1, 2, 3, 4],
    ]
    assert [s.tolist() for s in select_sets(marg, 0.5)] == [[2, 1, 3], []]
    adj = np.zeros((5, 5), bool)
    adj[2, 1] = adj[1, 2] = True
    hard = select_sets(marg, 0.99, DDIPolicy(mode="hard"), adj, rule="jaccard")
    assert hard[0].tolist() == [2, 3]  # the rule's set, then the policy's filter
    with pytest.raises(ValueError, match="unknown set rule"):
        select_sets(marg, 0.5, rule="median")


@pytest.mark.parametrize("shape", [(0, 7), (5, 0), (300, 40), (64, 131)])
def test_threshold_sets_are_each_visits_sorted_reading(shape):
    """One sort for every visit reads what a visit-by-visit reading does: P >= threshold,
    decreasing, equal P by smaller id (rounded values make many ties), NaN never in."""
    rng = np.random.default_rng(shape[0])
    marg = np.round(rng.random(shape) ** 3, 2)
    marg[rng.random(shape) < 0.05] = np.nan
    for threshold in (0.0, 0.2, 0.5, 1.0):
        got = threshold_sets(marg, threshold)
        assert len(got) == shape[0]
        for row, ids in zip(marg, got, strict=True):
            want = sorted(
                (k for k in range(row.size) if row[k] >= threshold), key=lambda k: (-row[k], k)
            )
            assert ids.dtype == np.int64 and ids.tolist() == want


def test_set_probabilities_are_each_sets_probabilities_and_mean():
    rng = np.random.default_rng(3)
    marg = rng.random((400, 300)) ** rng.uniform(0.2, 8, (400, 1))  # sets of ~10 to ~250
    marg[::7] *= 0.5  # and empty ones
    meds = select_sets(marg, 0.7)
    assert any(m.size == 0 for m in meds) and any(m.size > 1 for m in meds)
    probs, score = set_probabilities(marg, meds)
    assert score.dtype == np.float32 and len(probs) == 400
    for i, m in enumerate(meds):
        assert probs[i].dtype == np.float32
        assert probs[i].tolist() == marg[i, m].astype(np.float32).tolist()
        want = marg[i, m].astype(np.float32).mean() if m.size else 0.0
        assert score[i] == np.float32(want)  # the same float32 as the visit's own mean
    assert max(m.size for m in meds) > 128  # numpy sums those in halves
    empty_probs, empty_score = set_probabilities(marg[:0], [])
    assert empty_probs == [] and empty_score.shape == (0,)


def test_set_result_follows_the_configs_rule():
    marg = np.array([[0.3, 0.3, 0.3, 0.3, 0.3]])
    for rule, size in (("threshold", 0), ("jaccard", 5)):
        cfg = SetConfig.of(Decoding(name="set", threshold=0.5, rule=rule), end=5)
        assert cfg.rule == rule
        assert set_result(marg, 3, cfg).meds[0].size == size


def test_stored_rule_round_trips_and_older_models_read_threshold():
    new = Decoding(name="set", threshold=0.35, rule="jaccard", estimator="stratified")
    assert Decoding.from_json(new.to_json()) == new
    old = new.to_json()
    del old["rule"]
    assert Decoding.from_json(old).rule == "threshold"
    assert new.label == "set, 16 samples, expected-Jaccard sets, stratified draws"
    assert new.with_changes(rule="threshold").label.startswith("set, 16 samples, threshold 0.35")
    with pytest.raises(ValueError, match="unknown set rule"):
        Decoding(name="set", threshold=0.3, rule="median")


def test_asked_rule_and_a_ddi_target_read_the_threshold():
    stored = Decoding(name="set", threshold=0.35, rule="jaccard")
    assert DecodingRequest().decoding_on(stored).rule == "jaccard"  # the model's own
    assert DecodingRequest(threshold=0.3).decoding_on(stored).rule == "threshold"  # alone
    assert DecodingRequest(set_rule="jaccard").decoding_on(stored).rule == "jaccard"
    model = Decoding(name="set", threshold=0.35, rule="jaccard")
    soft = DDIPolicy(mode="soft", penalty=0.5)
    target = DDITarget(target=0.06, policy=soft, threshold=0.25, val_jaccard=0.5, val_ddi=0.05)
    decoding, policy = with_target(None, target, model, lambda d: d)
    assert (decoding.rule, decoding.threshold, policy.mode) == ("threshold", 0.25, "soft")
    decoding, policy = with_target(DDIPolicy(), target, model, lambda d: d)
    assert (decoding.rule, policy.mode) == ("jaccard", "off")
    # a target found with the expected-Jaccard rule decodes by that rule, whatever the model's
    by_rule = DDITarget(0.06, soft, 1.0, 0.5, 0.05, rule="jaccard")
    plain = Decoding(name="set", threshold=0.35)
    decoding, policy = with_target(None, by_rule, plain, lambda d: d)
    assert (decoding.rule, policy.mode) == ("jaccard", "soft")


def test_a_ddi_target_applies_to_the_decoding_run_when_it_is_the_one_it_was_chosen_for():
    """The decoding run, not the model's stored one, decides: a target chosen for the set
    head applies when the head is asked on a model whose own decoding is set decoding (as
    `cognet evaluate --decoding marginal --ddi-target R` finds it), and to nothing else."""
    capped = DDIPolicy(max_rate=0.06)
    head = DDITarget(0.06, capped, 0.3, 0.5, 0.05, rule="threshold", decoding="marginal")
    stored = Decoding(name="set", threshold=0.35, head_threshold=0.4, head_rule="jaccard")
    for asked, applies in ((None, False), ("set", False), ("beam", False), ("marginal", True)):
        request = DecodingRequest(decoding=asked)
        decoding, policy = request.resolve(stored, head)
        assert (policy == capped) == applies, asked
        if applies:
            assert decoding.selection == (0.3, "threshold")
    # the head's own decoding stored: the target applies unless another decoding is asked
    own = stored.with_changes(name="marginal")
    assert DecodingRequest().resolve(own, head)[1] == capped
    assert DecodingRequest(decoding="set").resolve(own, head)[1] == DDIPolicy()
    # a set decoding's target on the same model: applies to set decoding only
    soft = DDITarget(0.06, DDIPolicy("soft", 0.5), 0.25, 0.5, 0.05)
    assert DecodingRequest().resolve(stored, soft)[1] == soft.policy
    assert DecodingRequest(decoding="marginal").resolve(stored, soft)[1] == DDIPolicy()


def _patients(truths: list[set[int]]) -> list[list[Visit]]:
    return [[Visit(f"p{i}", f"v{i}", (), (), tuple(sorted(t)))] for i, t in enumerate(truths)]


def test_train_keeps_the_rule_that_scores_better_on_validation():
    rng = np.random.default_rng(1)
    n, m = 600, 20
    # visits of very different certainty, their true sets drawn from the probabilities
    marg = rng.beta(0.3, 0.3, size=(n, m)) * rng.uniform(0.3, 1.0, size=(n, 1))
    drawn = [set(np.flatnonzero(rng.random(m) < row).tolist()) for row in marg]
    tau, rule, info = choose_set_rule(_patients(drawn), marg)
    assert rule == "jaccard"
    assert info["val_jaccard_jaccard_rule"] > max(info["val_jaccard_by_threshold"].values())
    # true sets that are exactly a threshold's: the threshold rule wins
    cut = [set(np.flatnonzero(row >= 0.4).tolist()) for row in marg]
    tau, rule, info = choose_set_rule(_patients(cut), marg)
    assert (tau, rule) == (0.4, "threshold")
    assert info["val_jaccard_by_threshold"][0.4] == 1.0


@pytest.mark.parametrize("rule", [{"threshold": 0.3}, {"threshold": None, "rule": "jaccard"}])
def test_validation_jaccard_is_what_evaluate_reports(rule):
    """The tuning's Jaccard (multi-hot rows) = `cognet evaluate`'s patient-averaged Jaccard,
    with empty predictions and visits whose medications are unknown or empty."""
    rng = np.random.default_rng(4)
    m, patients = 15, []
    for i in range(40):
        visits = []
        for j in range(int(rng.integers(1, 6))):
            truth = tuple(sorted(rng.choice(m, int(rng.integers(0, 6)), replace=False).tolist()))
            visits.append(Visit(f"p{i}", f"p{i}-{j}", (), (), None if j == 2 else truth))
        patients.append(visits)
    visits = [v for p in patients for v in p]
    marg = rng.beta(0.3, 0.5, size=(len(visits), m)) * rng.uniform(0.1, 1.0, (len(visits), 1))
    sets = select_sets(marg, **rule)
    assert any(not v.meds for v in visits)
    assert any(len(s) == 0 for s in sets) == ("rule" not in rule)  # expected-Jaccard: >= 1
    results = [
        VisitResult(v.patient_id, tuple(s.tolist()), tuple(v.meds or ()), p)
        for v, s, p in zip(visits, sets, marg, strict=True)
    ]
    want = bootstrap_report(results, np.zeros((m, m), bool), rounds=1, fraction=1.0)
    got = validation_jaccard(patients, marg, **rule)
    assert got == pytest.approx(want["jaccard"]["mean"], rel=1e-12, abs=1e-12)
