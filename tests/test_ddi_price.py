"""The DDI pair price (`cognet.core.ddi.DDIPolicy.pair_price`,
`cognet.core.decoding.set_rules.priced_sets`): the expected-Jaccard set less a price per
interacting pair. At price 0 it is the expected-Jaccard rule; a price passes over an
interacting medication when the pair costs more than it adds; the pooled DDI rate falls as
the price rises; torch and the runtime read the same sets; the request, the stored target
and the command line take it, and refuse it where it does not apply."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from cognet.core.ddi import DDIPolicy, DDITarget
from cognet.core.decoding import Decoding
from cognet.core.decoding.request import DecodingRequest
from cognet.core.decoding.set_rules import priced_sets, select_sets
from cognet.core.errors import InputError
from cognet.core.metrics import ddi_rate_of_sets
from tests.tiny import runtime_sets, set_agreement, torch_sets


def _population(n: int, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    marg = (rng.random((n, m)) ** rng.uniform(0.5, 4, (n, 1))).astype(np.float32)
    adj = rng.random((m, m)) < 0.15
    adj = np.triu(adj, 1)
    return marg, adj | adj.T


def test_price_zero_reads_the_expected_jaccard_sets():
    """The greedy from the empty set stops where the expected-Jaccard rule's best size is."""
    for seed in range(5):
        marg, adj = _population(400, int(3 + 7 * seed), seed)
        order, sizes = priced_sets(marg, adj, 0.0)
        got = [o[:s].tolist() for o, s in zip(order, sizes, strict=True)]
        ref = [s.tolist() for s in select_sets(marg, 1.0, DDIPolicy(), adj, "jaccard")]
        assert got == ref


def test_a_price_passes_over_an_interacting_medication_by_hand():
    marg = np.array([[0.9, 0.8, 0.7, 0.1]])
    adj = np.zeros((4, 4), bool)
    adj[0, 1] = adj[1, 0] = True
    # expected Jaccard: {0} 0.346, {0,2} 0.552, {0,1} 0.607, {0,1,2} 0.774
    # price 0.2: {0}, then 2 (gains 0.206) before 1 (0.607 - 0.346 - 0.2), then 1 (0.022)
    # price 0.25: 1 would add 0.774 - 0.552 - 0.25 < 0, so {0, 2}
    sets = {
        price: select_sets(marg, 1.0, DDIPolicy(pair_price=price), adj, "jaccard")[0].tolist()
        for price in (0.01, 0.2, 0.25)
    }
    assert sets == {0.01: [0, 1, 2], 0.2: [0, 1, 2], 0.25: [0, 2]}  # decreasing probability
    assert select_sets(marg, 1.0, DDIPolicy(), adj, "jaccard")[0].tolist() == [0, 1, 2]


def test_the_pooled_ddi_rate_falls_as_the_price_rises():
    marg, adj = _population(500, 30, 7)
    rates, sizes = [], []
    for price in (0.0, 0.002, 0.01, 0.05, 0.5):
        sets = select_sets(marg, 1.0, DDIPolicy(pair_price=price), adj, "jaccard")
        rates.append(ddi_rate_of_sets(sets, adj))
        sizes.append(np.mean([len(s) for s in sets]))
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False)), rates
    assert rates[-1] == 0.0 and sizes[-1] > 0.5 * sizes[0]  # no pair left, most sets kept


def test_a_price_needs_the_expected_jaccard_rule_and_the_adjacency():
    marg, adj = _population(3, 5, 0)
    with pytest.raises(ValueError, match="expected-Jaccard"):
        select_sets(marg, 0.3, DDIPolicy(pair_price=0.01), adj, "threshold")
    with pytest.raises(ValueError, match="adjacency"):
        select_sets(marg, 1.0, DDIPolicy(pair_price=0.01), None, "jaccard")
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            DDIPolicy(pair_price=bad)


def test_the_request_asks_the_expected_jaccard_rule_for_a_price():
    stored = Decoding(name="set", threshold=0.35)
    priced = DDIPolicy(pair_price=0.002)
    decoding, policy = DecodingRequest(ddi=priced).resolve(stored)
    assert (decoding.rule, policy.pair_price, policy.active) == ("jaccard", 0.002, True)
    assert policy.label == "off, pair price 0.002"
    for asked in ({"threshold": 0.3}, {"set_rule": "threshold"}, {"decoding": "beam"}):
        with pytest.raises(ValueError, match="pair-price"):
            DecodingRequest(ddi=priced, **asked).resolve(stored)
    assert DecodingRequest().resolve(stored)[0].rule == "threshold"  # no price: the model's


def test_a_target_with_a_price_round_trips_and_older_targets_read_no_price():
    target = DDITarget(0.06, DDIPolicy(pair_price=0.002), 1.0, 0.55, 0.059, rule="jaccard")
    assert target.to_json()["policy"]["pair_price"] == 0.002
    assert DDITarget.from_json(target.to_json()) == target
    older = DDITarget(0.06, DDIPolicy("soft", 0.5), 0.4, 0.53, 0.059).to_json()
    assert "pair_price" not in older["policy"]  # files without a price are written as before
    assert DDITarget.from_json(older).policy.pair_price == 0.0
    with pytest.raises(ValueError, match="expected-Jaccard"):
        DDITarget(0.06, DDIPolicy(pair_price=0.002), 0.4, 0.55, 0.059, rule="threshold")


