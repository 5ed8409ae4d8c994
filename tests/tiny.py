"""Helpers shared by the test modules: tiny random datasets, checkpoints and models (no
training needed for parity), and the torch model behind the runtime's session interface.

`make_tiny(root)` writes `root/data` (a dataset directory with a split column) and
`root/ckpt` (a checkpoint of a randomly initialised COGNet whose END bias is lowered so that
beam search produces medication lists of varied lengths). `make_case()` builds such a model
and its patients in memory; `TorchDecoder` and `torch_encoder` run the torch model's graphs
where the runtime runs ONNX sessions. Fixtures built from these live in `conftest.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from cognet.core.ddi import DDIPolicy
from cognet.core.graphspec import ENCODER_INPUTS, ENCODER_OUTPUTS
from cognet.core.history import Visit
from cognet.core.vocab import Vocab
from cognet.model.network import COGNet, ModelConfig

# DDI policies that the parity tests run, and their test ids
DDI_POLICIES = [
    DDIPolicy(),
    DDIPolicy("soft", 0.5),
    DDIPolicy("hard"),
    DDIPolicy("off", max_rate=0.05),
    DDIPolicy("soft", 1.0, max_rate=0.0),
]
DDI_IDS = ["off", "soft", "hard", "max-rate", "soft+max-rate"]


def tiny_visits(
    n_patients: int = 30,
    seed: int = 0,
    n_diag: int = 40,
    n_proc: int = 25,
    n_med: int = 20,
    max_visits: int = 5,
) -> pa.Table:
    rng = np.random.default_rng(seed)
    rows = {
        k: []
        for k in (
            "patient_id",
            "visit_id",
            "visit_seq",
            "diagnoses",
            "procedures",
            "medications",
            "split",
        )
    }
    splits = ["train", "val", "test"]
    for p in range(n_patients):
        split = splits[p % 3] if p >= 3 else splits[0]
        for s in range(int(rng.integers(1, max_visits + 1))):
            rows["patient_id"].append(f"P{p:04d}")
            rows["visit_id"].append(f"V{p:04d}-{s}")
            rows["visit_seq"].append(s)
            rows["diagnoses"].append(
                [f"D{i:03d}" for i in rng.choice(n_diag, rng.integers(0, 8), replace=False)]
            )
            rows["procedures"].append(
                [f"P{i:03d}" for i in rng.choice(n_proc, rng.integers(1, 4), replace=False)]
            )
            rows["medications"].append(
                [f"M{i:02d}X" for i in rng.choice(n_med, rng.integers(1, 9), replace=False)]
            )
            rows["split"].append(split)
    return pa.table(
        {
            "patient_id": pa.array(rows["patient_id"], pa.string()),
            "visit_id": pa.array(rows["visit_id"], pa.string()),
            "visit_seq": pa.array(rows["visit_seq"], pa.int32()),
            "diagnoses": pa.array(rows["diagnoses"], pa.list_(pa.string())),
            "procedures": pa.array(rows["procedures"], pa.list_(pa.string())),
            "medications": pa.array(rows["medications"], pa.list_(pa.string())),
            "split": pa.array(rows["split"], pa.string()),
        }
    )


def tiny_ddi(n_med: int = 20, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed + 1)
    pairs = {tuple(sorted(rng.choice(n_med, 2, replace=False))) for _ in range(15)}
    return pa.table(
        {"drug_a": [f"M{a:02d}X" for a, _ in pairs], "drug_b": [f"M{b:02d}X" for _, b in pairs]}
    )


def make_tiny(
    root: str | Path,
    seed: int = 0,
    n_patients: int = 30,
    ablation: str = "none",
    dim: int = 16,
    heads: int = 2,
) -> tuple[Path, Path]:
    """Write a tiny dataset and a random-weight checkpoint; returns (data_dir, ckpt_dir)."""
    root = Path(root)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    pq.write_table(tiny_visits(n_patients, seed), data / "visits.parquet")
    pq.write_table(tiny_ddi(seed=seed), data / "ddi.parquet")
    ckpt = random_checkpoint(data, root / "ckpt", seed, ablation, dim, heads)
    return data, ckpt


def random_checkpoint(
    data: str | Path,
    ckpt: str | Path,
    seed: int = 0,
    ablation: str = "none",
    dim: int = 16,
    heads: int = 2,
    head: bool = False,
) -> Path:
    """A randomly initialised COGNet over the vocabulary of a dataset directory's train split
    (graphs from its train split and DDI pairs), saved as a checkpoint; returns its path.
    head: with a random set head (`random_head`)."""
    from cognet.core.history import load_split, train_vocabulary
    from cognet.model import checkpoint
    from cognet.model.batching import ddi_adjacency, ehr_adjacency

    visits = pq.read_table(Path(data) / "visits.parquet")
    ddi_table = pq.read_table(Path(data) / "ddi.parquet")
    vocab = train_vocabulary(visits)
    patients = load_split(visits, vocab, "train").patients
    pairs = list(
        zip(
            ddi_table.column("drug_a").to_pylist(),
            ddi_table.column("drug_b").to_pylist(),
            strict=True,
        )
    )
    ehr, ddi = ehr_adjacency(patients, vocab.n_med), ddi_adjacency(pairs, vocab)
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab.n_diag,
        vocab.n_proc,
        vocab.n_med,
        dim=dim,
        heads=heads,
        ffn=2 * dim,
        ablation=ablation,
    )
    model = COGNet(cfg, ehr, ddi).eval()
    with torch.no_grad():
        for p in model.parameters():  # livelier than the default init
            p.add_(torch.randn_like(p) * 0.3)
        model.gen_head.bias[vocab.end] = -0.5
    ckpt = Path(ckpt)
    tuned = checkpoint.Tuned(head=(random_head(vocab, seed), {"tiny": True}) if head else None)
    graphs = checkpoint.Graphs(ehr, ddi, pairs)
    checkpoint.save(ckpt, model, vocab, graphs, {"seed": seed, "tiny": True}, tuned)
    return ckpt


def random_head(vocab: Vocab, seed: int = 0, hidden: int = 32):
    """A randomly initialised set head (`cognet.model.set_head`) whose marginals spread over
    (0, 1), so that sets and thresholds vary; PAD rows stay zero, as training keeps them."""
    from cognet.model.set_head import HeadConfig, SetHead

    torch.manual_seed(seed + 1)
    head = SetHead(HeadConfig(vocab.n_diag, vocab.n_proc, vocab.n_med, hidden=hidden))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        for table in (head.diagnoses, head.procedures, head.last_meds, head.past_meds):
            table.weight[table.padding_idx].zero_()
        head.out.bias -= 1.0  # sets of a few medications, not half the vocabulary
    return head.eval()


def torch_encoder(model: COGNet):
    @torch.no_grad()
    def encode(inputs):
        out = model.encode_visits(*(torch.from_numpy(inputs[k]) for k in ENCODER_INPUTS))
        return {name: t.numpy() for name, t in zip(ENCODER_OUTPUTS, out, strict=True)}

    return encode


# -- a small random model and patients, in memory


def make_case(n_med: int = 12, n_patients: int = 12, seed: int = 0, dim: int = 16):
    rng = np.random.default_rng(seed)
    d, p = 30, 20
    vocab = Vocab(
        tuple(f"d{i:02d}" for i in range(d)),
        tuple(f"p{i:02d}" for i in range(p)),
        tuple(f"m{i:02d}" for i in range(n_med)),
        tuple(int(x) for x in rng.integers(1, 50, n_med)),
    )

    def visit(pid: str, i: int) -> Visit:
        diag = rng.choice(d, rng.integers(0, 6), replace=False).tolist()
        proc = rng.choice(p, rng.integers(0 if diag else 1, 4), replace=False).tolist()
        meds = vocab.rare_first(
            rng.choice(n_med, rng.integers(1, min(6, n_med)), replace=False).tolist()
        )
        return Visit(pid, f"{pid}-{i}", tuple(diag), tuple(proc), tuple(meds))

    patients = [[visit(f"p{k}", i) for i in range(rng.integers(1, 5))] for k in range(n_patients)]
    torch.manual_seed(seed)
    cfg = ModelConfig(d, p, n_med, dim=dim, heads=2, ffn=2 * dim)
    ddi = (rng.random((n_med, n_med)) < 0.1).astype(np.float32)
    model = COGNet(cfg, np.zeros((n_med, n_med), np.float32), np.maximum(ddi, ddi.T))
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(torch.randn_like(prm) * 0.3)
        model.gen_head.bias[n_med] = -1.0  # END less likely: longer, varied lists
    return model.eval(), vocab, patients


# -- scoring inputs ----------------------------------------------------------------------


def with_meds(table: pa.Table, meds: list) -> pa.Table:
    col = pa.array(meds, pa.list_(pa.string()))
    return table.set_column(table.schema.get_field_index("medications"), "medications", col)


def last_visits_unknown(table: pa.Table) -> pa.Table:
    pids = table["patient_id"].to_pylist()
    meds = table["medications"].to_pylist()
    return with_meds(
        table,
        [None if i + 1 == len(pids) or pids[i + 1] != p else meds[i] for i, p in enumerate(pids)],
    )


# A `cognet-batch` run killed by SIGKILL at the {after}-th call of `writer.{func}` (before
# or after the call, as {before} says): `python -c KILLER score ...`.
KILLER = """
import os, signal, sys
from cognet.runtime import writer
calls = {"n": 0}
target = writer.{func}
def killing(*args, **kwargs):
    calls["n"] += 1
    if calls["n"] == {after} and {before}:
        os.kill(os.getpid(), signal.SIGKILL)
    target(*args, **kwargs)
    if calls["n"] == {after} and not {before}:
        os.kill(os.getpid(), signal.SIGKILL)
