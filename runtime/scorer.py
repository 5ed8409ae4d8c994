"""`Scorer`: recommendations for a stream of visits, chunk by chunk, from a model directory.

    scorer = Scorer("model", device="cpu", beam=4)
    for chunk in scorer.score_file("visits.parquet"):
        print(chunk.recommendations.num_rows, chunk.reject_reasons)

Per chunk (whole patients, see `reader.chunks`): plan the rows (`assemble.Assembler`),
encode every needed visit once (sorted by length), cut the visits to score into batches of
similar history and code lengths, run the decoder init once per batch and the beam search
(`beam.beam_search`), then build the output rows in input order. Results come lazily, one
`ScoredChunk` at a time, so a caller can write them as they arrive.

Performance (2 cores of a Xeon, beam 4, real-size random model: dim 64, 4 heads, 2038/1413/
131 codes, 2000 last visits of synthetic patients, mean 25.6 medications): 1020 visits/s,
vs 344 for the torch reference batched beam search (`cognet.decode`) on the same visits
(best torch batch), with identical medication lists. What decides it, measured:
- Parallel streams: on the CPU each core decodes its own batch with a single-threaded
  session (1020 visits/s) instead of one batch on two intra-op threads (699; 617 when
  ONNX Runtime's threads spin, which is why spinning is off).
- Batch size 128 (64: 968, 256: 721): past that, a batch's memories and KV cache no longer
  fit the core's cache.
- Where one core's time goes: decoder step graph 70%, encoder 14%, decoder init 4%,
  dropping done visits 3%, Python (beam bookkeeping, assembly, output) 9%. Inside the step:
  the two cross-attention softmaxes over short code axes 16%, the self-attention KV cache
  append and reorder (Concat, Gather) 17%, copy scatter matmul 7%.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
from cognet.runtime import assemble, reader
from cognet.runtime.beam import BeamConfig, BeamResult, DecoderSession, beam_search
from cognet.runtime.outputs import EXPLANATION, ScoredChunk, output_schema, rejects_table
from cognet.runtime.session import OrtModel, default_threads

from cognet.core.ddi import DDIPolicy, ddi_matrix
from cognet.core.decoding import BEAM, MAX_LEN
from cognet.core.manifest import load_manifest
from cognet.core.metrics import PATIENT_COLUMNS, VisitResult, patient_rows
from cognet.core.vocab import Vocab

log = logging.getLogger(__name__)

# Visits decoded together. CPU: small batches keep a batch's memories and KV cache in the
# core's cache (2 cores, beam 4: 64 -> 936 visits/s, 128 -> 985, 256 -> 648). GPU: many rows,
# within the N <= 512 shape profile of the TensorRT engines built by cognet-export.
CPU_BATCH, GPU_BATCH = 128, 512
# Cap on a batch's padded history: visits x the largest number of past-medication slots among
# them. Every visit of a batch carries copy memories as long as the longest history (the
# one-hot scatter alone is [visits, slots, V1] floats): without a cap a batch of 4096 visits
# with one 680-slot history took 9 GB and ran at 147 visits/s. Visits are batched in order of
# history size, so the cap splits only the batches of long histories. On 2 CPU cores (beam 4,
# batch 4096, BENCHMARKS.md) caps of 2^10 .. 2^18 gave 767, 828, 855, 842, 796, 718 and 602
# visits/s: 2^12 it is. On a GPU, where wide batches pay, the cap only bounds memory.
CPU_BATCH_SLOTS, GPU_BATCH_SLOTS = 1 << 12, 1 << 20
# Diagnoses a medication attended to most: top TOP_DIAGNOSES codes by the diagnosis
# cross-attention (mean over heads) at the step that emitted it, heaviest first.
TOP_DIAGNOSES = 3


def cut_batches(
    order: np.ndarray, slots: np.ndarray, batch_size: int, batch_slots: int
) -> list[np.ndarray]:
    """Cut `order` (sorted by history slots, `slots` ascending alongside it) into batches of
    at most `batch_size` visits whose padded history, visits x the last one's slots, stays
    within `batch_slots` (a visit alone may exceed it)."""
    parts, lo, n = [], 0, order.size
    while lo < n:
        hi = min(lo + batch_size, n)
        size = np.arange(1, hi - lo + 1)
        fits = size * np.maximum(slots[lo:hi], 1) <= batch_slots
        take = max(1, int(fits.sum()))  # volume grows with the size: the fits are a prefix
        parts.append(order[lo : lo + take])
        lo += take
    return parts


class Scorer:
    """Batched beam search over visits with a model directory from `cognet-export`.

    device: auto | cpu | cuda | tensorrt; beam: default the manifest's; batch_size: visits
    decoded together; threads: CPU threads in all (default: the cores this process may use);
    streams: batches decoded in parallel, each on threads // streams intra-op threads
    (default: one per thread on the CPU, 1 on a GPU); max_history_visits: keep only the last
    K past visits (default all); ddi: DDI-aware decoding (`cognet.core.ddi.DDIPolicy`, default
    off) over the manifest's DDI pairs; batch_slots: a batch is cut smaller when its visits
    times its longest history (past-medication slots) would exceed this (default
    CPU_BATCH_SLOTS or GPU_BATCH_SLOTS).
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "auto",
        beam: int | None = None,
        batch_size: int | None = None,
        threads: int | None = None,
        max_history_visits: int | None = None,
        variant: str | None = None,
        streams: int | None = None,
        ddi: DDIPolicy | None = None,
        batch_slots: int | None = None,
    ):
        manifest = load_manifest(model_dir)
        threads = threads or default_threads()
        if streams is None:  # CPU: one single-threaded batch per core; GPU: one stream
            streams = 1 if device in ("cuda", "tensorrt") else threads
        model = OrtModel(
            manifest, device=device, threads=max(1, threads // streams), variant=variant
        )
        if model.on_device:
            streams = 1
        batch_size = batch_size or (GPU_BATCH if model.on_device else CPU_BATCH)
        batch_slots = batch_slots or (GPU_BATCH_SLOTS if model.on_device else CPU_BATCH_SLOTS)
        self.manifest = manifest
        self._setup(model.encode, model.decoder, manifest.vocabulary(), manifest.dims.dim,
                    manifest.ddi_pairs, beam or manifest.beam, manifest.max_len, batch_size,
                    max_history_visits, streams=streams, ddi=ddi,
                    batch_slots=batch_slots)  # fmt: skip
        if manifest.ablation == "no-diagnoses":  # attention weights of unused diagnoses
            self._attention = False
        self.providers = list(model.providers)
        self.threads = model.threads * streams

    @classmethod
    def from_session(
        cls,
        encode,
        decoder: DecoderSession,
        vocab: Vocab,
        dim: int,
        ddi_pairs: Sequence[Sequence[str]] = (),
        beam: int = BEAM,
        max_len: int = MAX_LEN,
        batch_size: int = CPU_BATCH,
        max_history_visits: int | None = None,
        **tuning,
    ) -> Scorer:
        """A scorer over any encoder callable and decoder session (tests plug torch in)."""
        self = cls.__new__(cls)
        self.manifest = None
        self._setup(encode, decoder, vocab, dim, ddi_pairs, beam, max_len, batch_size,
                    max_history_visits, **tuning)  # fmt: skip
        self.providers = ["custom"]
        self.threads = None
        return self

    def _setup(
        self,
        encode,
        decoder,
        vocab,
        dim,
        ddi_pairs,
        beam,
        max_len,
        batch_size,
        max_history_visits,
        compact_at: float = 0.75,
        chunk_targets: int | None = None,
        chunk_rows: int = 1 << 15,
        encode_batch: int = 64,
        streams: int = 1,
        ddi: DDIPolicy | None = None,
        batch_slots: int = CPU_BATCH_SLOTS,
    ) -> None:
        if batch_size < 1 or streams < 1 or batch_slots < 1:
            raise ValueError("batch_size, streams and batch_slots must be >= 1")
        self.encode, self.decoder, self.vocab, self.dim = encode, decoder, vocab, dim
        self.ddi_pairs = [tuple(p) for p in ddi_pairs]
        self._ddi_adj = ddi_matrix(vocab, self.ddi_pairs)  # bool [M, M]
        ddi = ddi or DDIPolicy()
        if ddi.active and not self._ddi_adj.any():
            log.warning("DDI policy %r: the model knows no interacting pair", ddi.label)
        self.beam_config = BeamConfig(
            end=vocab.end, beam=beam, max_len=max_len, compact_at=compact_at, ddi=ddi
        )
        self._attention = "diag_attention" in getattr(decoder, "step_outputs", ())
        self.batch_size = batch_size
        self.batch_slots = batch_slots
        self.max_history = max_history_visits
        self.chunk_targets = chunk_targets or 16 * batch_size
        self.chunk_rows = chunk_rows
        self.encode_batch = encode_batch
        self.streams = streams
        self._pool = ThreadPoolExecutor(streams, "cognet-batch") if streams > 1 else None
        self._codes = pa.array(vocab.medications, pa.string())
        self._diag_codes = np.asarray(vocab.diagnoses, dtype=object)

    # -- public API ---------------------------------------------------------------------------
    def interacting_pairs(self, medications: Sequence[str]) -> list[tuple[str, str]]:
        """The pairs of a medication list (codes) that the model's DDI pairs name, in list
        order."""
        index = {c: i for i, c in enumerate(self.vocab.medications)}
        ids = [index.get(m) for m in medications]
        return [
            (medications[a], medications[b])
            for a in range(len(ids))
            for b in range(a + 1, len(ids))
            if ids[a] is not None and ids[b] is not None and self._ddi_adj[ids[a], ids[b]]
        ]

    def settings(self) -> dict:
        """Everything that decides the results (a resumed run must use the same)."""
        cfg = self.beam_config
        return {
            "beam": cfg.beam,
            "max_len": cfg.max_len,
            "batch_size": self.batch_size,
            "max_history_visits": self.max_history,
            "compact_at": cfg.compact_at,
            "chunk_targets": self.chunk_targets,
            "chunk_rows": self.chunk_rows,
            "encode_batch": self.encode_batch,
            "ddi": cfg.ddi.to_json(),
        }

    def score_file(
        self, path: str | Path, *, sort: bool = False, **kwargs
    ) -> Iterator[ScoredChunk]:
        """Score a visits Parquet file, streamed by record batches (`sort`: in memory)."""
        source = reader.VisitFile(path)
        batches = source.sorted_batches() if sort else source.batches()
        return self.score_batches(batches, source=path, **kwargs)

    def score_table(self, table: pa.Table, **kwargs) -> Iterator[ScoredChunk]:
        """Score an in-memory visits table (DESIGN.md §2 columns; extra columns ignored)."""
        reader.check_columns(table.schema, "<table>")
        cast = reader.cast_input(table, "<table>")
        cast = cast.append_column(reader.ROW, pa.array(np.arange(len(cast), dtype=np.int64)))
        return self.score_batches([cast], **kwargs)

    def score_batches(
        self,
        batches: Iterable[pa.Table],
        *,
        score_all: bool = False,
        explain: bool = False,
        source: object = "<input>",
        skip_rows: int = 0,
    ) -> Iterator[ScoredChunk]:
        """Score a stream of tables with reader.INPUT_SCHEMA columns + ROW, lazily.

        score_all: score every visit (default: those whose medications are null) and compute
        metrics for those with known medications. explain: add per-medication copy share
        and source visit. skip_rows: chunks ending at or before this stream position are
        only checked (resume), not scored nor yielded.
        """
        assembler = assemble.Assembler(self.vocab, score_all, self.max_history)
        for chunk in reader.chunks(batches, source, score_all, self.chunk_targets, self.chunk_rows):
            if chunk.end <= skip_rows:
                assembler.keys(chunk.table)  # remember its visit_ids
                continue
            yield self._score_chunk(chunk, assembler, score_all, explain)

    # -- one chunk ----------------------------------------------------------------------------
    def _score_chunk(
        self, chunk: reader.Chunk, assembler: assemble.Assembler, score_all: bool, explain: bool
    ) -> ScoredChunk:
        started = time.perf_counter()
        plan = assembler.plan(chunk.table)
        enc = self._encode(plan)
        order, slots = self._batch_order(plan)
        parts = cut_batches(order, slots, self.batch_size, self.batch_slots)

        def decode(part: np.ndarray) -> tuple[BeamResult, dict]:
            inputs = assemble.init_inputs(
                plan, enc, plan.targets[part], [plan.histories[i] for i in part]
            )
            memories = self.decoder.init(inputs)
            result = beam_search(self.decoder, memories, part.size, self.beam_config,
                                 prauc=score_all, explain=explain, ddi_adj=self._ddi_adj,
                                 attention=self._attention)  # fmt: skip
            return result, inputs

        slots: dict[int, tuple[BeamResult, int, dict]] = {}
        for part, (res, inputs) in zip(parts, self._map(decode, parts), strict=True):
            for k, i in enumerate(part.tolist()):
                slots[i] = (res, k, inputs)
        out = self._recommendations(plan, slots, explain)
        metrics, evaluated = self._metrics(plan, slots) if score_all else (None, 0)
        counts = plan.counts()
        return ScoredChunk(
            index=chunk.index,
            start=chunk.start,
            end=chunk.end,
            recommendations=out,
            rejects=rejects_table(plan),
            rows_scored=counts["scored"],
            rows_rejected=counts["rejected"],
            rows_skipped=counts["skipped"],
            reject_reasons=plan.reject_reasons(),
            unknown_codes=plan.unknown_codes,
            seconds=time.perf_counter() - started,
            patient_metrics=metrics,
            visits_evaluated=evaluated,
        )

    def close(self) -> None:
        """Stop the parallel streams' threads (the scorer is unusable afterwards)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _map(self, func, items: list) -> Iterable:
        """func over items, on the parallel streams when there are several (in order)."""
        return map(func, items) if self._pool is None else self._pool.map(func, items)

    def _encode(self, plan: assemble.Plan) -> assemble.Encodings:
        enc = assemble.new_encodings(plan, self.dim)
        rows = plan.encode_rows
        # similar lengths pad little: group by medication count, then diagnoses + procedures
        rows = rows[
            np.lexsort(
                ((plan.diag.lengths + plan.proc.lengths)[rows], plan.meds.lengths[rows] // 4)
            )
        ]
        parts = [rows[lo : lo + self.encode_batch] for lo in range(0, rows.size, self.encode_batch)]

        def encode(part: np.ndarray) -> None:
            out = self.encode(assemble.encoder_inputs(plan, part, self.vocab))
            assemble.store_encodings(enc, plan, part, out)

        for _ in self._map(encode, parts):
            pass
        return enc

    def _batch_order(self, plan: assemble.Plan) -> tuple[np.ndarray, np.ndarray]:
        """Targets (indices into plan.targets) sorted by history slots, then code count, and
        the history slots of each in that order."""
        med_len = plan.meds.lengths
        slots = np.array([int(med_len[h].sum()) for h in plan.histories], np.int64)
        codes = (plan.diag.lengths + plan.proc.lengths)[plan.targets]
        order = np.lexsort((codes, slots))
        return order, slots[order]

    def _recommendations(self, plan: assemble.Plan, slots: dict, explain: bool) -> pa.Table:
        n = plan.targets.size
        meds, probs, scores = [], [], np.zeros(n, np.float32)
        for i in range(n):
            res, k, _ = slots[i]
            meds.append(res.meds[k])
            probs.append(res.med_probs[k])
            scores[i] = res.score[k]
        lengths = np.array([m.size for m in meds], np.int64)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        flat = np.concatenate(meds) if meds else np.zeros(0, np.int64)
        table = plan.table.take(pa.array(plan.targets))
        columns = {
            "patient_id": table["patient_id"],
            "visit_id": table["visit_id"],
            "medications": pa.ListArray.from_arrays(offsets, self._codes.take(pa.array(flat))),
            "score": pa.array(scores, pa.float32()),
            "probabilities": pa.ListArray.from_arrays(
                offsets, pa.array(np.concatenate(probs) if probs else [], pa.float32())
            ),
        }
        if explain:
            columns["explanations"] = self._explanations(plan, slots)
        return pa.table(columns, schema=output_schema(explain))

    def _explanations(self, plan: assemble.Plan, slots: dict) -> pa.Array:
        """Per medication: copy share 1 - w_g at its step, the past visit whose slots of
        that medication carry the most copy weight (null when none holds it), and the
        diagnoses of the visit it attended to most at its step."""
        visit_ids = plan.table["visit_id"]
        out = []
        for i in range(plan.targets.size):
            res, k, inputs = slots[i]
            meds = res.meds[k]
            share = 1.0 - res.gates[k]
            hist = plan.histories[i]
            src: list[str | None] = [None] * meds.size
            if hist.size and meds.size:
                slot_med, slot_visit = inputs["slot_med"][k], inputs["slot_visit"][k]
                real = inputs["slot_mask"][k] > 0
                weight = res.copies[k] * ((slot_med[None, :] == meds[:, None]) & real)
                per_visit = np.zeros((meds.size, hist.size))
                for j in range(meds.size):
                    per_visit[j] = np.bincount(slot_visit, weight[j], minlength=hist.size)[
                        : hist.size
                    ]
                best = per_visit.argmax(1)
                for j in np.flatnonzero(per_visit.max(1) > 0):
                    src[j] = visit_ids[int(hist[best[j]])].as_py()
            top = self._top_diagnoses(plan, plan.targets[i], res.attention, k, meds.size)
            out.append(
                [
                    {"copy_share": float(s), "source_visit": v, "top_diagnoses": d}
                    for s, v, d in zip(share.tolist(), src, top, strict=True)
                ]
            )
        return pa.array(out, pa.list_(EXPLANATION))

    def _top_diagnoses(self, plan: assemble.Plan, row: int, attention: list | None, k: int,
                       n_meds: int) -> list:  # fmt: skip
        """Per medication of one visit: [{code, weight}] of its TOP_DIAGNOSES most attended
        diagnoses (positions of the attention = the row's diagnosis ids, in plan order)."""
        if attention is None:
            return [None] * n_meds
        ids = plan.diag[row]
        weights = attention[k][:, : ids.size].astype(np.float32)  # [meds, diagnoses]
        order = np.argsort(-weights, axis=1, kind="stable")[:, :TOP_DIAGNOSES]
        codes = self._diag_codes[ids]
        return [
            [{"code": codes[j], "weight": float(w[j])} for j in o if w[j] > 0]
            for o, w in zip(order, weights, strict=True)
        ]

    def _metrics(self, plan: assemble.Plan, slots: dict) -> tuple[np.ndarray, int]:
        pids = plan.table["patient_id"]
        results = []
        for i, row in enumerate(plan.targets.tolist()):
            if not plan.has_meds[row]:
                continue
            res, k, _ = slots[i]
            results.append(
                VisitResult(
                    pids[row].as_py(),
                    tuple(res.meds[k].tolist()),
                    tuple(plan.meds[row].tolist()),
                    res.prauc_scores[k],
                )
            )
        if not results:
            return np.zeros((0, len(PATIENT_COLUMNS))), 0
        return patient_rows(results, self._ddi_adj), len(results)
