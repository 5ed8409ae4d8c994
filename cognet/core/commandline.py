"""Helpers shared by the cognet command lines (`cognet`, `cognet-export`, `cognet-batch`,
`cognet-bench`): error mapping, the output guard, logging and the options several commands
take (`count_option`, `ddi_options`, `decoding_options`).

The one module of click outside the command lines themselves: the library below them
(`cognet.core` included) raises plain exceptions and never imports click, and the torch-free
runtime may import this module and `cognet.core` only (`make lint` checks both)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import click

from cognet.core.ddi import DDI_MODES, RECOMMENDED_PENALTY, policy_from_options
from cognet.core.decoding.defaults import BEAM, DECODINGS, ESTIMATORS, SET_RULES
from cognet.core.decoding.request import DecodingRequest
from cognet.core.errors import InputError, OutputError, escaped
from cognet.core.files import Reads, guarded
from cognet.core.interrupt import EXIT_CODE, Terminated

# The optional packages a command may need, and the extra of setup.py that installs each:
# on a runtime-only install (`.[cpu]`), a command that needs one names the extra.
EXTRA_OF = {
    "torch": "train",
    "safetensors": "train",
    "onnx": "train",
    "onnxscript": "train",
    "onnxruntime": "cpu",
    "matplotlib": "bench",
    "ray": "ray",
    "duckdb": "db",
    "adbc_driver_postgresql": "db",
    "meds": "meds",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The one line naming the extra that installs the missing module; None when the module
    is not one of cognet's optional packages."""
    module = (exc.name or "").partition(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return None
    ctx = click.get_current_context(silent=True)
    command = ctx.command_path if ctx is not None else "this command"
    other = ' (or ".[gpu]" on a GPU machine)' if extra == "cpu" else ""
    return (
        f"{command} needs {module}, which is not installed: install the [{extra}] extra, "
        f'pip install -e ".[{extra}]"{other} (README, Installing)'
    )


def handle_errors(func: Callable) -> Callable:
    """Turn library exceptions into exit codes: InputError -> 2, anything else -> 1
    (OutputError, a file that could not be written, prints its one line).

    Click's own usage errors keep their exit code 2. A user mistake never prints a
    traceback; unexpected errors print one line unless COGNET_DEBUG is set.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except InputError as exc:  # every line escaped: names and values come from files
            click.echo(f"Error: {escaped(str(exc))}", err=True)
            sys.exit(2)
        except OutputError as exc:
            click.echo(f"Error: {escaped(str(exc))}", err=True)
            sys.exit(1)
        except FileNotFoundError as exc:
            click.echo(f"Error: {escaped(str(exc.filename or exc))}: file not found", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("Interrupted", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("Terminated", err=True)
            sys.exit(EXIT_CODE)
        except ModuleNotFoundError as exc:
            import os

            line = missing_extra(exc)
            if line is None or os.environ.get("COGNET_DEBUG"):
                raise
            click.echo(f"Error: {line}", err=True)
            sys.exit(2)
        except Exception as exc:  # noqa: BLE001 - the CLI boundary
            import os

            if os.environ.get("COGNET_DEBUG"):
                raise
            click.echo(f"Error: {type(exc).__name__}: {escaped(str(exc))}", err=True)
            sys.exit(1)

    return wrapper


class OneLineUsage:
    """A mixin for the top click command or group of a program: a usage error (a bad
    option value, a missing argument, a mix refused) prints one line, `Error: ...`, and
    exits 2, like every other input error, instead of click's usage block."""

    def make_context(self, *args, **kwargs):
        with _one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line():
            return super().invoke(ctx)


class OneLineGroup(OneLineUsage, click.Group):
    """A click group whose usage errors are one line (`OneLineUsage`)."""


class OneLineCommand(OneLineUsage, click.Command):
    """A click command whose usage errors are one line (`OneLineUsage`)."""


@contextlib.contextmanager
def _one_line():
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise  # the help text, not an error
    except click.UsageError as exc:
        error = click.ClickException(escaped(exc.format_message()))
        error.exit_code = exc.exit_code
        raise error from None


def guard_outputs(
    command: str,
    outputs: Mapping[str, str | Path | None],
    reads: Reads,
    folders: Sequence[str] = (),
) -> None:
    """Check the command's outputs before any work and lock them until the command ends
    (`cognet.core.files.guarded`): an output on an input, or one that cannot be written,
    exits 2 naming it; so does a second run on an output that a run is writing. `folders`:
    the options whose output is a folder written file by file. A click resource ends without
    seeing whether the command failed, so a folder built aside and moved in on success
    (`cognet.core.files.Stage`) takes `guarded` in a `with` block instead."""
    guard = guarded(command, outputs, reads, list(folders))  # names only: nothing staged
    click.get_current_context().with_resource(guard)


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class FiniteFloat(click.FloatRange):
    """A float option that must be a finite number in its range: click's FloatRange lets
    `nan` through every bound and `inf` through a missing one."""

    name = "finite float"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def count_option(
    *decls: str, help: str | None = None, default: int | None = None, **kwargs
) -> Callable:
    """A click option taking a positive integer (a count: beam width, threads, visits per
    batch, ...); its default, when it has one, shows in --help."""
    kwargs.setdefault("show_default", default is not None)
    return click.option(*decls, type=click.IntRange(min=1), default=default, help=help, **kwargs)


def db_timeout_options(func: Callable) -> Callable:
    """--connect-timeout / --statement-timeout: the longest waits on a database server, in
    seconds (`cognet.data.omop_db.Timeouts`)."""
    func = click.option(
        "--statement-timeout",
        type=FiniteFloat(0, min_open=True),
        default=3600,
        show_default=True,
        help="Database only: seconds one statement may run before the run stops (exit 2).",
    )(func)
    return click.option(
        "--connect-timeout",
        type=FiniteFloat(0, min_open=True),
        default=30,
        show_default=True,
        help="Database only: seconds to wait for the server to connect (at least 2).",
    )(func)


def ddi_options(func: Callable) -> Callable:
    """--ddi-mode / --ddi-penalty / --ddi-max-rate (see `cognet.core.ddi`); turn them into a
    policy with `ddi_policy`."""
    options = [
        click.option(
            "--ddi-mode",
            type=click.Choice(DDI_MODES),
            default=None,
            help="DDI-aware decoding: hard = never emit a medication interacting "
            "with one already recommended; soft = penalise it per pair. Default: the "
            "model's own (the policy of its --ddi-target, if trained with one), else off.",
        ),
        click.option(
            "--ddi-penalty",
            type=FiniteFloat(min=0),
            default=None,
            help="soft: log-probability removed per interacting pair "
            f"(default {RECOMMENDED_PENALTY:g}).",
        ),
        click.option(
            "--ddi-max-rate",
            type=FiniteFloat(0, 1),
            default=None,
            help="Keep the DDI rate of each recommendation <= this: set decoding drops "
            "a medication that would lift its set's rate above it; beam search returns the "
            "best finished beam within it (else the lowest-rate beam).",
        ),
        click.option(
            "--ddi-pair-price",
            type=FiniteFloat(0, 1),
            default=None,
            help="Set decoding: return the set of highest expected Jaccard less this "
            "per interacting pair it holds (e.g. 0.002; asks for the expected-Jaccard rule).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def ddi_policy(
    mode: str | None,
    penalty: float | None,
    max_rate: float | None,
    pair_price: float | None = None,
):
    """The `cognet.core.ddi.DDIPolicy` of the ddi_options, or None when none was given (the
    model's own policy applies); click.UsageError on a bad mix."""
    if mode is None and penalty is None and max_rate is None and pair_price is None:
        return None
    try:
        return policy_from_options(mode or "off", penalty, max_rate, pair_price)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def decoding_options(func: Callable) -> Callable:
    """The options of `DecodingRequest` (--decoding, --beam, --samples, --threshold,
    --estimator, --set-rule and the DDI options), given to `func` as one `request:
    DecodingRequest`; `cognet evaluate` and `cognet-batch score` take them alike. An option
    that does not apply to the asked decoding is a usage error (exit 2, one line)."""
    # the options below are the request's fields by name; the DDI options make its `ddi`
    named = [f.name for f in dataclasses.fields(DecodingRequest) if f.name != "ddi"]

    @functools.wraps(func)
    def wrapper(*args, ddi_mode, ddi_penalty, ddi_max_rate, ddi_pair_price, **kwargs):
        policy = ddi_policy(ddi_mode, ddi_penalty, ddi_max_rate, ddi_pair_price)
        asked = {name: kwargs.pop(name) for name in named}
        try:
            request = DecodingRequest(**asked, ddi=policy)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        return func(*args, request=request, **kwargs)

    options = [
        click.option(
            "--decoding",
            type=click.Choice(DECODINGS),
            default=None,
            help="set: the model's best set of medications (from seeded samples); "
            "beam: the paper's beam search; marginal: the set read in one pass from "
            "the model's set head (models trained with one). Default: the model's "
            "own (marginal for models trained with the set head, set without).",
        ),
        count_option(
            "--beam",
            help=f"Beam width of beam search (default {BEAM}; 1 = greedy); alone, it "
            "asks for beam search; with a set-decoding option, a usage error.",
        ),
        count_option(
            "--samples", help="Set decoding: samples per visit (default: the model's, 16)."
        ),
        click.option(
            "--threshold",
            type=FiniteFloat(0, 1, min_open=True),
            default=None,
            help="Set and marginal decoding: threshold on P(medication in set) "
            "(default: the model's, tuned on validation); it asks for the threshold rule.",
        ),
        click.option(
            "--estimator",
            type=click.Choice(ESTIMATORS),
            default=None,
            help="Set decoding: how the samples are drawn (default: the model's; "
            "plain for models from before the estimators).",
        ),
        click.option(
            "--set-rule",
            type=click.Choice(SET_RULES),
            default=None,
            help="Set and marginal decoding: how the set is read from P(medication "
            "in set): threshold, or the set of highest expected Jaccard (default: "
            "the model's; threshold with --threshold).",
        ),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return ddi_options(wrapper)
