"""The model-directory format shared by `cognet-export` and the runtime (torch-free).

A model directory holds `manifest.json` and the ONNX graphs it names; nothing else is
needed to score. Graph I/O names and their order come from `cognet.core.graphspec`.

API (stable; the runtime codes against it):

- `load_manifest(model_dir, verify=True) -> Manifest`: read `model_dir/manifest.json`.
  Raises `cognet.core.errors.InputError` (one line naming the file) when the directory or the
  manifest is missing or malformed, when `format_version` is not `FORMAT_VERSION` (an
  ensemble's: `ENSEMBLE_FORMAT_VERSION`), when a field is not of the type and range of
  `cognet.core.file_schemas.MANIFEST` (one line naming the field), or - with `verify` - when a
  graph file (of the main graphs and of every variant) is missing or its sha256 differs from
  the manifest's.
- `write_manifest(model_dir, manifest) -> Path`: check against the schema, then write
  `manifest.json` atomically.
- `file_sha256(path) -> str`: the hex sha256 of a file, as stored in the manifest.
- `Manifest` (frozen dataclass) and its parts `Dims`, `Special`, `TensorSpec`, `GraphSpec`:
    - `manifest.graph_spec(name, variant=None, member=0) -> GraphSpec` and
      `manifest.graph_path(name, variant=None, member=0) -> Path` for `name` in `GRAPHS`
      ("encoder", "decoder_init", "decoder_step"), `variant` None (float32) or a key of
      `manifest.variants` ("fp16", "int8") and `member` in range(`manifest.members`);
      InputError naming the variants there when the model has no such variant;
    - `manifest.vocabulary() -> cognet.core.vocab.Vocab`;
    - `manifest.to_json()` / `Manifest.from_json(obj, model_dir=None)`.

`manifest.json` fields: `format_version`, `opset`, `dims` (dim, heads, head_dim, n_diag, n_proc,
n_med, out_size), `special` (end, start, med_pad, diag_pad, proc_pad), `vocab`
(`Vocab.to_json()`), `max_len`, `beam`, `ablation`, `ddi_pairs` (medication code pairs),
`graphs` ({name: {file, sha256, inputs, outputs}}, every tensor as {name, dtype, shape} with
symbolic axis names such as "N", "B", "T", "T+1" and integers for fixed axes; besides `GRAPHS`,
optionally all three `graphspec.ENCODER_PARTS`, float32, absent in models exported before them),
`variants` ({variant: {name: graph}}: "fp16", whose float tensors are float16, and "int8", whose
MatMul weights are int8, for the CPU, with the float32 graphs' inputs and outputs),
`checkpoint_sha256`, `versions` (torch, onnx, onnxruntime, cognet), `parity` (the exporter's
validation report, or null when validation was skipped), `tensorrt` (null, or the engine cache
folder and min/opt/max shape profiles of `cognet-export --tensorrt`) and `decoding` (the model's
default decoding, `cognet.core.decoding.Decoding`; null: beam) and `search` ({name: graph} of
the search graphs, `cognet.export.search_graphs`; absent in models exported before them) and
`ddi_target` (null, or the DDI policy, set rule and threshold chosen on validation for a
DDI-rate target, `cognet.core.ddi.DDITarget`: the model's default policy,
`Manifest.default_target`) and, for an ensemble (`cognet.core.decoding.ensemble`), `members`
(absent: 1) and `member_graphs` ([{graphs, variants}] of members 1.., with member 0's variants;
member 0's are `graphs` and `variants`; the search graphs serve them all) and `head` (absent:
none; the set head's float32 graph, `cognet.core.head_inputs`, read by the marginal decoding).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cognet.core import strict_json
from cognet.core.ddi import DDITarget
from cognet.core.decoding import Decoding
from cognet.core.errors import InputError, one_line
from cognet.core.file_schemas import (  # noqa: F401 - LIMIT, MAX_BEAM, MAX_STEPS: part of this API
    GRAPHS,
    LIMIT,
    MANIFEST,
    MAX_BEAM,
    MAX_STEPS,
    VARIANTS,
)
from cognet.core.files import confined, write_text
from cognet.core.graphspec import ENCODER_PARTS
from cognet.core.json_schema import checked
from cognet.core.manifest_graphs import (  # noqa: F401 - DTYPES and TensorSpec: part of this API
    DTYPES,
    GraphSpec,
    MemberGraphs,
    TensorSpec,
    specs_from_json,
    specs_json,
)
from cognet.core.vocab import Vocab

FORMAT_VERSION = 1
ENSEMBLE_FORMAT_VERSION = 2  # older runtimes refuse it rather than serve member 0 alone
MANIFEST_FILE = "manifest.json"
# what a manifest that does not fit its schema (`cognet.core.file_schemas.MANIFEST`) needs
REEXPORT = " (malformed manifest: re-export the model with cognet-export)"


@dataclass(frozen=True)
class Dims:
    dim: int  # s
    heads: int  # H
    head_dim: int  # dh = s / H
    n_diag: int
    n_proc: int
    n_med: int  # M
    out_size: int  # V1 = M + 1 (medications + END)


@dataclass(frozen=True)
class Special:
    end: int  # M
    start: int  # M + 1
    med_pad: int  # M + 2
    diag_pad: int  # n_diag
    proc_pad: int  # n_proc


@dataclass(frozen=True)
class Manifest:
    opset: int
    dims: Dims
    special: Special
    vocab: dict  # Vocab.to_json()
    max_len: int
    beam: int
    ablation: str
    ddi_pairs: tuple[tuple[str, str], ...]
    graphs: dict[str, GraphSpec]
    checkpoint_sha256: str
    versions: dict[str, str]
    parity: dict | None = None
    variants: dict[str, dict[str, GraphSpec]] = field(default_factory=dict)
    tensorrt: dict | None = None  # engine cache dir and shape profiles, when built
    # the model's default decoding (`cognet.core.decoding.Decoding.to_json`); None: a model
    # exported before set decoding, decoded with the paper's beam search
    decoding: dict | None = None
    # the search graphs (`cognet.export.search_graphs`: candidate selection on the device and
    # row gathers); empty for a model exported before them (the runtime selects on the host)
    search: dict[str, GraphSpec] = field(default_factory=dict)
    # the DDI target's policy, rule and threshold (`cognet.core.ddi.DDITarget.to_json`); None: none
    ddi_target: dict | None = None
    # an ensemble's network count and the graphs of members 1.. (`check_manifest` checks them)
    members: int = 1
    member_graphs: tuple[MemberGraphs, ...] = ()
    # the set head's graph (`cognet.core.head_inputs`); None: the model has no head
    head: GraphSpec | None = None
    format_version: int = FORMAT_VERSION
    # Where the manifest was loaded from (not serialised); graph paths are relative to it.
    model_dir: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for member in (self, *self.member_graphs):
            missing = [g for g in GRAPHS if g not in member.graphs]
            if missing:
                raise ValueError(f"manifest lacks graphs {missing}")
            parts = [g for g in ENCODER_PARTS if g in member.graphs]
            if parts and len(parts) != len(ENCODER_PARTS):
                raise ValueError(f"manifest has encoder parts {parts}, not all of {ENCODER_PARTS}")
            for name, graphs in member.variants.items():
                if sorted(graphs) != sorted(GRAPHS):
                    raise ValueError(f"variant {name!r} must hold the graphs {GRAPHS}")

    def graph_spec(self, name: str, variant: str | None = None, member: int = 0) -> GraphSpec:
        # member 0's graphs are the manifest's own: a one-network model has no other
        graphs = self if member == 0 else self.member_graphs[member - 1]
        if variant is None:
            return graphs.graphs[name]
        if variant not in self.variants:
            how = f"; re-export the model with cognet-export --{variant}"
            raise InputError(
                f"{self._file()}: no {variant!r} variant "
                f"(available: {', '.join(sorted(self.variants)) or 'none'})"
                f"{how if variant in VARIANTS else ''}"
            )
        return graphs.variants[variant][name]

    def graph_path(self, name: str, variant: str | None = None, member: int = 0) -> Path:
        return Path(self.model_dir or ".") / self.graph_spec(name, variant, member).file

    @property
    def encoder_parts(self) -> bool:
        """Whether every member has the encoder cut by kind of code (`ENCODER_PARTS`)."""
        return all(ENCODER_PARTS.keys() <= m.graphs.keys() for m in (self, *self.member_graphs))

    def default_decoding(self) -> Decoding:
        """The decoding this model was tuned for (beam for a model without one)."""
        try:
            return Decoding.from_json(self.decoding or {"beam": self.beam, "max_len": self.max_len})
        except (TypeError, ValueError) as exc:
            raise InputError(f"{self._file()}: malformed decoding ({one_line(exc)})") from None

    def default_target(self) -> DDITarget | None:
        """The DDI target stored with the model (`cognet train --ddi-target`), or None."""
        try:
            return DDITarget.from_json(self.ddi_target)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{self._file()}: malformed ddi_target ({one_line(exc)})") from None

    def vocabulary(self) -> Vocab:
        return Vocab.from_json(self.vocab)

    @property
    def path(self) -> Path:
        """The manifest's file (`manifest.json` in `model_dir`), for messages."""
        return self._file()

    def _file(self) -> Path:
        return Path(self.model_dir or ".") / MANIFEST_FILE

    def to_json(self) -> dict[str, Any]:
        out = {
            "format_version": ENSEMBLE_FORMAT_VERSION if self._members_json() else FORMAT_VERSION,
            "opset": self.opset,
            "dims": vars(self.dims).copy(),
            "special": vars(self.special).copy(),
            "vocab": self.vocab,
            "max_len": self.max_len,
            "beam": self.beam,
            "ablation": self.ablation,
            "ddi_pairs": [list(p) for p in self.ddi_pairs],
            "graphs": specs_json(self.graphs),
            "variants": {v: specs_json(gs) for v, gs in self.variants.items()},
            "checkpoint_sha256": self.checkpoint_sha256,
            "versions": dict(self.versions),
            "parity": self.parity,
            "tensorrt": self.tensorrt,
            "decoding": self.decoding,
            "search": specs_json(self.search),
            "ddi_target": self.ddi_target,
        }
        return out | self._members_json() | self._head_json()

    def _head_json(self) -> dict[str, Any]:
        """The head's entry; none without a head (its manifest is as before heads)."""
        return {} if self.head is None else {"head": self.head.to_json()}

    def _members_json(self) -> dict[str, Any]:
        """The ensemble's fields; none for one network (its manifest is as before them)."""
        if self.members == 1 and not self.member_graphs:
            return {}
        return {"members": self.members, "member_graphs": [m.to_json() for m in self.member_graphs]}

    @classmethod
    def from_json(cls, obj: dict, model_dir: str | Path | None = None) -> Manifest:
        """Parse a manifest; raises ValueError/KeyError/TypeError on malformed content."""
        return cls(
            format_version=int(obj["format_version"]),
            opset=int(obj["opset"]),
            dims=Dims(**obj["dims"]),
            special=Special(**obj["special"]),
            vocab=obj["vocab"],
            max_len=int(obj["max_len"]),
            beam=int(obj["beam"]),
            ablation=str(obj["ablation"]),
            ddi_pairs=tuple((str(a), str(b)) for a, b in obj["ddi_pairs"]),
            graphs=specs_from_json(obj["graphs"]),
            variants={v: specs_from_json(gs) for v, gs in obj.get("variants", {}).items()},
            checkpoint_sha256=str(obj["checkpoint_sha256"]),
            versions=dict(obj.get("versions", {})),
            parity=obj.get("parity"),
            tensorrt=obj.get("tensorrt"),
            decoding=obj.get("decoding"),
            search=specs_from_json(obj.get("search", {})),
            ddi_target=obj.get("ddi_target"),
            members=obj.get("members", 1),  # as read: `check_manifest` checks it
            member_graphs=tuple(MemberGraphs.from_json(m) for m in obj.get("member_graphs", [])),
            head=GraphSpec.from_json(obj["head"]) if "head" in obj else None,
            model_dir=None if model_dir is None else Path(model_dir),
        )


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_manifest(model_dir: str | Path, verify: bool = True) -> Manifest:
    """Read and check a model directory's manifest (see the module docstring)."""
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST_FILE
    if not path.is_file():
        raise InputError(f"{path}: not a cognet model directory (missing {MANIFEST_FILE})")
    try:
        obj = strict_json.loads(path.read_text())  # NaN and Infinity are refused
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{path}: unreadable manifest ({one_line(exc)})") from None
    found = obj.get("format_version") if isinstance(obj, dict) else None
    ensemble = isinstance(obj, dict) and "members" in obj
    expected = ENSEMBLE_FORMAT_VERSION if ensemble else FORMAT_VERSION
    if found != expected or isinstance(found, bool):
        what = f"{expected} for an ensemble" if ensemble else expected
        raise InputError(
            f"{path}: unsupported model format version {found!r} (expected {what}); "
            "re-export the model with cognet-export"
        )
    checked(obj, MANIFEST, path, REEXPORT)  # every field's type and range, before any is read
    try:
        manifest = Manifest.from_json(obj, model_dir)
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: malformed manifest ({one_line(exc)})") from None
    check_manifest(manifest)
    if verify:
        verify_graphs(manifest)
    return manifest


