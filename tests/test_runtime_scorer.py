"""Scorer over exported ONNX graphs: identical medication lists and metrics to the torch
reference (`cognet.evaluation.evaluate`), output schema, explanations, history truncation."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cognet.core import metrics
from cognet.core import metrics as evaluation  # runtime/evaluation.py merged into metrics
from cognet.core.ddi import ddi_matrix
from cognet.core.decoding import Decoding
from cognet.core.decoding.plan import DecodingPlan
from cognet.core.errors import InputError
from cognet.core.graphspec import ENCODER_PARTS
from cognet.core.history import patients_from_table
from cognet.core.manifest import load_manifest
from cognet.core.metrics import visit_results
from cognet.model import checkpoint
from cognet.model.torch_decoding import decode_patients
from cognet.runtime import OUTPUT_SCHEMA, ScoreOptions, Scorer
from cognet.runtime.batches import CPU_BATCH_SLOTS, cut_padded, least_padded

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def reference(tiny):
    """Torch reference beam search over every visit of the tiny dataset (as evaluate does)."""
    model, vocab, config = checkpoint.load(tiny / "ckpt")
    visits = pq.read_table(tiny / "data" / "visits.parquet")
    patients = list(patients_from_table(visits, vocab))
    decoded = decode_patients(model, vocab, patients, DecodingPlan(Decoding(beam=4), vocab.end))
    ddi = ddi_matrix(vocab, config["ddi_pairs"])
    flat = [v for p in patients for v in p]
    return {
        "visits": visits,
        "vocab": vocab,
        "patients": patients,
        "decoded": decoded,
        "by_id": {v.visit_id: d for v, d in zip(flat, decoded, strict=True)},
        "report": metrics.bootstrap_report(visit_results(patients, decoded), ddi),
    }


def _score(scorer: Scorer, table: pa.Table, **kwargs):
    chunks = list(scorer.score_table(table, **kwargs))
    return chunks, pa.concat_tables([c.recommendations for c in chunks])


@pytest.mark.parametrize(
    "batch_size,streams,batch_slots,chunk_targets",
    [
        (64, 1, CPU_BATCH_SLOTS, None),
        (7, 2, CPU_BATCH_SLOTS, None),
        (64, 1, 40, None),
        (16, 1, CPU_BATCH_SLOTS, 5),
    ],
)
def test_onnx_runtime_equals_torch_reference(
    tiny, reference, batch_size, streams, batch_slots, chunk_targets
):
    """Several batch sizes and streams; many chunks of different sizes."""
    scorer = Scorer(
        tiny / "model",
        ScoreOptions.of(
            device="cpu",
            batch_size=batch_size,
            streams=streams,
            threads=streams,
            batch_slots=batch_slots,
            chunk_targets=chunk_targets,
        ),
    )
    assert scorer.providers == ["CPUExecutionProvider"]
    chunks, out = _score(scorer, reference["visits"], score_all=True)
    assert len(chunks) > (20 if chunk_targets else 0)
    vocab = reference["vocab"]
    assert out.num_rows == reference["visits"].num_rows >= 200
    for row in out.to_pylist():
        ref = reference["by_id"][row["visit_id"]]
        assert row["medications"] == vocab.med_codes(ref.meds)
        assert row["score"] == pytest.approx(ref.score, abs=1e-4)
        np.testing.assert_allclose(row["probabilities"], ref.med_probs, rtol=1e-4, atol=1e-6)
    # the block of all visits (first and later visits follow: runtime/outputs.py METRIC_WIDTH)
    rows = np.concatenate([c.patient_metrics for c in chunks])[:, : len(metrics.PATIENT_COLUMNS)]
    ours = evaluation.report(rows, sum(c.visits_evaluated for c in chunks))
    for key in metrics.METRICS:
        assert ours[key]["mean"] == pytest.approx(reference["report"][key]["mean"], abs=1e-6)
    assert ours["n_visits"] == reference["report"]["n_visits"]


def test_models_without_encoder_parts_score_the_same(tiny, reference, tmp_path):
    """The encoder parts serve the CPU's float32 scoring (each kind of code encoded on its
    own); a model exported before them (its manifest without them, their files gone)
    encodes with the one encoder graph, and scores the same lists. A manifest naming only
    some of the parts is refused."""
    with_parts = Scorer(tiny / "model", ScoreOptions.of(device="cpu"))
    assert with_parts.encode.split
    old = tmp_path / "model"
    shutil.copytree(tiny / "model", old)
    data = json.loads((old / "manifest.json").read_text())
    for name in ENCODER_PARTS:
        (old / data["graphs"].pop(name)["file"]).unlink()
    (old / "manifest.json").write_text(json.dumps(data))
    without = Scorer(old, ScoreOptions.of(device="cpu"))
    assert not without.encode.split and not load_manifest(old).encoder_parts
    got = {
        name: _score(scorer, reference["visits"], score_all=True)[1].to_pylist()
        for name, scorer in (("parts", with_parts), ("one graph", without))
    }
    assert len(got["parts"]) == reference["visits"].num_rows
    for a, b in zip(got["parts"], got["one graph"], strict=True):
        assert (a["visit_id"], a["medications"]) == (b["visit_id"], b["medications"])
        np.testing.assert_allclose(a["probabilities"], b["probabilities"], rtol=1e-5, atol=1e-6)
    data = json.loads((tiny / "model" / "manifest.json").read_text())
    del data["graphs"]["encoder_med"]
    (old / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="malformed manifest.*encoder parts"):
        load_manifest(old, verify=False)


def test_batches_are_cut_by_visits_and_by_padded_history():
    slots = np.array([0, 0, 3, 5, 5, 9, 20, 100])
    order = np.arange(slots.size)[::-1].copy()  # any labels, in the slots' order
    parts = cut_padded(order, [slots], [20], batch_size=4)
    assert [p.tolist() for p in parts] == [[7, 6, 5, 4], [3, 2], [1], [0]]
    # [0 0 3 5]: 4 visits (the cap on visits); [5 9]: 2 x 9 = 18 (3 x 20 would be 60);
    # [20]: exactly 20; [100]: alone, above the cap
    assert np.array_equal(np.concatenate(parts), order)
    one = cut_padded(order, [slots], [1 << 30], batch_size=100)
    assert [p.tolist() for p in one] == [order.tolist()]


def test_the_order_that_pads_least_is_cut():
    """Of the candidate orders, the batches of the one whose memories pad least: sorting by
    exact history slots leaves the code lists unsorted; slot buckets sort them."""
    slots, codes = np.array([4, 5, 6, 7]), np.array([30, 1, 30, 1])
    exact, bucketed = np.arange(4), np.lexsort((codes, slots // 4))  # one bucket: [1, 3, 0, 2]
    orders = [(o, [slots[o], codes[o]]) for o in (exact, bucketed)]
    budgets = [1 << 20] * 2
    # exact: [0 1] [2 3] pad 2 x (5 + 30) + 2 x (7 + 30) = 144; buckets: [1 3] [0 2] 88
    assert [p.tolist() for p in least_padded(orders, budgets, 2)] == [[1, 3], [0, 2]]
    assert [p.tolist() for p in least_padded(orders[::-1], budgets, 2)] == [[1, 3], [0, 2]]
    # the first of equal candidates wins; no visits, no batches
    twice = least_padded([orders[0], orders[0]], budgets, 2)
    assert [p.tolist() for p in twice] == [[0, 1], [2, 3]]
    empty = np.zeros(0, np.int64)
    assert least_padded([(empty, [empty, empty])], [8, 8], 2) == []


def test_default_scores_only_unknown_medications(tiny, reference):
    visits = reference["visits"]
    pids = visits["patient_id"].to_pylist()
    last = [i + 1 == len(pids) or pids[i + 1] != p for i, p in enumerate(pids)]
    meds = pa.array(
        [
            None if is_last else m
            for m, is_last in zip(visits["medications"].to_pylist(), last, strict=True)
        ],
        pa.list_(pa.string()),
    )
    table = visits.set_column(visits.schema.get_field_index("medications"), "medications", meds)
    scorer = Scorer(tiny / "model", ScoreOptions.of(device="cpu"))
    chunks, out = _score(scorer, table)
    assert out.schema == OUTPUT_SCHEMA
    assert out["visit_id"].to_pylist() == [
        v for v, x in zip(visits["visit_id"].to_pylist(), last, strict=True) if x
    ]
    assert sum(c.rows_skipped for c in chunks) == len(pids) - sum(last)
    # the history of a last visit is its earlier visits: as in the all-visits reference
    vocab = reference["vocab"]
    for row in out.to_pylist():
        assert row["medications"] == vocab.med_codes(reference["by_id"][row["visit_id"]].meds)


def test_explanations_point_at_past_visits_holding_the_medication(tiny, reference):
    scorer = Scorer(tiny / "model", ScoreOptions.of(device="cpu"))
    _, out = _score(scorer, reference["visits"], score_all=True, explain=True)
    attended = pa.list_(pa.struct([("code", pa.string()), ("weight", pa.float32())]))
    assert out.schema.field("explanations").type == pa.list_(
        pa.struct(
            [
                ("copy_share", pa.float32()),
                ("source_visit", pa.string()),
                ("top_diagnoses", attended),
            ]
        )
    )
    diagnoses_of = dict(
        zip(
            reference["visits"]["visit_id"].to_pylist(),
            reference["visits"]["diagnoses"].to_pylist(),
            strict=True,
        )
    )
    meds_of = dict(
        zip(
            reference["visits"]["visit_id"].to_pylist(),
            reference["visits"]["medications"].to_pylist(),
            strict=True,
        )
    )
    seen_source = 0
    for row in out.to_pylist():
        assert len(row["explanations"]) == len(row["medications"])
        first_visit = row["visit_id"].endswith("-0")
        for med, ex in zip(row["medications"], row["explanations"], strict=True):
            assert 0.0 <= ex["copy_share"] <= 1.0
            # the diagnoses of this visit it attended to most, heaviest first
            top = ex["top_diagnoses"]
            known = [d for d in diagnoses_of[row["visit_id"]] if d in reference["vocab"].diagnoses]
            assert len(top) == min(3, len(set(known)))
            assert {d["code"] for d in top} <= set(known)
            weights = [d["weight"] for d in top]
            assert weights == sorted(weights, reverse=True) and sum(weights) <= 1 + 1e-5
            if first_visit:  # no history: generated only
                assert ex["copy_share"] == 0.0 and ex["source_visit"] is None
            if ex["source_visit"] is not None:
                seen_source += 1
                assert ex["source_visit"].split("-")[0] == row["visit_id"].split("-")[0]
                assert med in meds_of[ex["source_visit"]]
    assert seen_source > 0


def test_max_history_visits_keeps_the_latest(tiny, reference):
    """With K = 1 a visit sees only its previous visit: the same as dropping older ones."""
    visits = reference["visits"]
    vid = visits["visit_id"].to_pylist()
    target = next(v for v in vid if v.endswith("-3"))  # a 4th visit
    patient = target.split("-")[0]
    keep = [v == target or v == f"{patient}-2" for v in vid]
    alone = visits.filter(pa.array(keep))
    scorer = Scorer(tiny / "model", ScoreOptions.of(device="cpu", max_history_visits=1))
    _, truncated = _score(scorer, visits, score_all=True)
    _, direct = _score(Scorer(tiny / "model", ScoreOptions.of(device="cpu")), alone, score_all=True)
    row = truncated.filter(pa.compute.equal(truncated["visit_id"], target)).to_pylist()[0]
    expect = direct.filter(pa.compute.equal(direct["visit_id"], target)).to_pylist()[0]
    assert row["medications"] == expect["medications"]
    _, none = _score(
        Scorer(tiny / "model", ScoreOptions.of(device="cpu", max_history_visits=0)),
        visits,
        score_all=True,
        explain=True,
    )
    assert all(ex["copy_share"] == 0.0 for r in none.to_pylist() for ex in r["explanations"])


def test_a_row_without_patient_id_does_not_split_its_patient(tiny, reference):
    """A rejected row between two visits of a patient leaves the later visit its history."""
    visits = reference["visits"]
    vid = visits["visit_id"].to_pylist()
    i = next(k for k, v in enumerate(vid) if v.endswith("-2"))  # a 3rd visit
    broken = pa.concat_tables([visits.slice(0, i), visits.slice(i, 1), visits.slice(i)])
    ids = broken["patient_id"].to_pylist()
    ids[i] = None  # the inserted copy loses its patient_id
    broken = broken.set_column(0, "patient_id", pa.array(ids, pa.string()))
    chunks, out = _score(
        Scorer(tiny / "model", ScoreOptions.of(device="cpu")), broken, score_all=True
    )
    assert sum(c.reject_reasons.get("missing_key", 0) for c in chunks) == 1
    row = out.filter(pa.compute.equal(out["visit_id"], vid[i])).to_pylist()
    assert len(row) == 1
    assert tuple(row[0]["medications"]) == tuple(
        reference["vocab"].medications[m] for m in reference["by_id"][vid[i]].meds
    )


def test_beam_option_and_greedy(tiny, reference):
    scorer = Scorer(tiny / "model", ScoreOptions.of(device="cpu", beam=1))
    _, out = _score(scorer, reference["visits"].slice(0, 40), score_all=True)
    model, vocab, _ = checkpoint.load(tiny / "ckpt")
    patients = list(patients_from_table(reference["visits"].slice(0, 40), vocab))
    greedy = decode_patients(model, vocab, patients, DecodingPlan(Decoding(beam=1), vocab.end))
    assert out["medications"].to_pylist() == [vocab.med_codes(d.meds) for d in greedy]


def test_patient_rows_report_equals_bootstrap_report():
    rng = np.random.default_rng(0)
    results = [
        metrics.VisitResult(
            f"p{i // 3}",
            tuple(rng.choice(9, 3, replace=False)),
            tuple(rng.choice(9, 4, replace=False)),
            rng.random(9),
        )
        for i in range(40)
    ]
    ddi = rng.random((9, 9)) < 0.2
    ours = evaluation.report(evaluation.patient_rows(results, ddi), len(results))
    assert ours == metrics.bootstrap_report(results, ddi)


def test_io_binding_decoder_equals_the_host_decoder(tiny, reference):
    """The CUDA/TensorRT decoder's bindings, run on the CPU: same lists as the host path."""
    from cognet.runtime.session import DeviceDecoder, OrtModel

    manifest = load_manifest(tiny / "model")
    model = OrtModel(manifest, device="cpu", threads=1)
    bound = DeviceDecoder(
        model.sessions["decoder_init"], model.sessions["decoder_step"], manifest, device=("cpu", 0)
    )
    table = reference["visits"]
    options = ScoreOptions(batch_size=16, compact_at=0.5)
    host = Scorer.from_session(
        model.encoder, model.decoder, manifest.vocabulary(), 16, options=options
    )
    dev = Scorer.from_session(model.encoder, bound, manifest.vocabulary(), 16, options=options)
    _, a = _score(host, table, score_all=True, explain=True)
    _, b = _score(dev, table, score_all=True, explain=True)
    assert a.equals(b)
