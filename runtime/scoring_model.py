"""What a `Scorer` runs: the encoder and decoder of a model and what the model says about
itself (`ScoringModel`); `open_model` opens one from a model directory with ONNX Runtime
(`session.OrtModel`), `Scorer.from_session` makes one from any encoder and decoder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cognet.core.decoding import BEAM, MAX_LEN
from cognet.core.manifest import Manifest, load_manifest
from cognet.core.vocab import Vocab
from cognet.runtime.encoder import PlanEncoder
from cognet.runtime.options import GPU_DEVICES, ScoreOptions
from cognet.runtime.session import OrtModel, default_threads


@dataclass(frozen=True)
class ScoringModel:
    """An encoder (`encoder.PlanEncoder`), a decoder session (`cognet.core.decoding.driver`'s
    `DecoderSession`: `session.HostDecoder` and `DeviceDecoder`; for an ensemble,
    `encoder.EnsembleEncoder` and an `EnsembleSession` over such decoders), where candidate
    selection runs, and what the model says about itself."""

    encode: PlanEncoder
    decoder: Any
    vocab: Vocab
    dim: int
    ddi_pairs: tuple[tuple[str, str], ...] = ()
    beam: int = BEAM  # the model's beam width, used unless the options name one
    max_len: int = MAX_LEN
    attention: bool = True  # diagnosis attention means something (not `no-diagnoses`)
    on_device: bool = False  # memories and caches live on a GPU
    # where candidate selection runs: host, or device (the search graphs of `decoder.search`)
    selection: str = "host"
    providers: tuple[str, ...] = ("custom",)
    threads: int | None = None  # intra-op threads of each stream's sessions
    streams: int = 1  # batches decoded in parallel
    manifest: Manifest | None = None
    head: Any = None  # the set head's `head.HeadSession` (`--decoding marginal`), if any


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
        selection=model.selection,
        providers=tuple(model.providers),
        threads=model.threads,
        streams=streams,
        manifest=manifest,
        head=model.head,
    )
