"""GGUF files of a transformers Llama folder, for tools/bench.py's llama.cpp contenders: the same
weights the other contenders read, made once and kept for later runs.

    folder = gguf_folder(Path("build/llama19/source"), Path("build/llama19"))   # named for the source's files
    make_gguf(Path("build/llama19/source"), folder, "q4_0")                      # folder/q4_0.gguf, if missing

bf16 is written with the gguf package, as llama.cpp's convert_hf_to_gguf.py writes a Llama (that
script cannot be used: it needs the model's tokenizer, and the benchmark's random model has none):
tensors named by the gguf map for MODEL_ARCH.LLAMA, the q and k projections' rows permuted (HF's
rotary embedding pairs dimension i of a head with i + head_dim/2, llama.cpp's with i + 1), 1-D
tensors (norms) in f32. The prompts are token ids, so the vocabulary is vocab_size synthetic tokens.
q4_0 and q8_0 are llama.cpp's own quantizer (llama_model_quantize, with its defaults: for Q4_0,
output.weight in Q6_K, as in the Q4_0 files people download) run on the bf16 file.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from zerolite.errors import ZeroliteError

WEIGHTS = ("bf16", "q4_0", "q8_0")
FILE_TYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}  # llama.cpp's quantizer's
CONTROL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2, as in Llama's own vocabulary


def gguf_folder(source: Path, root: Path) -> Path:
    """The folder under root for source's GGUF files, named for the source's files: another source,
    or the same one saved again, gets a folder of its own."""
    files = sorted(source.glob("*.safetensors")) + [source / "config.json"]
    key = [str(source.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return root / f"gguf-{source.name}-{hashlib.sha256(' '.join(key).encode()).hexdigest()[:16]}"


def make_gguf(source: Path, folder: Path, weights: str) -> Path:
    """folder/WEIGHTS.gguf, written from source unless it is there already."""
    if weights not in WEIGHTS:
        raise ZeroliteError(f"no GGUF of {weights!r} weights: one of {', '.join(WEIGHTS)}")
    path = folder / f"{weights}.gguf"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")  # a killed run leaves no file that looks whole
        if weights == "bf16":
            write_bf16(source, partial)
        else:
            quantize(make_gguf(source, folder, "bf16"), partial, weights)
        partial.rename(path)
    return path


def write_bf16(source: Path, path: Path) -> None:
    """One tensor in memory at a time: the header (every tensor's name, shape and type) first, then
    each tensor's data as it is read from the safetensors files."""
    config = json.loads((source / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ZeroliteError(f"{source} is a {config.get('architectures')} model: GGUFs are made of Llamas only")
    rope = config.get("rope_parameters") or config  # transformers 5 nests them, earlier versions did not
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ZeroliteError(f"{source}'s rotary embedding is scaled ({rope}): not written to GGUF here")
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    vocab = config["vocab_size"]

    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*CONTROL_TOKENS, *(f"<t{i}>" for i in range(len(CONTROL_TOKENS), vocab))])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * (vocab - len(CONTROL_TOKENS)))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tensors = []  # (safetensors file, its name, the GGUF's name)
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if gguf_name is None:
                    raise ZeroliteError(f"{file}: no GGUF name for the tensor {name!r}")
                shape = f.get_slice(name).get_shape()
                raw = gguf.GGMLQuantizationType.BF16 if len(shape) > 1 else None
                itemsize = 2 if raw else 4
                writer.add_tensor_info(gguf_name, shape, np.dtype(np.int16 if raw else np.float32),
                                       int(np.prod(shape)) * itemsize, raw_dtype=raw)
                tensors.append((file, name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for file, name in tensors:
        with safe_open(file, framework="pt") as f:
            tensor = f.get_tensor(name)
        if ".q_proj." in name:
            tensor = rotary_pairs_adjacent(tensor, heads)
        elif ".k_proj." in name:
            tensor = rotary_pairs_adjacent(tensor, kv_heads)
        if tensor.dim() > 1:
            writer.write_tensor_data(tensor.to(torch.bfloat16).view(torch.int16).numpy())
        else:
            writer.write_tensor_data(tensor.to(torch.float32).numpy())
    writer.close()


def rotary_pairs_adjacent(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: within each head, the rows HF's rotary embedding
    rotates together (i and i + head_dim/2) made neighbours (2i and 2i + 1), as llama.cpp rotates."""
    pairs = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def quantize(bf16: Path, path: Path, weights: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FILE_TYPES[weights])
    if llama_cpp.llama_model_quantize(str(bf16).encode(), str(path).encode(), ctypes.byref(params)) != 0:
        raise ZeroliteError(f"llama.cpp could not quantize {bf16} to {weights.upper()}")
