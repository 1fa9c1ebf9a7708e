"""The layout's on-disk format: where each block's bytes are, and where each tensor is inside its block.

    layout/
      manifest.json      written last, atomically: its presence means the layout is whole
      weights.bin        every block as one 4 KiB-aligned extent, in execution order
      config.json ...    the model's config, generation config and tokenizer files

A layout in place (zerolite.convert.in_place) is manifest.json alone: its blocks are pieces of the
checkpoint's own safetensors shards (the shards' sizes and times recorded, so that a changed shard
is refused), and the config and tokenizer are read from the checkpoint's folder. A mixture's layer
in place keeps its experts per expert as a converted layout does, each expert's extent made from
the parts of the checkpoint's tensors that transformers fuses into it (ExpertSources).

Everything read from manifest.json is validated before use: names are plain dotted identifiers,
the data file stays inside the layout folder, and every extent lies inside its file.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch

from zerolite.errors import ZeroliteError
from zerolite.io.engine import ALIGNMENT, align_up

FORMAT = "zerolite-layout"
VERSION = 1
MANIFEST = "manifest.json"
DATA_FILE = "weights.bin"
TENSOR_ALIGNMENT = 256  # inside a block: enough for any dtype and for vectorised GPU loads

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}
DTYPE_CHOICES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # what convert's `dtype` takes
QUANTIZED_WEIGHTS = ("int8", "int4")  # the weight schemes this build converts and runs (zerolite.quant.quantize)
NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the block (for a fused expert tensor: of expert 0's slice)
    expert_stride: int = 0  # a fused expert tensor stored one slice per expert extent: bytes from one
                            # expert's slice to the next; 0 for a tensor stored in one piece

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @property
    def span(self) -> int:
        """Bytes from the tensor's first byte to its last, padding between experts' slices included."""
        if not self.expert_stride:
            return self.nbytes
        return (self.shape[0] - 1) * self.expert_stride + self.nbytes // self.shape[0]


@dataclass(frozen=True)
class ExpertSources:
    """In place: where each expert's extent comes from in the shards. A checkpoint stores a
    mixture's experts one tensor per expert and matrix (Mixtral's experts.N.w1, w2, w3), which
    transformers stacks and concatenates into the fused tensors the module has (gate_up_proj is
    w1 then w3 along the rows, per expert): every expert's extent holds the same parts, each a
    run of bytes of one checkpoint tensor, at the same places; only where they lie in the
    shards differs from expert to expert."""
    places: tuple[int, ...]                # per part: bytes from the start of an expert's extent
    lengths: tuple[int, ...]               # per part: bytes
    shards: tuple[tuple[int, ...], ...]    # per expert, per part: index into Manifest.shards
    offsets: tuple[tuple[int, ...], ...]   # per expert, per part: bytes from the start of that shard


@dataclass(frozen=True)
class ExpertArea:
    """The tail of a layer's block where a mixture's experts lie, one 4 KiB-aligned extent each,
    holding that expert's slice of every fused expert tensor: a step reads only the experts its
    router picks. The bytes before offset (attention, norms, router, shared experts) are the
    layer's dense part."""
    module: str                 # the experts module, from the layer: "mlp.experts"
    offset: int                 # bytes from the start of the block to expert 0's extent
    stride: int                 # bytes per expert extent
    count: int
    dense_crc32: int | None     # of the bytes before offset (None in place until `zerolite verify`)
    crc32s: tuple[int | None, ...]  # of each expert's extent (likewise)
    sources: ExpertSources | None = None  # in place: where the experts' bytes lie in the shards

    def extent(self, expert: int) -> tuple[int, int]:
        """(start in the block, length) of one expert's bytes."""
        return self.offset + expert * self.stride, self.stride


@dataclass(frozen=True)
class Shard:
    """A checkpoint file a layout in place reads from, as it was when the manifest was written."""
    path: str      # absolute
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Piece:
    """Part of a block in place: bytes of one shard, 4 KiB aligned at both ends (the last piece of
    a shard may run past its end; those bytes read as zeros). A block's bytes are its pieces one
    after another."""
    shard: int    # index into Manifest.shards
    offset: int   # in the shard
    length: int


