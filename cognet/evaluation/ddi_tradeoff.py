"""The DDI trade-off of a checkpoint: accuracy against interaction risk, per decoding policy.

For the paper's decoding (`off`), `hard`, and `soft` at several penalties (plus optional
`max_rate` caps and, for set decoding, pair prices), decode one split with the torch model
(the checkpoint's decoding, or the one asked) and report Jaccard, F1, PRAUC, DDI rate and
number of drugs (DESIGN.md §4, bootstrap mean and std), as rows, a table and a plot of
Jaccard against DDI rate.

    result = run_tradeoff("ckpt", "data", EvalOptions(split="test"), policies((0.5, 1, 2)))
    print(result.table)
    plot(result.rows, "tradeoff.png")

Each policy decodes the whole split again (`cognet.model.torch_decoding.decode_patients`),
but a pair price, which changes only the set read from P(k in S), reads it from its step
policy's answers (`reselect`).
`recommend` picks the soft penalty to advertise: the one with the lowest DDI rate among
those that cost at most `max_jaccard_drop` Jaccard against `off`. What the trade-off
measured, and why a DDI cut costs accuracy: docs/guide/ddi.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cognet.core.dataset import DDI_FILE, read_dataset
from cognet.core.ddi import DDIPolicy, ddi_matrix, require_pairs
from cognet.core.decoding import Decoding
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.errors import InputError
from cognet.core.files import atomic_path
from cognet.core.history import load_split
from cognet.core.metrics import evaluation_report, visit_results
from cognet.evaluation.options import EvalOptions, ground_truth_ddi, stored_decoding

# fine between 0.25 and 1, where the frontier bends on real data (docs/guide/ddi.md)
DEFAULT_PENALTIES = (0.1, 0.25, 0.35, 0.5, 0.6, 0.7, 0.8, 1.0, 2.0)
MAX_JACCARD_DROP = 0.01  # accuracy a recommended penalty may cost against `off`
# Columns of the table: (report key, header, format).
COLUMNS = (
    ("jaccard", "Jaccard", "{:.4f}"),
    ("f1", "F1", "{:.4f}"),
    ("prauc", "PRAUC", "{:.4f}"),
    ("ddi", "DDI rate", "{:.4f}"),
    ("avg_drugs", "#Drugs", "{:.2f}"),
)


@dataclass(frozen=True)
class TradeoffRow:
    """One policy's report (`cognet.core.metrics.bootstrap_report`: {metric: {mean, std}})."""

    policy: DDIPolicy
    report: dict
    seconds: float  # decoding time

    def mean(self, key: str) -> float:
        return float(self.report[key]["mean"])

    def to_json(self) -> dict:
        return {
            "policy": self.policy.to_json(),
            "label": self.policy.label,
            "report": self.report,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class TradeoffResult:
    rows: list[TradeoffRow]  # off first
    recommended: TradeoffRow | None
    table: str
    ground_truth_ddi: float  # DDI rate of the split's true prescriptions

    def to_json(self) -> dict:
        return {
            "rows": [r.to_json() for r in self.rows],
            "recommended": None if self.recommended is None else self.recommended.policy.label,
            "ground_truth_ddi": self.ground_truth_ddi,
        }


def policies(
    penalties: Sequence[float] = DEFAULT_PENALTIES,
    max_rates: Sequence[float] = (),
    pair_prices: Sequence[float] = (),
) -> list[DDIPolicy]:
    """off, hard, soft at each penalty, then off capped at each max rate, then off at each
    pair price."""
    return [
        DDIPolicy("off"),
        DDIPolicy("hard"),
        *(DDIPolicy("soft", float(p)) for p in penalties),
        *(DDIPolicy("off", max_rate=float(r)) for r in max_rates),
        *(DDIPolicy("off", pair_price=float(p)) for p in pair_prices),
    ]


def tradeoff(
    model,
    vocab,
    patients,
    ddi_adj: np.ndarray,
    policy_list: Sequence[DDIPolicy],
    options: EvalOptions | None = None,
    on_policy: Callable[[TradeoffRow], None] | None = None,
    decoding: Decoding = Decoding(),
    head=None,
) -> list[TradeoffRow]:
    """Decode `patients` (lists of `cognet.core.history.Visit`) under every policy; one row each.

    ddi_adj: bool [M, M] for the DDI rate (`cognet.core.ddi.ddi_matrix`); the decoding
    itself uses the model's DDI graph, built from the same pairs. options: the bootstrap
    rounds and seed; decoding: what each policy decodes with (default: the paper's beam
    search); head: the set head that the marginal decoding reads."""
    # torch: lazy, so that `cognet evaluate --help` and the bench's report run without it
    from cognet.model.torch_decoding import decode_patients, reselect

    options = options or EvalOptions()
    rows = []
    # the answers of each step policy that a pair price reads again (no decoding per price)
    bases = {DDIPolicy(p.mode, p.penalty) for p in policy_list if p.pair_price}
    steps: dict[DDIPolicy, list] = {}
    for policy in policy_list:
        started = time.perf_counter()
        if policy.pair_price:  # the expected-Jaccard set less the price (no threshold)
            if decoding.name == "beam":
                raise ValueError("a DDI pair price is for set decoding, not beam search")
            rule = "head_rule" if decoding.name == "marginal" else "rule"
            priced = decoding.with_changes(**{rule: "jaccard"})
            base = DDIPolicy(policy.mode, policy.penalty)
            if base not in steps:
                plan = DecodingPlan(decoding, vocab.end, ddi=base)
                steps[base] = decode_patients(model, vocab, patients, plan, head=head)
            decoded = reselect(model, steps[base], priced, policy)  # same P(k in S)
        else:
            plan = DecodingPlan(decoding, vocab.end, ddi=policy)
            decoded = decode_patients(model, vocab, patients, plan, head=head)
            if policy in bases:
                steps[policy] = decoded
        seconds = time.perf_counter() - started
        results = visit_results(patients, decoded)
        rep = evaluation_report(results, ddi_adj, rounds=options.rounds, seed=options.seed)
        rows.append(TradeoffRow(policy, rep, seconds))
        if on_policy:
            on_policy(rows[-1])
    return rows


def recommend(
    rows: Sequence[TradeoffRow], max_jaccard_drop: float = MAX_JACCARD_DROP
) -> TradeoffRow | None:
    """The soft row with the lowest DDI rate whose Jaccard is at most `max_jaccard_drop`
    below `off`'s (ties: the smaller penalty); None without an `off` row or a fitting one."""
    off = next((r for r in rows if not r.policy.active), None)
    if off is None:
        return None
    fits = [
        r
        for r in rows
        if r.policy.mode == "soft"
        and r.policy.max_rate is None
        and off.mean("jaccard") - r.mean("jaccard") <= max_jaccard_drop + 1e-12
    ]
    return min(fits, key=lambda r: (r.mean("ddi"), r.policy.penalty), default=None)


def format_table(rows: Sequence[TradeoffRow], recommended: TradeoffRow | None = None) -> str:
    """Mean ± std per metric, with the Jaccard and DDI-rate change against `off`."""
    off = next((r for r in rows if not r.policy.active), None)
    head = ["Decoding", *(h for _, h, _ in COLUMNS), "ΔJaccard", "ΔDDI"]
    body = []
    for r in rows:
        cells = [r.policy.label + (" *" if r is recommended else "")]
        for key, _, fmt in COLUMNS:
            cells.append(f"{fmt.format(r.mean(key))} ± {fmt.format(r.report[key]['std'])}")
        if off is None or r is off:
            cells += ["", ""]
        else:
            cells.append(f"{r.mean('jaccard') - off.mean('jaccard'):+.4f}")
            base = off.mean("ddi")
            cells.append(f"{(r.mean('ddi') - base) / base:+.0%}" if base > 0 else "")
        body.append(cells)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [head, *body]
    ]
    if recommended is not None:
        lines.append(
            f"* recommended: {recommended.policy.label} (lowest DDI rate within "
            f"{MAX_JACCARD_DROP} Jaccard of off)"
        )
    return "\n".join(lines)


