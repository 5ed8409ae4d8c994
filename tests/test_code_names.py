"""Code names (`cognet.core.code_names`): the shipped ICD-9-CM names in every form the project
meets, a user's file first, and a bad user's file as one line."""

from __future__ import annotations

import gzip

import pytest

from cognet.core.code_names import SHIPPED, CodeNames
from cognet.core.errors import InputError


@pytest.fixture(scope="module")
def shipped() -> CodeNames:
    return CodeNames.load()


@pytest.mark.parametrize("code", ["5920", "592.0", "ICD9CM/592.0", " 592.0 "])
def test_diagnoses_are_named_dotted_undotted_and_as_omop_tokens(shipped, code):
    assert shipped.name("diagnosis", code) == "Calculus of kidney"


@pytest.mark.parametrize("code", ["3893", "38.93", "ICD9Proc/38.93"])
def test_procedures_are_named_apart_from_diagnoses(shipped, code):
    assert shipped.name("procedure", code) == "Venous catheterization, not elsewhere classified"


def test_kinds_vocabularies_and_atc(shipped):
    # 4019 is hypertension as a diagnosis and a lymphatic procedure as a procedure
    assert shipped.name("diagnosis", "401.9") == "Unspecified essential hypertension"
    assert shipped.name("procedure", "40.19").startswith("Other diagnostic procedures on lymph")
    assert shipped.name("diagnosis", "V30.00").startswith("Single liveborn, born in hospital")
    assert shipped.name("diagnosis", "E849.7") == "Accidents occurring in residential institution"
    assert shipped.name("diagnosis", "ICD10CM/592.0") is None  # another vocabulary
    assert shipped.name("medication", "N02A") is None  # no ATC names ship
    assert shipped.named("medication", "N02A") == "N02A"
    assert shipped.named("diagnosis", "5920") == "5920 (Calculus of kidney)"


def test_the_shipped_file_is_the_tools_output():
    head = gzip.decompress(SHIPPED.read_bytes()).decode().splitlines()[0]
    assert head == "kind\tcode\tname"


def test_a_users_file_comes_first_and_may_name_any_kind(shipped, tmp_path):
    path = tmp_path / "names.csv"
    path.write_text(
        "code,name,kind\nN02A,Opioids,medication\n592.0,Kidney stone,diagnosis\nD001,Cough,\n"
    )
    names = CodeNames.load(path)
    assert names.name("medication", "N02A") == "Opioids"
    assert names.name("diagnosis", "5920") == "Kidney stone"  # the user's, over CMS's
    assert names.name("procedure", "38.93") == shipped.name("procedure", "3893")
    assert names.name("diagnosis", "D001") == names.name("procedure", "D001") == "Cough"
    tsv = tmp_path / "names.tsv.gz"
    tsv.write_bytes(gzip.compress(b"code\tname\nB01A\tAntithrombotic agents\n"))
    assert CodeNames.load(tsv).name("medication", "B01A") == "Antithrombotic agents"


@pytest.mark.parametrize(
    "text,said",
    [
        ("code,label\nN02A,Opioids\n", "column 'name': no such column"),
        ("code,name,kind\nN02A,Opioids,drug\n", "line 2: column 'kind': 'drug' is none of"),
    ],
)
def test_a_bad_users_file_is_an_input_error_naming_where(tmp_path, text, said):
    path = tmp_path / "names.csv"
    path.write_text(text)
    with pytest.raises(InputError, match=said):
        CodeNames.load(path)
    with pytest.raises(InputError, match="file not found"):
        CodeNames.load(tmp_path / "nope.csv")