@dataclass(frozen=True)
class BlockEntry:
    name: str
    offset: int   # bytes from the start of the data file, 4 KiB aligned (0 in place)
    length: int   # bytes, 4 KiB aligned (zero padded)
    crc32: int | None  # of all `length` bytes; None in place until `zerolite verify` hashes it
    tensors: tuple[TensorEntry, ...]
    experts: ExpertArea | None = None  # where a mixture-of-experts layer's experts lie apart
    pieces: tuple[Piece, ...] = ()     # in place: where its bytes lie in the shards

    @property
    def dense_length(self) -> int:
        """Bytes a step always needs: the whole block, or a mixture's part before its experts."""
        return self.experts.offset if self.experts else self.length

    @classmethod
    def from_dict(cls, raw: dict) -> BlockEntry:
        """From its JSON form (the manifest's and the convert journal's): lists become tuples."""
        tensors = tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in raw["tensors"])
        experts = raw.get("experts")
        if experts is not None:
            sources = experts.get("sources")
            if sources is not None:
                sources = ExpertSources(tuple(sources["places"]), tuple(sources["lengths"]),
                                        tuple(map(tuple, sources["shards"])), tuple(map(tuple, sources["offsets"])))
            experts = ExpertArea(**{**experts, "crc32s": tuple(experts["crc32s"]), "sources": sources})
        pieces = tuple(Piece(**piece) for piece in raw.get("pieces", ()))
        return cls(**{**raw, "tensors": tensors, "experts": experts, "pieces": pieces})


@dataclass(frozen=True)
class Manifest:
    model_type: str
    dtype: str
    layers_path: str
    blocks: tuple[BlockEntry, ...]
    aliases: dict[str, str]          # tied parameter -> the stored tensor it shares
    source: dict[str, str]           # what it was converted from: {"model", "fingerprint"}
    data_file: str = DATA_FILE
    quantization: dict | None = None  # {"weights": "int8", ...} when the layers' Linear weights are quantized
    shards: tuple[Shard, ...] = ()    # in place: the checkpoint files its blocks' pieces lie in

    @property
    def in_place(self) -> bool:
        return bool(self.shards)

    @property
    def data_bytes(self) -> int:
        """The bytes its blocks take: the data file's, or in place what the pieces read."""
        if self.in_place:
            return sum(block.length for block in self.blocks)
        return self.blocks[-1].offset + self.blocks[-1].length if self.blocks else 0

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The decoder layers' blocks, in order; the others are the embeddings, final norm and head."""
        return tuple(b.name for b in self.blocks if b.name.startswith("layers."))

    def nbytes(self, names) -> int:
        """Bytes of the named blocks together."""
        return sum(self.block(name).length for name in names)

    def block(self, name: str) -> BlockEntry:
        """Called several times per layer per decode step: a dict lookup, not a scan of the blocks."""
        try:
            return self._blocks_by_name[name]
        except KeyError:
            raise KeyError(f"no block named {name!r}; blocks are {', '.join(b.name for b in self.blocks)}") from None

    @cached_property
    def _blocks_by_name(self) -> dict[str, BlockEntry]:
        # Built on first use; cached_property writes the instance __dict__, which a frozen dataclass allows.
        return {block.name: block for block in self.blocks}

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.pop("format", None) != FORMAT or raw.pop("version", None) != VERSION:
                raise ValueError(f"not a {FORMAT} version {VERSION} manifest")
            blocks = tuple(BlockEntry.from_dict(b) for b in raw.pop("blocks"))
            shards = tuple(Shard(**shard) for shard in raw.pop("shards", ()))
            manifest = cls(blocks=blocks, shards=shards, **raw)
            manifest.validate()
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ZeroliteError(
                f"{where} is damaged ({' '.join(str(e).split())}): convert the model again into a fresh `path`"
            ) from e
        return manifest

    def validate(self) -> None:
        """Refuses anything that could read outside the layout or misplace a tensor."""
        if not NAME.fullmatch(Path(self.data_file).name) or Path(self.data_file).name != self.data_file:
            raise ValueError(f"data file {self.data_file!r} is not a plain file name inside the layout")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.quantization is not None and self.quantization.get("weights") not in QUANTIZED_WEIGHTS:
            raise ValueError(f"unknown quantization {self.quantization!r}")
        if len(self._blocks_by_name) != len(self.blocks):
            raise ValueError("two blocks share a name")
        if any(not Path(shard.path).is_absolute() for shard in self.shards):
            raise ValueError("a shard path is not absolute")
        end = 0
        for block in self.blocks:
            if not NAME.fullmatch(block.name):
                raise ValueError(f"bad block name {block.name!r}")
            if self.in_place:
                self._validate_pieces(block)
            elif block.offset % ALIGNMENT or block.length % ALIGNMENT or block.offset < end or block.pieces:
                raise ValueError(f"block {block.name} has a misaligned or overlapping extent")
            end = block.offset + block.length
            for tensor in block.tensors:
                if not NAME.fullmatch(tensor.name) or tensor.dtype not in DTYPES:
                    raise ValueError(f"bad tensor entry {tensor.name!r} in block {block.name}")
                if any(not isinstance(d, int) or d < 0 for d in tensor.shape):
                    raise ValueError(f"bad shape for {tensor.name}")
                if tensor.offset < 0 or tensor.offset + tensor.span > block.length:
                    raise ValueError(f"{tensor.name} lies outside block {block.name}")
            if block.experts is not None:
                area = block.experts
                if (not NAME.fullmatch(area.module) or area.offset % ALIGNMENT or area.stride % ALIGNMENT
                        or area.count < 1 or len(area.crc32s) != area.count
                        or area.offset + area.count * area.stride != block.length
                        or (area.sources is not None) != self.in_place):
                    raise ValueError(f"block {block.name} has a bad expert area")
        if not self.in_place and any(block.crc32 is None for block in self.blocks):
            raise ValueError("a converted block has no checksum")
        stored = {t.name for b in self.blocks for t in b.tensors}
        for alias, target in self.aliases.items():
            if not NAME.fullmatch(alias) or target not in stored:
                raise ValueError(f"alias {alias!r} points at {target!r}, which is not stored")

    def _validate_pieces(self, block: BlockEntry) -> None:
        """A block in place: aligned pieces of recorded shards, as many bytes as the block has
        before its experts; each expert's parts inside its extent and inside their shards."""
        dense = sum(p.length for p in block.pieces)
        if not block.pieces or block.dense_length != dense:
            raise ValueError(f"block {block.name} has bad pieces")
        for piece in block.pieces:
            if (not 0 <= piece.shard < len(self.shards) or piece.offset % ALIGNMENT or piece.length % ALIGNMENT
                    or piece.length <= 0 or piece.offset + piece.length > align_up(self.shards[piece.shard].size)):
                raise ValueError(f"block {block.name} has a piece outside its shard")
        sources = block.experts.sources if block.experts is not None else None
        if sources is None:
            return
        parts = len(sources.places)
        if (len(sources.lengths) != parts or len(sources.shards) != block.experts.count
                or len(sources.offsets) != block.experts.count
                or any(place < 0 or length <= 0 or place + length > block.experts.stride
                       for place, length in zip(sources.places, sources.lengths))):
            raise ValueError(f"block {block.name} has bad expert sources")
        for shards, offsets in zip(sources.shards, sources.offsets):
            if len(shards) != parts or len(offsets) != parts or any(
                    not 0 <= shard < len(self.shards) or offset < 0 or offset + length > self.shards[shard].size
                    for shard, offset, length in zip(shards, offsets, sources.lengths)):
                raise ValueError(f"block {block.name} has an expert part outside its shard")


