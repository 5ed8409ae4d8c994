"""`--selection device` (the search graphs of `cognet.runtime.device_selectors`) against the torch
reference and the host path, visit by visit, for every DDI policy at several batch sizes, on
a tiny random model and on a trained real-size one."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from tiny import DDI_IDS, DDI_POLICIES, as_targets

from cognet.cli import main as cognet_main
from cognet.core.ddi import DDIPolicy
from cognet.core.decoding import Decoding, open_samples
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.errors import InputError
from cognet.core.history import patients_from_table
from cognet.model import checkpoint
from cognet.model.torch_decoding import decode_patients
from cognet.runtime import ScoreOptions, Scorer, device_selectors

torch.set_num_threads(1)


def _scored(root, visits: pa.Table, **options) -> dict:
    """visit_id -> output row of the runtime on the CPU; with selection="device", checks
    that every batch went through the search graphs."""
    calls = []
    drivers = {name: getattr(device_selectors, name) for name in ("beam_search", "set_marginals")}

    def counted(name):
        def run(*args, **kwargs):
            calls.append(name)
            return drivers[name](*args, **kwargs)

        return run

    with pytest.MonkeyPatch.context() as patch:
        for name in drivers:
            patch.setattr(device_selectors, name, counted(name))
        scorer = Scorer(root / "model", ScoreOptions.of(device="cpu", threads=1, **options))
        chunks = scorer.score_table(as_targets(visits))
        out = {r["visit_id"]: r for c in chunks for r in c.recommendations.to_pylist()}
    assert bool(calls) == (options.get("selection") == "device")
    return out


def _reference(root, decoding: Decoding, policy: DDIPolicy) -> tuple[dict, list]:
    model, vocab, _ = checkpoint.load(root / "ckpt")
    visits = pq.read_table(root / "data" / "visits.parquet")
    patients = list(patients_from_table(visits, vocab))
    decoded = decode_patients(model, vocab, patients, DecodingPlan(decoding, vocab.end, ddi=policy))
    flat = [v.visit_id for p in patients for v in p]
    return dict(zip(flat, decoded, strict=True)), vocab


def _assert_equal_lists(root, ref: dict, vocab, got: dict) -> None:
    assert got.keys() == ref.keys()
    for vid, row in got.items():
        assert row["medications"] == vocab.med_codes(ref[vid].meds), vid
        assert row["score"] == pytest.approx(ref[vid].score, abs=1e-4)


def _same_set_order(got: dict, want: dict, rtol: float) -> bool:
    """The same set in the same order, but for float ties: a set is ordered by decreasing
    probability, so two medications whose probabilities agree to float32 rounding may come
    in either order."""
    if sorted(got["medications"]) != sorted(want["medications"]):
        return False
    p_got = dict(zip(got["medications"], got["probabilities"], strict=True))
    p_want = dict(zip(want["medications"], want["probabilities"], strict=True))
    if any(abs(p - p_want[med]) > rtol * abs(p_want[med]) for med, p in p_got.items()):
        return False
    return all(  # swapped only where the two probabilities tie
        a == b or abs(p_want[a] - p_want[b]) <= 2 * rtol * max(p_want[a], p_want[b])
        for a, b in zip(got["medications"], want["medications"], strict=True)
    )


@pytest.fixture(scope="module")
def tiny_many(tmp_path_factory):
    """A tiny random model (20 medications) over 700 patients (> 2,000 visits)."""
    from tiny import make_tiny

    from cognet.export import ExportOptions, export

    root = tmp_path_factory.mktemp("search_tiny")
    _, ckpt = make_tiny(root, n_patients=700)
    export(ckpt, root / "model", ExportOptions(validate=False))
    return root


@pytest.mark.parametrize(
    "policy,batch_sizes",
    zip(DDI_POLICIES, [(7, 128, 1024), (64,), (300,), (33,), (128,)], strict=True),
    ids=DDI_IDS,
)
def test_device_selection_equals_torch_beam_search_on_the_tiny_model(
    tiny_many, policy, batch_sizes
):
    ref, vocab = _reference(tiny_many, Decoding(name="beam", beam=4), policy)
    assert len(ref) >= 2000
    visits = pq.read_table(tiny_many / "data" / "visits.parquet")
    for size in batch_sizes:
        got = _scored(
            tiny_many, visits, decoding="beam", ddi=policy, batch_size=size, selection="device"
        )
        _assert_equal_lists(tiny_many, ref, vocab, got)


def test_device_selection_of_a_model_without_search_graphs_is_refused(tiny_many, tmp_path):
    import json
    import shutil

    old = tmp_path / "model"
    shutil.copytree(tiny_many / "model", old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest.pop("search")
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="re-export"):
        Scorer(old, ScoreOptions.of(device="cpu", selection="device"))
    assert (
        Scorer(old, ScoreOptions.of(device="cpu")).decoder.search is None
    )  # auto: the numpy selection
    from cognet.core.manifest import load_manifest
    from cognet.runtime.session import OrtModel

    with pytest.raises(InputError, match="gpu_path"):
        OrtModel(load_manifest(old), device="cpu", gpu_path=True)
    # a model exported before init_gather: the GPU path gathers its encodings on the host
    manifest = json.loads((tiny_many / "model" / "manifest.json").read_text())
    for name in ("init_gather_float32", "init_gather_float16"):
        manifest["search"].pop(name)
    (old / "manifest.json").write_text(json.dumps(manifest))
    model = OrtModel(load_manifest(old), device="cpu", threads=1, gpu_path=True)
    assert model.encoder.search is None and model.selection == "device"
    table = as_targets(pq.read_table(tiny_many / "data" / "visits.parquet")).slice(0, 400)
    got = _lists(model.manifest, model.encoder, model.decoder, table, batch_size=64)
    host = OrtModel(load_manifest(old), device="cpu", threads=1, selection="host")
    assert got == _lists(host.manifest, host.encoder, host.decoder, table, batch_size=64)


@pytest.fixture(scope="module")
def trained_many(tmp_path_factory):
    """A real-size synthetic dataset (131 medications, 860 patients, > 2,000 visits), a
    checkpoint of one network trained 2 epochs with the default recipe less the set head
    (set decoding its default: the selection runs in its loop) and its export (an
    ensemble's beam search selects on the host: tests/test_ensemble_runtime.py)."""
    root = tmp_path_factory.mktemp("search_trained")
    runner = CliRunner()
    for args in (
        ["data", "synth", "--out", str(root / "data"), "--patients", "860", "--seed", "5"],
        [
            "train",
            "--data",
            str(root / "data"),
            "--out",
            str(root / "ckpt"),
            "--epochs",
            "2",
            "--threads",
            "1",
            "--members",
            "1",
            "--no-head",
            "--quiet",
        ],
    ):
        res = runner.invoke(cognet_main, args)
        assert res.exit_code == 0, res.output
    from cognet.export import ExportOptions, export

    export(root / "ckpt", root / "model", ExportOptions(validate=False))
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy,batch_size", zip(DDI_POLICIES, [128, 7, 1024, 256, 64], strict=True), ids=DDI_IDS
)
def test_device_selection_equals_torch_beam_search_on_a_trained_model(
    trained_many, policy, batch_size
):
    ref, vocab = _reference(trained_many, Decoding(name="beam", beam=4), policy)
    assert len(ref) >= 2000
    visits = pq.read_table(trained_many / "data" / "visits.parquet")
    got = _scored(
        trained_many, visits, decoding="beam", ddi=policy, batch_size=batch_size, selection="device"
    )
    _assert_equal_lists(trained_many, ref, vocab, got)
    if policy == DDIPolicy():
        lengths = [len(r.meds) for r in ref.values()]
        assert np.mean(lengths) > 8 and max(lengths) >= 25  # long lists


