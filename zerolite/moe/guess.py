"""A guess at the experts the next layer will pick, so that their reads start while this layer computes.

    guess = ExpertGuess(model, manifest, per_expert=["layers.0", ...], disk=disk, device=device)
    named = guess.ranks("layers.4", hidden, top_k)   # on the device, while layer 3's experts run
    early = guess.next("layers.4", named.tolist())   # taken to the host with layer 3's routing
    guess.score("layers.4", routed)                  # once layer 4's router has spoken

The guess applies the next layer's router to the hidden states this layer's experts receive: the
residual stream changes little from one layer to the next, so this picks many of the next layer's
experts (the pre-gating of MoE-Infinity and Pre-gated MoE). Only the router's linear part is
applied (top-k of its logits: softmax and sigmoid keep the order); biases that only steer
selection (DeepSeek-V3's) and group limits are left out, which a guess may afford. The routers are
read once at load and kept on the device (a few KB per layer; 7 MB for DeepSeek-V3's), so that a
guess never waits for the next layer's dense part, which is still queued behind this layer's
experts when a large batch routes to most of them. Nothing computed from them reaches the model's
output, so they skip the layout's checksums (which cover whole parts).

A wrong guess costs a read the step never uses, and a disk-bound step pays for every byte. Guesses
differ by rank: each token's first choice is right far more often than its second. So each rank
keeps its own running record, and the experts a rank names are read early only once, and while,
that rank has been right RELIABLE of the time lately; every guess is scored, read or not, so a
rank earns that trust over the first steps. The experts of the most reliable ranks are asked for
first: once the router has spoken, what has not started of the reads it did not take is given up
(zerolite.runtime.slots: drop_experts), and those are likeliest to be the last in line.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from zerolite.io.device import Device
from zerolite.io.engine import ALIGNMENT, aligned_empty
from zerolite.layout.blocks import module_path
from zerolite.layout.manifest import DTYPES, ExpertArea, Manifest, TensorEntry, round_up
from zerolite.layout.store import DiskStore

# A right guess takes its expert's read out of the wait after the router, but only the first few
# do: the disk would idle only while the layer computes, a few experts' reads, and past those an
# early read merely moves one the step makes anyway. A wrong one costs its bytes in a disk-bound
# step, and most of it is under way (the engine keeps 32 MiB in flight) before the router can give
# it up. So a rank is read early only while right 4 times in 5: for DeepSeek-V3's shape at batch 1
# its first three of eight (97, 93, 86%; the rest 47-75%), at batch 16, where the router picks most
# experts, all (90-97%). 1 in 2 read ~20 wrong experts a step (9.4 MB each) where this reads 1,
# and its batch-1 steps took 4-8% longer (11-13% before reads could be given up) with the disk
# throttled to 60 MB/s, as slow against this machine's loaded compute as its disk is against quiet.
RELIABLE = 0.8
MEMORY = 1 / 16  # weight of the newest guess in a rank's running record


class ExpertGuess:
    def __init__(self, model: nn.Module, manifest: Manifest, per_expert, disk: DiskStore, device: Device):
        hidden = model.config.get_text_config().hidden_size
        self._routers: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # block -> router weight, bias
        for name in per_expert:
            layer = module_path(manifest.layers_path, name)
            router = find_router(model.get_submodule(layer), manifest.block(name).experts, hidden)
            if router is None:
                continue
            prefix = f"{layer}.{router}."
            entries = {t.name.removeprefix(prefix): t
                       for t in manifest.block(name).tensors if t.name.startswith(prefix)}
            if "weight" in entries:  # a quantized router has none: no guess there
                wanted = [entries["weight"]] + [entries[b] for b in ("bias",) if b in entries]
                tensors = read_tensors(disk, name, wanted)
                self._routers[name] = tuple(t.to(device.torch_device) for t in tensors) + (None,) * (2 - len(tensors))
        self._guessed: dict[str, list[set[int]]] = {}  # block -> the experts each rank named for it
        self._early: dict[str, set[int]] = {}          # block -> those of them brought early
        self._shares: list[float] = []  # per rank: its running share of named experts routed to
        self.made = 0         # experts guessed (each counted once, whatever ranks named it)
        self.right = 0        # of them, routed to
        self.early_unused = 0  # experts brought early that the router then did not pick

    def can_guess(self, name: str) -> bool:
        return name in self._routers

    @torch.no_grad()
    def ranks(self, upcoming: str, hidden: torch.Tensor, top_k: int) -> torch.Tensor:
        """The experts upcoming's router would pick for these hidden states, [rank][token], on the
        device: the caller takes them to the host with what else it needs there, in one wait."""
        weight, bias = self._routers[upcoming]
        logits = F.linear(hidden.reshape(-1, weight.shape[1]).to(weight.dtype), weight, bias)
        return logits.topk(top_k, dim=-1).indices.T

    def next(self, upcoming: str, ranks: list[list[int]]) -> list[int]:
        """Records ranks (ranks()'s answer, on the host) as the guess for upcoming; returns the
        experts named by ranks reliable enough to read early, those of the most reliable first."""
        named = self._guessed[upcoming] = [set(tokens) for tokens in ranks]
        self._shares += [0.0] * (len(named) - len(self._shares))
        trusted = sorted((rank for rank in range(len(named)) if self._shares[rank] >= RELIABLE),
                         key=lambda rank: -self._shares[rank])
        early = list(dict.fromkeys(expert for rank in trusted for expert in ranks[rank]))
        self._early[upcoming] = set(early)
        return early

    def score(self, name: str, routed: list[int]) -> None:
        """Compares the guess made for name (if any) with what its router picked."""
        named = self._guessed.pop(name, None)
        self.early_unused += len(self._early.pop(name, set()).difference(routed))
        if not named:
            return
        for rank, experts in enumerate(named):
            self._shares[rank] += MEMORY * (len(experts.intersection(routed)) / len(experts) - self._shares[rank])
        guessed = set().union(*named)
        self.made += len(guessed)
        self.right += len(guessed.intersection(routed))


def read_tensors(disk: DiskStore, block: str, entries: list[TensorEntry]) -> list[torch.Tensor]:
    """These tensors of a block, read from the layout alone: the 4 KiB-aligned stretch holding them."""
    start = min(t.offset for t in entries) // ALIGNMENT * ALIGNMENT
    end = round_up(max(t.offset + t.nbytes for t in entries), ALIGNMENT)
    buffer = aligned_empty(end - start, huge_pages=False)  # read into once
    disk.wait(disk.submit(block, buffer, start, end - start))
    return [buffer[t.offset - start:t.offset - start + t.nbytes].view(DTYPES[t.dtype]).view(t.shape).clone()
            for t in entries]


def find_router(layer: nn.Module, experts: ExpertArea, hidden: int) -> str | None:
    """The path (from the layer) of the module beside the experts whose weight is [experts, hidden]."""
    parent = experts.module.rpartition(".")[0]
    block = layer.get_submodule(parent) if parent else layer
    for path, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == (experts.count, hidden):
            return f"{parent}.{path}" if parent else path
    return None
