"""A throw-away PostgreSQL server for the tests: Debian's ``postgresql`` binaries, a data
folder and a Unix socket in a temporary directory, password authentication (scram).

``initdb`` refuses to run as root, so as root the server runs as the ``postgres`` user that
the Debian package creates. `PgServer.start` returns None when the binaries are absent (the
tests then skip; .ci/run installs the package, so CI runs them).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

USER, PASSWORD, PORT = "cognet", "pw-7Hq2-secret", 5432


def binaries() -> Path | None:
    """The newest /usr/lib/postgresql/<version>/bin with initdb and pg_ctl, or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parent.parent.name),
    )
    return Path(found[-1]).parent if found else None


@dataclass
class PgServer:
    folder: Path
    bin: Path
    run_as: list[str]

    @classmethod
    def start(cls) -> PgServer | None:
        bin_dir = binaries()
        if bin_dir is None:
            return None
        folder = Path(tempfile.mkdtemp(prefix="cognet-pg-"))
        run_as = []
        if os.geteuid() == 0:
            shutil.chown(folder, "postgres")
            run_as = ["runuser", "-u", "postgres", "--"]
        (folder / "pw").write_text(PASSWORD + "\n")
        if run_as:
            shutil.chown(folder / "pw", "postgres")
        server = cls(folder, bin_dir, run_as)
        server._run(
            "initdb",
            "-D",
            str(folder / "data"),
            "-U",
            USER,
            "-A",
            "scram-sha-256",
            f"--pwfile={folder / 'pw'}",
            "--no-sync",
            "-E",
            "UTF8",
        )
        options = f"-k {folder} -c listen_addresses='' -p {PORT} -c fsync=off"
        server._run(
            "pg_ctl",
            "-D",
            str(folder / "data"),
            "-o",
            options,
            "-w",
            "-l",
            str(folder / "log"),
            "start",
        )
        return server

    def _run(self, tool: str, *args: str) -> None:
        command = [*self.run_as, str(self.bin / tool), *args]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()}")

    def url(self, database: str = "postgres", password: bool = True) -> str:
        secret = f":{PASSWORD}" if password else ""
        return f"postgresql://{USER}{secret}@/{database}?host={self.folder}&port={PORT}"

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)

    def load(self, schema: str, tables: dict[str, pa.Table]) -> None:
        """Create ``schema`` (dropped first) with these tables."""
        from adbc_driver_postgresql import dbapi

        with dbapi.connect(self.url()) as con, con.cursor() as cursor:
            cursor.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            cursor.execute(f'CREATE SCHEMA "{schema}"')
            for name, table in tables.items():
                cursor.adbc_ingest(name, table, mode="create", db_schema_name=schema)
            con.commit()
