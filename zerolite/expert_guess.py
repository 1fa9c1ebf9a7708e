"""A guess at the experts the next layer will pick, so that their reads start while this layer computes.

    guess = ExpertGuess(model, manifest, per_expert=["layers.0", ...])
    picked = guess.next("layers.4", layer_4_bytes, hidden, top_k)   # while layer 3's experts run
    guess.score("layers.4", routed)                                  # once layer 4's router has spoken

The guess applies the next layer's router to the hidden states this layer's experts receive: the
residual stream changes little from one layer to the next, so in trained mixtures this picks most
of the next layer's experts (the pre-gating of MoE-Infinity and Pre-gated MoE). Only the router's
linear part is applied (top-k of its logits: softmax and sigmoid keep the order); biases that only
steer selection (DeepSeek-V3's) and group limits are left out, which a guess may afford.

A wrong guess costs a read the step never uses, and a disk-bound step pays for every byte: the
reads follow the guess only once, and while, it has been right RELIABLE of the time lately (every
guess is scored, read or not, so a guess earns that trust over the first steps).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from zerolite.experts import find_experts
from zerolite.layout import tensor_views
from zerolite.manifest import BlockEntry, Manifest

RELIABLE = 0.8   # below this share of guessed experts routed to, guessed reads waste more than they hide
MEMORY = 1 / 16  # weight of the newest guess in the running share


class ExpertGuess:
    def __init__(self, model: nn.Module, manifest: Manifest, per_expert):
        hidden = model.config.get_text_config().hidden_size
        self._routers: dict[str, tuple[BlockEntry, str]] = {}  # block -> its router's tensors, their name prefix
        for name in per_expert:
            router = find_router(model.get_submodule(f"{manifest.layers_path}.{name.removeprefix('layers.')}"), hidden)
            if router is None:
                continue
            prefix = f"{manifest.layers_path}.{name.removeprefix('layers.')}.{router}."
            entries = {t.name.removeprefix(prefix): t for t in manifest.block(name).tensors if t.name.startswith(prefix)}
            if "weight" in entries:  # a quantized router has none: no guess for that layer
                self._routers[name] = (dataclasses.replace(manifest.block(name), tensors=tuple(entries.values())), prefix)
        self._guessed: dict[str, set[int]] = {}
        self.made = 0         # experts guessed
        self.right = 0        # of them, routed to
        self.share = 0.0      # running share of guessed experts routed to, recent guesses weighing most

    def can_guess(self, name: str) -> bool:
        return name in self._routers

    @property
    def reliable(self) -> bool:
        return self.share >= RELIABLE

    @torch.no_grad()
    def next(self, upcoming: str, block_bytes: torch.Tensor, hidden: torch.Tensor, top_k: int) -> list[int]:
        """The experts upcoming's router would pick for these hidden states (the union over them)."""
        entry, prefix = self._routers[upcoming]
        views = tensor_views(entry, block_bytes)
        weight = views[prefix + "weight"]
        logits = F.linear(hidden.reshape(-1, weight.shape[1]).to(weight.dtype), weight, views.get(prefix + "bias"))
        picked = sorted(set(logits.topk(top_k, dim=-1).indices.flatten().tolist()))
        self._guessed[upcoming] = set(picked)
        return picked

    def score(self, name: str, routed: list[int]) -> None:
        """Compares the guess made for name (if any) with what its router picked."""
        guessed = self._guessed.pop(name, None)
        if not guessed:
            return
        right = len(guessed.intersection(routed))
        self.made += len(guessed)
        self.right += right
        self.share += MEMORY * (right / len(guessed) - self.share)

    @property
    def rate(self) -> float | None:
        """The share of guessed experts that were routed to, over the run."""
        return self.right / self.made if self.made else None


def find_router(layer: nn.Module, hidden: int) -> str | None:
    """The path (from the layer) of the module beside the experts whose weight is [experts, hidden]."""
    experts = find_experts(layer)
    if experts is None:
        return None
    parent = experts.path.rpartition(".")[0]
    block = layer.get_submodule(parent) if parent else layer
    for path, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == (experts.count, hidden):
            return f"{parent}.{path}" if parent else path
    return None
