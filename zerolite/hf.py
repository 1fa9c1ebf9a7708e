"""transformers glue that every room shares: quiet logging, and a layout's tokenizer."""

from __future__ import annotations

from pathlib import Path

from zerolite.errors import ZeroliteError


def quiet_transformers() -> None:
    """transformers' and the hub's own bars and warnings would bury zerolite's progress on stderr."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    disable_progress_bars()


def load_tokenizer(folder: Path):
    """The layout's tokenizer, padding on the left as decoder-only generation needs; None if it has none."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ZeroliteError(f"cannot read the tokenizer in {folder} ({' '.join(str(e).split())[:160]})") from e
    tokenizer.padding_side = "left"
    return tokenizer
