"""The export pipeline: a checkpoint -> a model directory (`cognet.export.export`).

Writes the three graphs (`onnx_export`), their float16 and int8 variants (`fp16`, `int8`),
the float32 graphs' linear layers as Gemms (`linear_fusion`), the encoder cut into one graph
per kind of code (`encoder_diag.onnx`, `encoder_proc.onnx`, `encoder_med.onnx`: the
runtime's CPU encoding pads each kind alone),
checks their parity with the torch model (`validate`), optionally builds TensorRT engines
(`tensorrt`), and writes `manifest.json` last (`cognet.core.manifest`): a directory whose
parity failed holds `parity_report.json` and no manifest, so no runtime loads it.

An ensemble checkpoint (`cognet.model.ensemble`) gives one model directory: each member's
graphs, member 0's under the one-network names (`encoder.onnx`, ...), member i's with a
`.member<i>` suffix (`encoder.member1.onnx`, `encoder.member1.fp16.onnx`, ...), plain names
that the manifest's file checks accept (`cognet.core.files.confined`); the search graphs
are shared.

A checkpoint with a set head (`cognet.model.set_head`) also gives `head.onnx` (float32 only),
checked against the torch head by `validate` and listed under the manifest's `head`; one
without writes exactly what it wrote before heads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from cognet.core import progress as bars
from cognet.core import strict_json
from cognet.core.ddi import ddi_matrix
from cognet.core.decoding import BEAM, MAX_LEN, Decoding
from cognet.core.decoding.ensemble import MAX_MEMBERS
from cognet.core.errors import InputError, ParityError, one_line, writing
from cognet.core.files import remove, write_text
from cognet.core.graphspec import ENCODER_PARTS
from cognet.core.manifest import (
    GRAPHS,
    VARIANTS,
    Dims,
    Manifest,
    MemberGraphs,
    Special,
    check_manifest,
    write_manifest,
)
from cognet.export.graphs import tensor_specs
from cognet.export.onnx_export import (
    OPSET,
    export_graph,
    export_head,
    fuse_linear_layers,
    graph_spec,
    write_encoder_parts,
    write_fp16,
    write_int8,
)
from cognet.export.search_graphs import SEARCH_FILES, write_search_graphs
from cognet.export.tensorrt import build_engines, require_tensorrt
from cognet.model import checkpoint as ckpt
from cognet.model.ensemble import members_of

log = logging.getLogger(__name__)


def graph_files(member: int = 0, variant: str | None = None, names=GRAPHS) -> dict[str, str]:
    """{graph: file name} of one member's graphs of a variant (None: float32)."""
    suffix = (f".member{member}" if member else "") + (f".{variant}" if variant else "")
    return {name: f"{name}{suffix}.onnx" for name in names}


def part_files(member: int = 0) -> dict[str, str]:
    """{part: file name} of one member's encoder parts (float32 only)."""
    return graph_files(member, names=ENCODER_PARTS)


GRAPH_FILES = graph_files()
FP16_FILES = graph_files(variant="fp16")
INT8_FILES = graph_files(variant="int8")
PART_FILES = part_files()
HEAD_GRAPH_FILE = "head.onnx"
REPORT_FILE = "parity_report.json"
# every file an export writes but the manifest and the report (TensorRT's are in CACHE_DIR)
MODEL_FILES = (
    *(
        file
        for member in range(MAX_MEMBERS)
        for variant in (None, *VARIANTS)
        for file in graph_files(member, variant).values()
    ),
    *(file for member in range(MAX_MEMBERS) for file in part_files(member).values()),
    *SEARCH_FILES.values(),
    HEAD_GRAPH_FILE,
)


@dataclass(frozen=True)
class ExportOptions:
    """What an export writes and checks beside the float32 graphs and the manifest.

    `validate`: check the graphs' parity with the torch model, on `n_patients` random
    patients; `fp16` / `int8`: also write the float16 / int8 (CPU) variants of the three
    graphs; `tensorrt`: build TensorRT engines."""

    validate: bool = True
    fp16: bool = False
    int8: bool = False
    tensorrt: bool = False
    n_patients: int = 64


def export(
    checkpoint: str | Path,
    out: str | Path,
    options: ExportOptions = ExportOptions(),
    progress=None,
) -> Manifest:
    """Export `checkpoint` to the model directory `out` as `options` say; returns its
    manifest.

    Raises InputError for an unreadable checkpoint, TensorRTUnavailable, and
    cognet.core.errors.ParityError when validation fails (the report is then in
    `out/parity_report.json`). `progress`: a bar factory (`cognet.core.progress.progress`)
    for the graphs written and the parity checks run.
    """

    if options.tensorrt:
        require_tensorrt()
    model, vocab, config = _load_checkpoint(Path(checkpoint))
    out = Path(out)
    created = not out.exists()
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    # the manifest goes first (the directory is not servable until the end), then every
    # file a previous export may have left
    for stale in ("manifest.json", REPORT_FILE, *MODEL_FILES):
        (out / stale).unlink(missing_ok=True)
    try:
        return _export(model, vocab, config, checkpoint, out, options, progress or _no_bar)
    except ParityError:  # the graphs and the report stay, for a look; no manifest
        raise
    except BaseException:  # a full disk, an interrupt: no partial model left
        for name in MODEL_FILES:
            remove(out / name)
        if created:
            remove(out)
        raise


def _no_bar(**_):
    return bars.progress(quiet=True)


