"""The JSON schemas of a checkpoint and a model directory (torch-free), in the language of
`cognet.core.json_schema`: each field's type and range declared once, checked when the file is
read (`cognet.model.checkpoint.load`, `cognet.core.manifest.load_manifest`) and before a
manifest is written (`cognet.core.manifest.write_manifest`).

- `VOCAB`: vocab.json, and a manifest's `vocab` (`cognet.core.vocab.Vocab.to_json`).
- `MODEL`: config.json's `model` (`cognet.model.network.ModelConfig`).
- `TRAIN`: config.json's `train`, the run's record: the fields that are read (`cognet
  ensemble` compares and tunes with them) are checked, the rest is kept as written.
- `CONFIG`: a checkpoint's config.json.
- `MANIFEST`: a model directory's manifest.json (`cognet.core.manifest`).

Unknown fields are refused (`FILE: field 'F': unknown field`), except inside the free
records that are never read: `train` (besides its declared fields), `parity` (the
exporter's report), a run's `weights`. Files written by earlier versions hold no field this
version lacks (fields have only ever been added); a newer version's new field is refused
rather than ignored, since it may change what the file means. The stored decoding and DDI
target are `Record`s: their keys are checked here, their values by `Decoding` and
`DDITarget`, which declare them.
"""

from __future__ import annotations

from cognet.core.ddi import DDIPolicy, DDITarget
from cognet.core.decoding import DECODINGS, Decoding
from cognet.core.decoding.defaults import LIMITS
from cognet.core.decoding.ensemble import MAX_MEMBERS
from cognet.core.graphspec import ENCODER_PARTS
from cognet.core.json_schema import (
    ANY,
    SHA256,
    AnyOf,
    Bool,
    Int,
    ListOf,
    MapOf,
    Nullable,
    Number,
    Obj,
    OneOf,
    Record,
    Str,
)
from cognet.core.manifest_graphs import DTYPES

LIMIT = 10_000_000  # above any size, id or opset a model has
MAX_BEAM = LIMITS["beam"]
MAX_STEPS = LIMITS["max_len"]
GRAPHS = ("encoder", "decoder_init", "decoder_step")
VARIANTS = ("fp16", "int8")  # the variants cognet-export writes (--fp16, --int8)
ABLATIONS = ("none", "no-copy", "no-visit-score", "no-graph", "no-diagnoses", "no-procedures")

SIZE = Int(1, LIMIT)
COUNT = Int(0, LIMIT)
SEED = Int(-(2**63), 2**63 - 1)
SHARE = Number(0, 1, hi_open=True)  # a dropout
CODES = ListOf(Str(), unique=True)  # a vocabulary's codes: ids are their positions
PAIRS = ListOf(ListOf(Str(), length=2))  # DDI pairs [code, code]
MEMBERS = Int(1, MAX_MEMBERS)

VOCAB = Obj(
    {
        "format_version": OneOf((1,)),
        "diagnoses": CODES,
        "procedures": CODES,
        "medications": CODES,
        "med_frequency": ListOf(COUNT),
        "special": MapOf(COUNT, keys=("END", "START", "PAD", "DIAG_PAD", "PROC_PAD")),
    },
    required=("format_version", "diagnoses", "procedures", "medications", "med_frequency"),
)

# ModelConfig's fields (a test holds them to the dataclass's)
MODEL_FIELDS = {
    "n_diag": SIZE,
    "n_proc": SIZE,
    "n_med": SIZE,
    "dim": SIZE,
    "heads": SIZE,
    "ffn": SIZE,
    "dropout": SHARE,
    "dec_ffn": Nullable(SIZE),
    "emb_dropout": SHARE,
    "attn_dropout": SHARE,
    "shared_gcn": Bool(),
    "ablation": OneOf(ABLATIONS),
    "lambda_init": Number(),
}
MODEL = Obj(
    {"format_version": OneOf((1,)), **MODEL_FIELDS},
    required=("format_version", "n_diag", "n_proc", "n_med"),
)

WEIGHTS = Obj({"epochs": ListOf(SIZE), "val_nll": Number()}, extra=True)
RUN = {"seed": SEED, "best_epoch": COUNT, "weights": WEIGHTS, "epochs_run": COUNT}
# how the set head is trained (`cognet.training.set_head.HeadRecipe`), read by `cognet ensemble`
HEAD_RECIPE = Obj(
    {
        "hidden": SIZE,
        "dropout": SHARE,
        "mix": Number(0, 1),
        "epochs": SIZE,
        "patience": SIZE,
        "lr": Number(0, lo_open=True),
        "batch_size": SIZE,
    },
    required=("hidden", "dropout", "mix", "epochs", "patience", "lr", "batch_size"),
)
TRAIN = Obj(
    {
        **RUN,
        "epochs": SIZE,
        "lr": Number(0, lo_open=True),
        "batch_size": SIZE,
        "patience": Nullable(SIZE),
        "weight_decay": Number(0),
        "grad_clip": Nullable(Number(0)),
        "lr_decay": Number(0, 1, lo_open=True),
        "aux_loss": Number(0),
        "scheduled_sampling": Number(0, 1),
        "history_dropout": SHARE,
        "ddi_loss": Number(0),
        "ddi_loss_target": Nullable(Number(0, 1)),
        "teacher": Nullable(Str()),
        "distill_weight": Number(0, 1),
        "distill_samples": Int(1, LIMITS["samples"]),
        "distill_temperature": Number(0, 10, lo_open=True),
        "model": Obj(MODEL_FIELDS, required=("n_diag", "n_proc", "n_med")),
        "max_history": Nullable(SIZE),
        "device": Str(),
        "val_max_patients": Nullable(SIZE),
        "select": OneOf(("nll", "jaccard")),
        "average": ListOf(SIZE),
        "decoding": OneOf(DECODINGS),
        "set_samples": Int(1, LIMITS["samples"]),
        "recipe": Str(),
        "ddi_target": Nullable(Number(0, 1)),
        "members": MEMBERS,
        "head": Nullable(HEAD_RECIPE),
        "member_runs": ListOf(Obj(RUN, extra=True)),
        "data": Str(empty=True),
        "unknown_codes_val": COUNT,
    },
    extra=True,  # the record of a run: what is not declared above is never read
)