def check_manifest(manifest: Manifest) -> None:
    """InputError naming manifest.json and the field, before any graph is opened, unless
    every field has the type and range of its schema (`cognet.core.file_schemas.MANIFEST`) and
    they agree with each other: heads x head_dim = dim, out_size = n_med + 1, the special
    ids, the vocabulary's sizes, the members and their graphs, the default decoding and DDI
    target (`Decoding`'s and `DDITarget`'s ranges), every file a plain name inside the
    model directory (`cognet.core.files.confined`). The exporter runs it before writing, so
    it never writes a model that the runtime refuses."""
    file = manifest._file()
    folder = Path(manifest.model_dir or ".")
    checked(manifest.to_json(), MANIFEST, file, REEXPORT)

    def bad(field_name: str, why: str) -> InputError:
        return InputError(f"{file}: field {field_name!r}: {why}")

    d, s = manifest.dims, manifest.special
    if d.heads * d.head_dim != d.dim:
        raise bad("dims.head_dim", f"heads {d.heads} x head_dim {d.head_dim} != dim {d.dim}")
    if d.out_size != d.n_med + 1:
        raise bad("dims.out_size", f"{d.out_size}, expected n_med + 1 = {d.n_med + 1}")
    want = {
        "end": d.n_med,
        "start": d.n_med + 1,
        "med_pad": d.n_med + 2,
        "diag_pad": d.n_diag,
        "proc_pad": d.n_proc,
    }
    for key, value in want.items():
        if getattr(s, key) != value:
            raise bad(f"special.{key}", f"{getattr(s, key)}, the dims need {value}")
    try:
        vocab = manifest.vocabulary()
    except (KeyError, TypeError, ValueError) as exc:
        raise bad("vocab", one_line(exc)) from None
    for key, size in (("n_diag", vocab.n_diag), ("n_proc", vocab.n_proc), ("n_med", vocab.n_med)):
        if getattr(d, key) != size:
            raise bad(f"dims.{key}", f"{getattr(d, key)}, but the vocabulary has {size} codes")
    _check_members(manifest, bad)
    if manifest.head is not None:
        shapes = [tuple(t.shape) for t in manifest.head.outputs]
        if shapes != [("N", d.n_med)]:
            raise bad("head.outputs", f"shapes {shapes}, the dims need [('N', {d.n_med})]")
    manifest.default_decoding()  # an InputError naming the decoding field
    manifest.default_target()  # and the ddi_target field
    groups = [("graphs", manifest.graphs), ("search", manifest.search)]
    if manifest.head is not None:
        groups.append(("", {"head": manifest.head}))
    groups += [(f"variants.{v}", gs) for v, gs in manifest.variants.items()]
    for i, member in enumerate(manifest.member_graphs, 1):
        groups += [(f"member_graphs.{i}.graphs", member.graphs)]
        groups += [(f"member_graphs.{i}.variants.{v}", gs) for v, gs in member.variants.items()]
    for group, specs in groups:
        for name, spec in specs.items():
            where = f"{group}.{name}" if group else name
            confined(folder, spec.file, f"{file}: field '{where}.file'")
    if manifest.tensorrt is not None:
        cache = manifest.tensorrt["cache_dir"]
        confined(folder, cache, f"{file}: field 'tensorrt.cache_dir'")


