"""What a plan needs of the model named on the command line: its config, the precision it runs in,
the weight format if that is already made, and a file on the disk the layers would stream from.

    source = ModelSource.resolve("bigscience/bloom", dtype=None, path=None)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from zerolite.convert.checkpoint import find_weight_files, resolve_model_folder
from zerolite.convert.paths import builtin_gguf
from zerolite.errors import ZeroliteError
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import DTYPES, MANIFEST, choose_dtype
from zerolite.planner.measurements import nearest_existing


@dataclass(frozen=True)
class ModelSource:
    name: str
    config: PretrainedConfig
    dtype: torch.dtype             # what stored weights run in
    weights: str | None            # "stored", "int8" or "int4" where model is a layout (its format is made)
    disk_target: Path              # a file the layers stream from (its read rate is theirs), or a folder on that disk

    @classmethod
    def resolve(cls, model: str | None, dtype: str | None, path: Path | None) -> ModelSource:
        # no model, and a layout as the path: the job runs that layout, as the loader does (not the built-in model)
        given_layout = model is None and path is not None and (Path(path) / MANIFEST).is_file()
        source = Path(path) if given_layout else Path(model).expanduser() if model is not None else builtin_gguf()
        if (source / MANIFEST).is_file():
            layout = Layout.open(source)
            weights = (layout.manifest.quantization or {}).get("weights", "stored")
            return cls(str(source), AutoConfig.from_pretrained(layout.side_folder), DTYPES[layout.manifest.dtype],
                       weights, nearest_existing(path) if path and not given_layout else layout.read_paths[0])
        folder = resolve_model_folder(source if model is None else model)
        try:
            config = AutoConfig.from_pretrained(folder)
        except (ValueError, KeyError, OSError) as e:
            raise ZeroliteError(f"cannot read the model config in {folder}: {str(e).splitlines()[0]}") from e
        try:
            files = find_weight_files(folder)[0]
        except ZeroliteError:
            files = ()  # a config alone: the disk is measured in the folder (--path, or the model's)
        target = nearest_existing(path) if path else max(files, key=lambda f: f.stat().st_size) if files else folder
        return cls(str(model or source.stem), config, choose_dtype(dtype, config), None, target)
