"""Parity of the exported graphs with the torch model.

Two checks, both run by `cognet.export.export` unless `validate=False`:

1. Outputs: ONNX Runtime (all graph optimisations on, as the runtime runs it) against torch
   on the same inputs, graph by graph, for every output, at `SHAPE_CASES` (one visit and
   greedy; a padded batch; a long history; the step at every cache length T = 0..45).
   Float32 must match within `FLOAT32_ATOL` (`log_probs` clipped below at log
   `LOG_FLOOR`); the float16 variant within `FLOAT16_ATOL`
   (its `log_probs` compared as probabilities, see below) with `FLOAT16_MIN_TOP1` of the
   step rows choosing the same top-1 token. The int8 variant's bars are on the step's
   probabilities (`log_probs` as probabilities, `gate`, `copy_probs`): within `INT8_ATOL`,
   with `INT8_MIN_TOP1` of the rows choosing the same top-1 token; its other outputs
   (encodings, memories) are reported, not bounded, since they matter only through them.
2. Decoding: greedy and beam-4 search driven through the exported graphs by the runtime's
   numpy beam search (`cognet.core.decoding.beam`) must return the medication lists of the torch
   reference `cognet.model.torch_decoding.beam_search` on every visit. A model that decodes
   sets by default (its checkpoint's decoding) has its sets compared too, through the
   runtime's set decoding (`cognet.core.decoding.sampling`), against torch's `set_decode`:
   reported, not required, since a P(k in S) at the threshold may tie in the last float bits.

An ensemble (`cognet.model.ensemble`): each member's graphs against that member's network
(check 1; the report keeps, per case and output, the worst member, and each member's worst
diff under `members`), and the ensemble's lists, decoded through every member's graphs by
the runtime's `EnsembleSession`, against the torch `Ensemble`'s (check 2).

`copy_probs` are compared on visits with a history only: without one every slot has the
bias NEG and the distribution (unused: the gate is 1) is float rounding noise.
float16 (and int8) `log_probs` are compared as probabilities (exp of both sides): float16
has no numbers below 6e-8, so the log of a near-impossible medication is not comparable,
while the probability error is what decides the beam. The variants' beam-4 lists are
reported against torch's, not required equal.

A set head (`cognet.model.set_head`): its graph's `marginals` against the torch head's at
`HEAD_CASES` (one visit; a batch of 7; 64 visits of long lists; lists all empty, first
visits), within `HEAD_ATOL`, reported under "head" (absent for a model without one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from cognet.core.decoding import BEAM, MAX_LEN, Decoding
from cognet.core.decoding.beam import BeamConfig
from cognet.core.decoding.beam import beam_search as runtime_beam_search
from cognet.core.decoding.draws import visit_keys
from cognet.core.decoding.driver import Visits
from cognet.core.decoding.ensemble import EnsembleSession, decode_ensemble_sets
from cognet.core.decoding.sampling import SetConfig, decode_sets
from cognet.core.errors import ParityError
from cognet.core.graphspec import ENCODER_INPUTS, ENCODER_OUTPUTS, INIT_INPUTS
from cognet.core.history import Visit
from cognet.core.manifest import GRAPHS
from cognet.core.vocab import Vocab
from cognet.export.graphs import (
    GRAPH_IO,
    WRAPPERS,
    HeadSizes,
    ReferenceStep,
    Sizes,
    example_inputs,
    head_example,
)
from cognet.model.batching import make_batch
from cognet.model.ensemble import Ensemble, members_of
from cognet.model.network import COGNet, ModelConfig, history_inputs
from cognet.model.torch_decoding import beam_search, set_decode

FLOAT32_ATOL = 1e-4
# float32 `log_probs` are compared clipped below at log(LOG_FLOOR): under it, the float32
# rounding of the mixture's log is not comparable in absolute terms (a network trained on
# MIMIC-III: 1.25e-4 on a log-probability of -10.14, p = 4e-5, a relative error of 1.25e-4
# on that probability) and such a medication decides no beam or set; a value that crosses
# the floor on one side only still counts in full
LOG_FLOOR = 1e-3
# float16 (CPU provider), measured over the shape cases: worst abs diff 4.2e-3 on a checkpoint
# trained on the synthetic data (dim 64), 2.5e-3 / 5.1e-3 on random real-size / tiny ones
# (always on encodings; probabilities <= 6e-4); top-1 agreement >= 0.998. Bound: ~2x that.
FLOAT16_ATOL = 1e-2
FLOAT16_MIN_TOP1 = 0.98
# int8 (`cognet.export.int8`, CPU provider), over the shape cases: worst probability diff
# 4.3e-3 and top-1 agreement 0.987 on a checkpoint of the default model (dim 128, 2 epochs
# of synthetic data); 2.2e-2 and 0.960 on the tiny random one (dim 16, flat distributions,
# near-ties everywhere). Bound: ~2x the worst diff, 2.5x the worst disagreement.
INT8_ATOL = 5e-2
INT8_MIN_TOP1 = 0.9
# the step's outputs that are (log) probabilities
PROBABILITIES = ("log_probs", "gate", "copy_probs")

SHAPE_CASES: dict[str, tuple[Sizes, Sequence[int]]] = {
    # name: (sizes, cache lengths T at which the step runs)
    "batch1_greedy": (Sizes(N=1, B=1, Ld=6, Lp=3, Lm=5, J=1, S=4), (0, 1, 2)),
    "padded_batch": (Sizes(N=8, B=4, Ld=16, Lp=8, Lm=12, J=4, S=24), (0, 3, 7)),
    "long_history": (Sizes(N=3, B=4, Ld=10, Lp=5, Lm=20, J=40, S=400), (0, 5)),
    "T_0_to_45": (Sizes(N=4, B=4, Ld=8, Lp=4, Lm=8, J=3, S=12), tuple(range(MAX_LEN + 1))),
}


# the set head's P(k in S), float32 against torch: the same bound as the model's graphs
HEAD_ATOL = FLOAT32_ATOL
HEAD_CASES: dict[str, tuple[HeadSizes, float]] = {
    # name: (sizes, share of rows whose code lists are empty and that have no history)
    "one_visit": (HeadSizes(N=1, Ld=6, Lp=3, Ll=5, Lh=9), 0.0),
    "batch7": (HeadSizes(N=7, Ld=12, Lp=6, Ll=8, Lh=20), 0.3),
    "long_lists_64": (HeadSizes(N=64, Ld=60, Lp=30, Ll=40, Lh=300), 0.2),
    "all_empty": (HeadSizes(N=5, Ld=1, Lp=1, Ll=1, Lh=1), 1.0),
}


@contextmanager
def _one_torch_thread():
    """Torch and ONNX Runtime take turns on the same cores here; one torch thread avoids the
    OpenMP spin-wait that made torch many times slower on a busy machine (tiny tensors gain
    nothing from threads anyway)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Graphs:
    """ONNX Runtime sessions of the three graphs of one variant."""

    sessions: dict[str, ort.InferenceSession]

    @classmethod
    def load(cls, paths: dict[str, Path], threads: int = 0) -> Graphs:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        # no busy-waiting between runs: torch shares the cores during validation
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return cls(
            {
                name: ort.InferenceSession(
                    str(paths[name]), opts, providers=["CPUExecutionProvider"]
                )
                for name in GRAPHS
            }
        )

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one graph; float inputs are cast to the graph's float type, outputs to float32."""
        session = self.sessions[graph]
        inputs = {}
        for spec in session.get_inputs():
            x = np.asarray(feeds[spec.name])
            if x.dtype.kind == "f":
                x = x.astype(np.float16 if spec.type == "tensor(float16)" else np.float32)
            inputs[spec.name] = x
        names = [o.name for o in session.get_outputs()]
        outs = session.run(names, inputs)
        return {
            n: o.astype(np.float32) if o.dtype == np.float16 else o
            for n, o in zip(names, outs, strict=True)
        }


