"""The `zerolite` command: convert a model into a layout, and inspect or verify one.

Every problem a user can fix ends as one line on stderr and a non-zero exit; --debug adds the
traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.exceptions import TyperException
from rich.table import Table

from zerolite.errors import ZeroliteError
from zerolite.progress import stderr

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


@app.command()
def convert(
    path: Annotated[Path, typer.Option("--path", help="Folder to write the layout into.")],
    model: Annotated[
        str | None,
        typer.Argument(help="Model folder, .gguf file, or hub id in the local cache (default: the built-in SmolLM2-135M-Instruct)."),
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 (default: the config's dtype).")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read pickled .bin weights (weights_only=True).")] = False,
) -> None:
    """Convert a checkpoint into an aligned layout that zerolite streams at full disk speed."""
    from zerolite.convert import convert as run_convert
    from zerolite.gguf_source import builtin_gguf

    model = model or str(builtin_gguf())
    manifest = run_convert(model, path, dtype=dtype, allow_pickle=allow_pickle)
    print(f"{path}: {len(manifest.blocks)} blocks, {manifest.data_bytes / 1e9:.3f} GB of {manifest.dtype}")


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A layout folder written by zerolite convert.")],
    verify: Annotated[bool, typer.Option("--verify", help="Read every block and check its checksum.")] = False,
) -> None:
    """Show a layout's blocks; with --verify, read them all back and check their checksums."""
    from zerolite.io import IoEngine, aligned_empty
    from zerolite.layout import Layout
    from zerolite.progress import byte_progress

    layout = Layout.open(path)
    manifest = layout.manifest
    table = Table(title=f"{path} ({manifest.model_type}, {manifest.dtype})")
    for column in ("block", "offset", "bytes", "tensors"):
        table.add_column(column, justify="right" if column != "block" else "left")
    for block in manifest.blocks:
        table.add_row(block.name, str(block.offset), f"{block.length:,}", str(len(block.tensors)))
    typer.echo(f"{len(manifest.blocks)} blocks, {manifest.data_bytes / 1e9:.3f} GB, from {manifest.source['model']}")
    if not verify:
        stderr.print(table)
        return
    engine = IoEngine()
    buffer = aligned_empty(max(b.length for b in manifest.blocks))
    with byte_progress("verifying", manifest.data_bytes, len(manifest.blocks)) as progress:
        for block in manifest.blocks:
            layout.read_block(block.name, engine, buffer, verify=True)
            progress.advance(block.length)
    typer.echo("every block matches its checksum")


def main() -> None:
    # transformers draws raw tqdm bars (GGUF dequantization) that no logging switch silences; tqdm
    # reads this when it is first imported, which the lazy imports in the commands come after.
    os.environ.setdefault("TQDM_DISABLE", "1")
    argv = sys.argv[1:]
    debug = "--debug" in argv
    try:
        code = app(args=[a for a in argv if a != "--debug"], standalone_mode=False)
    except ZeroliteError as e:
        fail(str(e), debug)
    except TyperException as e:  # usage errors: a missing argument, a bad option value
        fail(f"{e.format_message()} (see zerolite --help)", debug, code=2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        fail("interrupted", debug, code=130)
    except Exception as e:  # a bug, not bad input: still one line unless asked for more
        fail(f"internal error: {type(e).__name__}: {' '.join(str(e).split())} (rerun with --debug for the traceback)", debug)
    sys.exit(code if isinstance(code, int) else 0)


def fail(message: str, debug: bool, code: int = 1) -> None:
    if debug:
        import traceback

        traceback.print_exc()
    print(f"zerolite: error: {message}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
