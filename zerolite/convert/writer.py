"""`zerolite convert`: a Hugging Face checkpoint into a layout the engine reads at full disk speed.

The extents of all blocks are planned from the model's shapes before any weight is read, so the
data file is allocated whole up front (a full disk fails then, not halfway) and an interrupted
conversion can resume: each finished block is made durable, then recorded in a journal. The
manifest is written last and atomically, so a layout without one is never taken for whole.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from zerolite.convert.checkpoint import Checkpoint, iter_block_tensors, one_line
from zerolite.convert.extents import data_bytes, plan_extents, same_extents
from zerolite.convert.paths import default_layout_path
from zerolite.convert.read_ahead import read_ahead
from zerolite.errors import ZeroliteError
from zerolite.hf import build_meta_model, rescales_weights
from zerolite.io.engine import aligned_empty
from zerolite.layout.blocks import partition
from zerolite.layout.manifest import DATA_FILE, MANIFEST, BlockEntry, Manifest, TensorEntry, choose_dtype
from zerolite.progress import byte_progress
from zerolite.quant.quantize import WeightScheme, quantizable_linears

PROCESS_SYMBOLS = ctypes.CDLL(None)  # the C library's among them
JOURNAL = "convert.journal"
LOCK = ".zerolite.lock"
SIDE_FILE_MARGIN = 64 << 20  # config and tokenizer files, on top of the weights


def convert(
    model: str | os.PathLike,
    path: str | os.PathLike,
    dtype: str | None = None,
    allow_pickle: bool = False,
    show_progress: bool = True,
    weights: str | None = None,
    group_size: int | None = None,
) -> Manifest:
    """Converts MODEL into a layout at path and returns its manifest (at once if it is already there).

    weights: "int8" or "int4" (in groups of group_size) stores the decoder layers' Linear weights
    quantized (zerolite.quant.quantize); None keeps them in the layout's dtype."""
    scheme = WeightScheme.parse(weights, group_size)
    checkpoint = Checkpoint.open(model, allow_pickle)
    config = checkpoint.config()
    torch_dtype = choose_dtype(dtype, config)
    meta_model = build_meta_model(config, torch_dtype)
    blocks = partition(meta_model)
    targets = scheme.fitting(quantizable_linears(meta_model, blocks.layers_path)) if scheme else {}
    if scheme:
        if rescales_weights(config):
            raise ZeroliteError(
                f"{config.model_type} divides the weights of its layers past the first {config.rescale_every} in "
                "place at its first forward (its rescale_every), which int8 and int4 weights cannot take: "
                "leave out `weights`")
    planned = plan_extents(meta_model, blocks, scheme, targets)
    source = {"model": source_name(model), "fingerprint": checkpoint.fingerprint()}
    dtype_name = str(torch_dtype).removeprefix("torch.")
    quantization = scheme.to_manifest() if scheme else None

    out = prepare_folder(path, model, dtype)
    with exclusive_lock(out):
        existing = read_existing_manifest(out)
        if existing and existing.source["model"] != source["model"]:
            raise ZeroliteError(
                f"{out} holds a layout of another model ({existing.source['model']}), not of {source['model']}: "
                "choose another `path`, or delete that folder to convert into it"
            )
        if (existing and existing.source["fingerprint"] == source["fingerprint"] and existing.dtype == dtype_name
                and existing.quantization == quantization and same_extents(existing, planned)):
            return existing
        (out / MANIFEST).unlink(missing_ok=True)  # from here on the layout is not whole

        header = {"fingerprint": source["fingerprint"], "dtype": dtype_name, "quantization": quantization,
                  "data_bytes": data_bytes(planned)}
        done = read_journal(out, header)
        check_free_space(out, header["data_bytes"])
        quantize = (lambda tensors: scheme.quantize_block(tensors, targets)) if scheme else (lambda tensors: tensors)
        finished = write_blocks(checkpoint, meta_model, blocks, planned, torch_dtype, out, header, done, show_progress,
                                quantize)

        for name in checkpoint.side_files():
            (out / name).parent.mkdir(exist_ok=True)
            shutil.copyfile(checkpoint.folder / name, out / name)
        manifest = Manifest(
            model_type=config.model_type,
            dtype=dtype_name,
            layers_path=blocks.layers_path,
            blocks=tuple(finished[name] for name in planned),
            aliases=blocks.aliases,
            source=source,
            quantization=quantization,
        )
        write_atomically(out / MANIFEST, manifest.to_json())
        (out / JOURNAL).unlink()
    return manifest