# -- 1. outputs -------------------------------------------------------------------------------
@_one_torch_thread()
def compare_outputs(model: COGNet, graphs: Graphs, as_probs: bool = False) -> dict:
    """Max abs diff of every output of every graph at every shape case, and top-1 agreement.
    as_probs: `log_probs` compared as probabilities, whose worst diff (with `gate` and
    `copy_probs`) is also reported as `probs_max_abs_diff`."""
    # the step graph against the model's own KV-cached step (`ReferenceStep`)
    wrappers = {**WRAPPERS, "decoder_step": ReferenceStep}
    modules = {name: wrappers[name](model).eval() for name in GRAPHS}
    cases, top1_same, top1_rows = {}, 0, 0
    for name, (sizes, lengths) in SHAPE_CASES.items():
        case: dict[str, float] = {}
        full = example_inputs(model, replace(sizes, T=max(lengths)))
        for t in lengths:
            # the step at cache length t: a prefix of the longest cache
            inputs = dict(full, past_tokens=full["past_tokens"][..., :t])
            graph_names = GRAPHS if t == lengths[0] else ("decoder_step",)
            for graph in graph_names:
                ins, outs = GRAPH_IO[graph]
                with torch.no_grad():
                    ref = modules[graph](*(inputs[k] for k in ins))
                got = graphs.run(graph, {k: inputs[k].numpy() for k in ins})
                for out, r in zip(outs, ref, strict=True):
                    r, g = r.numpy(), got[out]
                    if as_probs and out == "log_probs":
                        r, g = np.exp(r), np.exp(g)
                    elif out == "log_probs":
                        r, g = floored(r), floored(g)
                    if out == "copy_probs":  # defined only for visits with a history
                        used = inputs["has_history"].numpy()[:, None, None] > 0
                        r, g = r * used, g * used
                    diff = max_abs_diff(r, g)
                    key = f"{graph}.{out}"
                    case[key] = max(case.get(key, 0.0), diff)
                if graph == "decoder_step":
                    same = got["log_probs"].argmax(-1) == ref[0].numpy().argmax(-1)
                    top1_same += int(same.sum())
                    top1_rows += same.size
        cases[name] = case
    worst = max(d for case in cases.values() for d in case.values())
    shapes = {
        name: {**asdict(sizes), "T": list(lengths)}
        for name, (sizes, lengths) in SHAPE_CASES.items()
    }
    report = {
        "cases": cases,
        "shapes": shapes,
        "max_abs_diff": worst,
        "top1_agreement": top1_same / top1_rows,
    }
    if as_probs:
        report["probs_max_abs_diff"] = max(
            d
            for case in cases.values()
            for key, d in case.items()
            if key.split(".") in (["decoder_step", out] for out in PROBABILITIES)
        )
    return report


