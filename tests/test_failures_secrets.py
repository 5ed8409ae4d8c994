"""Issue 59, rule 9: a password is masked in every message, whether its URL parses or not
(`make failures`). A password holding '/', '?', '#' or '@' ends a URL's user part for a
parser (`u:se#cret@host` reads as host `u`, port `se`), so such a URL is refused (exit 2)
with the password masked, as it was written."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cognet.cli import main
from cognet.data.omop_db import mask_secrets, masked

SECRET = "se{}cret"


@pytest.mark.parametrize("char", ["#", "?", "/", "@", "#/?"])
def test_a_password_that_ends_the_user_part_is_refused_masked(tmp_path, char):
    url = f"postgresql://u:{SECRET.format(char)}@host/db"
    argv = ["data", "omop", "--cdm", url, "--out", str(tmp_path / "o"), "--connect-timeout", "2"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("Error: postgresql://u:***@host/db: not a valid URL"), lines[0]
    assert "cret" not in result.output and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "text",
    [
        "postgresql://u:se#cret@host/db",
        "postgresql://u:se?cret@host:5432/db?sslmode=require",
        "postgresql://u:se/cret@[::1/db",
        "could not connect to postgresql://u:se#cr/et@host:x/db (timeout)",
        "postgresql://u:se%23cret@host/db?password=se2cret",
    ],
)
def test_mask_secrets_masks_urls_that_do_not_parse(text):
    shown = mask_secrets(text)
    assert "cret" not in shown and "cr/et" not in shown and "***" in shown, shown


def test_masked_keeps_the_rest_of_the_url():
    shown, secrets = masked("postgresql://u:p%40ss@host:5432/db?sslmode=require")
    assert shown == "postgresql://u:***@host:5432/db?sslmode=require"
    assert secrets == ["p%40ss", "p@ss"]
