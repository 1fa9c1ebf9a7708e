"""A loaded model: transformers' own, its blocks streamed by the executor, with generate as
transformers has it.

    lm = zerolite.load("/nvme/bloom", offload="nvme")
    out = lm.generate(**lm.tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=100)
"""

from __future__ import annotations

import functools
from operator import attrgetter

import torch

from zerolite.distributed.world import World
from zerolite.io.device import Device
from zerolite.io.engine import IoEngine
from zerolite.layout.folder import Layout
from zerolite.lm.generate_call import (
    checked_arguments,
    given_cache,
    job_length,
    on_device,
    returned_cache,
    streaming_config,
    with_cache,
)
from zerolite.moe.counts import ExpertCounts
from zerolite.runtime.executor import Executor
from zerolite.runtime.micro_batches import MicroBatchCache
from zerolite.runtime.plan import Plan
from zerolite.runtime.policy import Policy
from zerolite.speculative.decoding import Speculator, speculative_decoding


def built(path: str, doc: str | None = None) -> property:
    """A read-only attribute of what loading built (OffloadedLM.parts), at a dotted path."""
    return property(lambda lm: attrgetter(path)(lm.parts), doc=doc)


class OffloadedLM:
    """A transformers causal LM whose blocks stream from disk or host memory as it runs.

    .model is transformers' own model object, .tokenizer its tokenizer (None when the layout has
    none), .generate takes everything transformers' generate does. .plan, .layout, .policy,
    .device and .load_read_gbps are what the plan printer and the profiler read.
    """

    world: World = built("world", "The ranks of a torchrun job, each with a model of its own.")
    device: Device = built("device", "The zerolite Device the model runs on (its streams, memory and events).")
    plan: Plan = built("plan")
    layout: Layout = built("layout")
    policy: Policy = built("policy")
    engine: IoEngine = built("engine")
    bytes_read: int = built("bytes_read")
    torch_device: torch.device = built("device.torch_device")
    load_read_gbps: float = built("load_read_gbps", "How fast the disk read while loading: the plan's bound uses it.")
    per_expert: frozenset[str] = built("routing.per_expert",
                                       "The streamed layers whose experts are read apart, only those the router picks.")
    host_experts: frozenset[str] = built("routing.host_experts", "Of those, the layers whose routed experts the host "
                                         "computes (`experts` cpu on a GPU).")

    def __init__(self, executor: Executor, tokenizer, load_s: float, convert_s: float, draft: OffloadedLM | None = None,
                 draft_step_s: float | None = None):
        self.executor = executor
        self.parts = executor.parts  # what loading built: the plan, the layout, the slots, the K/V caches' pool
        self.model = executor.model
        self.tokenizer = tokenizer
        self.load_s = load_s
        self.convert_s = convert_s
        # held resident; generate drafts with it (zerolite.speculative.draft, zerolite.speculative.decoding)
        self.draft = draft
        self.speculator = Speculator(draft.model, executor.timeline, draft_step_s) if draft is not None else None

    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return self.model.generation_config

    def expert_counts(self) -> ExpertCounts:
        """Running totals of a mixture streamed per expert (zerolite.moe.counts)."""
        return self.parts.expert_counts()

    def new_cache(self, tokens: int = 0):
        """The cache generate would make: with kv_offload, that share of the layers' K/V in host memory,
        its buffers made for tokens (where the job's length is known) from the pool all caches share;
        with kv_disk, that share in files on disk; with kv_bits, the K/V quantized; with micro_batches,
        one such cache per micro-batch."""
        def one():
            return self.parts.caches.new(self.model.config, self.policy.kv_offload, tokens, self.policy.kv_bits,
                                         self.policy.kv_disk)

        if self.policy.micro_batches > 1:
            return MicroBatchCache([one() for _ in range(self.policy.micro_batches)])
        return one()

    def recover(self) -> None:
        """After a forward that raised half-way: what was running unbound and its slots freed, so
        that the next forward starts clean."""
        self.executor.recover()

    def wait_for_reads(self) -> None:
        """Waits for the reads ahead still in flight (a profile puts them on its timeline too)."""
        self.executor.slots.drain()

    def generate(self, *args, **kwargs):
        """transformers' generate, with tensor arguments moved to the model's device and, with
        kv_offload set, a cache that keeps that fraction of the layers' K/V in host memory (with
        kv_bits, a cache that keeps its K/V quantized; with micro_batches, a cache per micro-batch);
        with a draft, speculative decoding."""
        input_ids = args[0] if args else kwargs.get("input_ids")
        kwargs = checked_arguments(self.model, input_ids, kwargs, speculating=self.draft is not None)
        if self.draft is not None:
            # transformers hands a callable custom_generate its own new keywords only, not the streamer
            kwargs["custom_generate"] = functools.partial(speculative_decoding, speculator=self.speculator,
                                                          streamer=kwargs.get("streamer"))
        args, kwargs = on_device(args, kwargs, self.torch_device)
        # micro-batches need a cache per micro-batch; a draft's speculative decoding runs one sequence
        micro = self.policy.micro_batches > 1 and self.draft is None
        own_cache = ((self.policy.kv_offload > 0 or self.policy.kv_disk > 0 or self.policy.kv_bits < 16 or micro)
                     and given_cache(kwargs) is None)
        config = streaming_config(self.model, kwargs, own_cache)
        cache = self.new_cache(job_length(input_ids, kwargs, config)) if own_cache else None
        if cache is not None:
            kwargs = with_cache(kwargs, cache)
        output = None
        try:
            output = self.model.generate(*args, **kwargs)
            return output
        except BaseException:
            self.recover()
            raise
        finally:
            if cache is not None:
                if returned_cache(output) is cache:
                    cache.wait_for_copies()  # the caller has it
                else:
                    cache.return_host_buffers()  # its host buffers serve the next generate

    def close(self) -> None:
        self.executor.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> OffloadedLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
