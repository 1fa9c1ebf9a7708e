"""GGUF files as a conversion source, and the built-in model that ships as one.

transformers reads GGUF by dequantizing every tensor into memory, so this path holds the whole
model in RAM once: right for the small built-in model, not for a 70B one (convert those from
safetensors). The dequantized model is saved once as an ordinary safetensors folder in zerolite's
cache, and conversion proceeds from there like any other checkpoint.
"""

from __future__ import annotations

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
