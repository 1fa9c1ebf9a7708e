"""The layout a model runs from: the one given, or the checkpoint given converted into one, once."""

from __future__ import annotations

from pathlib import Path

from zerolite.convert.paths import builtin_gguf, default_layout_path
from zerolite.convert.writer import JOURNAL, convert, holds_layout
from zerolite.errors import ZeroliteError
from zerolite.layout.manifest import MANIFEST


def ensure_layout(model, path, dtype, allow_pickle: bool, show_progress: bool) -> Path:
    """The layout folder to run from: model itself if it is one, else model converted (once).

    path is a layout (or an unfinished conversion) to use, or else an offload root such as /nvme
    holding one layout per model, each in a folder of its own (default: zerolite's cache).
    """
    path = Path(path).expanduser() if path is not None else None
    if model is None and path is not None and holds_layout(path):
        model = path  # no --model: --path names the layout to run
    if model is not None and (Path(model).expanduser() / MANIFEST).is_file():
        return Path(model).expanduser()
    if model is not None and (Path(model).expanduser() / JOURNAL).is_file():
        raise ZeroliteError(
            f"the conversion into {model} did not finish: run zerolite convert MODEL --path {model} again to complete it"
        )
    source = str(model) if model is not None else str(builtin_gguf())
    folder = path if path is not None and holds_layout(path) else default_layout_path(source, dtype, root=path)
    convert(source, folder, dtype=dtype, allow_pickle=allow_pickle, show_progress=show_progress)
    return folder