def worst_outputs(reports: Sequence[dict]) -> dict:
    """The `compare_outputs` report of several members' graphs: at every case and output the
    largest diff, the lowest top-1 agreement, and each member's own under `members` (one
    member: its report as it is)."""
    if len(reports) == 1:
        return reports[0]
    first = reports[0]
    cases = {
        name: {key: max(r["cases"][name][key] for r in reports) for key in case}
        for name, case in first["cases"].items()
    }
    diffs = [k for k in ("max_abs_diff", "probs_max_abs_diff") if k in first]
    out = {"cases": cases, "shapes": first["shapes"]}
    out.update({k: max(r[k] for r in reports) for k in diffs})
    out["top1_agreement"] = min(r["top1_agreement"] for r in reports)
    out["members"] = [{k: r[k] for k in (*diffs, "top1_agreement")} for r in reports]
    return out


def floored(log_probs: np.ndarray) -> np.ndarray:
    """Log-probabilities clipped below at log(LOG_FLOOR), as float32 parity compares them
    (NaN stays NaN, -inf becomes the floor)."""
    return np.maximum(log_probs, np.float32(math.log(LOG_FLOOR)))


def max_abs_diff(ref: np.ndarray, got: np.ndarray) -> float:
    """The largest |ref - got|, infinite where a NaN or a lone infinity is on either side:
    `max(0.0, nan)` is 0.0, so a model of NaNs would otherwise match its graphs exactly.
    Infinities of one sign on both sides (a masked log-probability) agree."""
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    odd = ~(np.isfinite(ref) & np.isfinite(got))
    if odd.any():
        if np.isnan(ref[odd]).any() or np.isnan(got[odd]).any() or (ref[odd] != got[odd]).any():
            return math.inf
        ref, got = ref[~odd], got[~odd]
    return float(np.abs(ref - got).max()) if ref.size else 0.0


# -- 2. decoding ------------------------------------------------------------------------------
def synthetic_patients(vocab: Vocab, n_patients: int, seed: int = 0) -> list[list[Visit]]:
    """Random patients (1-4 visits) over the vocabulary, for decoding checks at export time."""
    rng = np.random.default_rng(seed)

    def codes(n: int, low: int, high: int) -> tuple[int, ...]:
        k = min(n, int(rng.integers(low, high + 1)))
        return tuple(int(i) for i in rng.choice(n, k, replace=False))

    patients = []
    for p in range(n_patients):
        visits = []
        for s in range(int(rng.integers(1, 5))):
            meds = codes(vocab.n_med, 1, 10)
            visits.append(
                Visit(
                    f"P{p}",
                    f"P{p}-{s}",
                    codes(vocab.n_diag, 0, 10),
                    codes(vocab.n_proc, 1, 5),
                    tuple(vocab.rare_first(meds)),
                )
            )
        patients.append(visits)
    return patients


