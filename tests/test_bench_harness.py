"""The bench's measurement loop (`cognet.benchmarks.interleaved_runs`): what each pass does around
the engine's runs, what it reports as it ends, when an engine's memory goes back, and how
the guard's reference decodes and scores a list (its tie check)."""

from __future__ import annotations

import pytest
import torch

from cognet.benchmarks import interleaved_runs
from cognet.benchmarks.guard import Guard
from cognet.core.dataset import read_dataset
from cognet.core.history import load_split
from cognet.model.batching import make_batch
from cognet.model.torch_decoding import beam_search


def test_each_pass_hands_back_freed_memory_before_its_peak_is_reset(monkeypatch):
    """A pass's peak RSS must not include what the engine before it freed: glibc keeps freed
    heap pages resident, so the reset comes after a release, before every pass."""
    events = []

    class Engine:
        name = "fake"

        def run(self, batch):
            events.append("run")
            return batch

        def recommendations(self, batch, out):
            return {}

        def after_pass(self):
            events.append("after")

    monkeypatch.setattr(interleaved_runs, "release_memory", lambda: events.append("release") or 0.0)
    monkeypatch.setattr(interleaved_runs, "reset_peak_rss", lambda: events.append("reset") or True)
    monkeypatch.setattr(interleaved_runs, "peak_rss_mb", lambda: 1.0)
    jobs = [interleaved_runs.Job(Engine(), 2, [[1], [2]], [1]) for _ in range(2)]
    for _ in range(2):
        for job in jobs:
            job.one_pass()
    # and the engine hands back what it cached (torch's CUDA cache) after every pass
    assert events == ["release", "reset", "run", "run", "after"] * 4


def test_each_pass_is_reported_as_it_ends(monkeypatch):
    """A block reports every pass when it ends, engines in turn, so that a run stopped from
    outside still shows what it measured; a pass that fails ends its engine's lines."""
    monkeypatch.setattr(interleaved_runs, "release_memory", lambda: 0.0)
    monkeypatch.setattr(interleaved_runs, "reset_peak_rss", lambda: True)
    monkeypatch.setattr(interleaved_runs, "peak_rss_mb", lambda: 12.0)

    class Engine:
        providers: list = []

        def __init__(self, name, fail_on=None):
            self.name, self.fail_on, self.passes = name, fail_on, 0

        def prepare(self, beam, batch_size):
            pass

        def run(self, batch):
            if batch == ["v1"]:  # the first batch of a pass
                self.passes += 1
            if self.passes == self.fail_on:
                raise RuntimeError("out of memory")
            return batch

        def recommendations(self, batch, out):
            return {v: () for v in batch}

        def gpu_memory_mb(self):
            return None

        def release(self):
            pass

        def after_pass(self):
            pass

    batches = [["v1"], ["v2", "v3"]]
    jobs = [
        interleaved_runs.Job(Engine("a"), 2, batches, ["w"]),
        interleaved_runs.Job(Engine("b", 2), 2, batches, ["w"]),
    ]
    lines = []
    records = interleaved_runs.measure_block(jobs, 4, 3, Guard(None), say=lines.append)
    heads = [line.split(":")[0].strip() + " " + line.split()[2] for line in lines]
    assert heads == ["pass 1 a", "pass 1 b", "pass 2 a", "pass 3 a"]
    assert all("beam 4 batch 2:" in line and "3 visits in" in line for line in lines)
    assert "peak RSS 12 MB" in lines[0]
    assert [r["engine"] for r in records] == ["a"] and jobs[1].error.endswith("out of memory")


@pytest.mark.parametrize("device,calls", [("cpu", [32, 8]), ("cuda", [40])])
def test_the_reference_decodes_in_chunks_that_suit_its_device(device, calls):
    """The guard's untimed reference decodes 32 patients a call on a CPU (torch-batched's
    fastest) and up to 4,096 on a GPU, each visit once, then hands back what it cached."""
    from types import SimpleNamespace

    from cognet.benchmarks.workload import Batch

    seen = []

    class Reference:
        def __init__(self):
            self.device = device

        def prepare(self, beam, batch_size):
            seen.append(("prepare", beam, batch_size))

        def run(self, batch):
            seen.append(("run", len(batch)))
            return [("A",)] * len(batch)

        def recommendations(self, batch, out):
            return dict(zip(batch.visit_ids, out, strict=True))

        def after_pass(self):
            seen.append(("after",))

    patients = [[SimpleNamespace(visit_id=f"v{i}")] for i in range(40)]
    batch = Batch(None, patients, [p[-1].visit_id for p in patients])
    guard = Guard(Reference())
    guard.ensure([batch], 4)
    guard.ensure([batch], 4)  # nothing left to decode: no call
    chunk = 4096 if device == "cuda" else 32
    assert seen == [("prepare", 4, chunk), *(("run", n) for n in calls), ("after",)]
    assert guard.recs[(4, "v39")] == [("A",)]