def markdown_table(rows: Sequence[TradeoffRow], recommended: TradeoffRow | None = None) -> str:
    """The same table in Markdown (README, bench reports)."""
    off = next((r for r in rows if not r.policy.active), None)
    head = ["Decoding", *(h for _, h, _ in COLUMNS), "ΔJaccard vs off", "ΔDDI vs off"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"**{r.policy.label}**" if r is recommended else r.policy.label]
        cells += [fmt.format(r.mean(key)) for key, _, fmt in COLUMNS]
        if off is None or r is off:
            cells += ["", ""]
        else:
            base = off.mean("ddi")
            cells += [
                f"{r.mean('jaccard') - off.mean('jaccard'):+.4f}",
                f"{(r.mean('ddi') - base) / base:+.0%}" if base > 0 else "",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# One marker per point: off a hollow square, hard a diamond; the soft penalties (coloured
# dark to light as the penalty grows), then the max-rate caps (orange), the pair prices
# (green), then the --mark
# points (black) take these in turn.
MARKERS = ("o", "v", "^", "<", ">", "p", "h", "8", "d", "P", "X", "*", "H", "1", "2", "3", "4")


def plot(
    rows: Sequence[TradeoffRow],
    path: str | Path,
    recommended: TradeoffRow | None = None,
    title: str = "",
    marks: Sequence[tuple[str, float, float]] = (),
) -> Path:
    """Jaccard against DDI rate, one point per policy, each with its own marker and legend
    entry (bootstrap std as error bars); off and the soft penalties joined in order, a
    dotted line at `off` - MAX_JACCARD_DROP and a dashed one at 70% of off's DDI rate, and
    `marks` ((name, jaccard, ddi): published models, say) as black points named on the plot;
    every line and marker named in the legend (right of the axes, off hollow so that a
    point it covers shows); a PNG at `path`. Needs matplotlib."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10.0, 4.8), dpi=120)  # the legend right of the axes
    soft = _draw_curve_and_guides(ax, rows)
    caps = [r for r in rows if r.policy.max_rate is not None]
    priced = _draw_prices(ax, rows)
    _draw_policies(ax, rows, _point_styles(plt, soft, caps, priced), recommended)
    _zoom_past_hard(ax, rows, marks)
    for i, (name, jaccard, ddi) in enumerate(marks, len(soft) + len(caps) + len(priced)):
        marker = MARKERS[i % len(MARKERS)]
        ax.plot(ddi, jaccard, marker, color="black", ms=10, zorder=3, label=f"{name} (given)")
        ax.annotate(name, (ddi, jaccard), xytext=(5, 5), textcoords="offset points", fontsize=8)
    _finish_axes(ax, title)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


def _pyplot():
    """matplotlib.pyplot on the Agg backend; an InputError when matplotlib is missing."""
    try:  # matplotlib: the [bench] extra, needed by the plot only
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'cognet[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_curve_and_guides(ax, rows: Sequence[TradeoffRow]) -> list[TradeoffRow]:
    """The line through off and the soft penalties in order, and the two guides (the
    Jaccard floor, the 30% DDI cut) around off; returns the soft rows by penalty."""
    off = next((r for r in rows if not r.policy.active), None)
    soft = sorted(
        (r for r in rows if r.policy.mode == "soft" and r.policy.max_rate is None),
        key=lambda r: r.policy.penalty,
    )
    _draw_line(ax, off, soft, "tab:blue", "soft penalties in order (off = 0)")
    if off is not None:  # the region a recommended penalty must reach
        floor = f"Jaccard of off - {MAX_JACCARD_DROP:g} (floor of a recommended penalty)"
        ax.axhline(off.mean("jaccard") - MAX_JACCARD_DROP, color="gray", ls=":", lw=1, label=floor)
        cut = "70% of off's DDI rate (a 30% cut)"
        ax.axvline(0.7 * off.mean("ddi"), color="gray", ls="--", lw=1, label=cut)
    return soft


def _draw_prices(ax, rows: Sequence[TradeoffRow]) -> list[TradeoffRow]:
    """The line through off and the pair prices in order; returns the priced rows by price."""
    off = next((r for r in rows if not r.policy.active), None)
    priced = sorted((r for r in rows if r.policy.pair_price), key=lambda r: r.policy.pair_price)
    _draw_line(ax, off, priced, "tab:green", "pair prices in order (off = 0)")
    return priced


def _draw_line(ax, off: TradeoffRow | None, rows: list[TradeoffRow], color: str, label: str):
    """One policy family's line: off (its level 0), then `rows` in order, when it has any."""
    curve = ([off] if off else []) + rows
    if rows and len(curve) > 1:
        ax.plot(
            [r.mean("ddi") for r in curve],
            [r.mean("jaccard") for r in curve],
            "-",
            color=color,
            alpha=0.5,
            zorder=1,
            label=label,
        )


def _point_styles(
    plt, soft: list[TradeoffRow], caps: list[TradeoffRow], priced: list[TradeoffRow]
) -> dict:
    """{id(row): (marker, colour)}: the soft penalties dark to light, the caps orange, the
    pair prices green."""
    shades = plt.get_cmap("viridis")(np.linspace(0.15, 0.85, max(1, len(soft))))
    oranges = plt.get_cmap("Oranges")(np.linspace(0.5, 0.9, max(1, len(caps))))
    greens = plt.get_cmap("Greens")(np.linspace(0.5, 0.95, max(1, len(priced))))
    colors = [*shades[: len(soft)], *oranges[: len(caps)], *greens[: len(priced)]]
    return {
        id(r): (MARKERS[i % len(MARKERS)], c)
        for i, (r, c) in enumerate(zip(soft + caps + priced, colors, strict=True))
    }


def _draw_policies(
    ax, rows: Sequence[TradeoffRow], style: dict, recommended: TradeoffRow | None
) -> None:
    """One point per policy with its bootstrap std as error bars, each in the legend."""
    fixed = {"off": ("s", "tab:gray"), "hard": ("D", "tab:red")}
    for r in rows:  # one legend entry per policy: labels never overlap the points
        marker, color = style.get(id(r)) or fixed.get(r.policy.mode, ("o", "tab:blue"))
        label = r.policy.label + (" (recommended)" if r is recommended else "")
        ax.errorbar(
            r.mean("ddi"),
            r.mean("jaccard"),
            xerr=r.report["ddi"]["std"],
            yerr=r.report["jaccard"]["std"],
            fmt=marker,
            color=color,
            ms=9 if r is recommended else 7,
            mec="black" if r is recommended else color,
            mfc="none" if not r.policy.active else color,  # hollow: see what it covers
            alpha=0.85,
            capsize=2,
            zorder=2,
            label=label,
        )


def _zoom_past_hard(ax, rows: Sequence[TradeoffRow], marks) -> None:
    """When `hard` lies far below every other point (on real data it costs a third of the
    Jaccard), the Jaccard axis spans the others only, so that the frontier where the choices
    are made stays readable; the legend says where hard lies."""
    hard = [r for r in rows if r.policy.mode == "hard"]
    others = [r.mean("jaccard") for r in rows if r.policy.mode != "hard"]
    others += [jaccard for _, jaccard, _ in marks]
    if not hard or len(others) < 2:
        return
    low, high = min(others), max(others)
    span = max(high - low, 0.01)
    if hard[0].mean("jaccard") >= low - 2 * span:
        return
    ax.set_ylim(low - 0.15 * span, high + 0.15 * span)
    for line in ax.get_legend_handles_labels()[0]:
        if line.get_label() == "hard":
            line.set_label(f"hard ({hard[0].mean('jaccard'):.4f} at 0: below the axes)")


def _finish_axes(ax, title: str) -> None:
    """The legend right of the axes (the given points last), the labels, title and grid."""
    handles, labels = ax.get_legend_handles_labels()  # the given points last
    order = sorted(range(len(labels)), key=lambda i: labels[i].endswith("(given)"))
    ax.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0,
    )
    ax.set_xlabel("DDI rate (lower is safer)")
    ax.set_ylabel("Jaccard")
    ax.set_title(
        title or "COGNet: accuracy vs drug-drug interactions by decoding policy",
        fontsize=10,
    )
    ax.text(  # what the error bars are
        0.99,
        0.01,
        "error bars: bootstrap std",
        transform=ax.transAxes,
        ha="right",
        va="bottom",
        fontsize=7,
        color="gray",
    )
    ax.grid(alpha=0.3)