@pytest.mark.slow
@pytest.mark.parametrize("policy", [DDIPolicy(), DDIPolicy("hard")], ids=["off", "hard"])
def test_device_selection_sets_equal_the_host_and_torch_on_a_trained_model(
    trained_many, policy, monkeypatch
):
    visits = pq.read_table(trained_many / "data" / "visits.parquet")
    # the host sampler in the one loop, as the search graphs run it: the narrowed loop
    # steps rows at other shapes (float32 rounding; tests/test_open_samples.py compares the two)
    with monkeypatch.context() as patch:
        patch.setattr(open_samples, "applies", lambda *_: False)
        host = _scored(trained_many, visits, ddi=policy, batch_size=128, selection="host")
    device = _scored(trained_many, visits, ddi=policy, batch_size=512, selection="device")
    assert len(device) >= 2000 and device.keys() == host.keys()
    # a draw at a CDF boundary may take another path: the graph's float32 exp and numpy's
    # differ by a few ulps, and numpy's by CPU (AVX-512 or not); the bar of set decoding
    apart = [k for k, row in device.items() if not _same_set_order(row, host[k], rtol=1e-6)]
    assert len(apart) <= 0.005 * len(device), apart
    if policy.mode != "off":
        return  # the torch reference's sets: once (the host path's own tests cover the rest)
    stored = Scorer(trained_many / "model", ScoreOptions.of(device="cpu")).decoding
    ref, vocab = _reference(trained_many, stored, policy)
    same = sum(device[k]["medications"] == vocab.med_codes(ref[k].meds) for k in ref)
    assert same / len(ref) >= 0.995