def onnx_beam_search(
    graphs: Graphs | Sequence[Graphs],
    batch: dict[str, torch.Tensor],
    cfg: ModelConfig,
    end: int,
    beam: int = BEAM,
    max_len: int = MAX_LEN,
) -> list[tuple[tuple[int, ...], float]]:
    """Decode the targets of `batch` (`cognet.model.batching.make_batch`) through the
    exported graphs (one network's, or each member's of an ensemble) with the runtime's own
    decoder sessions and beam search (`cognet.runtime.session.HostDecoder`, over an
    ensemble `cognet.core.decoding.ensemble.EnsembleSession`, `cognet.core.decoding.beam`):
    the driver and sessions that serve the model are the ones validated. The decoder-init
    inputs are assembled as for the torch model (`history_inputs`). Returns (medications,
    score) per visit."""
    sessions, memories = _host_sessions(graphs, batch, cfg)
    if len(sessions) == 1:
        session, memory = sessions[0], memories[0]
    else:
        session, memory = EnsembleSession(sessions), tuple(memories)
    result = runtime_beam_search(
        session,
        memory,
        BeamConfig.of(Decoding("beam", beam=beam, max_len=max_len), end),
        Visits(len(batch["target"])),
    )
    return [
        (tuple(int(m) for m in meds), float(score))
        for meds, score in zip(result.meds, result.score, strict=True)
    ]


def _host_sessions(graphs: Graphs | Sequence[Graphs], batch: dict, cfg: ModelConfig):
    """(the runtime's decoder session of each member's graphs, its memories of `batch`)."""
    # the runtime: export imports it inside functions only (DESIGN.md §1)
    from cognet.runtime.session import HostDecoder

    sessions, memories = [], []
    for member in [graphs] if isinstance(graphs, Graphs) else graphs:
        enc = member.run("encoder", {k: batch[k].numpy() for k in ENCODER_INPUTS})
        encodings = (torch.from_numpy(enc[k]) for k in ENCODER_OUTPUTS)
        init = history_inputs(batch, *encodings, cfg)
        inputs = {k: v.numpy() for k, v in zip(INIT_INPUTS, init, strict=True)}
        step = member.sessions["decoder_step"]
        sessions.append(HostDecoder(member.sessions["decoder_init"], step, cfg.heads, cfg.head_dim))
        memories.append(sessions[-1].init(inputs))
    return sessions, memories


def onnx_sets(
    graphs: Graphs | Sequence[Graphs],
    batch: dict[str, torch.Tensor],
    cfg: ModelConfig,
    decoding: Decoding,
    visit_ids: Sequence[str],
) -> list[tuple[int, ...]]:
    """The sets of `decoding` (set decoding, DDI off) of the targets of `batch`, through the
    exported graphs and the runtime's set decoding, each visit's draws keyed by its id as
    torch's `set_decode` keys them."""
    sessions, memories = _host_sessions(graphs, batch, cfg)
    visits = Visits(len(batch["target"]), keys=visit_keys(visit_ids))
    set_cfg = SetConfig.of(decoding, cfg.n_med)
    if len(sessions) == 1:
        result = decode_sets(sessions[0], memories[0], set_cfg, visits)
    else:
        result = decode_ensemble_sets(sessions, memories, set_cfg, visits)
    return [tuple(int(m) for m in meds) for meds in result.meds]


@_one_torch_thread()
def compare_sets(
    model: COGNet | Ensemble,
    graphs: Graphs | Sequence[Graphs],
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    decoding: Decoding,
    chunk: int = 256,
) -> dict:
    """The sets of torch's `set_decode` vs those decoded through the graphs (`onnx_sets`)."""
    same = total = 0
    mismatches: list[dict] = []
    for start in range(0, len(patients), chunk):
        part = patients[start : start + chunk]
        batch = make_batch(part, vocab, targets=False)
        ids = [v.visit_id for p in part for v in p]
        ref = set_decode(model, batch, ids, decoding)
        got = onnx_sets(graphs, batch, model.cfg, decoding, ids)
        for i, (r, meds) in enumerate(zip(ref, got, strict=True)):
            total += 1
            if tuple(r.meds) == meds:
                same += 1
            elif len(mismatches) < 5:
                mismatches.append({"visit": ids[i], "torch": list(r.meds), "onnx": list(meds)})
    return {
        "decoding": decoding.label,
        "visits": total,
        "identical": same,
        "mismatches": mismatches,
    }


