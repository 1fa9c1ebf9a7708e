"""zerolite convert, inspect and verify: making a layout, looking into one, and checking its bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from zerolite.cli import options
from zerolite.cli.app import app
from zerolite.progress import stderr


@app.command()
def convert(
    path: Annotated[Path, typer.Option(
        "--path", help="Folder to write the layout into: a new or empty one, or a layout to bring up to date.")],
    model: Annotated[
        str | None,
        typer.Argument(help="Model folder, .gguf file, or hub id in the local cache "
                       "(default: the built-in SmolLM2-135M-Instruct)."),
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 (default: the config's dtype).")] = None,
    weights: Annotated[str | None, typer.Option(
        help="int8 or int4: the decoder layers' Linear weights quantized, about 0.5x (int8, one scale per output "
        "channel) or 0.28x (int4, a scale and zero point per group) of bf16's bytes per step (default: the layout's "
        "dtype).")] = None,
    group_size: Annotated[int | None, typer.Option(
        "--group-size", help="int4: input weights per scale and zero point, 32, 64 or 128 (default 64; 32 keeps a GGUF "
        "Q4_0/Q4_1 source's values).")] = None,
    allow_pickle: options.AllowPickle = False,
) -> None:
    """Convert a checkpoint into an aligned layout that zerolite streams at full disk speed."""
    from zerolite.convert.paths import builtin_gguf
    from zerolite.convert.writer import convert as run_convert

    model = model or str(builtin_gguf())
    manifest = run_convert(model, path, dtype=dtype, allow_pickle=allow_pickle, weights=weights, group_size=group_size)
    kind = manifest.dtype + (f", {manifest.quantization['weights']} layer weights" if manifest.quantization else "")
    print(f"{path}: {len(manifest.blocks)} blocks, {manifest.data_bytes / 1e9:.3f} GB of {kind}")


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A layout folder: converted, or in place.")],
    verify: Annotated[bool, typer.Option("--verify", help="Read every block and check its checksum.")] = False,
) -> None:
    """Show a layout's blocks; with --verify, read them all back and check their checksums."""
    from zerolite.layout.folder import Layout

    layout = Layout.open(path)
    manifest = layout.manifest
    where = "pieces (shard:offset)" if manifest.in_place else "offset"
    table = Table(title=f"{path} ({manifest.model_type}, {manifest.dtype}{', in place' if manifest.in_place else ''})")
    for column in ("block", where, "bytes", "tensors"):
        table.add_column(column, justify="right" if column != "block" else "left")
    for block in manifest.blocks:
        place = " ".join(f"{p.shard}:{p.offset}" for p in block.pieces) if manifest.in_place else str(block.offset)
        table.add_row(block.name, place, f"{block.length:,}", str(len(block.tensors)))
    kind = f"read in place from {len(manifest.shards)} shard(s) of" if manifest.in_place else "from"
    typer.echo(f"{len(manifest.blocks)} blocks, {manifest.data_bytes / 1e9:.3f} GB, {kind} {manifest.source['model']}")
    if not verify:
        stderr.print(table)
        return
    check_blocks(layout)


@app.command("verify")
def verify_layout(
    path: Annotated[Path, typer.Argument(help="A layout folder: converted, or in place.")],
) -> None:
    """Check every block against its checksum. A layout in place has none at first (safetensors
    carries none): its blocks are read once and their checksums recorded in its manifest, against
    which every later run checks each block it reads."""
    from zerolite.layout.folder import Layout

    layout = Layout.open(path)
    if any(block.crc32 is None for block in layout.manifest.blocks):
        from zerolite.convert.in_place import record_checksums

        record_checksums(layout)
        typer.echo(f"checksums of {len(layout.manifest.blocks)} blocks recorded in {path}: "
                   "later runs check every block they read")
        return
    check_blocks(layout)


def check_blocks(layout) -> None:
    """Reads every block and checks it against its checksum, with a bar."""
    from zerolite.io.engine import IoEngine, aligned_empty
    from zerolite.layout.store import DiskStore
    from zerolite.progress import byte_progress

    manifest = layout.manifest
    disk = DiskStore(layout, IoEngine())
    buffer = aligned_empty(max(b.length for b in manifest.blocks))
    with byte_progress("verifying", manifest.data_bytes, len(manifest.blocks)) as progress:
        for block in manifest.blocks:
            disk.read(block.name, buffer)
            progress.advance(block.length)
    typer.echo("every block matches its checksum")
