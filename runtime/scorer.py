"""`Scorer`: recommendations for a stream of visits, chunk by chunk, from a model directory.

    with Scorer("model", ScoreOptions.of(device="cpu", beam=4)) as scorer:
        for chunk in scorer.score_file("visits.parquet"):
            print(chunk.recommendations.num_rows, chunk.reject_reasons)

Each chunk (whole patients, see `reader.chunks`) goes through four stages:
- plan (`plan.Assembler`): which rows are scored, rejected or skipped, their codes and
  histories;
- encode (`encoder.encode_plan`): every needed visit once, in calls of similar lengths;
- decode (`cognet.core.decoding.plan.decode`, by the scorer's `DecodingPlan`): the visits to
  score cut into batches of similar history and code lengths (`batches.least_padded` of
  `Plan.decode_orders`), each batch's decoder init, then beam search or set decoding in
  the one loop of `cognet.core.decoding.driver`;
  an ensemble's members each encode and init from their own graphs, and the batch decodes
  by the rules of `cognet.core.decoding.ensemble`;
- emit (`emit`): the output rows in input order, and the metrics with `--all`.
The marginal decoding (`--decoding marginal`) plans, then reads each target's P(k in S) from
the set head's graph (`head.HeadSession`) and its set by the set rules: no encoder nor decoder
graph runs, but with explanations, which come from COGNet's own set decoding of the same
visits (`cognet.core.decoding.plan.explained_sets`).
Results come lazily, one `ScoredChunk` at a time, so a caller can write them as they arrive.

What decides the speed (figures: BENCHMARKS.md "Latest results" and "What was tried"):
- Parallel streams: on the CPU each core decodes its own batch with a single-threaded
  session rather than one batch on several intra-op threads (whose spinning is off: it
  took the core the Python side needs).
- Small CPU batches (`batches.CPU_BATCH`): past them a batch's memories and cache no longer fit
  the core's cache; batches of long histories are cut smaller (CPU_BATCH_SLOTS), and so
  are those of long code lists (`batches`: memory stays bounded on every padded axis).
- Most of the time goes to the decoder step graph, then the encoder; the Python side
  (selection, assembly, output) takes the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

from cognet.core.ddi import ddi_matrix, require_pairs
from cognet.core.decoding import Decoding
from cognet.core.decoding.beam import BeamResult
from cognet.core.decoding.ensemble import member_sessions
from cognet.core.decoding.plan import decode
from cognet.core.decoding.sampling import SetResult
from cognet.core.errors import InputError
from cognet.core.vocab import Vocab
from cognet.runtime import device_selectors, emit, reader
from cognet.runtime.batches import Budgets, least_padded
from cognet.runtime.encoder import PlanEncoder, encode_plan, init_memories
from cognet.runtime.options import ScoreOptions
from cognet.runtime.outputs import ScoredChunk, rejects_table
from cognet.runtime.plan import Assembler, Plan
from cognet.runtime.scoring_model import ScoringModel, open_model

log = logging.getLogger(__name__)


class Scorer:
    """Batched decoding of visits with a model directory from `cognet-export`.

    Configure it with one `ScoreOptions` (what `cognet-batch` builds; see
    `cognet.runtime.options` for what each field means); None: the defaults.
    `ScoreOptions.of` takes its fields and its request's as keywords:

        with Scorer("model", ScoreOptions.of(device="cpu", beam=1)) as scorer:
            for chunk in scorer.score_file("visits.parquet"):
                ...
        Scorer("model", ScoreOptions(device="cpu", request=DecodingRequest(beam=1)))

    The request's fields (`decoding` to `ddi`) left None leave the model's own. A scorer
    with parallel streams owns a thread pool: `close()`, or the end of the `with` block,
    stops it. `options` is the options as given; `settings()` what decides the results,
    resolved (`decoding_plan`: what each batch's decoding runs).
    """

    def __init__(
        self, model: str | Path | ScoringModel, options: ScoreOptions | None = None
    ) -> None:
        options = ScoreOptions() if options is None else options
        if not isinstance(options, ScoreOptions):
            raise TypeError(
                f"Scorer: options must be a ScoreOptions, not {type(options).__name__} "
                "(ScoreOptions.of(device=..., beam=...) builds one from keywords)"
            )
        if not isinstance(model, ScoringModel):
            model = open_model(model, options)
        self.options, self.model = options, model
        self.manifest, self.vocab = model.manifest, model.vocab
        self.encode, self.decoder = model.encode, model.decoder
        self.providers, self.streams = list(model.providers), model.streams
        self.threads = None if model.threads is None else model.threads * model.streams
        self.budgets = Budgets.of(options, model.on_device)
        self._ddi_adj = ddi_matrix(self.vocab, [tuple(p) for p in model.ddi_pairs])  # [M, M]
        manifest = model.manifest
        default = (
            manifest.default_decoding()
            if manifest is not None
            else Decoding(beam=model.beam, max_len=model.max_len)
        )
        # the asked policy, else the model's DDI target (when it has one), else off
        target = manifest.default_target() if manifest is not None else None
        self._attention = model.attention and "diag_attention" in model.decoder.step_outputs
        self.decoding_plan = options.plan(
            default,
            target,
            end=self.vocab.end,
            selection=model.selection,
            attention=self._attention,
            ddi_adj=self._ddi_adj,
        )
        self.decoding, self.ddi = self.decoding_plan.decoding, self.decoding_plan.ddi
        policy = options.request.ddi
        if policy is not None and policy.active:  # asked: refused without pairs
            where = manifest.path if manifest is not None else "the model"
            require_pairs(model.ddi_pairs, where, f"the DDI policy {policy.label!r}")
        self.head = model.head if self.decoding.name == "marginal" else None
        if self.decoding.name == "marginal" and self.head is None:
            where = manifest.model_dir if manifest is not None else "the model"
            raise InputError(
                f"{where}: --decoding marginal reads a set head and this model has none "
                "(train one: cognet train --data DATA --teacher CKPT --out NEW, then "
                "cognet-export --checkpoint NEW --out MODEL)"
            )
        if self.head is not None:  # the graph the one pass runs: where it really ran
            self.providers = list(self.head.session.get_providers())
        self._pool = ThreadPoolExecutor(self.streams, "cognet-batch") if self.streams > 1 else None
        self._codes = pa.array(self.vocab.medications, pa.string())
        self._diag_codes = np.asarray(self.vocab.diagnoses, dtype=object)

    @classmethod
    def from_session(
        cls,
        encode: PlanEncoder,
        decoder,
        vocab: Vocab,
        dim: int,
        ddi_pairs: Sequence[Sequence[str]] = (),
        options: ScoreOptions | None = None,
    ) -> Scorer:
        """A scorer over any encoder (`encoder.PlanEncoder`; `encoder.HostEncoder` adapts a
        callable) and decoder session (`scoring_model.ScoringModel.decoder`): beam 4, max length 45,
        `options.streams` or one stream. `options.selection` auto selects on the device
        where the decoder has the search graphs (`search`: an `OrtModel`'s that selects
        there), else on the host."""
        options = options or ScoreOptions()
        pairs = tuple((str(a), str(b)) for a, b in ddi_pairs)
        graphs = member_sessions(decoder)[0].search is not None
        selection = options.selection
        if selection == "auto":
            selection = "device" if graphs else "host"
        if selection == "device" and not graphs:
            raise InputError("--selection device needs a decoder with the search graphs")
        model = ScoringModel(
            encode, decoder, vocab, dim, pairs, streams=options.streams or 1, selection=selection
        )
        return cls(model, options)

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def batch_size(self) -> int:
        return self.budgets.batch_size

    @property
    def chunk_targets(self) -> int:
        return self.budgets.chunk_targets

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
        cfg, budgets = self.decoding_plan.beam, self.budgets
        return {
            "decoding": self.decoding.to_json(),
            "beam": cfg.beam,
            "max_len": cfg.max_len,
            "batch_size": budgets.batch_size,
            "max_history_visits": self.options.max_history_visits,
            "compact_at": cfg.compact_at,
            "chunk_targets": budgets.chunk_targets,
            "chunk_rows": budgets.chunk_rows,
            "encode_batch": budgets.encode_batch,
            "ddi": cfg.ddi.to_json(),
        }

    def score_file(
        self,
        path: str | Path,
        *,
        sort: bool = False,
        score_all: bool = False,
        explain: bool = False,
    ) -> Iterator[ScoredChunk]:
        """Score a visits Parquet file, streamed by record batches (`sort`: in memory);
        score_all and explain as `score_batches` takes them."""
        source = reader.VisitFile(path, keep=self.options.keep_columns)
        batches = source.sorted_batches() if sort else source.batches()
        return self.score_batches(batches, score_all=score_all, explain=explain, source=path)

    def score_table(
        self, table: pa.Table, *, score_all: bool = False, explain: bool = False
    ) -> Iterator[ScoredChunk]:
        """Score an in-memory visits table (DESIGN.md §2 columns; other columns ignored, but
        those of options.keep_columns); score_all and explain as `score_batches` takes them."""
        reader.check_columns(table.schema, "<table>")
        cast = reader.cast_input(table, "<table>")
        cast = cast.append_column(reader.ROW, pa.array(np.arange(len(cast), dtype=np.int64)))
        kept = reader.kept_columns(table.schema, self.options.keep_columns, "<table>")
        return self.score_batches(
            [reader.keep(cast, table, kept)], score_all=score_all, explain=explain
        )

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
        options, budgets = self.options, self.budgets
        assembler = Assembler(
            self.vocab, score_all, options.max_history_visits, options.max_codes_per_visit
        )
        chunks = reader.chunks(
            batches, source, score_all, budgets.chunk_targets, budgets.chunk_rows
        )
        for chunk in chunks:
            if chunk.end <= skip_rows:
                assembler.keys(chunk.table)  # remember its visit_ids
                continue
            yield self._score_chunk(chunk, assembler, score_all, explain)

    def close(self) -> None:
        """Stop the parallel streams' threads and wait for them (once: closing again does
        nothing); a closed scorer decodes on the calling thread alone."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # -- one chunk: plan -> encode -> decode -> emit ------------------------------------------
    def _score_chunk(
        self, chunk: reader.Chunk, assembler: Assembler, score_all: bool, explain: bool
    ) -> ScoredChunk:
        started = time.perf_counter()
        plan = assembler.plan(chunk.table)
        if self.head is not None and not explain:  # one pass of the head, no decoder
            parts = self.head.batches(plan)
            results = list(self._map(lambda part: (self._head_sets(plan, part), None), parts))
        else:
            parts, results = self._encode_decode(plan, score_all, explain)
        # per target: (its batch's result, its place there, its batch's decoder-init inputs)
        slots: dict[int, tuple[BeamResult, int, dict]] = {}
        if explain or score_all:
            for part, (res, inputs) in zip(parts, results, strict=True):
                for k, i in enumerate(part.tolist()):
                    slots[i] = (res, k, inputs)
        diag_codes = self._diag_codes if explain else None
        out = emit.recommendations(
            plan, parts, [r for r, _ in results], slots, self._codes, diag_codes
        )
        metrics, evaluated = (None, 0)
        if score_all:
            metrics, evaluated = emit.patient_metrics(plan, slots, self._ddi_adj)
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
            codes_given=plan.codes_given,
            seconds=time.perf_counter() - started,
            patient_metrics=metrics,
            visits_evaluated=evaluated,
        )

    def _encode_decode(
        self, plan: Plan, score_all: bool, explain: bool
    ) -> tuple[list[np.ndarray], list[tuple[BeamResult | SetResult, dict]]]:
        """Encode the plan's visits, then decode its targets in batches: (the batches, as
        indices into plan.targets; each batch's result and decoder-init inputs)."""
        budgets = self.budgets
        enc = encode_plan(
            self.encode, plan, self.vocab, budgets.encode_cells, budgets.encode_batch, self._map
        )
        cuts = (budgets.batch_slots, budgets.batch_codes, budgets.batch_codes)
        parts = least_padded(plan.decode_orders(), cuts, budgets.batch_size)
        try:
            results = list(
                self._map(lambda part: self._decode(plan, enc, part, score_all, explain), parts)
            )
        finally:
            self.encode.release(enc)  # its buffers may serve the next chunk
        return parts, results

    def _head_sets(self, plan: Plan, part: np.ndarray) -> SetResult:
        """The marginal decoding's sets of the targets `part` (indices into plan.targets)."""
        return self.decoding_plan.read_sets(self.head.marginals(plan, part))

    def _decode(
        self, plan: Plan, enc, part: np.ndarray, score_all: bool, explain: bool
    ) -> tuple[BeamResult | SetResult, dict]:
        """One batch (`part`: indices into plan.targets): its decoder init from the
        encodings (gathered on the host, or where they are), then its decoding (the
        marginal decoding's: the head's sets, explained by the set decoding)."""
        targets, histories = plan.targets[part], plan.histories.take(part)
        memories, inputs = init_memories(self.decoder, plan, enc, targets, histories)
        ids = plan.table.column("visit_id").take(targets).to_pylist()
        marginals = None if self.head is None else self.head.marginals(plan, part)
        asked = self.decoding_plan.asking(prauc=score_all, explain=explain)
        return decode(self.decoder, memories, asked, ids, device_selectors, marginals), inputs

    def _map(self, func, items) -> Iterable:
        """func over items, on the parallel streams when there are several (in order)."""
        return map(func, items) if self._pool is None else self._pool.map(func, items)
