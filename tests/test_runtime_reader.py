"""Streaming reader (order checks, chunks of whole patients) and history assembly (code ids,
row statuses, histories, decoder-init inputs equal to the torch batching)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from tiny import make_case, torch_encoder

from cognet.core.errors import InputError
from cognet.core.graphspec import INIT_INPUTS
from cognet.core.history import patients_from_table
from cognet.model.batching import make_batch
from cognet.model.network import history_inputs
from cognet.runtime import reader
from cognet.runtime.encoder import (
    encoder_inputs,
    init_inputs,
    new_encodings,
    store_encodings,
)
from cognet.runtime.layout import layout
from cognet.runtime.plan import (
    REASONS,
    REJECTED,
    SCORED,
    SKIPPED,
    Assembler,
    Spans,
    encode_codes,
    rare_first_rank,
)

torch.set_num_threads(1)


def visits_table(vocab, n_patients: int = 10, seed: int = 0, null_last: bool = False):
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_patients):
        n = int(rng.integers(1, 5))
        for s in range(n):
            meds = list(rng.choice(vocab.medications, rng.integers(1, 5), replace=False))
            rows.append(
                {
                    "patient_id": f"p{p}",
                    "visit_id": f"p{p}-{s}",
                    "visit_seq": s,
                    "diagnoses": list(
                        rng.choice(vocab.diagnoses, rng.integers(0, 5), replace=False)
                    ),
                    "procedures": list(
                        rng.choice(vocab.procedures, rng.integers(1, 3), replace=False)
                    ),
                    "medications": None if null_last and s == n - 1 else meds,
                }
            )
    table = reader.cast_input(pa.Table.from_pylist(rows), "t")
    return table.append_column(reader.ROW, pa.array(np.arange(len(rows), dtype=np.int64)))


def test_encode_codes_matches_vocab_encode():
    _, vocab, _ = make_case()
    rng = np.random.default_rng(0)
    codes = [*vocab.diagnoses, "X1", "X2", "", None]
    lists = [
        None
        if rng.random() < 0.1
        else list(rng.choice(np.array(codes, object), rng.integers(0, 8)))
        for _ in range(60)
    ]
    arr = pa.array(lists, pa.list_(pa.string())).slice(5)  # a slice: offsets do not start at 0
    ids, unknown, given = encode_codes(arr, vocab.diagnoses)
    for i, row in enumerate(lists[5:]):
        want, unk = vocab.encode("diagnoses", [c for c in (row or ()) if c is not None])
        unk += sum(c is None for c in (row or ()))
        assert ids[i].tolist() == want and unknown[i] == unk and given[i] == len(row or ())
    meds = [list(rng.choice(vocab.medications, 5)) for _ in range(20)]
    ids, _, _ = encode_codes(pa.array(meds), vocab.medications, rare_first_rank(vocab))
    for i, row in enumerate(meds):
        assert ids[i].tolist() == vocab.rare_first(vocab.encode("medications", row)[0])


def test_statuses_reasons_and_histories():
    _, vocab, _ = make_case()
    rows = [
        ("a", "a0", 0, ["d00"], [], ["m00", "m01"]),  # history
        ("a", "a1", 1, [], [], None),  # no codes
        ("a", "a2", 2, ["zz"], ["yy"], ["m02"]),  # unknown codes only, still history
        ("a", "a3", 3, ["d01", "zz"], [], None),  # scored, 1 unknown dropped
        ("b", "a3", 0, ["d01"], [], None),  # duplicate visit_id
        (None, "c0", 0, ["d01"], [], None),  # missing key
        ("d", "d0", 0, ["d02"], ["p01"], ["m03"]),
        ("d", "d1", 1, ["d02"], ["p01"], None),
    ]
    names = ["patient_id", "visit_id", "visit_seq", "diagnoses", "procedures", "medications"]
    table = reader.cast_input(
        pa.table(dict(zip(names, map(list, zip(*rows, strict=True)), strict=True))), "t"
    )
    table = table.append_column(reader.ROW, pa.array(np.arange(len(rows), dtype=np.int64)))
    plan = Assembler(vocab).plan(table)
    S, R, K = SCORED, REJECTED, SKIPPED
    assert plan.status.tolist() == [K, R, K, S, R, R, K, S]
    reasons = [REASONS[r] if r >= 0 else None for r in plan.reason]
    assert reasons == [
        None,
        "no_codes",
        None,
        None,
        "duplicate_visit_id",
        "missing_key",
        None,
        None,
    ]
    assert plan.targets.tolist() == [3, 7]
    assert [h.tolist() for h in plan.histories] == [[0, 2], [6]]
    assert plan.unknown_codes == 3  # a2's two (history row) and a3's one
    assert sorted(plan.encode_rows.tolist()) == [0, 2, 3, 6, 7]
    every = Assembler(vocab, score_all=True, max_history=1).plan(table)
    assert every.status.tolist() == [S, R, R, S, R, R, S, S]
    assert [h.tolist() for h in every.histories] == [[], [2], [], [6]]  # K = 1: the latest
    assert every.reject_reasons() == {
        "missing_key": 1,
        "duplicate_visit_id": 1,
        "no_codes": 1,
        "unknown_codes": 1,
    }


def test_duplicates_are_found_across_chunks():
    _, vocab, _ = make_case()
    table = visits_table(vocab, 4)
    asm = Assembler(vocab)
    assert not asm.keys(table)[1].any()
    assert asm.plan(table).reject_reasons() == {"duplicate_visit_id": table.num_rows}


@pytest.mark.parametrize("by_kind", [False, True], ids=["every-kind", "one-kind-per-call"])
def test_init_inputs_equal_the_torch_batching(by_kind):
    """Encoded in several calls of shuffled rows (each padded to its own widths), laid out
    call after call, gathered back: the torch batching's inputs, zeros at padding. By kind:
    each call encodes one kind of code (as the encoder parts do), each kind's rows in
    their own order, medications only of the rows that serve as history."""
    model, vocab, _ = make_case()
    table = visits_table(vocab, 12, seed=1)
    plan = Assembler(vocab, score_all=True).plan(table)
    rng = np.random.default_rng(0)
    rows = rng.permutation(plan.encode_rows)
    parts, kinds = [rows[:1], rows[1:6], rows[6:]], None
    if by_kind:
        with_meds = np.unique(plan.histories.covered())  # the only medications read
        assert 0 < with_meds.size < plan.encode_rows.size
        cuts = [rng.permutation(r) for r in (rows, rows, with_meds)]
        parts = [c[:2] for c in cuts] + [c[2:] for c in cuts]
        kinds = np.tile(np.eye(3, dtype=bool), (2, 1))
    lay = layout(plan, parts, kinds)
    enc = new_encodings(lay, model.cfg.dim)
    for k, part in enumerate(parts):
        out = torch_encoder(model)(encoder_inputs(plan, part, vocab))
        assert (
            set(lay.outputs(k)) == ({"diag_enc", "v_d"}, {"proc_enc", "v_p"}, {"med_enc"})[k % 3]
            if by_kind
            else set(out)
        )
        store_encodings(enc, k, out)  # only the outputs of the call's kinds
    ours = init_inputs(plan, enc, plan.targets, plan.histories)
    batch = make_batch(list(patients_from_table(table, vocab)), vocab, targets=False)
    with torch.no_grad():
        enc_t = model.encode_visits(batch["diagnoses"], batch["procedures"], batch["medications"])
        ref = dict(zip(INIT_INPUTS, history_inputs(batch, *enc_t, model.cfg), strict=True))
    for name in INIT_INPUTS:
        want, got = ref[name].numpy(), ours[name]
        mask = {
            "diag_enc": "diag_mask",
            "proc_enc": "proc_mask",
            "hist_v_d": "hist_mask",
            "hist_v_p": "hist_mask",
            "slot_enc": "slot_mask",
        }.get(name)
        if mask:  # padding positions may differ (masked in the model): ours are zero
            keep = ref[mask].numpy() > 0
            assert not ours[name][ours[mask] == 0].any(), name
            want, got = want[keep], got[:, : keep.shape[1]][keep]
        else:
            want, got = want * 1, got[:, : want.shape[1]] if got.ndim > 1 else got
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


# -- reader ----------------------------------------------------------------------------------


def test_chunks_hold_whole_patients_across_record_batches():
    _, vocab, _ = make_case()
    table = visits_table(vocab, 20, null_last=True)
    batches = [table.slice(i, 3) for i in range(0, table.num_rows, 3)]
    got = list(reader.chunks(batches, "t", score_all=False, max_targets=4, max_rows=1000))
    assert pa.concat_tables([c.table for c in got]).equals(table)
    assert [c.start for c in got] == [0, *np.cumsum([len(c.table) for c in got])[:-1]]
    for c in got:
        pids = c.table["patient_id"].to_pylist()
        assert pids[0] != (table["patient_id"][c.start - 1].as_py() if c.start else None)
        assert c.table["medications"].null_count >= 4 or c is got[-1]
    again = list(reader.chunks(iter(batches), "t", False, 4, 1000))
    assert [(c.start, c.end) for c in again] == [(c.start, c.end) for c in got]
    small = list(reader.chunks([table], "t", True, 10**6, max_rows=5))
    assert all(len(c.table) < 5 + 4 for c in small) and len(small) > 1


@pytest.mark.parametrize(
    "order,row,what",
    [
        ([0, 1, 3, 2], 3, "after visit_seq"),
        ([0, 1, 2, 2], 3, "twice"),
    ],
)
def test_order_check_names_the_first_bad_row(order, row, what):
    table = pa.table({"patient_id": ["a"] * 4, "visit_seq": order, reader.ROW: list(range(4))})
    check = reader.OrderCheck("f.parquet")
    check.feed(table.slice(0, 2))  # the patient spans two batches
    with pytest.raises(InputError, match=rf"f.parquet: column 'visit_seq', row {row}: .*{what}"):
        check.feed(table.slice(2))


def test_order_check_finds_a_returning_patient_in_a_later_batch():
    table = pa.table(
        {"patient_id": ["a", "b", "c", "a"], "visit_seq": [0, 0, 0, 1], reader.ROW: [0, 1, 2, 3]}
    )
    check = reader.OrderCheck("f")
    check.feed(table.slice(0, 3))
    with pytest.raises(InputError, match="row 3: patient 'a' appears again"):
        check.feed(table.slice(3))
    assert reader.check_order([table.slice(0, 3)], "f") == 3


def test_sorted_batches_group_patients(tmp_path):
    import pyarrow.parquet as pq

    _, vocab, _ = make_case()
    table = visits_table(vocab, 6).drop_columns([reader.ROW])
    shuffled = table.take(pa.array(np.random.default_rng(0).permutation(table.num_rows)))
    pq.write_table(shuffled, tmp_path / "v.parquet")
    got = pa.concat_tables(reader.VisitFile(tmp_path / "v.parquet", batch_rows=4).sorted_batches())
    reader.check_order([got], "v")
    assert sorted(got["visit_id"].to_pylist()) == sorted(table["visit_id"].to_pylist())
    back = shuffled["visit_id"].take(got[reader.ROW]).to_pylist()
    assert back == got["visit_id"].to_pylist()  # ROW is the row in the file


def test_hash_set_remembers_across_merges():
    seen = reader.HashSet(recent_cap=4)
    assert seen.add([1, 2, 3]).tolist() == [False, False, False]
    assert seen.add([3, 4, 4, 5, 6]).tolist() == [True, False, True, False, False]
    assert seen.add([1, 6, 7]).tolist() == [True, True, False]
    assert len(set(range(1, 8))) == 7 and seen.add(list(range(1, 9))).sum() == 7


def test_spans_take_sums_and_cover_as_their_definition():
    """Histories kept as bounds into one array: `take`, `sums` and `covered` equal the
    per-target loops they replace, empty spans and repeated items included."""
    rng = np.random.default_rng(3)
    rows = np.sort(rng.choice(500, 120, replace=False))
    start = rng.integers(0, 120, 60)
    end = np.minimum(start + rng.integers(0, 6, 60), 120)
    spans = Spans(rows, start, end)
    lists = [rows[a:b] for a, b in zip(start, end, strict=True)]
    assert [s.tolist() for s in spans] == [x.tolist() for x in lists]
    items = rng.integers(0, 60, 45)
    got = spans.take(items)
    assert [got[i].tolist() for i in range(len(got))] == [lists[i].tolist() for i in items]
    weights = rng.integers(0, 9, 500)
    assert spans.sums(weights).tolist() == [int(weights[x].sum()) for x in lists]
    assert spans.covered().tolist() == sorted(set(np.concatenate(lists).tolist()))
