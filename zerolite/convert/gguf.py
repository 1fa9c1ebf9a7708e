"""GGUF files as a conversion source, and the built-in model that ships as one.

transformers reads GGUF by dequantizing every tensor into memory, so this path holds the whole
model in RAM once: right for the small built-in model, not for a 70B one (convert those from
safetensors). The dequantized model is saved once as an ordinary safetensors folder in zerolite's
cache, and conversion proceeds from there like any other checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from pathlib import Path

from zerolite.convert.paths import cache_dir
from zerolite.errors import ZeroliteError
from zerolite.hf import quiet_transformers


def gguf_as_folder(gguf: Path) -> Path:
    """A safetensors model folder (weights, config, tokenizer) made from gguf, once, in the cache."""
    stat = gguf.stat()
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with parsed_once(gguf):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError) as e:
        raise ZeroliteError(f"cannot read {gguf} as a GGUF model ({' '.join(str(e).split())[:200]})") from e
    # The tensors are dequantized already; the GGUF quantizer only stops save_pretrained.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)  # whole or absent
    return folder


@contextlib.contextmanager
def parsed_once(gguf: Path):
    """While transformers loads gguf: one gguf-py reader of the file, and one tensor-name map per
    architecture and depth.

    transformers' GGUF loading (load_gguf_checkpoint, which every architecture but a few new ones
    takes, 5.17 to 5.24 at least) parses the file with gguf-py's GGUFReader anew for the config, the
    weights and the tokenizer's config, each parse walking every string of the vocabulary and merges,
    and builds gguf-py's tensor-name map anew for every submodule of the model (397 times for SmolLM2)
    though the map depends only on the architecture and the depth: together most of the built-in
    model's conversion time. Both are made once here and handed out by the names transformers imports
    them by at each call; the config, the names' mapping and the permutations are still transformers'.
    """
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(gguf)
    make_reader, make_name_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map

    def reader_of(path, *args, **kwargs):
        if not args and not kwargs and Path(path).resolve() == gguf.resolve():
            return reader
        return make_reader(path, *args, **kwargs)

    gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader_of, functools.cache(make_name_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = make_reader, make_name_map