def _export(model, vocab, config, checkpoint, out: Path, options: ExportOptions, progress):
    """`export` once the checkpoint is loaded and OUT is ready."""
    fp16, int8 = options.fp16, options.int8
    head = ckpt.load_head(checkpoint, config)  # a damaged head fails before any graph is written
    # each member's graphs and variants, and their paths ({variant: {graph: path}})
    nets = members_of(model)
    exported = []
    with progress(total=len(nets), desc="writing graphs", unit="network") as bar:
        for i, net in enumerate(nets):
            exported.append(_export_member(net, i, out, fp16, int8))
            bar.update(1)
    paths = [p for _, p in exported]
    head_graph = None
    if head is not None:
        log.info("exporting the set head")
        head_graph = export_head(head, out / HEAD_GRAPH_FILE)

    parity = None
    if options.validate:
        # onnxruntime (the [cpu] or [gpu] extra, not [train]): lazy, so that an export
        # without validation runs without it
        from cognet.export.validate import Exported, check, parity_steps
        from cognet.export.validate import validate as run_validation

        checked = Exported(
            model,
            vocab,
            [p[None] for p in paths],
            fp16_paths=[p["fp16"] for p in paths] if fp16 else None,
            int8_paths=[p["int8"] for p in paths] if int8 else None,
            sets=Decoding.from_json(config.get("decoding")),  # the model's own decoding
            head=None if head is None else (head, out / HEAD_GRAPH_FILE),
        )
        steps = parity_steps(checked)
        with progress(total=steps, desc="parity check", unit="check") as bar:
            parity = run_validation(
                checked,
                n_patients=options.n_patients,
                log=log.info,
                step=lambda: bar.update(1),
            )
        # the operators TensorRT may meet (onnx_ops_allowlist.txt); the int8 graphs are CPU-only
        floats = [f for p in paths for v in (None, "fp16") for f in p.get(v, {}).values()]
        floats += [] if head is None else [out / HEAD_GRAPH_FILE]
        parity["ops"] = sorted(_ops(floats))
        if not parity["passed"]:
            report = out / REPORT_FILE
            write_text(report, strict_json.dumps(parity, indent=1) + "\n")
            check(parity, report)

    cfg = model.cfg
    pairs = tuple((str(a), str(b)) for a, b in config.get("ddi_pairs", []))
    # the adjacency the runtime builds from the manifest's pairs (`Scorer`), as a constant
    search = write_search_graphs(
        out, cfg.out_size, ddi_matrix(vocab, pairs), OPSET, members=len(exported)
    )
    manifest = Manifest(
        opset=OPSET,
        dims=Dims(
            cfg.dim, cfg.heads, cfg.head_dim, cfg.n_diag, cfg.n_proc, cfg.n_med, cfg.out_size
        ),
        special=Special(vocab.end, vocab.start, vocab.med_pad, vocab.diag_pad, vocab.proc_pad),
        vocab=vocab.to_json(),
        max_len=MAX_LEN,
        beam=BEAM,
        ablation=cfg.ablation,
        ddi_pairs=pairs,
        graphs=exported[0][0].graphs,
        variants=exported[0][0].variants,
        checkpoint_sha256=ckpt.checkpoint_hash(checkpoint),
        versions=_versions(),
        parity=parity,
        decoding=config.get("decoding"),  # the checkpoint's tuned default, when it has one
        search=search,
        ddi_target=config.get("ddi_target"),  # its DDI target's policy and threshold, if any
        members=len(exported),
        member_graphs=tuple(graphs for graphs, _ in exported[1:]),
        head=head_graph,
        model_dir=out,
    )
    if options.tensorrt:
        manifest = build_engines(manifest, fp16=fp16)
    check_manifest(manifest)  # the runtime's checks: never write a model it would refuse
    write_manifest(out, manifest)
    return manifest


def _export_member(
    net, member: int, out: Path, fp16: bool, int8: bool
) -> tuple[MemberGraphs, dict[str | None, dict[str, Path]]]:
    """One network's three graphs (member `member` of its model), its encoder cut by kind of
    code (`write_encoder_parts`) and the variants asked:
    their manifest entries, and their paths by variant (None: float32)."""
    import torch

    specs = tensor_specs(net)
    paths = {None: {name: out / file for name, file in graph_files(member).items()}}
    with torch.no_grad():
        for name in GRAPHS:
            log.info("exporting %s%s", name, f" of member {member}" if member else "")
            export_graph(net, name, paths[None][name])
    variants = {}
    for variant, wanted, write in (("fp16", fp16, write_fp16), ("int8", int8, write_int8)):
        if wanted:
            log.info("writing the %s graphs", variant)
            files = graph_files(member, variant)
            paths[variant] = {name: out / file for name, file in files.items()}
            variants[variant] = {
                name: write(paths[None][name], paths[variant][name], name, specs) for name in GRAPHS
            }
    # the float32 graphs' linear layers as Gemms, after the variants: int8 quantizes MatMuls
    for name in GRAPHS:
        fuse_linear_layers(paths[None][name], name, specs)
    graphs = {name: graph_spec(paths[None][name], name, specs) for name in GRAPHS}
    parts = {name: out / file for name, file in part_files(member).items()}
    graphs |= write_encoder_parts(paths[None]["encoder"], parts, specs)
    return MemberGraphs(graphs, variants), paths


def _load_checkpoint(path: Path):
    from safetensors import SafetensorError

    try:
        return ckpt.load(path)
    except InputError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        raise InputError(f"{path}: cannot load checkpoint ({one_line(exc)[:200]})") from None


def _ops(paths) -> set[str]:
    import onnx

    return {node.op_type for p in paths for node in onnx.load(str(p)).graph.node}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "onnx", "onnxruntime", "cognet"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out
