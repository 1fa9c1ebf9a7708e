"""Tiny random models and their layouts, each saved and converted once per test session."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest

from support.tiny_models import save_tiny_model
from zerolite.convert.writer import convert


class TinyLayouts:
    """Hands out the folder of a tiny model (source) or of its layout, made the first time its
    arguments are asked for and shared after that. A test that changes the files asks for
    fresh=True: its own copy, so that the shared one stays as made."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._tmp = tmp_path_factory
        self._made: dict[tuple, Path] = {}

    def source(self, arch: str = "llama", layers: int = 3, tie: bool = True, seed: int = 0, fresh: bool = False,
               **config) -> Path:
        """config: fields of the transformers config, over tiny_models' small shape."""
        key = ("source", arch, layers, tie, seed, *sorted(config.items()))
        if key not in self._made:
            folder = self._tmp.mktemp(f"{arch}-source") / "source"
            # Unheard: transformers' progress bar would land in the output of the test that asked first.
            with contextlib.redirect_stderr(io.StringIO()):
                self._made[key] = save_tiny_model(arch, folder, layers=layers, tie=tie, seed=seed, **config)
        return self._copy(self._made[key]) if fresh else self._made[key]

    def layout(self, arch: str = "llama", layers: int = 3, tie: bool = True, seed: int = 0, dtype: str | None = None,
               weights: str | None = None, group_size: int | None = None, fresh: bool = False, **config) -> Path:
        """dtype: the conversion's --dtype (None keeps the checkpoint's); weights, group_size: its
        --weights and --group-size."""
        key = ("layout", arch, layers, tie, seed, dtype, weights, group_size, *sorted(config.items()))
        if key not in self._made:
            source = self.source(arch, layers, tie, seed, **config)
            folder = self._tmp.mktemp(f"{arch}-layout") / "layout"
            convert(source, folder, dtype=dtype, weights=weights, group_size=group_size, show_progress=False)
            self._made[key] = folder
        return self._copy(self._made[key]) if fresh else self._made[key]

    def _copy(self, folder: Path) -> Path:
        copy = self._tmp.mktemp(f"{folder.name}-copy") / folder.name
        shutil.copytree(folder, copy)
        return copy