def test_an_engine_hands_back_its_memory_when_its_last_pass_ends(monkeypatch):
    """With one pass each (a GPU run), engine a is released before engine b warms up, so
    their memory never shares the device; an engine run in two modes (request and stream)
    is released once, after the last pass of both, with its device memory read first."""
    monkeypatch.setattr(interleaved_runs, "release_memory", lambda: 0.0)
    monkeypatch.setattr(interleaved_runs, "reset_peak_rss", lambda: True)
    monkeypatch.setattr(interleaved_runs, "peak_rss_mb", lambda: 1.0)
    events = []

    class Engine:
        providers: list = []

        def __init__(self, name):
            self.name = name

        def prepare(self, beam, batch_size):
            events.append(("prepare", self.name))

        def run(self, batch):
            events.append(("warm" if batch == ["w"] else "run", self.name))
            return batch

        def recommendations(self, batch, out):
            return {v: () for v in batch}

        def gpu_memory_mb(self):
            events.append(("gpu", self.name))
            return 7.0

        def release(self):
            events.append(("release", self.name))

        def after_pass(self):
            pass

    a, b = Engine("a"), Engine("b")
    batches = [["v1"]]
    jobs = [
        interleaved_runs.Job(a, 1, batches, ["w"]),
        interleaved_runs.Job(b, 1, batches, ["w"]),
        interleaved_runs.Job(b, 1, batches, ["w"], mode="stream"),
    ]
    records = interleaved_runs.measure_block(jobs, 4, 1, Guard(None))
    assert events == [
        ("prepare", "a"),
        ("prepare", "b"),
        ("prepare", "b"),
        ("warm", "a"),
        ("run", "a"),
        ("gpu", "a"),
        ("release", "a"),
        ("warm", "b"),
        ("run", "b"),
        ("warm", "b"),
        ("run", "b"),
        ("gpu", "b"),
        ("release", "b"),
    ]
    assert [(r["engine"], r["mode"], r["gpu_mem_mb"]) for r in records] == [
        ("a", "request", 7.0),
        ("b", "request", 7.0),
        ("b", "stream", 7.0),
    ]


def test_list_scores_are_the_beam_scores(tiny):
    """The guard's tie check scores a list teacher forced: the beam search's own answer gets
    the score the beam search reported; a changed list gets another."""
    from cognet.benchmarks.engines import TorchBatched

    torch.set_num_threads(1)
    engine = TorchBatched("torch-batched", tiny / "ckpt", 1)
    vocab = engine.vocab
    visits = read_dataset(tiny / "data").visits
    patients = load_split(visits, vocab, "train").patients[:20]
    batch = make_batch(patients, vocab, targets=False)
    last = torch.tensor([sum(map(len, patients[: i + 1])) - 1 for i in range(len(patients))])
    decoded = beam_search(engine.model, batch, beam=4, rows=last)
    lists = [vocab.med_codes(d.meds) for d in decoded]
    scores = engine.list_scores(patients, lists)
    assert scores == pytest.approx([d.score for d in decoded], abs=1e-4)
    longer = [[*m, c] for m, c in zip(lists, vocab.medications, strict=False) if c not in m]
    changed = engine.list_scores(patients[: len(longer)], longer)
    assert all(abs(a - b) > 1e-3 for a, b in zip(changed, scores, strict=False))


def test_each_pass_hands_the_records_so_far_to_on_pass(monkeypatch):
    """The results files are rewritten after every pass (`harness.run_all`'s progress): the
    block hands over the records of its passes so far, each with the passes it ran."""
    monkeypatch.setattr(interleaved_runs, "release_memory", lambda: 0.0)
    monkeypatch.setattr(interleaved_runs, "reset_peak_rss", lambda: True)
    monkeypatch.setattr(interleaved_runs, "peak_rss_mb", lambda: 12.0)

    class Engine:
        providers: list = []

        def __init__(self, name):
            self.name = name

        def prepare(self, beam, batch_size):
            pass

        def run(self, batch):
            return batch

        def recommendations(self, batch, out):
            return {v: () for v in batch}

        def gpu_memory_mb(self):
            return None

        def release(self):
            pass

        def after_pass(self):
            pass

    jobs = [interleaved_runs.Job(Engine(n), 2, [["v1"], ["v2"]], ["w"]) for n in "ab"]
    seen = []
    interleaved_runs.measure_block(
        jobs, 4, 2, Guard(None), on_pass=lambda records: seen.append(records)
    )
    assert [[(r["engine"], r["repeats"]) for r in records] for records in seen] == [
        [("a", 1)],
        [("a", 1), ("b", 1)],
        [("a", 2), ("b", 1)],
        [("a", 2), ("b", 2)],
    ]
    assert seen[-1][0]["latency_samples"] == 4  # 2 batches x 2 passes
