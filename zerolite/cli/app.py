"""The `zerolite` command: convert a model into a layout, inspect or verify one, generate from it, serve it, profile it.

The commands live beside this file, one module each (zerolite.cli.main gathers them).
"""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(
    name="zerolite",
    help="Run Hugging Face causal LMs larger than memory by streaming blocks from NVMe or CPU memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    """--debug is taken out of the arguments by main(), wherever it stands; it is declared here for --help."""
