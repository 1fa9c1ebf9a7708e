"""Putting a block's tensors into the model's own modules, and taking them out again.

The model is built with every parameter on the meta device. Binding swaps a block's meta
parameters (and stored buffers) for views of the bytes in a slot; unbinding swaps the meta ones
back, so a block that ran without its weights bound fails loudly instead of using stale bytes.
A swap is a dict assignment per tensor: a few microseconds for a whole decoder layer. The views
are made once per place a block's bytes lie (making them took a decode step's layer ~60 us, as
long as some of its matmuls): a block held in memory, or back in the ring slot it had, rebinds
the views it had. A module that
keeps something made from its bound tensors (a GPU's int4 layer, the fused kernel's packing of its
weight: zerolite.quant.linear) has an unbound() method, called as they are taken out.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolite.layout.folder import tensor_views
from zerolite.layout.manifest import BlockEntry


class BlockBinding:
    def __init__(self, model: nn.Module, entry: BlockEntry, aliases: dict[str, str]):
        self.entry = entry
        stored = {t.name for t in entry.tensors}
        names = [(t.name, t.name) for t in entry.tensors]
        names += [(alias, target) for alias, target in aliases.items() if target in stored]
        # (the module's parameter or buffer dict, attribute, stored tensor name, meta placeholder)
        self._targets: list[tuple[dict, str, str, torch.Tensor]] = []
        unbound = {}
        for attribute_path, stored_name in names:
            module_path, _, leaf = attribute_path.rpartition(".")
            module = model.get_submodule(module_path)
            home = module._parameters if leaf in module._parameters else module._buffers
            self._targets.append((home, leaf, stored_name, home[leaf]))
            if callable(getattr(module, "unbound", None)):
                unbound[id(module)] = module.unbound
        self._unbound = list(unbound.values())
        # (device, address, bytes) of the buffer last bound, and its views: while they live, so
        # does the buffer, so a buffer at the same address with the same size is that one
        self._made_for: tuple | None = None
        self._views: list[torch.Tensor] = []

    def bind(self, block_bytes: torch.Tensor) -> None:
        """Makes the module use the tensors laid out in block_bytes (no copy)."""
        where = (block_bytes.device, block_bytes.data_ptr(), block_bytes.numel())
        if where != self._made_for:
            views = tensor_views(self.entry, block_bytes)
            self._views = [views[stored_name] for _, _, stored_name, _ in self._targets]
            self._made_for = where
        for (home, leaf, _, _), view in zip(self._targets, self._views):
            home[leaf] = view

    def unbind(self) -> None:
        for home, leaf, _, placeholder in self._targets:
            home[leaf] = placeholder
        for unbound in self._unbound:
            unbound()
