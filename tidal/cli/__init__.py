"""The ``tidal`` command. Each command group lives in its own module and registers on ``app``."""

from __future__ import annotations

import sys

import typer

from tidal.api import ConfigError
from tidal.backends.api import BackendError

app = typer.Typer(
    name="tidal",
    help="Elastic training for PyTorch: run elastic jobs, inspect them, plan and simulate resources.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a one-line error to stderr and return the Exit to raise."""
    typer.echo(f"tidal: error: {message}", err=True)
    return typer.Exit(code)


def _register_commands() -> None:
    # Imported for their side effect of adding commands to ``app``.
    from tidal.cli import brain, job, sim, stream  # noqa: F401


def main() -> None:
    import logging
    import os

    logging.basicConfig(level=os.environ.get("TIDAL_LOG_LEVEL", "ERROR").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _register_commands()
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as exc:  # the base of typer's (vendored) click exceptions
        if type(exc).__name__ == "NoArgsIsHelpError":  # typer's own test; it printed the help already
            sys.exit(exc.exit_code)
        # the parser's refusals (an unknown option, a value that does not parse as the option's
        # type, a missing argument) in the same one line as tidal's, not a boxed usage block
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        typer.echo(f"tidal: error: {exc.format_message().rstrip('.')}{hint}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("tidal: aborted", err=True)
        sys.exit(1)
    except (ConfigError, BackendError) as exc:  # BackendError: e.g. a journal naming a backend not registered
        typer.echo(f"tidal: error: {exc}", err=True)
        sys.exit(2)
    # without standalone mode click returns what ended the command: typer.Exit's code or None
    sys.exit(code if isinstance(code, int) else 0)