@_one_torch_thread()
def compare_decoding(
    model: COGNet | Ensemble,
    graphs: Graphs | Sequence[Graphs],
    vocab: Vocab,
    patients: Sequence[Sequence[Visit]],
    beams: Sequence[int] = (1, BEAM),
    chunk: int = 256,
) -> dict:
    """Medication lists of the torch reference vs the ONNX-driven beam search, per beam size
    (an ensemble: one `Graphs` per member)."""
    report = {}
    for beam in beams:
        same = total = 0
        worst_score = 0.0
        mismatches: list[dict] = []
        for start in range(0, len(patients), chunk):
            batch = make_batch(patients[start : start + chunk], vocab, targets=False)
            ref = beam_search(model, batch, beam=beam)
            got = onnx_beam_search(graphs, batch, model.cfg, vocab.end, beam=beam)
            for i, (r, (meds, score)) in enumerate(zip(ref, got, strict=True)):
                total += 1
                if r.meds == meds and math.isfinite(r.score) and math.isfinite(score):
                    same += 1
                    worst_score = max(worst_score, abs(r.score - score))
                elif len(mismatches) < 5:
                    mismatches.append(
                        {"visit": start + i, "torch": list(r.meds), "onnx": list(meds)}
                    )
        report[f"beam{beam}"] = {
            "visits": total,
            "identical": same,
            "max_score_diff": worst_score,
            "mismatches": mismatches,
        }
    return report


