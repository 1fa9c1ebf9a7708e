"""A mixture's layers streamed per expert: hooks on each experts module bring only the experts its
router picked into the layer's slot, and guess the next layer's so that their reads start early.

    routing = ExpertRouting(model, manifest, per_expert, disk, device)   # the next layers' routers read
    hooks = routing.attach(model, manifest, slots)                        # once the ring exists

The executor streams such a layer's dense part as any block; these hooks then run inside its
forward, where the routing is known. Where the host computes the experts (host_experts, `experts`
cpu on a GPU), the experts module's forward is replaced by zerolite.moe.host_experts' for as long
as the hooks stay. slots is the executor's ring (zerolite.runtime.slots): it
keeps each layer's experts in rows of its slot (want_experts, wait_experts, first_here, holds).
"""

from __future__ import annotations

import torch
from torch import nn

from zerolite.errors import ZeroliteError
from zerolite.io.device import Device
from zerolite.layout.blocks import module_path
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import Manifest
from zerolite.layout.store import DiskStore
from zerolite.moe.cache import ExpertCache
from zerolite.moe.counts import ExpertCounts
from zerolite.moe.experts import find_experts
from zerolite.moe.guess import ExpertGuess
from zerolite.moe.host_experts import HostExperts


class ExpertRouting:
    def __init__(self, model: nn.Module, manifest: Manifest, per_expert: frozenset[str], disk: DiskStore,
                 device: Device, host_experts: frozenset[str] = frozenset()):
        """host_experts: those of per_expert whose experts the host computes."""
        self.per_expert = per_expert
        self.device = device
        self.host = HostExperts(manifest, device) if host_experts else None
        self.host_experts = host_experts
        self.guess = ExpertGuess(model, manifest, per_expert, disk, device)
        layers = manifest.layer_names
        self._next_layer = {a: b for a, b in zip(layers, layers[1:]) if a in per_expert and b in per_expert}
        self._routed: set[str] = set()  # layers whose experts were called with their routing in this forward
        self._later: dict[str, tuple] = {}  # layer -> the experts module's arguments for the share routing() left
        self.slots = None

    def attach(self, model: nn.Module, manifest: Manifest, slots) -> list:
        """Hooks every per-expert layer's experts module; returns the hooks' handles."""
        self.slots = slots
        hooks = []
        for name in self.per_expert:
            experts = model.get_submodule(
                module_path(manifest.layers_path, name) + "." + manifest.block(name).experts.module)
            hooks += [experts.register_forward_pre_hook(self._before(name)),
                      experts.register_forward_hook(self._after(name))]
            if name in self.host_experts:
                experts.forward = self.host.forward_of(name, experts, slots)
                hooks.append(ForwardReplaced(experts, self.host))
        return hooks

    def routing(self, name: str, hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor | None = None,
                experts: nn.Module | None = None):
        """A mixture's layer streamed per expert, its router having picked (chosen: [tokens, k],
        with their weights):

        1. the experts to bring: the union over every position (padding included: its outputs
           must be finite too, or attention's zero weights on them would still make NaN)
        2. ask for them: those not here already (guessed, cached) start reading now; the reads
           of guesses the router did not take give up what has not started
        3. guess the next layer's from these hidden states; read early those of reliable ranks,
           the most reliable first (the last are the likeliest to be given up in step 2)
        4. wait for this layer's; but where one token picked k experts and some are still
           reading (on a CPU), return the experts module's arguments narrowed to the one here
           first: it computes while the others land, and routed_later() adds theirs, each as it
           lands (at batch 1 a step's compute is mostly its experts', and so it overlaps their reads)
        """
        upcoming = self._next_layer.get(name)
        if upcoming is not None and not (self.guess.can_guess(upcoming) and self.slots.holds(upcoming)):
            upcoming = None
        named = self.guess.ranks(upcoming, hidden, chosen.shape[-1]) if upcoming is not None else None
        # One wait for the device per layer: each answer taken to the host stops the host from
        # queueing ahead of the GPU, so the routing and the guess go there together.
        answers = (torch.cat([chosen.flatten(), named.flatten().to(chosen.dtype)]) if named is not None
                   else chosen.flatten())
        picked = answers.tolist()
        routed = sorted(set(picked[:chosen.numel()]))
        self.guess.score(name, routed)
        self.slots.want_experts(name, routed)
        self.slots.drop_experts(name, routed)
        if named is not None:
            guessed, tokens = picked[chosen.numel():], named.shape[1]
            ranks = [guessed[rank * tokens:(rank + 1) * tokens] for rank in range(named.shape[0])]
            self.slots.want_experts(upcoming, self.guess.next(upcoming, ranks))
        self._routed.add(name)
        if not (chosen.shape[0] == 1 and len(routed) == chosen.shape[1] > 1 and weights is not None
                and not self.device.separate_memory and splits_exactly(experts, hidden)):
            self.slots.wait_experts(name, routed)
            return None
        here, every = self.slots.first_here(name, routed)
        if every:
            return None
        first = chosen[0].tolist().index(here)
        self._later[name] = (hidden, chosen, weights, first)
        return hidden, chosen[:, first:first + 1], torch.ones_like(weights[:, :1])

    def routed_later(self, name: str, experts: nn.Module, output: torch.Tensor) -> torch.Tensor | None:
        """The layer's output once the experts routing() left for later are here, each computed as
        it lands (the soonest of those left first): each expert's output (asked for with weight 1,
        so exactly its own: one token's row through each expert, as in the one call), weighted and
        summed over k as grouped_mm sums them (in the weights' precision, rounded once), so the
        result is the one call's."""
        later = self._later.pop(name, None)
        if later is None:
            return None
        hidden, chosen, weights, first = later
        picks = chosen[0].tolist()
        one = torch.ones_like(weights[:, :1])
        own = {first: output}
        left = [expert for k, expert in enumerate(picks) if k != first]
        while left:
            here, _ = self.slots.first_here(name, left)
            left.remove(here)
            k = picks.index(here)
            own[k] = experts.forward(hidden, chosen[:, k:k + 1], one)  # forward itself, not the call: no hooks again
        return torch.stack([own[k] * weights[:, k:k + 1] for k in range(len(picks))], dim=1).sum(dim=1).to(hidden.dtype)

    def layer_done(self, name: str) -> None:
        """A streamed layer's forward ended: a per-expert layer must have been through routing()."""
        if name in self.per_expert and name not in self._routed:
            raise ZeroliteError(
                f"{name}'s experts ran without being called with their routing (a kernel replaced transformers' "
                "mixture forward?), so zerolite could not bring the ones they used: load with `experts` whole")
        self._routed.discard(name)

    def reset(self) -> None:
        """After a forward that raised half-way."""
        self._routed.clear()
        self._later.clear()

    def counts(self, expert_bytes_read: int, spared_bytes: int, cache: ExpertCache | None) -> ExpertCounts:
        """Running totals: expert bytes read (and those of guesses given up), cache hits, guesses."""
        return ExpertCounts(expert_bytes_read, cache.hits if cache else 0, cache.hits + cache.misses if cache else 0,
                            self.guess.made, self.guess.right, self.guess.early_unused, spared_bytes)

    def _before(self, name: str):
        def before(module: nn.Module, args):
            return self.routing(name, args[0], args[1], args[2] if len(args) == 3 else None, module)

        return before

    def _after(self, name: str):
        def after(module: nn.Module, args, output):
            return self.routed_later(name, module, output)

        return after