def run_tradeoff(
    ckpt,
    data_dir,
    options: EvalOptions | None = None,
    policy_list: Sequence[DDIPolicy] | None = None,
    on_policy: Callable[[TradeoffRow], None] | None = None,
    max_patients: int | None = None,
) -> TradeoffResult:
    """What `cognet evaluate --ddi-tradeoff` does (and what `cognet-bench` may call): every
    policy of `policy_list` (default: `policies()`) on the split of `options` of a dataset
    directory (its first `max_patients` patients when given: a policy costs about a torch
    decoding of the split), decoded as `options` says on top of the checkpoint's own."""
    from cognet.model import checkpoint  # torch: lazy, as in `tradeoff`

    options = options or EvalOptions()
    split = options.split
    dataset = read_dataset(data_dir)
    require_pairs(dataset.ddi_pairs, Path(data_dir) / DDI_FILE, "--ddi-tradeoff")
    model, vocab, config = checkpoint.load(ckpt)
    try:  # the decoding asked on the checkpoint's own; every policy of the list decodes it
        decoding = options.request.decoding_on(stored_decoding(config))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    patients = load_split(dataset.visits, vocab, split).patients[:max_patients]
    if not patients:
        raise InputError(f"{data_dir}: the {split} split has no labelled visit")
    ddi_adj = ddi_matrix(vocab, dataset.ddi_pairs)
    policy_list = policies() if policy_list is None else policy_list
    if decoding.name == "beam" and any(p.pair_price for p in policy_list):
        raise InputError("--pair-prices are for set decoding, not beam search")
    head = None
    if decoding.name == "marginal":  # one pass: no step for a soft penalty to act on
        head = checkpoint.load_head(ckpt, config)
        if head is None:
            raise InputError(f"{ckpt}: --decoding marginal reads a set head and it has none")
        policy_list = [p for p in policy_list if p.mode != "soft"]
    rows = tradeoff(
        model, vocab, patients, ddi_adj, policy_list, options, on_policy, decoding, head
    )
    best = recommend(rows)
    truth = ground_truth_ddi(patients, ddi_adj)
    table = (
        f"{format_table(rows, best)}\nground-truth DDI rate of the {split} split: "
        f"{truth:.4f} ({rows[0].report['n_patients']} patients, "
        f"{rows[0].report['n_visits']} visits, {decoding.label})"
    )
    return TradeoffResult(rows, best, table, truth)