@pytest.mark.parametrize("selection", ["host", "device"])
def test_torch_and_the_runtime_read_the_same_priced_sets(tiny, selection):
    priced = DDIPolicy(pair_price=0.02)
    decoding = Decoding(name="set", samples=8, threshold=0.3, rule="jaccard")
    ref = torch_sets(tiny, decoding)
    model_sets = torch_sets(tiny, decoding, ddi=priced)
    got = runtime_sets(
        tiny, decoding="set", samples=8, batch_size=64, selection=selection, ddi=priced
    )
    assert set_agreement(got, model_sets) >= 0.995
    assert set_agreement(model_sets, ref) < 1.0  # the price changed some sets


def test_the_command_lines_take_a_price_and_refuse_it_with_a_threshold(tiny, tmp_path):
    from cognet.cli import main as cognet_main
    from cognet.runtime.cli import main as batch_main

    common = ["--checkpoint", str(tiny / "ckpt"), "--data", str(tiny / "data"), "--rounds", "1"]
    priced = ["--decoding", "set", "--ddi-pair-price", "0.02"]  # the tiny model's own: beam
    res = CliRunner().invoke(cognet_main, ["evaluate", *common, *priced])
    assert res.exit_code == 0, res.output
    assert "pair price 0.02" in res.output and "expected-Jaccard sets" in res.output
    res = CliRunner().invoke(cognet_main, ["evaluate", *common, *priced, "--threshold", "0.3"])
    assert res.exit_code == 2 and "--ddi-pair-price" in res.output
    visits = str(tiny / "data" / "visits.parquet")
    out = str(tmp_path / "recs.parquet")
    args = ["score", visits, "--model", str(tiny / "model"), "--out", out, "--all", "--quiet"]
    res = CliRunner().invoke(batch_main, [*args, "--ddi-pair-price", "0.02", "--decoding", "beam"])
    assert res.exit_code == 2 and "set decoding" in res.output


def test_the_tradeoffs_prices_read_what_a_priced_decoding_returns(tiny, tmp_path):
    """`--ddi-tradeoff --pair-prices` reads each price from off's P(k in S) without decoding
    again: the same report as evaluating with that price; the plot draws them."""
    from cognet.evaluation import ddi_tradeoff
    from cognet.evaluation.evaluate import EvalOptions, run_evaluation

    asked = DecodingRequest(decoding="set", samples=8, set_rule="jaccard")
    options = EvalOptions(request=asked, rounds=2)
    result = ddi_tradeoff.run_tradeoff(
        tiny / "ckpt",
        tiny / "data",
        options,
        ddi_tradeoff.policies(penalties=(1.0,), pair_prices=(0.02, 0.2)),
    )
    by = {r.policy.label: r for r in result.rows}
    assert list(by) == ["off", "hard", "soft 1", "off, pair price 0.02", "off, pair price 0.2"]
    for price in (0.02, 0.2):
        priced = replace(options, request=replace(asked, ddi=DDIPolicy(pair_price=price)))
        direct = run_evaluation(tiny / "ckpt", tiny / "data", priced)["report"]
        row = by[f"off, pair price {price:g}"].report
        assert row["jaccard"] == direct["jaccard"] and row["ddi"] == direct["ddi"]
    assert by["off, pair price 0.2"].mean("ddi") < by["off"].mean("ddi")
    png = ddi_tradeoff.plot(result.rows, tmp_path / "t.png", marks=[("RASNet", 0.54, 0.06)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    beam = replace(options, request=DecodingRequest(decoding="beam"))
    with pytest.raises(InputError, match="set decoding"):
        ddi_tradeoff.run_tradeoff(
            tiny / "ckpt", tiny / "data", beam, ddi_tradeoff.policies((), (), (0.02,))
        )


def test_the_plot_zooms_past_a_far_hard_point():
    """Real data's `hard` costs a third of the Jaccard: the axis then spans the other points
    (the frontier stays readable) and the legend says where hard lies; a near one stays."""
    from cognet.evaluation import ddi_tradeoff

    plt = ddi_tradeoff._pyplot()

    def row(policy, jaccard, ddi):
        stats = {"jaccard": {"mean": jaccard, "std": 0.0}, "ddi": {"mean": ddi, "std": 0.0}}
        return ddi_tradeoff.TradeoffRow(policy, stats, 0.0)

    for hard_jaccard, zoomed in ((0.37, True), (0.53, False)):
        rows = [
            row(DDIPolicy(), 0.552, 0.089),
            row(DDIPolicy("hard"), hard_jaccard, 0.0),
            row(DDIPolicy("soft", 0.6), 0.540, 0.061),
            row(DDIPolicy(pair_price=0.002), 0.550, 0.060),
        ]
        fig, ax = plt.subplots()
        ddi_tradeoff._draw_policies(ax, rows, {}, None)
        ddi_tradeoff._zoom_past_hard(ax, rows, [("RASNet", 0.5401, 0.0599)])
        low, high = ax.get_ylim()
        labels = ax.get_legend_handles_labels()[1]
        assert (low > hard_jaccard) == zoomed and high > 0.552
        assert any("below the axes" in label for label in labels) == zoomed
        plt.close(fig)