def _check_members(manifest: Manifest, bad) -> None:
    """The graphs of every member but the first in `member_graphs`, each with member 0's
    variants."""
    count, n = manifest.members, len(manifest.member_graphs)
    if n != count - 1:
        raise bad("member_graphs", f"{n} entries, but {count} members need {count - 1}")
    for i, member in enumerate(manifest.member_graphs, 1):
        have, want = sorted(member.variants), sorted(manifest.variants)
        if have != want:
            raise bad(f"member_graphs.{i}.variants", f"{have}, but member 0 has {want}")


def verify_graphs(manifest: Manifest) -> None:
    """Check that every graph file (all members and variants) exists and matches its sha256."""
    specs = []
    for member in (manifest, *manifest.member_graphs):
        specs += list(member.graphs.values())  # GRAPHS and the encoder parts
        specs += [gs[g] for gs in member.variants.values() for g in GRAPHS]
    specs += list(manifest.search.values())
    specs += [] if manifest.head is None else [manifest.head]
    for spec in specs:
        folder = Path(manifest.model_dir or ".")
        path = confined(folder, spec.file, f"{manifest._file()}: graph file")
        if not path.is_file():
            raise InputError(f"{path}: graph file missing (named in {MANIFEST_FILE})")
        if file_sha256(path) != spec.sha256:
            raise InputError(
                f"{path}: sha256 does not match {MANIFEST_FILE} "
                "(file corrupted or modified); re-export the model"
            )


def write_manifest(model_dir: str | Path, manifest: Manifest) -> Path:
    """Write `model_dir/manifest.json` atomically; returns its path. What it writes is
    checked against the schema first (`cognet.core.file_schemas.MANIFEST`): an InputError, and
    nothing written, where the runtime would refuse a field."""
    obj = manifest.to_json()
    checked(obj, MANIFEST, Path(model_dir) / MANIFEST_FILE, REEXPORT)
    text = strict_json.dumps(obj, indent=1) + "\n"
    return write_text(Path(model_dir) / MANIFEST_FILE, text)
