"""Issue 30, never hang and never print a secret (`make failures`): a database server that
accepts and never answers ends the run with exit 2 within the connect timeout, a statement
that runs past the statement timeout too (a real PostgreSQL server, `pg_server`), each with
one line naming the server and never the password; a password is masked in every
connection form; schema names are matched exactly, a match in case only is refused when
there are two.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cdm_forms import typed
from click.testing import CliRunner
from omop_tables import CONCEPT, CONCEPT_ANCESTOR, TABLES
from pg_server import PASSWORD, PgServer

from cognet.cli import main
from cognet.data.omop import VOCABULARY
from cognet.data.omop_db import mask_secrets

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-Pw-91"


def error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def omop(*args: object, timeout: float = 600, env: dict | None = None):
    """`cognet data omop` in its own process; `timeout` only catches a hang (a busy machine
    may take minutes: how long a refusal takes is no test's business, the message is)."""
    argv = [sys.executable, "-c", "from cognet.cli import main; main()", "data", "omop"]
    return subprocess.run(
        [*argv, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# -- 2. bounded waits ---------------------------------------------------------------------------
def test_a_server_that_accepts_and_never_answers_exits_2_within_the_connect_timeout(tmp_path):
    with socket.socket() as listener:  # the kernel completes the handshake; nobody answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        url = f"postgresql://cognet:{SECRET}@127.0.0.1:{port}/cdm"
        done = omop("--cdm", url, "--out", tmp_path / "out", "--connect-timeout", 2)
    assert done.returncode == 2, done.stderr
    line = error(done.stderr)
    assert f"postgresql://cognet:***@127.0.0.1:{port}/cdm: cannot connect within the 2 s" in line
    assert SECRET not in done.stdout + done.stderr
    assert os.listdir(tmp_path) == []  # no dataset, no lock file


@pytest.fixture(scope="module")
def pg():
    server = PgServer.start()
    if server is None:
        pytest.skip("PostgreSQL binaries not installed (apt-get install postgresql; .ci/run does)")
    tables = {**TABLES, "concept": CONCEPT, "concept_ancestor": CONCEPT_ANCESTOR}
    tables = {name: typed(table) for name, table in tables.items()}
    server.load("cdm", {k: v for k, v in tables.items() if k not in VOCABULARY})
    server.load("vocab", {k: v for k, v in tables.items() if k in VOCABULARY})
    server.load("VOCAB", {k: v for k, v in tables.items() if k in VOCABULARY})
    server.load("slow", {k: v for k, v in tables.items() if k != "person"})
    from adbc_driver_postgresql import dbapi

    with dbapi.connect(server.url()) as con, con.cursor() as cursor:  # person takes 30 s
        cursor.execute(
            "CREATE VIEW slow.person AS SELECT p.* FROM cdm.person p, (SELECT pg_sleep(30)) s"
        )
        con.commit()
    yield server
    server.stop()


def test_a_statement_past_the_statement_timeout_exits_2(pg, tmp_path):
    args = ["--cdm", pg.url(), "--cdm-schema", "slow", "--vocab-schema", "vocab"]
    done = omop(*args, "--out", tmp_path / "out", "--statement-timeout", 1)
    assert done.returncode == 2, done.stderr
    line = error(done.stderr)
    assert "reading table slow.person failed (statement timeout 1 s" in line, line
    assert f"host={pg.folder}" in line and PASSWORD not in done.stderr
    assert os.listdir(tmp_path) == []


# -- 6. names matched exactly -------------------------------------------------------------------
def test_a_schema_matched_in_case_only_is_refused_when_two_match(pg, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["data", "omop", "--cdm", pg.url(), "--vocab-schema", "Vocab", "--out", str(out)]
    )
    assert result.exit_code == 2
    assert "table Vocab.concept matches VOCAB.concept and vocab.concept in case only" in (
        error(result.output)
    )
    for exact in ("VOCAB", "vocab"):  # either one named exactly is read
        argv = ["data", "omop", "--cdm", pg.url(), "--vocab-schema", exact, "--out", str(out)]
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 0, result.output
    assert PASSWORD not in result.output


# -- 8. secrets masked in every connection form ---------------------------------------------------
def test_a_key_value_connection_string_is_refused_with_its_password_masked(tmp_path):
    text = f"host=db.example.org user=ohdsi password={SECRET} dbname=cdm"
    result = CliRunner().invoke(main, ["data", "omop", "--cdm", text, "--out", tmp_path / "o"])
    assert result.exit_code == 2
    line = error(result.output)
    assert "host=db.example.org user=ohdsi password=*** dbname=cdm: a key/value" in line
    assert SECRET not in result.output and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"postgresql://u:{SECRET}@h/db", "postgresql://u:***@h/db"),
        (f"postgresql://u@h/db?password={SECRET}", "postgresql://u@h/db?password=***"),
        (f"host=h password='{SECRET} x' dbname=d", "host=h password=*** dbname=d"),
        (
            f"could not connect, password {SECRET} in PGPASSWORD",
            "could not connect, password *** in PGPASSWORD",
        ),
    ],
)
def test_every_connection_form_is_masked(monkeypatch, text, shown):
    monkeypatch.setenv("PGPASSWORD", SECRET)
    assert mask_secrets(text) == shown


# -- 10. input errors exit 2 with one line --------------------------------------------------------
def test_an_invalid_url_exits_2_with_one_line(tmp_path):
    for url in (f"postgresql://u:{SECRET}@[::1/db", "postgresql://u@h:99999/db"):
        result = CliRunner().invoke(main, ["data", "omop", "--cdm", url, "--out", tmp_path / "o"])
        assert result.exit_code == 2, result.output
        assert "not a valid URL" in error(result.output) and SECRET not in result.output
