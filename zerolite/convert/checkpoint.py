"""Reading a Hugging Face checkpoint one block at a time, through transformers' own loading conversion.

transformers 5 renames and fuses some checkpoint tensors while loading (legacy names, missing
base-model prefixes, per-expert MoE weights stacked into one tensor). Rather than re-implement
that, each block's checkpoint tensors are handed to transformers' loader for a model built on the
meta device; what comes out has exactly the names and shapes the instantiated modules have. Only
one block's tensors are ever materialised, so memory stays within a few blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    convert_and_load_state_dict_in_model,
    rename_source_key,
)
from transformers.modeling_utils import LoadStateDictConfig

from zerolite.convert.gguf import gguf_as_folder
from zerolite.errors import ZeroliteError
from zerolite.hf import quiet_transformers
from zerolite.io.engine import aligned_empty, pread_into
from zerolite.layout.blocks import BlockPartition, BlockSpec

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"

# The files of a model folder that a layout copies. Tokenizers are those transformers 5 saves with
# save_pretrained and reads back (tokenizer_config.json, tokenizer.json, chat_template.jinja and the
# other templates in CHAT_TEMPLATE_DIR, added_tokens.json; special_tokens_map.json and
# chat_template.json from older saves), and the vocabularies under the names the tokenizer classes
# of causal LMs give them (vocab_files_names; tekken.json is mistral-common's).
LAYOUT_FILES = (
    "config.json", "generation_config.json",
    "tokenizer_config.json", "tokenizer.json", "chat_template.jinja", "added_tokens.json",
    "special_tokens_map.json", "chat_template.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
    "sentencepiece.model", "emoji.json", "tekken.json",
)
CHAT_TEMPLATE_DIR = "additional_chat_templates"

FINGERPRINT_SAMPLE = 1 << 20

@dataclass(frozen=True)
class Checkpoint:
    """A local model folder: its config and the weight files that hold its tensors."""

    folder: Path
    weight_files: tuple[Path, ...]
    pickled: bool  # .bin files, read with torch.load(weights_only=True)

    @classmethod
    def open(cls, model: str | os.PathLike, allow_pickle: bool = False) -> Checkpoint:
        folder = resolve_model_folder(model)
        if not (folder / "config.json").is_file():
            raise ZeroliteError(f"{folder} has no config.json: point MODEL at a Hugging Face model folder")
        weight_files, pickled = find_weight_files(folder)
        if pickled and not allow_pickle:
            raise ZeroliteError(
                f"{folder} holds only pickled .bin weights, which can run code when loaded: "
                "pass `allow_pickle` if you trust them (they are read with weights_only=True)"
            )
        if not pickled:
            for path in weight_files:
                check_safetensors_file(path)
        return cls(folder, weight_files, pickled)

    def config(self) -> PretrainedConfig:
        try:
            return AutoConfig.from_pretrained(self.folder)
        except (ValueError, KeyError, OSError) as e:
            raise ZeroliteError(f"cannot read the model config in {self.folder}: {one_line(e)}") from e

    def fingerprint(self) -> str:
        """Changes whenever a weight file does. File times tick only every few milliseconds, so a
        sample of each file's bytes (its head, holding the tensor index, and its tail) goes in too."""
        digest = hashlib.sha256()
        for path in self.weight_files:
            stat = path.stat()
            digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}\n".encode())
            with open(path, "rb") as f:
                digest.update(f.read(FINGERPRINT_SAMPLE))
                f.seek(max(stat.st_size - FINGERPRINT_SAMPLE, 0))
                digest.update(f.read(FINGERPRINT_SAMPLE))
        return digest.hexdigest()

    def side_files(self) -> list[Path]:
        """What a layout needs besides the weights to run alone, relative to the folder: the config,
        the generation config and the tokenizer. Whatever else lies there (notes, prompts, remote
        code) stays behind."""
        names = [Path(name) for name in LAYOUT_FILES if (self.folder / name).is_file()]
        templates = sorted((self.folder / CHAT_TEMPLATE_DIR).glob("*.jinja"))
        return names + [path.relative_to(self.folder) for path in templates]

    def lazy_state_dict(self) -> dict[str, object]:
        """Every checkpoint tensor by name, none read yet (StoredTensor, or mmapped tensors of pickled files)."""
        state: dict[str, object] = {}
        for path in self.weight_files:
            if self.pickled:
                state.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            else:
                data_start, header = safetensors_header(path)
                for key, info in header.items():
                    begin, end = info["data_offsets"]
                    state[key] = StoredTensor(path, data_start + begin, end - begin, info["dtype"],
                                              tuple(info["shape"]))
        return state


SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(where the data starts, the tensors' entries) of a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


@dataclass(frozen=True)
class StoredTensor:
    """A safetensors tensor not read yet. transformers' loader reads it with tensor[...]: one pread
    into memory of its own, freed with the block. Not a mapping of the file (safetensors' slices):
    a mapping's pages, once read, stay in the process's resident memory until it unmaps the file,
    which held a whole 26 GB checkpoint in a 23 GB machine's RSS by the end of a conversion."""
    path: Path
    offset: int
    nbytes: int
    dtype: str     # safetensors' name: "BF16", ...
    shape: tuple[int, ...]

    def __getitem__(self, index) -> torch.Tensor:
        if self.dtype not in SAFETENSORS_DTYPES:
            raise ZeroliteError(f"{self.path} stores a tensor as {self.dtype}, which zerolite does not read")
        # Memory of its own from 2 MiB on (aligned_empty): unmapped when the block is done with it.
        # From malloc, glibc's raised mmap threshold kept tensors of tens of MB on its heap, which
        # grew by a layer's worth every few layers. Small pages: it is read into once.
        data = aligned_empty(self.nbytes, huge_pages=False)
        if pread_into(self.path, data, self.offset) < self.nbytes:
            raise ZeroliteError(f"{self.path} ends before its tensors do: it is truncated; download it again")
        return data.view(getattr(torch, SAFETENSORS_DTYPES[self.dtype])).view(self.shape)[index]


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def resolve_model_folder(model: str | os.PathLike) -> Path:
    """A local folder as given, a GGUF file (dequantized once into the cache), or a hub id (org/name)
    looked up in the local Hugging Face cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_as_folder(path)
    if path.exists():
        raise ZeroliteError(f"{path} is a file, not a model folder: point MODEL at the folder holding config.json")
    if isinstance(model, str) and model.count("/") == 1 and not model.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            pass
    raise ZeroliteError(
        f"model folder {model} does not exist, nor is it a model id in the local Hugging Face cache: "
        "give a folder holding config.json and weights, or download the model first (hf download ID)"
    )


def find_weight_files(folder: Path) -> tuple[tuple[Path, ...], bool]:
    for index_name, pickled in ((SAFETENSORS_INDEX, False), (PICKLE_INDEX, True)):
        index = folder / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as e:
                raise ZeroliteError(f"{index} is not a valid weight index ({one_line(e)}): download it again") from e
            missing = [name for name in names if not (folder / name).is_file()]
            if missing:
                raise ZeroliteError(f"{index} names {missing[0]}, which is missing: download the model again")
            return tuple(folder / name for name in names), pickled
    for pattern, pickled in (("*.safetensors", False), ("pytorch_model*.bin", True)):
        files = sorted(folder.glob(pattern))
        if files:
            return tuple(files), pickled
    raise ZeroliteError(
        f"no weights in {folder}: expected model.safetensors (or shards with {SAFETENSORS_INDEX}); "
        "pickled pytorch_model.bin is read only with `allow_pickle`"
    )


def check_safetensors_file(path: Path) -> None:
    """Fails early, with the file named, on a truncated or corrupt safetensors file."""
    try:
        with safe_open(path, framework="pt") as handle:
            handle.keys()
    except (SafetensorError, OSError) as e:
        raise ZeroliteError(
            f"{path} is not a readable safetensors file ({one_line(e)}): it is probably truncated; download it again"
        ) from e


def iter_block_tensors(
    checkpoint: Checkpoint,
    model: nn.Module,
    partition: BlockPartition,
    dtype: torch.dtype,
    skip: set[str] = frozenset(),
) -> Iterator[tuple[BlockSpec, dict[str, torch.Tensor]]]:
    """Yields each block (except those in skip) with its tensors converted to module names and dtype.

    The model is used as a scratch target: a block's parameters are loaded into it, taken out,
    and put back on the meta device before the next block, so memory holds one block at a time.
    """
    quiet_transformers()
    state = checkpoint.lazy_state_dict()
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta_state = model.state_dict()

    keys_by_block: dict[str, list[str]] = {}
    for key in state:
        target, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if target not in meta_state and key in meta_state:
            target = key
        owner = partition.block_of(target)
        if owner is not None:
            keys_by_block.setdefault(owner, []).append(key)

    load_config = LoadStateDictConfig(device_map={"": "cpu"}, dtype=dtype, weight_mapping=mapping)
    for block in partition.blocks:
        if block.name in skip:
            continue
        sub_state = {key: state[key] for key in keys_by_block.get(block.name, [])}
        info, _ = convert_and_load_state_dict_in_model(model, sub_state, load_config)
        if info.mismatched_keys:
            name, found, expected = sorted(info.mismatched_keys)[0]
            raise ZeroliteError(
                f"{name} in {checkpoint.folder} has shape {tuple(found)}, but config.json makes it "
                f"{tuple(expected)}: the weights are for another model than the config"
            )
        yield block, take_block_tensors(model, block, checkpoint.folder)


def take_block_tensors(model: nn.Module, block: BlockSpec, folder: Path) -> dict[str, torch.Tensor]:
    """Removes a loaded block's tensors from the model (leaving meta tensors) and returns them."""
    tensors = {}
    for name in block.tensor_names:
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path)
        tensor = getattr(module, leaf)
        if tensor.device.type == "meta":
            raise ZeroliteError(
                f"the checkpoint in {folder} has no weight for {name}: it is incomplete or for another "
                "model than its config.json describes"
            )
        tensors[name] = tensor.detach()
        meta = torch.empty_like(tensor, device="meta")
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(meta, requires_grad=False)
        else:
            module._buffers[leaf] = meta
    return tensors