writer.{func} = killing
from cognet.runtime.cli import main
main(sys.argv[1:])
"""


def as_targets(visits: pa.Table) -> pa.Table:
    """Every visit as the one visit to score (medications unknown) of its own patient, its
    earlier visits as history: `--all` would ask for PRAUC scores, which beam search
    computes on the host path only."""
    rows = visits.sort_by([("patient_id", "ascending"), ("visit_seq", "ascending")]).to_pylist()
    out = []
    for i, row in enumerate(rows):
        past = [r for r in rows[:i] if r["patient_id"] == row["patient_id"]]
        pid = f"{row['patient_id']}#{len(past)}"
        out += [{**r, "patient_id": pid, "visit_id": f"{r['visit_id']}#{len(past)}"} for r in past]
        out.append({**row, "patient_id": pid, "medications": None})
    return pa.Table.from_pylist(out, schema=visits.schema)


# -- the whole pipeline -------------------------------------------------------------------


def run_pipeline(data: Path, tmp: Path) -> dict:
    """stats, one epoch of training, export and scoring of every visit; the score summary."""

    from click.testing import CliRunner

    from cognet.cli import main
    from cognet.export.cli import main as export_main
    from cognet.runtime.cli import main as batch_main

    def ok(command, args: list) -> str:
        result = CliRunner().invoke(command, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result.output

    stats = json.loads(ok(main, ["data", "stats", data, "--json"]))
    assert stats["visits"] == pq.read_metadata(data / "visits.parquet").num_rows
    ok(
        main,
        ["train", "--data", data, "--out", tmp / "ckpt", "--epochs", 1, "--threads", 1, "--quiet"],
    )
    ok(export_main, ["--checkpoint", tmp / "ckpt", "--out", tmp / "model", "--no-validate"])
    ok(
        batch_main,
        [
            "score",
            data / "visits.parquet",
            "--model",
            tmp / "model",
            "--out",
            tmp / "recs.parquet",
            "--all",
            "--summary-json",
            tmp / "s.json",
            "--quiet",
        ],
    )
    summary = json.loads((tmp / "s.json").read_text())
    assert summary["rows_read"] == stats["visits"] == summary["rows_scored"]
    assert pq.read_table(tmp / "recs.parquet").num_rows == stats["visits"]
    return summary


# -- the --beam rule (cognet evaluate and cognet-batch score) ------------------------------
# (arguments, the decoding name and beam width they ask of a model whose own is set decoding)
BEAM_ALONE = [([], "set", 4), (["--beam", "2"], "beam", 2), (["--decoding", "beam"], "beam", 4)]
# (arguments that are a usage error, the option the message names besides --beam)
BEAM_WITH_SET_OPTIONS = [
    (["--beam", "2", "--samples", "4"], "--samples"),
    (["--beam", "2", "--threshold", "0.3"], "--threshold"),
    (["--decoding", "beam", "--beam", "1", "--samples", "4"], "--samples"),
    (["--decoding", "set", "--beam", "2", "--threshold", "0.3"], "--threshold"),
]

# (arguments that ask for options the asked decoding does not read, the one line refusing
# them): a usage error (exit 2), word for word the same in `cognet evaluate` and
# `cognet-batch score`. The last ones apply to no decoding until the model's own is known
# (the tiny model's own is beam search).
NOT_APPLYING = [
    (
        ["--decoding", "beam", "--set-rule", "jaccard"],
        "--set-rule is for set decoding, not --decoding beam",
    ),
    (["--beam", "2", "--estimator", "tree"], "--estimator is for set decoding, not beam search"),
    (
        ["--set-rule", "jaccard", "--threshold", "0.5"],
        "--threshold is for --set-rule threshold, not jaccard",
    ),
    (["--decoding", "set", "--beam", "2"], "--beam is for beam search, not set decoding"),
    (
        ["--decoding", "beam", "--samples", "4", "--estimator", "plain"],
        "--samples and --estimator are for set decoding, not --decoding beam",
    ),
    (["--estimator", "tree"], "--estimator is for set decoding, not beam search"),
    (["--set-rule", "jaccard"], "--set-rule is for set decoding, not beam search"),
]


def with_set_decoding(source: Path, where: Path, config: str) -> Path:
    """A copy of the checkpoint or model directory `source` under `where` whose own decoding
    (`config`: config.json or manifest.json) is set decoding, as a trained one's."""
    import shutil

    out = where / source.name
    shutil.copytree(source, out)
    data = json.loads((out / config).read_text())
    data["decoding"] = {"name": "set", "samples": 4, "threshold": 0.3}
    (out / config).write_text(json.dumps(data))
    return out