@pytest.mark.parametrize(
    "options",
    [
        {"decoding": "beam"},
        {"decoding": "beam", "ddi": DDIPolicy("hard", max_rate=0.0)},
        {"decoding": "set", "samples": 8, "threshold": 0.3},
    ],
    ids=["beam", "beam-hard-max-rate", "set"],
)
def test_the_gpu_bindings_run_on_the_cpu_equal_the_host_path(tiny_many, options, monkeypatch):
    """What a GPU runs (encoder outputs written into device buffers and gathered there by
    init_gather, IO binding, the split TopK graphs, gathers by the take graphs), bound to CPU
    memory: the lists of the numpy selection (set decoding's scores to float32 rounding);
    chunks of several sizes, each reusing the device buffers of the one before when they
    are long enough. The host path in the one loop, as the GPU path runs it (the narrowed
    loop: tests/test_open_samples.py)."""
    monkeypatch.setattr(open_samples, "applies", lambda *_: False)
    model, bound, encoder = _bound(tiny_many / "model")
    calls = {"chunks": 0, "allocations": 0}

    def counted(method, key):
        def run(*args):
            calls[key] += 1
            return method(*args)

        return run

    encoder.new_encodings = counted(encoder.new_encodings, "chunks")
    encoder._allocate = counted(encoder._allocate, "allocations")
    table = as_targets(pq.read_table(tiny_many / "data" / "visits.parquet"))
    common = {"batch_size": 64, "compact_at": 0.5, "chunk_targets": 300, **options}
    runs = {
        name: _lists(model.manifest, encode, decoder, table, **common)
        for name, encode, decoder in (
            ("host", model.encoder, model.decoder),
            ("bound", encoder, bound),
        )
    }
    assert len(runs["host"]) >= 2000
    if options["decoding"] == "set":  # float32 exponentials, ONNX Runtime's and numpy's
        # up to 2 ulps apart: the same medications, the scores to float32 rounding
        for got, want in zip(runs["bound"], runs["host"], strict=True):
            assert got["medications"] == want["medications"], got["visit_id"]
            assert got["score"] == pytest.approx(want["score"], rel=2e-6), got["visit_id"]
    else:
        assert runs["bound"] == runs["host"]
    assert 2 * calls["chunks"] > calls["allocations"] + 10  # 2 buffers a chunk unless reused


def _bound(model_dir, variant=None):
    """(an OrtModel on the CPU with the host path: numpy selection; the decoder and encoder
    of one with the GPU path, bound to CPU memory: `OrtModel(gpu_path=True)`)."""
    from cognet.core.manifest import load_manifest
    from cognet.runtime.session import DeviceDecoder, OrtModel

    manifest = load_manifest(model_dir)
    model = OrtModel(manifest, device="cpu", threads=1, selection="host", variant=variant)
    gpu = OrtModel(manifest, device="cpu", threads=1, variant=variant, gpu_path=True)
    assert isinstance(gpu.decoder, DeviceDecoder) and gpu.selection == "device"
    assert gpu.decoder.search.device == ("cpu", 0) and gpu.providers[0] == "CPUExecutionProvider"
    assert gpu.encoder.search is not None  # the model has the init_gather graphs
    return model, gpu.decoder, gpu.encoder


