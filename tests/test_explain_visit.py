"""`cognet-batch explain` in words (`cognet.runtime.explain_visit`): names beside codes, the
source visit only beside what was copied, set decoding's rank, the score's meaning, and the
interacting pairs by name."""

from __future__ import annotations

import json

from click.testing import CliRunner

from cognet.runtime.cli import main
from cognet.runtime.explain_visit import ExplainedStep, VisitExplanation, format_explanation


def _explanation(ranked: bool) -> VisitExplanation:
    def step(i, med, share, source):
        return ExplainedStep(i, med, 0.9, share, source, [("592.0", 0.5)], True)

    return VisitExplanation(
        patient_id="P1",
        visit_id="P1-2",
        visit_seq=2,
        diagnoses=["592.0", "Z99"],
        procedures=["38.93"],
        history=["P1-0", "P1-1"],
        truth=["N02A", "B01A", "C03C"],
        steps=[step(1, "N02A", 0.98, "P1-1"), step(2, "B01A", 0.02, "P1-0")],
        score=0.689 if ranked else -1.25,
        interacting_pairs=[("N02A", "B01A")],
        decoding="set, 64 samples, threshold 0.5, DDI off" if ranked else "beam 4, DDI off",
        ranked=ranked,
        names={
            "diagnosis": {"592.0": "Calculus of kidney"},
            "procedure": {"38.93": "Venous catheterization"},
            "medication": {"N02A": "Opioids", "B01A": "Antithrombotic agents"},
        },
    )


def test_a_set_explanation_reads_in_words():
    text = format_explanation(_explanation(ranked=True))
    lines = text.splitlines()
    assert "score 0.689: the mean P(k in S) of the recommended medications" in text
    assert "  592.0  Calculus of kidney" in lines and "  Z99" in lines  # Z99: no name
    assert "  38.93  Venous catheterization" in lines
    head = next(i for i, line in enumerate(lines) if line.startswith("rank"))
    copied, generated = lines[head + 1], lines[head + 2]
    assert "N02A Opioids" in copied and "copied" in copied and "P1-1" in copied
    # 2% copied: generated, and no visit beside it (its copy weight's visit is no source)
    assert "generated" in generated and "P1-0" not in generated
    assert "rank: place in the set, most probable first" in text
    assert "missed: C03C" in text
    assert "interacting pairs in the recommendation: 1 (pairs the model's DDI graph" in text
    assert "  N02A (Opioids) - B01A (Antithrombotic agents)" in lines


def test_a_beam_explanation_keeps_steps_and_says_what_its_score_is():
    e = _explanation(ranked=False)
    text = format_explanation(e)
    assert any(line.startswith("step") for line in text.splitlines())
    assert "score -1.250: the sum of the log-probabilities of the list's steps" in text
    assert json.loads(json.dumps(e.to_json()))["score_meaning"] == e.score_meaning


def test_explain_takes_a_users_names(tiny, visits, tmp_path):
    rows = visits.to_pylist()
    row = next(r for r in rows if r["visit_seq"] >= 2 and r["diagnoses"])
    names = tmp_path / "names.csv"
    meds = sorted({m for r in rows for m in r["medications"]})
    names.write_text(
        "code,name,kind\n"
        + f"{row['diagnoses'][0]},First diagnosis,diagnosis\n"
        + "".join(f"{m},Drug class {m},medication\n" for m in meds)
    )
    args = ["explain", str(tiny / "data" / "visits.parquet"), "--model", str(tiny / "model")]
    args += ["--visit-id", row["visit_id"], "--names", str(names)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert f"  {row['diagnoses'][0]}  First diagnosis" in result.output
    head = next(i for i, s in enumerate(result.output.splitlines()) if s.startswith("step"))
    first = result.output.splitlines()[head + 1].split()
    assert first[2:5] == ["Drug", "class", first[1]]  # "1 M07X Drug class M07X"
    names.write_text("code,kind\nM01X,medication\n")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "column 'name'" in result.output
    assert len(result.output.strip().splitlines()) == 1