def train_small(data: str | Path, out: str | Path, *extra: str):
    """`cognet train` of one small network (16 dimensions, 2 epochs) on `data` into `out`,
    with `extra` options; the click result."""
    from click.testing import CliRunner

    from cognet.cli import main

    small = ["--dim", "16", "--epochs", "2", "--quiet", "--members", "1"]
    return CliRunner().invoke(
        main, ["train", "--data", str(data), "--out", str(out), *small, *extra]
    )


def set_agreement(a: dict, b: dict) -> float:
    """The share of visits whose answers (visit_id -> medication codes) are equal."""
    assert a.keys() == b.keys()
    return sum(a[k] == b[k] for k in a) / len(a)


def torch_sets(root, decoding, split: str | None = None, ddi: DDIPolicy = DDIPolicy()) -> dict:
    """visit_id -> medication codes: the torch reference's answers for the visits of
    `root/data` (a `make_tiny` folder; one split when given) from `root/ckpt`."""
    from cognet.core.decoding.plan import DecodingPlan
    from cognet.core.history import patients_from_table
    from cognet.model import checkpoint
    from cognet.model.torch_decoding import decode_patients

    model, vocab, _ = checkpoint.load(root / "ckpt")
    table = pq.read_table(root / "data" / "visits.parquet")
    if split:
        table = table.filter(pa.compute.equal(table["split"], split))
    patients = list(patients_from_table(table, vocab))
    decoded = decode_patients(model, vocab, patients, DecodingPlan(decoding, vocab.end, ddi=ddi))
    flat = [v for p in patients for v in p]
    return {v.visit_id: vocab.med_codes(d.meds) for v, d in zip(flat, decoded, strict=True)}


def runtime_sets(root, **options) -> dict:
    """visit_id -> medication codes: the runtime's answers (`Scorer` on `root/model`, CPU,
    `options` as its keywords) for every visit of `root/data`."""
    from cognet.runtime import ScoreOptions, Scorer

    scorer = Scorer(root / "model", ScoreOptions.of(device="cpu", **options))
    table = pq.read_table(root / "data" / "visits.parquet")
    out = pa.concat_tables([c.recommendations for c in scorer.score_table(table, score_all=True)])
    return {r["visit_id"]: r["medications"] for r in out.to_pylist()}
