"""`Scorer`: recommendations for a stream of visits, chunk by chunk, from a model directory.

    scorer = Scorer("model", ScoreOptions(device="cpu", beam=4))
    for chunk in scorer.score_file("visits.parquet"):
        print(chunk.recommendations.num_rows, chunk.reject_reasons)

Per chunk (whole patients, see `reader.chunks`): plan the rows (`assemble.Assembler`),
encode every needed visit once (sorted by length), cut the visits to score into batches of
similar history and code lengths, run the decoder init once per batch and the beam search
(`beam.beam_search`), then build the output rows in input order (`outputs`). Results come
lazily, one `ScoredChunk` at a time, so a caller can write them as they arrive.

What decides the speed (figures: BENCHMARKS.md, "Where the time goes in ort-cpu" and
"Findings"; the batch constants below carry their own sweeps):
- Parallel streams: on the CPU each core decodes its own batch with a single-threaded
  session rather than one batch on several intra-op threads (whose spinning is off: it
  took the core the Python side needs).
- Small CPU batches (CPU_BATCH): past them a batch's memories and KV cache no longer fit
  the core's cache; batches of long histories are cut smaller (CPU_BATCH_SLOTS), and so
  are those of long code lists (`batches`: memory stays bounded on every padded axis).
- Most of the time goes to the decoder step graph, then the encoder; the Python side
  (beam bookkeeping, assembly, output) takes the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from cognet.core.ddi import ddi_matrix
from cognet.core.decoding import BEAM, MAX_LEN, Decoding
from cognet.core.manifest import Manifest, load_manifest
from cognet.core.metrics import PATIENT_COLUMNS, VisitResult, patient_rows
from cognet.core.vocab import Vocab
from cognet.runtime import assemble, reader
from cognet.runtime.batches import CPU_BATCH_CODES, GPU_BATCH_CODES, cut_padded, encoder_budget
from cognet.core.driver import DecoderSession
from cognet.runtime.beam import BeamResult
from cognet.runtime.decode import decode as run_decoding
from cognet.runtime.decode import decoding_configs
from cognet.runtime.options import GPU_DEVICES, ScoreOptions
from cognet.runtime.outputs import (
    ScoredChunk,
    explanations,
    output_schema,
    rejects_table,
    with_kept,
)
from cognet.runtime.session import OrtModel, default_threads

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


@dataclass(frozen=True)
class ScoringModel:
    """What a `Scorer` runs: an encoder (inputs -> `graphspec.ENCODER_OUTPUTS`), a decoder
    session (`beam.DecoderSession`) and what the model says about itself.

    `open_model` makes one from a model directory with ONNX Runtime; `Scorer.from_session`
    from any encoder and decoder (the tests plug torch in)."""

    # host arrays in, host arrays out; one with `new_encodings` and `encode_into`
    # (`encoder.Encoder`) writes its outputs in place, on a GPU into the device's memory
    encode: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]
    decoder: DecoderSession
    vocab: Vocab
    dim: int
    ddi_pairs: tuple[tuple[str, str], ...] = ()
    beam: int = BEAM  # the model's beam width, used unless the options name one
    max_len: int = MAX_LEN
    attention: bool = True  # diagnosis attention means something (not `no-diagnoses`)
    on_device: bool = False  # memories and caches live on a GPU
    providers: tuple[str, ...] = ("custom",)
    threads: int | None = None  # intra-op threads of each stream's sessions
    streams: int = 1  # batches decoded in parallel
    manifest: Manifest | None = None


def open_model(
    model_dir: str | Path, options: ScoreOptions, gpu_path: bool = False
) -> ScoringModel:
    """The ONNX Runtime sessions of a model directory for `options` (device, threads,
    streams, variant). CPU: one single-threaded stream per thread by default; GPU: one
    unless `options.streams` asks for more (host threads that feed the one device: while
    one waits for its graphs, another assembles or traces back). gpu_path: the GPU's code
    path on the CPU provider (`OrtModel`)."""
    manifest = load_manifest(model_dir)
    threads = options.threads or default_threads()
    streams = options.streams or (1 if options.device in GPU_DEVICES else threads)
    model = OrtModel(
        manifest,
        options.device,
        max(1, threads // streams),
        options.variant,
        options.selection,
        gpu_path,
    )
    if model.on_device and not options.streams:  # --device auto found a GPU
        streams = 1
    return ScoringModel(
        encode=model.encoder,
        decoder=model.decoder,
        vocab=manifest.vocabulary(),
        dim=manifest.dims.dim,
        ddi_pairs=manifest.ddi_pairs,
        beam=manifest.beam,
        max_len=manifest.max_len,
        attention=manifest.ablation != "no-diagnoses",
        on_device=model.on_device,
        providers=tuple(model.providers),
        threads=model.threads,
        streams=streams,
        manifest=manifest,
    )


class Scorer:
    """Batched decoding of visits with a model directory from `cognet-export`, configured by
    one `ScoreOptions` (see `cognet.runtime.options`; keywords change its fields):

        Scorer("model", ScoreOptions(device="cpu", beam=1))
        Scorer("model", device="cpu", beam=1)

    `options` is the options as given; `settings()` what decides the results, resolved.
    """

    def __init__(
        self,
        model: str | Path | ScoringModel,
        options: ScoreOptions | None = None,
        **changes,
    ):
        options = replace(options or ScoreOptions(), **changes)
        if not isinstance(model, ScoringModel):
            model = open_model(model, options)
        self.options, self.manifest, self.vocab = options, model.manifest, model.vocab
        self.encode, self.decoder, self.dim = model.encode, model.decoder, model.dim
        self.providers = list(model.providers)
        self.streams = model.streams
        self.threads = None if model.threads is None else model.threads * model.streams
        self.batch_size = options.batch_size or (GPU_BATCH if model.on_device else CPU_BATCH)
        gpu = model.on_device
        self.batch_slots = options.batch_slots or (GPU_BATCH_SLOTS if gpu else CPU_BATCH_SLOTS)
        self.batch_codes = GPU_BATCH_CODES if gpu else CPU_BATCH_CODES
        self.max_history = options.max_history_visits
        self.chunk_targets = options.chunk_targets or 16 * self.batch_size
        self.chunk_rows = options.chunk_rows
        self.encode_batch, self.encode_cells = encoder_budget(gpu)
        self.encode_batch = options.encode_batch or self.encode_batch
        self.ddi_pairs = [tuple(p) for p in model.ddi_pairs]
        self._ddi_adj = ddi_matrix(self.vocab, self.ddi_pairs)  # bool [M, M]
        if options.ddi.active and not self._ddi_adj.any():
            log.warning("DDI policy %r: the model knows no interacting pair", options.ddi.label)
        default = (
            model.manifest.default_decoding()
            if model.manifest is not None
            else Decoding(beam=model.beam, max_len=model.max_len)
        )
        self.decoding = options.resolve_decoding(default)
        self.beam_config, self.set_config = decoding_configs(
            self.decoding, self.vocab.end, options.ddi, options.compact_at
        )
        self._attention = model.attention and "diag_attention" in model.decoder.step_outputs
        self._pool = ThreadPoolExecutor(self.streams, "cognet-batch") if self.streams > 1 else None
        self._codes = pa.array(self.vocab.medications, pa.string())
        self._diag_codes = np.asarray(self.vocab.diagnoses, dtype=object)

    @classmethod
    def from_session(
        cls,
        encode: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]],
        decoder: DecoderSession,
        vocab: Vocab,
        dim: int,
        ddi_pairs: Sequence[Sequence[str]] = (),
        options: ScoreOptions | None = None,
        **changes,
    ) -> Scorer:
        """A scorer over any encoder callable and decoder session (tests plug torch in):
        beam 4, max length 45, `options.streams` or one stream."""
        options = replace(options or ScoreOptions(), **changes)
        pairs = tuple((str(a), str(b)) for a, b in ddi_pairs)
        model = ScoringModel(encode, decoder, vocab, dim, pairs, streams=options.streams or 1)
        return cls(model, options)

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
            "decoding": self.decoding.to_json(),
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
        source = reader.VisitFile(path, keep=self.options.keep_columns)
        batches = source.sorted_batches() if sort else source.batches()
        return self.score_batches(batches, source=path, **kwargs)

    def score_table(self, table: pa.Table, **kwargs) -> Iterator[ScoredChunk]:
        """Score an in-memory visits table (DESIGN.md §2 columns; other columns ignored, but
        those of options.keep_columns)."""
        reader.check_columns(table.schema, "<table>")
        cast = reader.cast_input(table, "<table>")
        cast = cast.append_column(reader.ROW, pa.array(np.arange(len(cast), dtype=np.int64)))
        kept = reader.kept_columns(table.schema, self.options.keep_columns, "<table>")
        return self.score_batches([reader.keep(cast, table, kept)], **kwargs)

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
        assembler = assemble.Assembler(
            self.vocab, score_all, self.max_history, self.options.max_codes_per_visit
        )
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
        order, widths = self._batch_order(plan)
        budgets = (self.batch_slots, self.batch_codes, self.batch_codes)
        parts = cut_padded(order, widths, budgets, self.batch_size)

        def decode(part: np.ndarray) -> tuple[BeamResult, dict]:
            targets, histories = plan.targets[part], plan.histories.take(part)
            if isinstance(enc.codes, np.ndarray):
                inputs = assemble.init_inputs(plan, enc, targets, histories)
                memories = self.decoder.init(inputs)
            else:  # encodings on the device: gathered there
                rows, inputs = assemble.init_index(plan, enc.layout, targets, histories)
                memories = self.decoder.init_gathered(enc, rows, inputs)
            ids = plan.table.column("visit_id").take(targets).to_pylist()
            result = run_decoding(
                self.decoder,
                memories,
                self.set_config or self.beam_config,
                ids,
                on_device=self.decoder.select_on_device,
                prauc=score_all,
                explain=explain,
                ddi_adj=self._ddi_adj,
                attention=self._attention,
            )
            return result, inputs

        try:
            results = list(self._map(decode, parts))
        finally:
            release = getattr(self.encode, "release", None)
            if release is not None:
                release(enc)  # its buffers may serve the next chunk
        # per target: (its batch's result, its place there, its batch's decoder-init inputs)
        slots: dict[int, tuple[BeamResult, int, dict]] = {}
        if explain or score_all:
            for part, (res, inputs) in zip(parts, results, strict=True):
                for k, i in enumerate(part.tolist()):
                    slots[i] = (res, k, inputs)
        out = self._recommendations(plan, parts, [r for r, _ in results], slots, explain)
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
        rows = plan.encode_rows
        # similar lengths pad little: group by medication count, then diagnoses + procedures
        rows = rows[
            np.lexsort(
                ((plan.diag.lengths + plan.proc.lengths)[rows], plan.meds.lengths[rows] // 4)
            )
        ]
        lengths = [ragged.lengths[rows] for ragged in (plan.diag, plan.proc, plan.meds)]
        cells = [self.encode_cells] * 3
        parts = cut_padded(rows, lengths, cells, self.encode_batch, squared=True)
        lay = assemble.layout(plan, parts)
        in_place = getattr(self.encode, "encode_into", None)  # `encoder.Encoder`
        if in_place is not None:
            enc = self.encode.new_encodings(lay)
        else:
            enc = assemble.new_encodings(lay, self.dim)

        def encode(k: int) -> None:
            inputs = assemble.encoder_inputs(plan, parts[k], self.vocab)
            if in_place is not None:
                in_place(inputs, enc, k)
            else:
                assemble.store_encodings(enc, k, self.encode(inputs))

        for _ in self._map(encode, range(len(parts))):
            pass
        return enc

    def _batch_order(self, plan: assemble.Plan) -> tuple[np.ndarray, list[np.ndarray]]:
        """Targets (indices into plan.targets) sorted by history slots, then code count, and
        the padded widths of each in that order: history slots, diagnoses, procedures."""
        slots = plan.histories.sums(plan.meds.lengths)
        diag, proc = plan.diag.lengths[plan.targets], plan.proc.lengths[plan.targets]
        order = np.lexsort((diag + proc, slots))
        return order, [slots[order], diag[order], proc[order]]

    def _recommendations(
        self,
        plan: assemble.Plan,
        parts: list[np.ndarray],
        results: list[BeamResult],
        slots: dict,
        explain: bool,
    ) -> pa.Table:
        """The output rows of the targets, in target order, from each batch's result (lists
        built batch by batch, then put in order by one Arrow take)."""
        lengths = np.concatenate(
            [np.zeros(0, np.int64)]
            + [np.fromiter(map(len, r.meds), np.int64, len(r.meds)) for r in results]
        )
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        flat = np.concatenate([np.zeros(0, np.int64)] + [m for r in results for m in r.meds])
        probs = np.concatenate(
            [np.zeros(0, np.float32)] + [p for r in results for p in r.med_probs]
        )
        scores = np.concatenate([np.zeros(0, np.float32)] + [r.score for r in results])
        order = np.concatenate([np.zeros(0, np.int64)] + list(parts))  # target at each place
        place = np.empty(order.size, np.int64)
        place[order] = np.arange(order.size)  # the inverse permutation
        place = pa.array(place)
        medications = pa.ListArray.from_arrays(offsets, self._codes.take(pa.array(flat)))
        probabilities = pa.ListArray.from_arrays(offsets, pa.array(probs, pa.float32()))
        table = plan.table.take(pa.array(plan.targets))
        columns = {
            "patient_id": table["patient_id"],
            "visit_id": table["visit_id"],
            "medications": medications.take(place),
            "score": pa.array(scores, pa.float32()).take(place),
            "probabilities": probabilities.take(place),
        }
        if explain:
            columns["explanations"] = explanations(plan, slots, self._diag_codes)
        return with_kept(pa.table(columns, schema=output_schema(explain)), table)

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