class ForwardReplaced:
    """A hook-like handle: remove() gives the experts module its own forward back, once the last copy
    of the host's output has finished."""

    def __init__(self, module: nn.Module, host: HostExperts):
        self.module, self.host = module, host

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)
        self.host.close()


def splits_exactly(experts: nn.Module | None, hidden: torch.Tensor) -> bool:
    """Whether a token's experts computed apart give the one call's result bit for bit: with
    transformers' grouped_mm (the default, on CPUs too), whose sum over k routed_later() repeats,
    on bfloat16, where it runs torch's own grouped matmul. (Other dtypes go through its per-expert
    fallback, whose float32 matmul rounds a row differently by where it lands in the output: 1e-5
    on tiny gpt_oss logits. eager rounds each share to the hidden states' precision first.)"""
    config = getattr(experts, "config", None)
    return getattr(config, "_experts_implementation", None) == "grouped_mm" and hidden.dtype == torch.bfloat16


def streamed_per_expert(model: nn.Module, layout: Layout, streamed, on_disk, whole: bool,
                        separate_memory: bool) -> tuple[frozenset[str], str | None]:
    """The streamed layers whose experts move apart from their dense part: a mixture's layers
    laid out per expert whose experts take their routing, where a step moves their bytes at all
    (on a CPU a layer held in host memory moves nothing). And, where a mixture's layers must
    stream whole instead, one line saying why. whole: every expert asked for at every step."""
    if whole:
        return frozenset(), None
    per_expert, why = [], None
    for name in streamed:
        if name not in on_disk and not separate_memory:
            continue
        experts = find_experts(model.get_submodule(module_path(layout.manifest.layers_path, name)))
        area = layout.manifest.block(name).experts
        if experts is None:
            continue
        if not experts.routed:
            why = f"its experts module ({experts.kind}) is not called with the router's choice"
        elif area is None or area.module != experts.path:
            why = (f"the layout at {layout.folder} keeps each layer's experts together: convert the model again "
                   f"(zerolite convert MODEL --path {layout.folder}) to read only the experts the router picks")
        else:
            per_expert.append(name)
    note = f"{layout.manifest.model_type}'s layers stream whole, every expert at every step: {why}" if why else None
    return frozenset(per_expert), note