# -- 3. the set head -------------------------------------------------------------------------
@_one_torch_thread()
def compare_head(head, path: Path, seed: int = 0) -> dict:
    """Max abs diff of the head graph's `marginals` against the torch head's at every
    `HEAD_CASES` case; `passed` when all are within `HEAD_ATOL`."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    ins, (out,) = GRAPH_IO["head"]
    cases = {}
    for name, (sizes, empty) in HEAD_CASES.items():
        inputs = head_example(head.cfg, sizes, seed, empty)
        with torch.no_grad():
            ref = head.eval()(*(inputs[k] for k in ins)).numpy()
        (got,) = session.run([out], {k: inputs[k].numpy() for k in ins})
        cases[name] = max_abs_diff(ref, got)
    worst = max(cases.values())
    shapes = {name: asdict(sizes) for name, (sizes, _) in HEAD_CASES.items()}
    return {
        "cases": cases,
        "shapes": shapes,
        "max_abs_diff": worst,
        "atol": HEAD_ATOL,
        "passed": worst <= HEAD_ATOL,
    }


# -- the report -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exported:
    """What the parity check compares: the torch model and its vocabulary against the graphs
    exported from it. `paths`, `fp16_paths`, `int8_paths`: {graph: path} of each member
    (`members_of(model)`), None for a variant not written; `sets`: the model's own decoding
    (its sets are checked when it is a set decoding); `head`: (the set head, its graph's
    path), None without one."""

    model: COGNet | Ensemble
    vocab: Vocab
    paths: Sequence[dict[str, Path]]
    fp16_paths: Sequence[dict[str, Path]] | None = None
    int8_paths: Sequence[dict[str, Path]] | None = None
    sets: Decoding | None = None
    head: tuple | None = None


def validate(
    exported: Exported,
    n_patients: int = 64,
    seed: int = 0,
    log: Callable[[str], None] = lambda _: None,
    step: Callable[[], None] = lambda: None,
) -> dict:
    """Run every check on `n_patients` synthetic patients (`seed`); returns the parity report
    (`passed` says whether all passed), with a "float16" / "int8" section for each variant
    given, a "sets" section when the model's own decoding is a set decoding, and a "head"
    section with a set head. `step()` after each check (`parity_steps` of them: a progress
    bar's)."""
    model, vocab, sets, head = exported.model, exported.vocab, exported.sets, exported.head
    patients = synthetic_patients(vocab, n_patients, seed)
    log("parity: float32 outputs")
    outputs, graphs = _outputs(model, exported.paths)
    outputs.update(atol=FLOAT32_ATOL, passed=outputs["max_abs_diff"] <= FLOAT32_ATOL)
    step()
    log("parity: greedy and beam-4 decoding")
    decoding = compare_decoding(model, graphs, vocab, patients)
    decode_ok = all(d["identical"] == d["visits"] for d in decoding.values())
    report = {"float32": outputs, "decoding": {**decoding, "passed": decode_ok}}
    step()
    if sets is not None and sets.name == "set":
        log(f"parity: {sets.label}")
        report["sets"] = compare_sets(model, graphs, vocab, patients, sets)
        step()
    passed = outputs["passed"] and decode_ok
    for name, files, diff, atol, min_top1 in _variants(exported.fp16_paths, exported.int8_paths):
        log(f"parity: {name} outputs")
        report[name] = _variant_parity(model, files, vocab, patients, diff, atol, min_top1)
        passed = passed and report[name]["passed"]
        step()
    if head is not None:
        log("parity: the set head")
        report["head"] = compare_head(*head, seed=seed)
        passed = passed and report["head"]["passed"]
        step()
    report["passed"] = passed
    return report


def _variants(fp16_paths, int8_paths) -> list[tuple]:
    """(name, paths, the diff bounded, its bound, the least top-1 agreement) of the
    variants given."""
    variants = (
        ("float16", fp16_paths, "max_abs_diff", FLOAT16_ATOL, FLOAT16_MIN_TOP1),
        ("int8", int8_paths, "probs_max_abs_diff", INT8_ATOL, INT8_MIN_TOP1),
    )
    return [v for v in variants if v[1] is not None]


def parity_steps(exported: Exported) -> int:
    """How many times `validate` calls its `step`."""
    sets = exported.sets
    checks = 2 + (sets is not None and sets.name == "set") + (exported.head is not None)
    return checks + len(_variants(exported.fp16_paths, exported.int8_paths))


def _outputs(
    model: COGNet | Ensemble, paths: Sequence[dict[str, Path]], as_probs: bool = False
) -> tuple[dict, list[Graphs]]:
    """(`compare_outputs` of each member's graphs against its network, worst member first
    (`worst_outputs`); the members' graphs)."""
    nets = members_of(model)
    if len(paths) != len(nets):
        raise ValueError(f"{len(nets)} networks but the graphs of {len(paths)}")
    graphs = [Graphs.load(p, threads=1) for p in paths]
    reports = [compare_outputs(n, g, as_probs) for n, g in zip(nets, graphs, strict=True)]
    return worst_outputs(reports), graphs


def _variant_parity(
    model: COGNet | Ensemble, paths, vocab: Vocab, patients, diff: str, atol, min_top1
) -> dict:
    """A lower-precision variant's parity: its outputs as probabilities against torch, its
    beam-4 lists, and whether `diff` (a key of `compare_outputs`) and the top-1 agreement
    hold their bars."""
    out, graphs = _outputs(model, paths, as_probs=True)
    out["decoding"] = compare_decoding(model, graphs, vocab, patients, beams=(BEAM,))
    passed = out[diff] <= atol and out["top1_agreement"] >= min_top1
    out.update(atol=atol, min_top1=min_top1, passed=passed)
    return out


def failure_summary(report: dict) -> str:
    """One line naming what broke parity."""
    parts = []
    f32 = report["float32"]
    if not f32["passed"]:
        parts.append(f"float32 max abs diff {f32['max_abs_diff']:.3g} > {f32['atol']:g}")
    for name, d in report["decoding"].items():
        if isinstance(d, dict) and d["identical"] != d["visits"]:
            parts.append(f"{name}: {d['visits'] - d['identical']}/{d['visits']} lists differ")
    f16 = report.get("float16")
    if f16 and not f16["passed"]:
        parts.append(
            f"float16 max diff {f16['max_abs_diff']:.3g} (bound {f16['atol']:g}), "
            f"top-1 agreement {f16['top1_agreement']:.3f}"
        )
    i8 = report.get("int8")
    if i8 and not i8["passed"]:
        parts.append(
            f"int8 max probability diff {i8['probs_max_abs_diff']:.3g} (bound {i8['atol']:g}), "
            f"top-1 agreement {i8['top1_agreement']:.3f} (bound {i8['min_top1']:g})"
        )
    h = report.get("head")
    if h and not h["passed"]:
        parts.append(f"set head max abs diff {h['max_abs_diff']:.3g} > {h['atol']:g}")
    return "; ".join(parts) or "ok"


def check(report: dict, where: Path) -> None:
    if not report["passed"]:
        raise ParityError(f"parity failed: {failure_summary(report)} (report: {where})")