def pack(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Places tensors one after another, each TENSOR_ALIGNMENT aligned; returns entries and block length."""
    entries, cursor = [], 0
    for name, tensor in tensors.items():
        cursor = round_up(cursor, TENSOR_ALIGNMENT)
        entry = TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), cursor)
        entries.append(entry)
        cursor += entry.nbytes
    return entries, round_up(cursor, ALIGNMENT)


def pack_experts(tensors: dict[str, torch.Tensor], start: int) -> tuple[list[TensorEntry], int]:
    """Places fused expert tensors ([experts, ...] each) from start (4 KiB aligned) on: one extent
    per expert, holding its slice of every tensor, each slice TENSOR_ALIGNMENT aligned; returns
    the entries and the extents' stride."""
    slices, cursor = {}, 0
    for name, tensor in tensors.items():
        cursor = round_up(cursor, TENSOR_ALIGNMENT)
        slices[name] = cursor
        cursor += tensor[0].numel() * tensor.dtype.itemsize
    stride = round_up(cursor, ALIGNMENT)
    entries = [TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), start + slices[name], stride)
               for name, tensor in tensors.items()]
    return entries, stride


def choose_dtype(dtype: str | None, config) -> torch.dtype:
    """The dtype a layout is converted to: the one asked for by name, else the config's where it is
    one of DTYPE_CHOICES, else fp32."""
    if dtype is not None:
        if dtype not in DTYPE_CHOICES:
            raise ZeroliteError(f"unknown `dtype` {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
        return DTYPE_CHOICES[dtype]
    configured = getattr(config, "dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    return configured if configured in DTYPE_CHOICES.values() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
