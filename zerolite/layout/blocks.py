"""How a model's weights split into blocks: the unit zerolite stores, reads and streams.

A block is one decoder layer, or everything before the layers (the embeddings), or everything after
them (final norm and head). The decoder layers are found without naming any architecture: they are
the nn.ModuleList holding most of the model's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from zerolite.errors import ZeroliteError

EMBED = "embed"
HEAD = "head"


@dataclass(frozen=True)
class BlockSpec:
    name: str                     # "embed", "layers.0", ..., "head"
    tensor_names: tuple[str, ...]  # state-dict names, in storage order


@dataclass(frozen=True)
class BlockPartition:
    layers_path: str                  # where the decoder layers live, e.g. "model.layers"
    blocks: tuple[BlockSpec, ...]     # in execution order
    aliases: dict[str, str]           # tied name -> the name it is stored under

    @cached_property
    def _owners(self) -> dict[str, str]:
        return {name: block.name for block in self.blocks for name in block.tensor_names}

    def block_of(self, tensor_name: str) -> str | None:
        """The block a state-dict name belongs to (aliases resolved), or None if it is not stored."""
        return self._owners.get(self.aliases.get(tensor_name, tensor_name))


def module_path(layers_path: str, block: str) -> str:
    """Where a layer's block lives in the model: "layers.3" under "model.layers" is "model.layers.3"."""
    return f"{layers_path}.{block.removeprefix('layers.')}"


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList with the most parameters: the decoder stack in every causal LM we know."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if best is None or numel > best[0]:
                best = (numel, path, module)
    if best is None:
        raise ZeroliteError(
            f"{type(model).__name__} has no list of decoder layers; zerolite runs decoder-only "
            "transformers (Llama, Mistral, BLOOM, OPT, GPT-2 and the like)"
        )
    return best[1], best[2]


def stored_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the layout stores: parameters (tied ones once) and persistent buffers."""
    tensors = dict(model.named_parameters())
    persistent = model.state_dict(keep_vars=True)
    tensors.update((name, b) for name, b in model.named_buffers() if name in persistent)
    return tensors


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameter names that share storage with an earlier one: {alias: stored name}."""
    first_name: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            aliases[name] = first_name[id(param)]
        else:
            first_name[id(param)] = name
    return aliases


def partition(model: nn.Module) -> BlockPartition:
    """Splits the model's stored tensors into embed, one block per decoder layer, and head.

    Outside the layers, embedding tables (nn.Embedding and subclasses) form the embed block and the
    rest (final norm, head, and the odd norm between embedding and layers) the head block.
    """
    layers_path, layers = find_decoder_layers(model)
    embedding_params = {
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        for name, _ in module.named_parameters(recurse=False)
    }
    names = list(stored_tensors(model))
    per_layer: list[list[str]] = [[] for _ in layers]
    embed, head = [], []
    for name in names:
        if name.startswith(layers_path + "."):
            index = int(name[len(layers_path) + 1 :].split(".", 1)[0])
            per_layer[index].append(name)
        elif name in embedding_params:
            embed.append(name)
        else:
            head.append(name)
    blocks = [BlockSpec(EMBED, tuple(embed))]
    blocks += [BlockSpec(f"layers.{i}", tuple(t)) for i, t in enumerate(per_layer)]
    blocks.append(BlockSpec(HEAD, tuple(head)))
    return BlockPartition(layers_path, tuple(b for b in blocks if b.tensor_names), tied_aliases(model))