def source_name(model: str | os.PathLike) -> str:
    """How the manifest names its source: an absolute path for local files, else the hub id."""
    local = Path(model).expanduser()
    return str(local.resolve()) if local.exists() else str(model)


def prepare_folder(path: str | os.PathLike, model: str | os.PathLike, dtype: str | None) -> Path:
    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        # A layout has a folder of its own: written beside other files, it would mix with them.
        if not holds_layout(out) and any(entry.name != LOCK for entry in out.iterdir()):
            raise ZeroliteError(
                f"`path` {out} holds other files and no zerolite layout: convert into a new or empty folder, "
                f"such as {default_layout_path(str(model), dtype, root=out)}"
            )
        probe = out / ".zerolite-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ZeroliteError(
            f"cannot write to `path` {out}: {e.strerror or one_line(e)}; choose a folder you can write to"
        ) from e
    return out


def holds_layout(folder: Path) -> bool:
    """A layout, or a conversion into one that did not finish."""
    return (folder / MANIFEST).is_file() or (folder / JOURNAL).is_file()


@contextmanager
def exclusive_lock(out: Path) -> Iterator[None]:
    """One writer per layout: a second convert into the same folder is refused, never interleaved."""
    with open(out / LOCK, "a+") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ZeroliteError(
                f"another zerolite is converting into {out}: wait for it to finish or choose another `path`"
            ) from None
        yield


def read_existing_manifest(out: Path) -> Manifest | None:
    if not (out / MANIFEST).is_file():
        return None
    try:
        return Manifest.from_json((out / MANIFEST).read_text(), out / MANIFEST)
    except ZeroliteError:
        return None  # damaged: converted again


def read_journal(out: Path, header: dict) -> dict[str, BlockEntry]:
    """Blocks an interrupted conversion of the same source finished; otherwise starts afresh."""
    journal = out / JOURNAL
    done: dict[str, BlockEntry] = {}
    if journal.is_file() and (out / DATA_FILE).is_file():  # without the data, the journal vouches for nothing
        lines = journal.read_text().split("\n")
        if lines and json_or_none(lines[0]) == header:
            # The last line may be torn by the crash; every complete one follows a durable block.
            for line in lines[1:]:
                raw = json_or_none(line)
                if raw is not None:
                    done[raw["name"]] = BlockEntry.from_dict(raw)
    if not done:
        (out / DATA_FILE).unlink(missing_ok=True)
        write_atomically(journal, json.dumps(header) + "\n")
    return done