DECODING = Nullable(Record(Decoding))
# the set head (`cognet.model.set_head.HeadConfig`) and its training record (never read)
HEAD_CONFIG = Obj(
    {
        "format_version": OneOf((1,)),
        "n_diag": SIZE,
        "n_proc": SIZE,
        "n_med": SIZE,
        "hidden": SIZE,
        "dropout": SHARE,
    },
    required=("format_version", "n_diag", "n_proc", "n_med", "hidden", "dropout"),
)
HEAD = Obj({"config": HEAD_CONFIG, "training": MapOf(ANY)}, required=("config",))
HEAD_FILE = "head.safetensors"
DDI_TARGET = Nullable(Record(DDITarget, {"policy": Record(DDIPolicy)}))

CONFIG = Obj(
    {
        "format_version": OneOf((1,)),
        "model": MODEL,
        "train": TRAIN,
        "ddi_pairs": PAIRS,
        "sha256": Obj(
            {name: SHA256 for name in ("vocab.json", "model.safetensors", "graphs.npz", HEAD_FILE)},
            required=("vocab.json", "model.safetensors", "graphs.npz"),
        ),
        "members": MEMBERS,
        "decoding": DECODING,
        "ddi_target": DDI_TARGET,
        "head": HEAD,
    },
    required=("format_version", "model", "train"),
)

AXIS = AnyOf((Str(), Int(0, LIMIT)), "an axis (a name or a size)")
TENSOR = Obj(
    {"name": Str(), "dtype": OneOf(DTYPES), "shape": ListOf(AXIS)},
    required=("name", "dtype", "shape"),
)
GRAPH = Obj(
    {
        "file": Str(suffix=".onnx"),  # a plain name inside the folder: `files.confined`
        "sha256": SHA256,
        "inputs": ListOf(TENSOR),
        "outputs": ListOf(TENSOR),
    },
    required=("file", "sha256", "inputs", "outputs"),
)
MODEL_GRAPHS = MapOf(GRAPH, keys=(*GRAPHS, *ENCODER_PARTS))
VARIANT_GRAPHS = MapOf(MapOf(GRAPH, keys=GRAPHS), keys=VARIANTS)
MEMBER = Obj({"graphs": MODEL_GRAPHS, "variants": VARIANT_GRAPHS}, required=("graphs",))

DIMS = ("dim", "heads", "head_dim", "n_diag", "n_proc", "n_med", "out_size")
SPECIAL = ("end", "start", "med_pad", "diag_pad", "proc_pad")
MANIFEST = Obj(
    {
        "format_version": OneOf((1, 2)),
        "opset": SIZE,
        "dims": Obj(dict.fromkeys(DIMS, SIZE), required=DIMS),
        "special": Obj(dict.fromkeys(SPECIAL, SIZE), required=SPECIAL),
        "vocab": VOCAB,
        "max_len": Int(1, MAX_STEPS),
        "beam": Int(1, MAX_BEAM),
        "ablation": OneOf(ABLATIONS),
        "ddi_pairs": PAIRS,
        "graphs": MODEL_GRAPHS,
        "variants": VARIANT_GRAPHS,
        "checkpoint_sha256": SHA256,
        "versions": MapOf(Str(empty=True)),
        "parity": Nullable(MapOf(ANY)),  # the exporter's report, never read
        "tensorrt": Nullable(
            Obj(
                {"cache_dir": Str(), "fp16": Bool(), "profiles": MapOf(MapOf(Str()), keys=GRAPHS)},
                required=("cache_dir", "profiles"),
            )
        ),
        "decoding": DECODING,
        "search": MapOf(GRAPH),
        "head": GRAPH,  # the set head's graph (`cognet.core.head_inputs`)
        "ddi_target": DDI_TARGET,
        "members": MEMBERS,
        "member_graphs": ListOf(MEMBER, first=1),  # members 1..
    },
    required=(
        "format_version",
        "opset",
        "dims",
        "special",
        "vocab",
        "max_len",
        "beam",
        "ablation",
        "ddi_pairs",
        "graphs",
        "checkpoint_sha256",
    ),
)
