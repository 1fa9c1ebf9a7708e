"""A mixture's routed experts computed by the host where their bytes live (`experts` cpu), while the
device computes attention, the shared experts and the dense parts: only the hidden states of a
step's tokens cross the link, twice, never an expert's weights.

    host = HostExperts(manifest, device)
    module.forward = host.forward_of("layers.3", module, slots)   # installed by ExpertRouting.attach

At batch 1 a DeepSeek-V3 token's routed experts are ~20 GB at 4 bits: over a 25 GB/s link about one
token a second, from host memory at 100-300 GB/s several (ktransformers, llama.cpp's --cpu-moe).
The experts module's own forward runs on the host, its tensors views of the layer's bytes there:
the block's home in host memory, or the host buffer the step's routed experts were read into from
disk (zerolite.runtime.slots keeps them there and copies none). Every kernel transformers has for
the module (grouped_mm, batched_mm, eager) reads only the rows of the experts routed to.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from zerolite.io.device import Device
from zerolite.layout.blocks import module_path
from zerolite.layout.folder import tensor_views
from zerolite.layout.manifest import Manifest


class HostExperts:
    def __init__(self, manifest: Manifest, device: Device):
        self.manifest = manifest
        self.device = device
        self.stream = device.new_stream()  # the outputs' copies back to the device
        # Pinned, by role, grown as the tokens grow. Each call's wait for its inputs also sees the
        # last call's output copied out of "out": compute waited for that copy before it went on.
        self._buffers: dict[str, torch.Tensor] = {}

    def forward_of(self, name: str, module: nn.Module, slots):
        """The forward that replaces module's (an experts module called with its routing)."""
        prefix = f"{module_path(self.manifest.layers_path, name)}.{self.manifest.block(name).experts.module}."

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            return self.compute(name, module, prefix, slots.host_bytes(name), hidden_states, top_k_index, top_k_weights)

        return forward

    @torch.no_grad()
    def compute(self, name: str, module: nn.Module, prefix: str, host_bytes: torch.Tensor, hidden: torch.Tensor,
                chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts' output for these tokens, on the device:

        1. the hidden states, the routing and its weights to the host: copies on the compute
           stream, after the work that made them, waited for by the host (the routing already was)
        2. the experts module's own forward on the host, its tensors views of the layer's bytes there
        3. the output back to the device on a stream of its own, into memory compute allocated
           (so that stream waits for compute first); compute waits for the copy before its next
           use of the output
        """
        compute = self.device.compute_stream()
        inputs = [self._host("hidden", hidden), self._host("chosen", chosen), self._host("weights", weights)]
        for target, source in zip(inputs, (hidden, chosen, weights)):
            self.device.copy(target, source.contiguous(), compute)
        self.device.record(compute).synchronize()

        views = tensor_views(self.manifest.block(name), host_bytes)
        twin = copy.copy(module)  # the same module, its tensors those in host memory
        twin._parameters = {leaf: views[prefix + leaf] for leaf in module._parameters}
        output = type(module).forward(twin, *inputs)

        staged = self._host("out", output)
        staged.copy_(output)
        result = torch.empty_like(hidden)
        self.device.wait_stream(self.stream, compute)
        self.device.copy(result, staged, self.stream)
        self.device.wait_event(compute, self.device.record(self.stream))
        return result

    def _host(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor shaped as like, from the role's buffer (grown to twice what is asked:
        tokens grow at prefill only, so this rarely pins)."""
        nbytes = like.numel() * like.element_size()
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[role] = self.device.pinned_empty(max(2 * nbytes, 4096))
        return buffer[:nbytes].view(like.dtype).view(like.shape)

    def close(self) -> None:
        """Before the buffers go: the last copy out of them has finished."""
        self.device.synchronize(self.stream)