def _lists(manifest, encode, decoder, table, **options) -> list[dict]:
    scorer = Scorer.from_session(
        encode,
        decoder,
        manifest.vocabulary(),
        manifest.dims.dim,
        manifest.ddi_pairs,
        ScoreOptions.of(**options),
    )
    out = pa.concat_tables([c.recommendations for c in scorer.score_table(table)])
    return out.select(["visit_id", "medications", "score"]).to_pylist()


@pytest.mark.parametrize("batch", [1, 7, 300])
def test_init_gathered_on_the_device_equals_the_host_assembly(tiny_many, batch):
    """Encoder calls of several widths written into device buffers, then a batch's memories
    from init_gather: exactly the memories of the host assembly."""
    from cognet.runtime.batches import cut_padded
    from cognet.runtime.encoder import (
        encoder_inputs,
        init_index,
        init_inputs,
        new_encodings,
        store_encodings,
    )
    from cognet.runtime.layout import ALIGN_ROWS, layout
    from cognet.runtime.plan import Assembler

    model, bound, encoder = _bound(tiny_many / "model")
    vocab = model.manifest.vocabulary()
    table = pq.read_table(tiny_many / "data" / "visits.parquet")
    plan = Assembler(vocab, score_all=True).plan(table)
    rows = np.random.default_rng(batch).permutation(plan.encode_rows)
    lengths = [r.lengths[rows] for r in (plan.diag, plan.proc, plan.meds)]
    parts = cut_padded(rows, lengths, [1 << 12] * 3, 50, squared=True)
    lay = layout(plan, parts)
    host, dev = new_encodings(lay, model.manifest.dims.dim), encoder.new_encodings(lay)
    for k, part in enumerate(parts):
        inputs = encoder_inputs(plan, part, vocab)
        store_encodings(host, k, model.encoder(inputs))
        encoder.encode_into(inputs, dev, k)
    written = {"codes": [lay.code_rows - 1], "visits": [lay.visit_rows - 1]}  # + zero rows
    for k in range(len(parts)):
        for buffer, first, shape in lay.outputs(k).values():
            assert first % ALIGN_ROWS == 0
            written[buffer] += list(range(first, first + int(np.prod(shape))))
    for name in ("codes", "visits"):
        rows = np.array(written[name])
        assert np.unique(rows).size == rows.size  # no two outputs share a row
        got, want = getattr(dev, name).numpy()[rows], getattr(host, name)[rows]
        np.testing.assert_array_equal(got, want, err_msg=name)
    pick = np.random.default_rng(1).choice(plan.targets.size, batch, replace=False)
    targets, histories = plan.targets[pick], [plan.histories[i] for i in pick]
    want = model.decoder.init(init_inputs(plan, host, targets, histories))
    rows_, rest = init_index(plan, lay, targets, histories)
    got = bound.init_gathered(dev, rows_, rest)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name].numpy(), value, err_msg=name)


def test_the_fp16_variant_scores_end_to_end(tiny_many, tmp_path):
    """The float16 graphs through the whole runtime (float32 assembly cast to what the
    graphs take), on both selections: the same lists as each other, close to float32's."""
    from cognet.export import ExportOptions, export

    export(tiny_many / "ckpt", tmp_path / "model", ExportOptions(validate=False, fp16=True))
    (tmp_path / "data").symlink_to(tiny_many / "data")
    visits = pq.read_table(tiny_many / "data" / "visits.parquet")
    fp32 = _scored(tmp_path, visits, decoding="beam", batch_size=256, selection="host")
    runs = {
        sel: _scored(
            tmp_path, visits, decoding="beam", batch_size=256, selection=sel, variant="fp16"
        )
        for sel in ("host", "device")
    }
    lists = {sel: {k: r["medications"] for k, r in run.items()} for sel, run in runs.items()}
    assert lists["host"] == lists["device"]
    model, bound, encoder = _bound(tmp_path / "model", variant="fp16")  # as on a GPU
    assert encoder.dtype == np.float16
    gpu = _lists(model.manifest, encoder, bound, as_targets(visits), batch_size=256)
    assert {r["visit_id"]: r["medications"] for r in gpu} == lists["device"]
    same = sum(lists["host"][k] == r["medications"] for k, r in fp32.items())
    assert len(fp32) >= 2000 and same / len(fp32) >= 0.9
