"""`cognet train` / `cognet evaluate` end to end on a tiny dataset, and checkpoint safety."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tiny import BEAM_ALONE, BEAM_WITH_SET_OPTIONS, NOT_APPLYING, with_set_decoding

from cognet.cli import main
from cognet.core.decoding import Decoding
from cognet.core.errors import InputError
from cognet.model import checkpoint


def test_train_then_evaluate(tiny, tmp_path):
    data = tiny / "data"
    out = tmp_path / "ckpt"
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "train",
            "--data",
            str(data),
            "--out",
            str(out),
            "--epochs",
            "2",
            "--seed",
            "3",
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "val nll" in res.output and "weights: " in res.output
    # two members (the default): each one's weights named as its epoch lines name it
    assert "weights: member 0: epoch" in res.output and "; member 1: epoch" in res.output
    for name in ("config.json", "vocab.json", "model.safetensors", "graphs.npz", "train_log.jsonl"):
        assert (out / name).is_file()
    stored = Decoding.from_json(json.loads((out / "config.json").read_text())["decoding"])
    # the default: the set head's one pass, its set rule tuned on validation (and set
    # decoding's threshold too: the networks stay a model of their own)
    assert stored.name == "marginal" and stored.samples == 16 and stored.threshold is not None
    assert stored.selection[1] in ("threshold", "jaccard") and (out / "head.safetensors").is_file()
    assert f"decoding: {stored.label};" in res.output  # the set rule chosen on validation
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    # the default trains two members, each its own epochs
    assert [(r["member"], r["epoch"]) for r in log] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    report = tmp_path / "r.json"
    preds = tmp_path / "p.parquet"
    res = runner.invoke(
        main,
        [
            "evaluate",
            "--checkpoint",
            str(out),
            "--data",
            str(data),
            "--rounds",
            "3",
            "--json",
            str(report),
            "--predictions",
            str(preds),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "Jaccard" in res.output and "ground-truth DDI" in res.output
    rep = json.loads(report.read_text())
    for key in ("jaccard", "f1", "prauc", "ddi", "avg_drugs"):
        assert set(rep[key]) == {"mean", "std"}
    first, later = rep["by_history"]["first"], rep["by_history"]["later"]
    assert first["n_visits"] == rep["n_patients"]  # one first visit per patient
    assert first["n_visits"] + later["n_visits"] == rep["n_visits"]
    assert "first visits (no history): Jaccard" in res.output
    import pyarrow.parquet as pq

    table = pq.read_table(preds)
    assert table.column_names == ["patient_id", "visit_id", "medications", "score", "probabilities"]
    assert table.num_rows == rep["n_visits"]


@pytest.mark.parametrize("sampling", ["0", "0.5"])
def test_training_is_deterministic_with_a_seed(tiny, tmp_path, sampling):
    data = tiny / "data"
    runner = CliRunner()
    for name in ("a", "b"):
        res = runner.invoke(
            main,
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(tmp_path / name),
                "--epochs",
                "1",
                "--seed",
                "7",
                "--quiet",
                "--scheduled-sampling",
                sampling,
            ],
        )
        assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("baseline", ["copy-last", "frequent", "lr"])
def test_evaluate_baselines(tiny, baseline):
    data = tiny / "data"
    res = CliRunner().invoke(
        main, ["evaluate", "--data", str(data), "--baseline", baseline, "--rounds", "2"]
    )
    assert res.exit_code == 0, res.output
    assert baseline in res.output


def test_evaluate_needs_a_checkpoint_or_baseline(tiny):
    data = tiny / "data"
    res = CliRunner().invoke(main, ["evaluate", "--data", str(data)])
    assert res.exit_code == 2
    assert "--checkpoint" in res.output


def test_bad_checkpoint_is_a_one_line_input_error(tiny, tmp_path):
    data = tiny / "data"
    res = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(tmp_path), "--data", str(data)])
    assert res.exit_code == 2
    assert "not a cognet checkpoint" in res.output
    assert "Traceback" not in res.output


def test_checkpoint_loading_never_unpickles(tiny, tmp_path):
    """graphs.npz with an object array (which would need pickle) is refused."""
    import shutil

    import numpy as np

    ckpt = tiny / "ckpt"
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    np.savez(bad / "graphs.npz", ehr=np.array([object()], dtype=object), ddi=np.zeros(1))
    with pytest.raises(InputError, match="graphs.npz: sha256 differs"):
        checkpoint.load(bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["sha256"]  # as a checkpoint saved before the hashes: the npz is read, never unpickled
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="graphs.npz: unreadable .*pickle"):
        checkpoint.load(bad)


def test_checkpoint_format_version_is_checked(tiny, tmp_path):
    import shutil

    ckpt = tiny / "ckpt"
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["format_version"] = 99
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="format version"):
        checkpoint.load(bad)


@pytest.mark.parametrize(
    "args", [["--help"], ["train", "--help"], ["evaluate", "--help"], ["data", "--help"]]
)
def test_help(args):
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0
    assert "Example" in res.output or args == ["data", "--help"]


def test_by_history_splits_first_and_later_visits():
    from cognet.core.metrics import VisitResult
    from cognet.evaluation.evaluate import by_history

    ddi = np.zeros((4, 4), bool)
    results = [
        VisitResult("A", (0, 1), (0, 1)),  # first visit of A: Jaccard 1
        VisitResult("A", (2,), (3,)),  # later: 0
        VisitResult("B", (0,), (0, 1)),  # first visit of B: 0.5
    ]
    parts = by_history(results, ddi)
    assert parts["first"]["jaccard"] == pytest.approx(0.75)  # per patient, then over patients
    assert parts["first"]["n_visits"] == 2
    assert parts["later"]["jaccard"] == 0.0 and parts["later"]["n_visits"] == 1
    assert by_history(results[2:], ddi)["later"] is None


def _evaluate(ckpt: Path, data: Path, report: Path, *args: str):
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data", str(data), "--rounds", "1"]
    return CliRunner().invoke(main, [*argv, "--quiet", "--json", str(report), *args])


@pytest.mark.parametrize("args,name,beam", BEAM_ALONE)
def test_evaluate_beam_alone_asks_for_beam_search(tiny, tmp_path, args, name, beam):
    ckpt = with_set_decoding(tiny / "ckpt", tmp_path, "config.json")
    report = tmp_path / "r.json"
    res = _evaluate(ckpt, tiny / "data", report, *args)
    assert res.exit_code == 0, res.output
    decoding = json.loads(report.read_text())["decoding"]
    assert (decoding["name"], decoding["beam"]) == (name, beam)


@pytest.mark.parametrize("args,named", BEAM_WITH_SET_OPTIONS)
def test_evaluate_refuses_beam_with_set_options(tiny, tmp_path, args, named):
    report = tmp_path / "r.json"
    res = _evaluate(tiny / "ckpt", tiny / "data", report, *args)
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert "Traceback" not in res.output and "--beam is for beam search" in lines[-1]
    assert named in lines[-1] and not report.exists()


@pytest.mark.parametrize("args,line", NOT_APPLYING)
def test_evaluate_refuses_options_of_another_decoding(tiny, tmp_path, args, line):
    report = tmp_path / "r.json"
    res = _evaluate(tiny / "ckpt", tiny / "data", report, *args)
    assert res.exit_code == 2, res.output
    lines = [text for text in res.output.splitlines() if text.strip()]
    assert "Traceback" not in res.output and lines[-1].endswith(line), lines
    assert not report.exists()


class RecordedBar:
    """A tqdm-like bar that records what it was told (`train`'s progress factory)."""

    made: list[RecordedBar] = []

    def __init__(self, total=None, desc="", unit="it"):
        self.total, self.desc, self.unit, self.n, self.closed = total, desc, unit, 0, False
        RecordedBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **_) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_every_phase_of_training_has_a_bar(tiny, tmp_path):
    """The epochs (by batches), their validation, the weight averaging, the set decoding's
    tuning, the DDI target search and the set head's teacher pass and epochs each move a
    bar, closed at its end."""
    from cognet.training.train import TrainConfig, train

    RecordedBar.made = []
    cfg = TrainConfig(epochs=2, members=1, select="jaccard", average=(1, 2), ddi_target=0.2)
    train(tiny / "data", tmp_path / "ckpt", cfg, progress=RecordedBar)
    moved = {bar.desc: bar.n for bar in RecordedBar.made}
    for phase in ("epoch 1", "epoch 1 validation", "epoch 2", "averaging weights"):
        assert moved[phase] > 0, phase
    bars = {bar.desc: bar for bar in RecordedBar.made}
    assert moved["tuning the set decoding"] == bars["tuning the set decoding"].total > 0
    assert moved["DDI target 0.2 search"] >= moved["tuning the set decoding"]
    # the set head: the teacher's pass over every training visit, then its epochs
    assert moved["teacher P(k in S)"] == bars["teacher P(k in S)"].total > 0
    assert 0 < moved["set head"] <= bars["set head"].total
    descs = [bar.desc for bar in RecordedBar.made]
    # the default decoding is the head's: its target is searched over the head's marginals
    assert descs.index("set head") < descs.index("DDI target 0.2 search")
    assert all(bar.closed for bar in RecordedBar.made)
