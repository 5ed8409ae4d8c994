"""OMOP CDM tables read straight from a database: a DuckDB file or a PostgreSQL server.

`open_database` takes what ``cognet data omop --cdm`` was given: ``duckdb:///cdm.duckdb``
(SQLAlchemy's spelling: three slashes then a relative path, four for an absolute one), a path
ending in ``.duckdb`` / ``.ddb``, or ``postgresql://user@host:port/db`` (``postgres://`` and
``postgresql+driver://`` too; a Unix socket as ``postgresql://user@/db?host=/run/dir``).
`DbTable` is a `tables.SourceTable` whose record batches come from a query, so that the
conversion in `omop` (the code mapping, the counts, the errors) is the one the files use and
the output is the same byte for byte.

What the database does: column selection, and the filters that drop rows no step counts one by
one (concept: the concepts in use and the ATC classes; concept_ancestor: the rows with an ATC
ancestor); the steps still report the table's full row count. Rows come as Arrow record
batches: DuckDB's own reader (in process, with ``memory_limit`` set: it counts toward our
memory), PostgreSQL's through ADBC's libpq driver (binary COPY). Both are opened read-only.

Credentials come from the URL or libpq's environment (PGPASSWORD, ~/.pgpass, PGSERVICE); the
password never appears in a message: errors show the URL with it masked and have it (and
PGPASSWORD's value) cut out; a libpq key/value string (``host=... password=...``), which is
not taken, is refused with its password masked too (`mask_secrets`).

Every wait on the server is bounded (`Timeouts`): the connection by libpq's
``connect_timeout`` (a server that accepts and never answers included), every statement by
the session's ``statement_timeout``; either ends the run with exit 2 naming the server.

Schema and table names are matched exactly; when none matches exactly, a match in another
case is taken only if it is the one there is (``--cdm-schema CDM`` finds ``cdm``), and two
(``VOCAB`` and ``vocab``, asked ``Vocab``) are refused, naming both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import pyarrow as pa

from cognet.core.errors import InputError, one_line
from cognet.data.tables import SourceTable, find_tables

DUCKDB_MEMORY = "512MB"  # DuckDB's memory_limit: it runs in our process; a scan needs little
DUCKDB_THREADS = 2
DUCKDB_BATCH = 1 << 18  # rows per record batch
DUCKDB_SUFFIXES = (".duckdb", ".ddb")
MASK = "***"
# a libpq key/value connection string: at least one `key=value` with a key libpq knows
KEY_VALUE = re.compile(r"(?:^|\s)(?:host|hostaddr|port|dbname|user|password|service)\s*=", re.I)
SECRET_VALUE = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S*)", re.I)


@dataclass(frozen=True)
class Timeouts:
    """The longest waits on a database server, in seconds: the connection (libpq's
    connect_timeout, whose least is 2 s) and each statement (statement_timeout)."""

    connect: float = 30.0
    statement: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("connect", "statement"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"the {name} timeout must be a number of seconds > 0")


@dataclass(frozen=True)
class DbOptions:
    """How `build_omop` reads a CDM database (a folder of files ignores them): the schema of
    the clinical tables, that of concept and concept_ancestor (None: the same) and the
    longest waits on the server."""

    cdm_schema: str = "cdm"
    vocab_schema: str | None = None
    timeouts: Timeouts = Timeouts()


def mask_secrets(text: str) -> str:
    """`text` with every password it may hold masked: a URL's (user part, found on the text
    itself, so a URL that does not parse is masked too, or ``password=`` parameter), a
    key/value string's (``password=...``, quoted or not), and the value of PGPASSWORD
    wherever it appears."""
    span = password_span(text)
    if span:
        text = text[: span[0]] + MASK + text[span[1] :]
    text = SECRET_VALUE.sub(lambda m: m.group(1) + MASK, text)
    env = os.environ.get("PGPASSWORD")
    return text.replace(env, MASK) if env else text


def password_span(url: str) -> tuple[int, int] | None:
    """Where the password of a URL's user part lies in `url` ([start, end)), else None: from
    the first ':' after '://' to the last '@'. Read on the text, not by a URL parser: a host
    holds no '@', while a password may hold '/', '?' or '#', which end the user part for a
    parser (`urlsplit` would take `se` of `u:se#cret@host` for a port, and show `cret`)."""
    begin = url.find("://")
    at = url.rfind("@")
    if begin < 0 or at < begin + 3:
        return None
    colon = url.find(":", begin + 3, at)
    return (colon + 1, at) if colon >= 0 else None


def is_database(cdm: str | Path) -> bool:
    """Whether ``--cdm`` names a database (a URL or a DuckDB file) rather than a folder."""
    text = str(cdm)
    return "://" in text or text.lower().endswith(DUCKDB_SUFFIXES)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Database:
    """One read-only connection; every error it raises names the database, never a password."""

    kind = ""

    def __init__(self, shown: str, secrets: Sequence[str] = ()):
        env = os.environ.get("PGPASSWORD", "")
        self.shown = shown
        self.secrets = sorted({s for s in (*secrets, env) if s}, key=len, reverse=True)

    def error(self, what: str, exc: BaseException) -> InputError:
        """``DATABASE: WHAT (reason)`` with the password cut out of the reason."""
        reason = one_line(exc)
        for secret in self.secrets:
            reason = reason.replace(secret, MASK)
        return InputError(f"{self.shown}: {what} ({reason})")

    def stream(self, sql: str, name: str) -> Iterator[pa.RecordBatch]:
        raise NotImplementedError

    def rows(self, sql: str, name: str) -> list[tuple]:
        """All rows of a small query (catalog look-ups, counts)."""
        rows = []
        for batch in self.stream(sql, name):
            rows.extend(zip(*(c.to_pylist() for c in batch.columns), strict=True))
        return rows

    def find_table(self, schema: str, table: str) -> tuple[str, str, str, list[str]] | None:
        """(catalog, schema, table, columns) as the database spells them, in the database
        opened: the names as given, else the one match in another case; InputError when
        there are several such matches (`VOCAB` and `vocab`), None when there is none."""
        rows = self.rows(
            "SELECT table_catalog, table_schema, table_name, column_name "
            "FROM information_schema.columns WHERE table_catalog = current_database() "
            f"AND lower(table_schema) = {_literal(schema.lower())} "
            f"AND lower(table_name) = {_literal(table.lower())} "
            "ORDER BY table_schema, table_name, ordinal_position",
            "information_schema.columns",
        )
        found = list(dict.fromkeys(r[:3] for r in rows))
        exact = [f for f in found if f[1:] == (schema, table)]
        if len(found) > 1 and not exact:
            names = " and ".join(f"{f[1]}.{f[2]}" for f in found)
            raise InputError(
                f"{self.shown}: table {schema}.{table} matches {names} in case only; name "
                "one exactly (--cdm-schema, --vocab-schema)"
            )
        if not found:
            return None
        first = (exact or found)[0]
        return (*first, [r[3] for r in rows if r[:3] == first])

    def schemas(self) -> list[str]:
        """The schemas that hold tables (for the message of a table not found)."""
        rows = self.rows(
            "SELECT DISTINCT table_schema FROM information_schema.tables "
            "WHERE table_catalog = current_database() "
            "AND table_schema NOT IN ('information_schema', 'pg_catalog') ORDER BY 1",
            "information_schema.tables",
        )
        return [r[0] for r in rows]

    def close(self) -> None:
        """Release the connection and what the engine holds (again: nothing happens)."""
        if getattr(self, "con", None) is not None:
            self.con.close()
            self.con = None


class DuckDatabase(Database):
    kind = "duckdb"

    def __init__(self, path: Path):
        import duckdb

        super().__init__(str(path))
        self.path = path
        if not path.is_file():
            raise InputError(f"{path}: DuckDB database not found")
        config = {"memory_limit": DUCKDB_MEMORY, "threads": DUCKDB_THREADS}
        try:
            self.con = duckdb.connect(str(path), read_only=True, config=config)
        except duckdb.Error as exc:
            raise self.error("not a readable DuckDB database", exc) from None
        self._error = duckdb.Error

    def stream(self, sql: str, name: str) -> Iterator[pa.RecordBatch]:
        try:
            reader = self.con.cursor().sql(sql).to_arrow_reader(DUCKDB_BATCH)
            yield from reader
        except self._error as exc:
            raise self.error(f"reading {name} failed", exc) from None


class PostgresDatabase(Database):
    kind = "postgresql"

    def __init__(self, url: str, secrets: Sequence[str], shown: str, timeouts: Timeouts):
        from adbc_driver_postgresql import dbapi

        super().__init__(shown, secrets)
        self._error = dbapi.Error
        self.timeouts = timeouts
        try:
            self.con = dbapi.connect(with_connect_timeout(url, timeouts.connect))
            with self.con.cursor() as cursor:  # nothing this run does may write there
                cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
                cursor.execute(f"SET statement_timeout = {int(timeouts.statement * 1000)}")
        except dbapi.Error as exc:
            raise self.error(
                f"cannot connect within the {timeouts.connect:g} s connect timeout", exc
            ) from None

    def error(self, what: str, exc: BaseException) -> InputError:
        """As Database.error, saying which timeout ended a statement."""
        if "statement timeout" in str(exc):
            what += f" (statement timeout {self.timeouts.statement:g} s: --statement-timeout)"
        return super().error(what, exc)

    def stream(self, sql: str, name: str) -> Iterator[pa.RecordBatch]:
        try:
            with self.con.cursor() as cursor:
                cursor.execute(sql)
                yield from cursor.fetch_record_batch()
        except (self._error, OSError) as exc:  # the reader raises OSError (a timeout too)
            raise self.error(f"reading {name} failed", exc) from None


def masked(url: str) -> tuple[str, list[str]]:
    """The URL with its password (in the user part or a ``password=`` parameter) replaced by
    ``***``, and the password as written and decoded (empty when there is none)."""
    secrets = []
    span = password_span(url)
    if span:
        secrets.append(url[span[0] : span[1]])
        url = url[: span[0]] + MASK + url[span[1] :]
    parts = urlsplit(url)
    query = []
    for item in parts.query.split("&") if parts.query else []:
        key, equals, value = item.partition("=")
        if key.lower() == "password" and equals:
            secrets.append(value)
            value = MASK
        query.append(f"{key}{equals}{value}")
    shown = urlunsplit(parts._replace(query="&".join(query)))
    secrets = [s for s in secrets if s]
    return shown, sorted({*secrets, *(unquote(s) for s in secrets)}, key=len, reverse=True)


def with_connect_timeout(url: str, seconds: float) -> str:
    """`url` with libpq's connect_timeout (whole seconds, at least 2, libpq's least), unless
    it sets one itself."""
    parts = urlsplit(url)
    if "connect_timeout=" in parts.query:
        return url
    query = "&".join(q for q in (parts.query, f"connect_timeout={max(2, round(seconds))}") if q)
    return urlunsplit(parts._replace(query=query))


def database_file(cdm: str | Path) -> Path | None:
    """The DuckDB file that ``--cdm`` names (a path or duckdb:/// URL), else None."""
    text = str(cdm)
    if text.lower().startswith("duckdb:///"):
        return Path(text[len("duckdb:///") :]) if len(text) > len("duckdb:///") else None
    return Path(text) if is_database(text) and "://" not in text else None


def open_database(cdm: str | Path, timeouts: Timeouts = Timeouts()) -> Database:
    """The database that ``--cdm`` names; InputError for an unknown kind or a failed
    connection (the message shows the URL with its password masked)."""
    text = str(cdm)
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if not scheme:
        return DuckDatabase(Path(text))
    span = password_span(text)
    if span and any(c in text[span[0] : span[1]] for c in "/?#@"):  # parsers split there
        raise InputError(
            f"{mask_secrets(text)}: not a valid URL (its password holds '/', '?', '#' or '@', "
            "which end a URL's user part: write them %2F, %3F, %23, %40)"
        )
    try:
        shown, secrets = masked(text)
        urlsplit(text).port  # noqa: B018 - a bad port or IPv6 address raises here
    except ValueError as exc:
        raise InputError(f"{mask_secrets(text)}: not a valid URL ({one_line(exc)})") from None
    if scheme == "duckdb":
        path = database_file(text)
        if path is None:
            raise InputError(
                f"{shown}: a DuckDB URL is duckdb:///relative/path or duckdb:////absolute/path"
            )
        return DuckDatabase(path)
    base = scheme.split("+", 1)[0]
    if base in ("postgresql", "postgres"):
        return PostgresDatabase("postgresql://" + text.split("://", 1)[1], secrets, shown, timeouts)
    raise InputError(
        f"{shown}: unsupported database {scheme!r} (supported: duckdb:///PATH, a .duckdb "
        "file, postgresql://USER@HOST/DB)"
    )


class DbTable(SourceTable):
    """One table of a database, read as `SourceTable` reads a file: ``batches`` streams the
    columns asked for (and the rows the filter keeps), and `rows_read` gives the full count."""

    def __init__(self, db: Database, catalog: str, schema: str, name: str, columns: list[str]):
        self.db, self.schema, self.table = db, schema, name
        self.path = Path(f"{schema}.{name}")
        # the catalog too: a DuckDB file cdm.duckdb is a catalog "cdm", as the schema may be
        self.qualified = ".".join(_ident(n) for n in (catalog, schema, name))
        self.parquet = True  # typed columns: no tab-file unquoting
        self.names = list(columns)
        self.columns = {}
        for column in self.names:
            self.columns.setdefault(column.lower(), column)
        self.filter: str | None = None

    def label(self) -> str:
        return f"{self.db.shown}: table {self.schema}.{self.table}"

    def row_name(self, row: int) -> str:
        return f"row {row} of the scan"

    def where(self, column: str, row: int | None = None) -> str:
        text = f"{self.label()}: column {self.columns.get(column, column)!r}"
        return text if row is None else f"{text}, {self.row_name(row)}"

    def column(self, name: str) -> str:
        """The column as a quoted SQL identifier; InputError when the table lacks it."""
        if name not in self.columns:
            raise InputError(f"{self.where(name)}: missing column")
        return _ident(self.columns[name])

    def batches(self, required: Sequence[str], optional: Sequence[str] = ()):
        wanted = [*required, *(c for c in optional if c in self.columns)]
        select = ", ".join(self.column(c) for c in wanted)
        sql = f"SELECT {select} FROM {self.qualified}"
        if self.filter:
            sql += f" WHERE {self.filter}"
        start = 0
        for batch in self.db.stream(sql, f"table {self.schema}.{self.table}"):
            yield start, {c: batch.column(i) for i, c in enumerate(wanted)}
            start += batch.num_rows

    def rows_read(self, read: int) -> int:
        if not self.filter:
            return read
        sql = f"SELECT count(*) FROM {self.qualified}"
        return int(self.db.rows(sql, f"table {self.schema}.{self.table}")[0][0])


def find_db_tables(
    db: Database, names: Sequence[str], schema_of: dict[str, str]
) -> dict[str, DbTable]:
    """Each table in its schema; InputError naming the missing one and the schemas there are."""
    tables = {}
    for name in names:
        schema = schema_of[name]
        found = db.find_table(schema, name)
        if found is None:
            there = ", ".join(db.schemas()) or "none"
            raise InputError(
                f"{db.shown}: table {schema}.{name} not found (schemas with tables: {there}; "
                "see --cdm-schema and --vocab-schema)"
            )
        tables[name] = DbTable(db, *found)
    return tables


def push_down_filters(
    tables: dict[str, DbTable], atc_classes: Sequence[str], event_columns: dict[str, str]
) -> None:
    """The rows of concept and concept_ancestor that the conversion can use, chosen in the
    database: concepts of conditions and procedures, ATC classes, their descendants."""
    concept, ancestor = tables["concept"], tables["concept_ancestor"]
    classes = ", ".join(_literal(c) for c in atc_classes)
    atc = f"lower({concept.column('concept_class_id')}) IN ({classes})"
    used = " UNION ".join(
        f"SELECT {tables[t].column(c)} FROM {tables[t].qualified}" for t, c in event_columns.items()
    )
    concept.filter = f"{atc} OR {concept.column('concept_id')} IN ({used})"
    ancestor.filter = (
        f"{ancestor.column('ancestor_concept_id')} IN "
        f"(SELECT {concept.column('concept_id')} FROM {concept.qualified} WHERE {atc})"
    )


@dataclass
class Cdm:
    """The opened tables of a CDM, what to show for it, and the paths the run reads."""

    tables: dict[str, SourceTable]
    shown: str
    inputs: list[Path]
    release: Callable[[], None] = lambda: None  # once the tables are read: free the engine


@contextmanager
def open_cdm(
    cdm: str | Path,
    names: Sequence[str],
    schema_of: dict[str, str],
    event_columns: dict[str, str],
    atc_classes: Sequence[str],
    timeouts: Timeouts = Timeouts(),
) -> Iterator[Cdm]:
    """The tables of a CDM folder (`tables.find_tables`) or database, closed on exit; in a
    database the concept filters are pushed down (`push_down_filters`)."""
    if KEY_VALUE.search(str(cdm)) and not is_database(cdm):
        raise InputError(
            f"{mask_secrets(str(cdm))}: a key/value connection string is not taken; give "
            "postgresql://USER@HOST:PORT/DB (the password from PGPASSWORD or ~/.pgpass)"
        )
    if not is_database(cdm):
        folder = Path(cdm)
        tables = find_tables(folder, names)
        yield Cdm(tables, str(folder), [folder, *(t.path for t in tables.values())])
        return
    db = open_database(cdm, timeouts)
    try:
        found = find_db_tables(db, names, schema_of)
        push_down_filters(found, atc_classes, event_columns)
        inputs = [db.path] if isinstance(db, DuckDatabase) else []
        yield Cdm(dict(found), db.shown, inputs, db.close)
    finally:
        db.close()