def json_or_none(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def check_free_space(out: Path, needed: int) -> None:
    data = out / DATA_FILE
    already = data.stat().st_blocks * 512 if data.exists() else 0
    missing = max(needed - already, 0) + SIDE_FILE_MARGIN
    free = shutil.disk_usage(out).free
    if free < missing:
        raise ZeroliteError(
            f"not enough free space on {out}: the layout needs {missing / 1e9:.2f} GB more, "
            f"{free / 1e9:.2f} GB is free; free some space or choose another `path`"
        )


def write_blocks(checkpoint, meta_model, blocks, planned, dtype, out, header, done, show_progress,
                 quantize) -> dict[str, BlockEntry]:
    """Writes every block not yet done, its tensors through quantize; each is durable before the
    journal records it. The next block is read meanwhile."""
    finished = dict(done)
    fd = os.open(out / DATA_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        allocate(fd, header["data_bytes"], out)
        pending = [name for name in planned if name not in done]
        todo_bytes = sum(planned[name].length for name in pending)
        with byte_progress("converting", todo_bytes, len(pending), enabled=show_progress) as progress, \
                open(out / JOURNAL, "a") as journal:
            for block, tensors in read_ahead(iter_block_tensors(checkpoint, meta_model, blocks, dtype, skip=set(done))):
                entry = write_block(fd, planned[block.name], quantize(tensors), out)
                journal.write(json.dumps(asdict(entry)) + "\n")
                journal.flush()
                os.fsync(journal.fileno())
                finished[block.name] = entry
                progress.advance(entry.length)
                give_back_freed_heap()
    finally:
        os.close(fd)
    return finished


def give_back_freed_heap() -> None:
    """Returns the heap a block's work freed to the system (glibc keeps it otherwise: quantizing a
    26 GB model's layers left half a gigabyte of its temporaries resident between blocks)."""
    if hasattr(PROCESS_SYMBOLS, "malloc_trim"):  # glibc's
        PROCESS_SYMBOLS.malloc_trim(0)


def allocate(fd: int, nbytes: int, out: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ZeroliteError(f"{out} ran out of space allocating {nbytes / 1e9:.2f} GB: "
                                "free some space or choose another `path`") from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def write_block(fd: int, planned: BlockEntry, tensors: dict[str, torch.Tensor], out: Path) -> BlockEntry:
    # The buffer's pages are taken as tensors are copied in, and each tensor is let go once copied,
    # so the block is in memory about once, not twice (a layer of a 26 GB model is 0.64 GB; zeroing
    # the whole buffer first held both, 2.06 GB of peak RSS). Only the padding is zeroed: it is part
    # of the checksum.
    buffer = aligned_empty(planned.length, huge_pages=False)  # filled once (io.engine.host_mapping)
    for start, end in padding(planned):
        buffer[start:end] = 0
    for entry in planned.tensors:
        tensor = tensors.pop(entry.name).contiguous()
        if str(tensor.dtype).removeprefix("torch.") != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ZeroliteError(f"{entry.name} came out of the checkpoint as {tensor.dtype} {tuple(tensor.shape)}, "
                                f"expected {entry.dtype} {entry.shape}")
        for start, piece in tensor_pieces(entry, tensor):
            buffer[start : start + piece.nbytes] = piece.reshape(-1).view(torch.uint8)
    data = buffer.numpy()
    try:
        written = os.pwrite(fd, data, planned.offset)
        if written != planned.length:
            raise OSError(errno.EIO, f"short write of block {planned.name}")
        os.fdatasync(fd)
    except OSError as e:
        raise ZeroliteError(f"writing {out / DATA_FILE} failed: {one_line(e)}; free space or choose another `path`, "
                            "then convert again (finished blocks are kept)") from e
    # Written once, read back later with O_DIRECT: keep it out of the page cache.
    os.posix_fadvise(fd, planned.offset, planned.length, os.POSIX_FADV_DONTNEED)
    area = planned.experts
    if area is not None:
        crc32s = tuple(zlib.crc32(data[start:start + length]) for start, length in map(area.extent, range(area.count)))
        area = dataclasses.replace(area, dense_crc32=zlib.crc32(data[:area.offset]), crc32s=crc32s)
    return BlockEntry(planned.name, planned.offset, planned.length, zlib.crc32(data), planned.tensors, area)


def padding(planned: BlockEntry) -> list[tuple[int, int]]:
    """The (start, end) ranges of the block that no tensor's bytes cover."""
    covered = sorted((start, start + nbytes) for entry in planned.tensors for start, nbytes in piece_extents(entry))
    gaps, cursor = [], 0
    for start, end in covered:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    return gaps + ([(cursor, planned.length)] if cursor < planned.length else [])


def piece_extents(entry: TensorEntry) -> list[tuple[int, int]]:
    """(offset in the block, bytes) of each piece tensor_pieces writes."""
    if not entry.expert_stride:
        return [(entry.offset, entry.nbytes)]
    return [(entry.offset + expert * entry.expert_stride, entry.nbytes // entry.shape[0])
            for expert in range(entry.shape[0])]


def tensor_pieces(entry: TensorEntry, tensor: torch.Tensor):
    """(offset in the block, bytes) of the tensor: whole, or each expert's slice in its extent."""
    if not entry.expert_stride:
        return [(entry.offset, tensor)]
    return [(start, tensor[expert]) for expert, (start, _) in enumerate(piece_extents(entry))]


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the whole new one, never a part: temp file, fsync, rename, fsync dir."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
