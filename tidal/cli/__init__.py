"""The ``tidal`` command. Each command group lives in its own module and registers on ``app``."""

from __future__ import annotations

import sys

import typer

from tidal.api import ConfigError

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
    from tidal.cli import brain, job, sim  # noqa: F401


def main() -> None:
    import logging
    import os

    logging.basicConfig(level=os.environ.get("TIDAL_LOG_LEVEL", "ERROR").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _register_commands()
    try:
        app()
    except ConfigError as exc:
        typer.echo(f"tidal: error: {exc}", err=True)
        sys.exit(2)
