"""cognet-bench: the smoke run writes its files (latency.png among them) and every engine
matches torch-batched; the paper-style engine decodes like the reference; the guard flags a
wrong engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tiny import with_set_decoding

from cognet.benchmarks import engines as eng
from cognet.benchmarks.cli import main
from cognet.benchmarks.guard import Guard
from cognet.benchmarks.perpatient import decode_perpatient
from cognet.benchmarks.report import markdown, ratios
from cognet.core.dataset import read_dataset
from cognet.core.history import load_split
from cognet.model import checkpoint
from cognet.model.batching import make_batch
from cognet.model.torch_decoding import beam_search


@pytest.fixture(scope="module")
def quick_run(tiny, tmp_path_factory) -> tuple[object, Path]:
    out = tmp_path_factory.mktemp("bench") / "out"
    result = CliRunner().invoke(
        main,
        [
            "--quick",
            "--model",
            str(tiny / "model"),
            "--checkpoint",
            str(tiny / "ckpt"),
            "--data",
            str(tiny / "data"),
            "--out",
            str(out),
        ],
    )
    return result, out


def test_quick_run_writes_results_and_guard_passes(quick_run):
    result, out = quick_run
    assert result.exit_code == 0, result.output
    for name in ("results.json", "results.md", "throughput.png", "latency.png"):
        assert (out / name).stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    # --quick: requests of 1 and 8 visits, through the runtime's default engine
    assert [(r["engine"], r["visits"]) for r in results["latency"]] == [
        ("ort-cpu", 1),
        ("ort-cpu", 8),
    ]
    assert {"cpu", "cores", "versions"} <= set(results["machine"])
    runs = results["runs"]
    engines = {"torch-perpatient", "torch-batched", "ort-cpu", "ort-cpu-device", "ort-cpu-gpupath"}
    assert {r["engine"] for r in runs} == engines
    assert results["profile"]["engine"] == "ort-cpu"
    assert {r["beam"] for r in runs} == {1, 4}
    for run in runs + results["series"]["past_visits"]:
        assert run["matches_reference"] is True, run
        assert run["visits_per_s"] > 0 and run["meds_per_s"] > 0
        assert set(run["latency_ms"]) == {"p50", "p95", "p99"}
        # stream: one call a pass, no per-batch latency
        per_pass = 0 if run.get("mode") == "stream" else run["batches"]
        assert run["latency_samples"] == per_pass * run["repeats"]
        for key in ("engine", "batch_size", "beam", "peak_rss_mb", "providers"):
            assert key in run
    assert [p["returncode"] for p in results["series"]["input_size"]] == [0]
    assert results["series"]["input_size"][0]["visits_scored"] > 0


def test_unavailable_engines_are_skipped_with_a_reason(quick_run):
    _, out = quick_run
    engines = json.loads((out / "results.json").read_text())["engines"]
    assert set(engines) == {
        "torch-perpatient",
        "torch-batched",
        "ort-cpu",
        "ort-cpu-device",
        "ort-cpu-fp16",
        "ort-cpu-int8",
        "ort-cpu-gpupath",
        "ort-cuda",
        "ort-cuda-host",
        "ort-cuda-fp16",
        "ort-cuda-streams",
        "ort-cuda-fp16-streams",
        "ort-tensorrt",
        "torch-cuda",
    }
    for e in engines.values():
        assert e["status"] in ("ok", "skipped")
        if e["status"] == "skipped":
            assert e["reason"]
        else:
            assert e["load_s"] >= 0
    if not torch.cuda.is_available():
        assert engines["torch-cuda"]["status"] == "skipped"


def test_results_md_has_the_ratio_and_table(quick_run):
    _, out = quick_run
    text = (out / "results.md").read_text()
    assert "| engine | decoding | batch | passes | visits/s |" in text
    assert "x** torch-batched" in text and "x** torch-perpatient" in text


def test_ddi_tradeoff_is_reported(quick_run):
    result, out = quick_run
    t = json.loads((out / "results.json").read_text())["ddi_tradeoff"]
    labels = [r["label"] for r in t["rows"]]
    assert labels[:2] == ["off", "hard"] and any(x.startswith("soft") for x in labels)
    assert t["rows"][1]["report"]["ddi"]["mean"] == 0.0  # hard: no interacting pair
    assert (out / "ddi_tradeoff.png").stat().st_size > 0
    assert "## DDI trade-off" in (out / "results.md").read_text()
    assert "ddi_tradeoff.png" in result.output


@pytest.mark.parametrize("beam", [1, 4])
def test_perpatient_decodes_like_the_reference(tiny, beam):
    torch.set_num_threads(1)
    model, vocab, _ = checkpoint.load(tiny / "ckpt")
    visits = read_dataset(tiny / "data").visits
    patients = load_split(visits, vocab, "train").patients[:12]
    batch = make_batch(patients, vocab, targets=False)
    last = torch.tensor([sum(map(len, patients[: i + 1])) - 1 for i in range(len(patients))])
    reference = [d.meds for d in beam_search(model, batch, beam=beam, rows=last)]
    assert decode_perpatient(model, patients, vocab, beam) == reference


def test_guard_flags_a_wrong_engine():
    guard = Guard(reference=_Reference())
    guard.add(4, {"v1": ("A", "B"), "v2": ("C",)})
    assert guard.compare(4, {"v1": ("A", "B"), "v2": ("C",)})["matches_reference"] is True
    bad = guard.compare(4, {"v1": ("B", "A"), "v2": ("C",)})
    assert bad["matches_reference"] is False and bad["mismatches"] == 1
    assert bad["examples"][0]["visit_id"] == "v1"
    assert Guard(None).compare(4, {"v1": ()})["matches_reference"] is None


def test_guard_counts_a_set_in_another_order_as_a_tie_not_a_difference():
    """Set decoding orders its set by P(k in S): two probabilities equal within float32 can
    come out in either order (same medications); other medications are a difference."""
    from cognet.benchmarks.engines import SET

    guard = Guard(reference=_Reference())
    ref = {f"v{i}": ("A", "B", "C") for i in range(300)}
    guard.add(SET, ref)
    swapped = {**ref, "v1": ("A", "C", "B"), "v2": ("B", "A", "C")}
    got = guard.compare(SET, swapped)
    assert got["matches_reference"] is True and got["mismatches"] == 0 and got["ties"] == 2
    assert got["tie_examples"][0] == {
        "visit_id": "v1",
        "reference": ["A", "B", "C"],
        "got": ["A", "C", "B"],
        "same_set": True,
    }
    other = guard.compare(SET, {**swapped, "v3": ("A", "B"), "v4": ("A", "B", "D")})
    assert other["mismatches"] == 2 and other["ties"] == 2
    assert other["matches_reference"] is False  # 2 of 300 differ: over 0.5% (1 allowed)
    guard.add(4, ref)
    assert guard.compare(4, {**ref, "v1": ("A", "C", "B")})["mismatches"] == 1  # beam: order


def test_guard_accepts_any_answer_the_reference_gave():
    """A near-tie the reference itself answers two ways (two batch sizes on a GPU)."""
    guard = Guard(reference=_Reference())
    guard.add(4, {"v1": ("A", "B"), "v2": ("C",)})
    assert guard.compare(4, {"v1": ("A", "C"), "v2": ("C",)})["mismatches"] == 1
    guard.add(4, {"v1": ("A", "C"), "v2": ("C",)})
    again = guard.compare(4, {"v1": ("A", "C"), "v2": ("C",)})
    assert again["matches_reference"] is True and again["reference_ambiguous"] == 1
    assert guard.compare(4, {"v1": ("C",), "v2": ("C",)})["mismatches"] == 1


def test_ratios_take_each_engine_at_its_best_batch_size():
    def run(engine, bs, vps):
        return {"engine": engine, "batch_size": bs, "beam": 4, "visits_per_s": vps}

    results = {
        "runs": [
            run("ort-cpu", 1, 100.0),
            run("ort-cpu", 256, 1000.0),
            run("torch-batched", 16, 250.0),
            run("torch-batched", 256, 200.0),
            run("torch-perpatient", 1, 10.0),
        ]
    }
    r = ratios(results, beam=4)
    assert r["torch-batched"]["ratio"] == pytest.approx(4.0)
    assert r["torch-batched"]["baseline_batch_size"] == 16
    assert r["torch-perpatient"]["ratio"] == pytest.approx(100.0)
    assert ratios(results, beam=1) == {}


def test_markdown_reports_a_mismatch(quick_run):
    _, out = quick_run
    results = json.loads((out / "results.json").read_text())
    results["runs"][0].update(matches_reference=False, mismatches=2, compared=16)
    assert "**NO: 2 of 16 differ**" in markdown(results)
    tie = {"visit_id": "v", "reference": [], "got": [], "score_gap": 1e-6}
    results["runs"][0].update(matches_reference=True, mismatches=0, ties=1, tie_examples=[tie])
    assert "yes (15 of 16 equal; 1 float tie(s) broken the other way (score gap 1.0e-06))" in (
        markdown(results)
    )
    tie = {"visit_id": "v", "reference": ["A", "B"], "got": ["B", "A"], "same_set": True}
    results["runs"][0].update(tie_examples=[tie])
    assert "yes (15 of 16 equal; 1 set(s) equal in another order" in markdown(results)


def test_help_and_usage_errors():
    runner = CliRunner()
    assert runner.invoke(main, ["--help"]).exit_code == 0
    bad = runner.invoke(main, ["--engines", "nope", "--model", "x", "--out", "y"])
    assert bad.exit_code == 2
    assert "unknown engines" in bad.output
    bad = runner.invoke(main, ["--batch-sizes", "1,x"])
    assert bad.exit_code == 2


def test_fp16_engine_reports_its_agreement(quick_run, tiny, tmp_path):
    """Without float16 graphs the engine is skipped, saying how to get them; with them it
    runs, and its runs report their agreement with the reference, not a match."""
    _, out = quick_run
    engines = json.loads((out / "results.json").read_text())["engines"]
    assert "cognet-export --fp16" in engines["ort-cpu-fp16"]["reason"]
    assert "cognet-export --int8" in engines["ort-cpu-int8"]["reason"]  # --model given
    guard = Guard(reference=object())
    guard.add(4, {"v1": ("A", "B"), "v2": ("C",)})
    got = guard.compare(4, {"v1": ("A",), "v2": ("C",)}, exact=False)
    assert got["matches_reference"] is None and got["agreement"] == 0.5
    from cognet.export import ExportOptions, export

    export(tiny / "ckpt", tmp_path / "model", ExportOptions(validate=False, fp16=True))
    out = tmp_path / "out"
    args = [
        "--quick",
        "--engines",
        "torch-batched,ort-cpu-fp16",
        "--model",
        str(tmp_path / "model"),
    ]
    args += ["--checkpoint", str(tiny / "ckpt"), "--data", str(tiny / "data"), "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert (
        "ort-cpu-fp16" not in results["engines"]
        or "reason" not in results["engines"]["ort-cpu-fp16"]
    )
    runs = [r for r in results["runs"] if r["engine"] == "ort-cpu-fp16"]
    assert runs and {r["beam"] for r in runs} == {r["beam"] for r in results["runs"]}
    for run in runs:
        assert run["matches_reference"] is None and 0.5 <= run["agreement"] <= 1.0, run
    assert f"({runs[0]['agreement']:.2%}; not required)" in (out / "results.md").read_text()


class _Reference:
    """A reference engine whose answer for a visit decoded alone is `alone[visit_id]` (no
    medication when not given)."""

    def __init__(self, alone: dict | None = None):
        self.alone, self.runs = alone or {}, 0

    def prepare(self, beam: int, batch_size: int) -> None:
        assert batch_size == 1  # the guard decodes a differing visit alone

    def run(self, batch) -> list:
        self.runs += 1
        return [self.alone.get(vid, ()) for vid in batch.visit_ids]

    def recommendations(self, batch, output) -> dict:
        return dict(zip(batch.visit_ids, output, strict=True))


class _Scored(_Reference):
    """A reference that scores lists from a table (the guard's tie check)."""

    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def list_scores(self, patients, lists):
        import numpy as np

        return np.array([self.table[(p, tuple(m))] for p, m in zip(patients, lists, strict=True)])


def test_guard_counts_a_float_tie_but_not_a_real_difference():
    guard = Guard(
        _Scored(
            {
                ("p1", ("A", "B")): -5.3537422,
                ("p1", ("B", "A")): -5.3537412,
                ("p2", ("C",)): -2.0,
                ("p2", ("D",)): -2.01,
            }
        )
    )
    guard.add(4, {"v1": ("A", "B"), "v2": ("C",)})
    guard.patients.update({"v1": "p1", "v2": "p2"})
    got = guard.compare(4, {"v1": ("B", "A"), "v2": ("C",)})
    assert got["matches_reference"] is True and got["ties"] == 1 and got["mismatches"] == 0
    assert got["tie_examples"][0]["score_gap"] == pytest.approx(1e-6, abs=1e-8)
    bad = guard.compare(4, {"v1": ("A", "B"), "v2": ("D",)})
    assert bad["matches_reference"] is False and bad["mismatches"] == 1 and bad["ties"] == 0
    assert bad["examples"][0]["score_gap"] == pytest.approx(0.01)
    assert guard.compare(4, {"v1": ("B", "A")}, exact=False)["ties"] == 0  # fp16: agreement


@pytest.mark.parametrize(
    "name", ["ort-cpu-fp16", "ort-cpu-int8", "ort-cuda-fp16", "ort-cuda-streams"]
)
def test_engine_options_hold_at_every_decoding(name):
    """An engine's variant and streams apply to set decoding as to beam search (the fp16
    engine once scored set decoding with the float32 graphs)."""
    engine = object.__new__(eng.OrtEngine)  # its options only: no model loaded
    engine.device, engine.threads = eng.ORT_DEVICES[name], 1
    engine.selection = eng.ORT_SELECTIONS.get(name, "auto")
    engine.variant, engine.streams = eng.ORT_VARIANTS.get(name), eng.ORT_STREAMS.get(name)
    for beam in (4, eng.SET):
        options = engine.options(beam, 256)
        assert options.variant == eng.ORT_VARIANTS.get(name)
        assert options.streams == eng.ORT_STREAMS.get(name)
        assert options.request.decoding == ("set" if beam == eng.SET else "beam")


def test_profile_of_the_gpu_path_on_the_cpu(tiny):
    """The GPU's code path profiled on the CPU: its graphs (init_gather, the split
    selection) and the host's share."""
    import pyarrow.parquet as pq

    from cognet.benchmarks.profile import profile_ort
    from cognet.benchmarks.workload import Batch, mask_last_visits

    table = mask_last_visits(pq.read_table(tiny / "data" / "visits.parquet").slice(0, 60))
    out = profile_ort(tiny / "model", [Batch(table, [], [])], 4, 64, 1, gpu_path=True, top=3)
    assert out["engine"] == "ort-cpu-gpupath"
    assert {"init_gather_float32", "beam_select_split", "decoder_step"} <= set(out["graphs"])
    assert 0 < out["python_share"] < 1
    assert out["host_us_per_visit"] == pytest.approx(out["python_s"] / out["visits"] * 1e6)
    # what crosses between host and device on a GPU: inputs each step, lists back
    for way in ("to_device", "to_host"):
        assert out["copies"][way]["calls"] > 0 and out["copies"][way]["bytes"] > 0
        assert out["copies"][way]["bytes_per_visit"] == out["copies"][way]["bytes"] / out["visits"]
    cpu = profile_ort(tiny / "model", [Batch(table, [], [])], 4, 64, 1, top=3)
    assert cpu["copies"] is None  # the CPU's own path copies nothing


def test_copies_are_counted_by_way_and_bytes_and_the_hooks_come_off():
    import onnxruntime as ort

    from cognet.benchmarks.profile import _counted_copies

    before = (ort.OrtValue.numpy, ort.OrtValue.ortvalue_from_numpy, ort.InferenceSession.run)
    with _counted_copies() as counts:
        value = ort.OrtValue.ortvalue_from_numpy(np.zeros((3, 4), np.float32))
        value.update_inplace(np.ones((3, 4), np.float32))
        assert value.numpy().sum() == 12
    assert counts == {"to_device": [2, 96], "to_host": [1, 48]}
    ort.OrtValue.ortvalue_from_numpy(np.zeros(5, np.float32)).numpy()  # no longer counted
    assert counts == {"to_device": [2, 96], "to_host": [1, 48]}
    after = (ort.OrtValue.numpy, ort.OrtValue.ortvalue_from_numpy, ort.InferenceSession.run)
    assert after == before
    assert "run" not in ort.InferenceSession.__dict__  # inherited again, not shadowed


def test_profile_of_set_decoding(tiny, tmp_path):
    """The profile of a set decoding: the sampler's steps in the decoder graphs, its Python
    (the sampler) among the functions, and the harness's choice of the set runs."""
    import pyarrow.parquet as pq

    from cognet.benchmarks.harness import profile_best
    from cognet.benchmarks.profile import profile_ort
    from cognet.benchmarks.workload import Batch, mask_last_visits

    model = with_set_decoding(tiny / "model", tmp_path, "manifest.json")
    table = mask_last_visits(pq.read_table(tiny / "data" / "visits.parquet").slice(0, 60))
    out = profile_ort(model, [Batch(table, [], [])], eng.SET, 64, 1, top=40)
    assert out["beam"] == eng.SET and out["engine"] == "ort-cpu"
    # the CPU encodes by the encoder parts, one kind of code per call
    assert {"encoder_diag", "encoder_proc", "encoder_med", "decoder_step"} <= set(out["graphs"])
    assert any("sampling.py" in f["function"] for f in out["python_functions"])
    runs = [{"engine": "ort-cpu", "beam": 4, "batch_size": 8, "visits_per_s": 1.0}]
    assert profile_best(None, None, runs, print, eng.SET) is None  # no set run, no profile


def test_guard_scores_a_bounded_number_of_differences():
    """A broken engine (every visit differs) is not scored visit by visit: past TIE_CHECKS
    differences, the rest count as mismatches unscored."""
    from cognet.benchmarks.guard import TIE_CHECKS

    n = TIE_CHECKS + 44
    table = {(f"p{i}", m): -1.0 for i in range(n) for m in (("A",), ("B",))}  # all ties
    guard = Guard(_Scored(table))
    guard.add(4, {f"v{i}": ("A",) for i in range(n)})
    guard.patients.update({f"v{i}": f"p{i}" for i in range(n)})
    got = guard.compare(4, {f"v{i}": ("B",) for i in range(n)})
    assert (got["ties"], got["mismatches"]) == (TIE_CHECKS, 44)
    assert got["matches_reference"] is False


def test_guard_reports_a_batch_dependent_reference_apart():
    """The reference answered v1 one way in its batch and another alone: an engine giving
    the answer alone is reported apart, not as a mismatch; another answer still is one."""
    reference = _Reference(alone={"v1": ("B", "A"), "v2": ("C",)})
    guard = Guard(reference)
    guard.add(4, {"v1": ("A", "B"), "v2": ("C",)})
    guard.patients.update({"v1": "p1", "v2": "p2"})
    got = guard.compare(4, {"v1": ("B", "A"), "v2": ("C",)})
    assert got["matches_reference"] is True and got["mismatches"] == 0
    assert got["batch_dependent"] == 1
    assert got["batch_dependent_examples"] == [
        {"visit_id": "v1", "reference": ["A", "B"], "got": ["B", "A"]}
    ]
    bad = guard.compare(4, {"v1": ("D",), "v2": ("C",)})
    assert bad["matches_reference"] is False and bad["mismatches"] == 1
    assert bad["batch_dependent"] == 0
    assert reference.runs == 1  # v1 decoded alone once; v2 never differed


def test_guard_decodes_a_differing_visit_alone_with_the_torch_reference(tiny):
    """With torch-batched as the reference: a visit whose reference answer (as if flipped by
    its batch) differs from the engine's is decoded alone, which gives the engine's answer."""
    from cognet.benchmarks.engines import TorchBatched
    from cognet.benchmarks.workload import Batch

    torch.set_num_threads(1)
    engine = TorchBatched("torch-batched", tiny / "ckpt", 1)
    patients = load_split(read_dataset(tiny / "data").visits, engine.vocab, "train").patients
    patients = patients[:6]
    batch = Batch(None, patients, [p[-1].visit_id for p in patients])
    engine.prepare(4, len(patients))
    right = engine.recommendations(batch, engine.run(batch))
    guard = Guard(engine)
    guard.patients.update((p[-1].visit_id, p) for p in patients)
    flipped = batch.visit_ids[0]
    other, wrong = [(m,) for m in engine.vocab.medications if (m,) != right[flipped]][:2]
    guard.add(4, {**right, flipped: other})  # the reference's answer in its batch
    got = guard.compare(4, right)
    assert got["matches_reference"] is True and got["mismatches"] == 0
    assert got["batch_dependent"] == 1
    assert got["batch_dependent_examples"][0]["visit_id"] == flipped
    bad = guard.compare(4, {**right, flipped: wrong})
    assert bad["mismatches"] == 1 and bad["batch_dependent"] == 0


def test_agreement_counts_identical_lists_and_missing_visits(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cognet.benchmarks import agreement

    def write(name, rows):
        ids, meds = zip(*rows, strict=True)
        table = pa.table({"visit_id": list(ids), "medications": list(meds)})
        pq.write_table(table, tmp_path / name)
        return tmp_path / name

    ref = write("ref.parquet", [("a", ["m1", "m2"]), ("b", ["m3"]), ("c", [])])
    same = write("same.parquet", [("c", None), ("b", ["m3"]), ("a", ["m1", "m2"])])
    order = write("order.parquet", [("a", ["m2", "m1"]), ("b", ["m3"]), ("c", [])])
    short = write("short.parquet", [("a", ["m1", "m2"]), ("b", ["m3"])])
    lists = agreement.medication_lists
    assert agreement.agreement(lists(ref), lists(same))["share"] == 1.0
    assert agreement.agreement(lists(ref), lists(order))["identical"] == 2
    assert agreement.agreement(lists(ref), lists(short))["missing"] == 1
    assert agreement.main([str(ref), str(same)]) == 0
    assert agreement.main([str(ref), str(same), str(order)]) == 1
    assert agreement.main([str(ref), str(order), "--min", "0.6"]) == 0
    assert agreement.main([str(ref), str(short), "--min", "0.5"]) == 1
    assert "| order.parquet | 3 | 2 | 0.6667 | 0 |" in capsys.readouterr().out
    pq.write_table(pa.table({"row": [1]}), tmp_path / "x.rejects.parquet")
    assert agreement.main([str(ref), str(tmp_path / "x.rejects.parquet")]) == 2
    assert "no column visit_id, medications" in capsys.readouterr().err


@pytest.mark.parametrize("int8", [False, True])
def test_the_demo_model_has_int8_graphs_when_their_engine_runs(tmp_path, monkeypatch, int8):
    """No --model: the demo model is exported with --int8 when ort-cpu-int8 is selected
    (data, training and export recorded, not run)."""
    from cognet.benchmarks import cli
    from cognet.export import ExportOptions

    exports = []
    monkeypatch.setattr("cognet.data.synth.generate", lambda *args, **kwargs: None)
    monkeypatch.setattr("cognet.training.train.train", lambda *args, **kwargs: None)
    monkeypatch.setattr("cognet.export.export", lambda ckpt, model, opts: exports.append(opts))
    model, _, _ = cli._model_and_data(None, None, None, tmp_path, True, [], int8=int8)
    assert model == tmp_path / "demo" / "model" and exports == [ExportOptions(int8=int8)]
