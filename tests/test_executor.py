"""Streamed generation equals transformers' generate on the same weights in RAM, token for token."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

import zerolite
from support.helpers import PAD, greedy
from zerolite.errors import ZeroliteError
from zerolite.hf import keep_experts_implementation
from zerolite.layout.folder import Layout

ARCHS = ["llama", "mistral", "bloom", "opt", "gpt2"]
LAYERS = 6  # more than the deepest ring tested, so slots are refilled and reads wrap around
NEW_TOKENS = 10

# One prompt alone, then a batch of prompts of different lengths, left-padded.
SINGLE = [[5, 17, 33, 9]]
BATCH = [[5, 17, 33, 9, 44, 61, 70], [12, 90], [101, 3, 7, 55]]

# Where the weights and the K/V cache live. "nvme" streams every layer from disk (--cpu-memory 0);
# "tiers" keeps half the layers in host memory and streams the other half; "kv" variants keep that
# share of the layers' K/V in host memory while every layer streams.
SETUPS = {
    "nvme": dict(offload="nvme", cpu_memory=0),
    "cpu": dict(offload="cpu"),
    "none": dict(offload="none"),
}
MORE_SETUPS = {
    "tiers": dict(offload="nvme", cpu_memory="half"),
    "kv-0.5": dict(offload="nvme", cpu_memory=0, kv_offload=0.5),
    "kv-1.0": dict(offload="nvme", cpu_memory=0, kv_offload=1.0),
}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, make_source, make_layout):
    return layout_and_reference(request.param, make_source, make_layout)


@functools.cache  # per session (make_source and make_layout are the session's): every test of a family shares them
def layout_and_reference(arch: str, make_source, make_layout):
    """A tiny random model of one architecture: its layout, and transformers' own outputs per device,
    each worked out the first time it is asked for."""
    source = make_source(arch, layers=LAYERS)
    references = {}

    def reference(device: str):
        if device not in references:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(device)
            # safetensors loads into an mmap at unaligned offsets, where some CPU kernels round
            # differently (2e-6 apart); fresh tensors are aligned like zerolite's slots.
            with torch.no_grad():
                for param in model.parameters():
                    param.data = param.data.clone()
            # Off the CPU, generate would decode a mixture with batched_mm, whose sums round
            # differently (2e-4 on tiny logits); zerolite keeps the kernel the model was built with.
            keep_experts_implementation(model)
            references[device] = [greedy(model, rows, NEW_TOKENS, logits=True, device=device)
                                  for rows in (SINGLE, BATCH)]
        return references[device]

    return make_layout(arch, layers=LAYERS), reference


def assert_same_generation(expected, got) -> None:
    assert torch.equal(expected.sequences.cpu(), got.sequences.cpu())
    for step, (e, g) in enumerate(zip(expected.logits, got.logits, strict=True)):
        assert torch.allclose(e, g, rtol=0, atol=1e-5), f"step {step}: logits differ by {(e - g).abs().max()}"


def half_the_layers(layout, budget: str) -> int:
    """A --cpu-memory (or --gpu-memory: the embeddings and head come first there) holding half the layers."""
    blocks = Layout.open(layout).manifest.blocks
    always = sum(b.length for b in blocks if not b.name.startswith("layers.")) if budget == "gpu_memory" else 0
    return always + sum(b.length for b in blocks if b.name.startswith("layers.")) // 2


def reference_device(device) -> str:
    """Where transformers runs the reference: the simulated device computes on the CPU."""
    return device if isinstance(device, str) else "cpu"


def check_equal(tiny, setup: dict, depth: int, device, streamed: int | None = None, check=None) -> None:
    """streamed: how many layers the plan must stream through the ring (None: not checked); check:
    called with the loaded model, for what else the caller asserts of it."""
    layout, reference = tiny
    setup = {key: half_the_layers(layout, key) if value == "half" else value for key, value in setup.items()}
    with zerolite.load(layout, device=device, prefetch_depth=depth, show_progress=False, **setup) as lm:
        if streamed is not None:
            assert sum(name.startswith("layers.") for name in lm.plan.streamed) == streamed, lm.plan
        if check is not None:
            check(lm)
        for expected, rows in zip(reference(reference_device(device)), (SINGLE, BATCH)):
            assert_same_generation(expected, greedy(lm, rows, NEW_TOKENS, logits=True, device=reference_device(device)))


def test_the_tiny_models_do_not_repeat_one_token(tiny):
    """Scaled random weights: generation varies, so a wrong weight would show in the tokens (tiny
    random BLOOMs still fall into short loops; the logits, compared everywhere, catch the rest)."""
    _, reference = tiny
    new = reference("cpu")[1].sequences[:, -NEW_TOKENS:]
    assert len(set(new.flatten().tolist())) >= 4, new
    assert any(len(set(row.tolist())) > 1 for row in new), new


def ring_cases(device_of_its_own: bool) -> list:
    """(setup, depth): the ring's depth decides what is read (and on a device of its own, copied)
    ahead, so every depth runs where blocks are; where nothing is (every layer resident; on a CPU,
    layers in host memory, bound where they lie: Executor._transferred), depth 2 stands for the others."""
    moved = ("nvme", "cpu") if device_of_its_own else ("nvme",)
    return ([pytest.param(setup, depth, id=f"{setup}-{depth}") for setup in moved for depth in (1, 2, 4)]
            + [pytest.param(setup, 2, id=f"{setup}-2") for setup in SETUPS if setup not in moved])


@pytest.mark.parametrize("setup, depth", ring_cases(device_of_its_own=False))
def test_cpu_generation_equals_transformers(tiny, setup, depth):
    check_equal(tiny, SETUPS[setup], depth, "cpu")


@pytest.mark.parametrize("setup", MORE_SETUPS)
def test_cpu_generation_with_tiers_and_kv_offload_equals_transformers(tiny, setup):
    check_equal(tiny, MORE_SETUPS[setup], 2, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("setup, depth", ring_cases(device_of_its_own=True))
def test_gpu_generation_equals_transformers(tiny, setup, depth, gpu):
    """nvme and cpu with no GPU memory for resident layers: every layer goes through the ring, from
    disk or from host memory. none: every layer resident on the GPU (the one resident case)."""
    if setup == "none":
        check_equal(tiny, SETUPS[setup], depth, gpu, streamed=0)
    else:
        check_equal(tiny, {**SETUPS[setup], "gpu_memory": 0}, depth, gpu, streamed=LAYERS)


@pytest.mark.cuda
@pytest.mark.parametrize("setup", [*MORE_SETUPS, "gpu-half"])
def test_gpu_generation_with_tiers_and_kv_offload_equals_transformers(tiny, setup, gpu):
    """Every layer streamed, but for gpu-half: half the layers resident on the GPU, the other half
    streamed from disk."""
    setups = {**{name: {**value, "gpu_memory": 0} for name, value in MORE_SETUPS.items()},
              "gpu-half": dict(offload="nvme", cpu_memory=0, gpu_memory="half")}
    check_equal(tiny, setups[setup], 2, gpu, streamed=LAYERS // 2 if setup == "gpu-half" else LAYERS)


def test_streaming_reads_every_layer_each_forward_and_nothing_when_resident(tiny):
    layout, _ = tiny
    with zerolite.load(layout, offload="nvme", cpu_memory=0, device="cpu", prefetch_depth=1, show_progress=False) as lm:
        layer_bytes = sum(b.length for b in lm.layout.blocks if b.name.startswith("layers."))
        # fewer on an end token
        forwards = greedy(lm, SINGLE, NEW_TOKENS, logits=True).sequences.shape[1] - len(SINGLE[0])
        assert lm.bytes_read == forwards * layer_bytes
    for offload in ("cpu", "none"):
        with zerolite.load(layout, offload=offload, device="cpu", show_progress=False) as lm:
            greedy(lm, SINGLE, NEW_TOKENS, logits=True)
            assert lm.bytes_read == 0


def test_a_failed_forward_leaves_the_model_usable(tiny):
    layout, reference = tiny
    with zerolite.load(layout, offload="nvme", cpu_memory=0, device="cpu", show_progress=False) as lm:
        with pytest.raises(ZeroliteError, match="vocabulary"):  # checked on the host, before any device work
            lm.generate(input_ids=torch.tensor([[10_000]]), max_new_tokens=2)

        def fail(*_):
            raise RuntimeError("a layer failed")

        layer = lm.model.get_submodule(f"{lm.layout.manifest.layers_path}.2")
        hook = layer.register_forward_pre_hook(fail)  # after the executor's: the layer's slot is taken
        with pytest.raises(RuntimeError, match="a layer failed"):
            greedy(lm, SINGLE, NEW_TOKENS, logits=True)
        hook.remove()
        assert_same_generation(reference("cpu")[0], greedy(lm, SINGLE, NEW_TOKENS, logits=True))


def test_generate_takes_transformers_generation_arguments(tiny):
    """GenerationConfig, stopping criteria and streamers pass through to transformers' generate."""
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.puts.append("end")

    class StopAfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= len(SINGLE[0]) + 3, dtype=torch.bool)

    layout, reference = tiny
    streamer = Collect()
    with zerolite.load(layout, offload="nvme", device="cpu", show_progress=False) as lm:
        out = lm.generate(
            input_ids=torch.tensor(SINGLE),
            generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD),
            stopping_criteria=StoppingCriteriaList([StopAfterThree()]), streamer=streamer,
        )
    expected = reference("cpu")[0].sequences[:, : len(SINGLE[0]) + 3]
    assert torch.equal(out, expected[:, : out.shape[1]]) and out.shape[1] <= len(SINGLE[0]) + 3
    assert streamer.puts[0] == SINGLE and streamer.puts[-1] == "end"


# jamba's and recurrent_gemma's tokens are transformers' in every setup, but their logits in
# generate are up to 1.2e-5 from transformers', with every layer resident too: the head's product
# for the one row generate keeps (logits_to_keep=1) rounds otherwise, while a forward's logits for
# every row are equal. bamba and qwen3_next stand for the hybrids here.
@pytest.mark.parametrize("arch", ["gemma2", "bamba", "qwen3_next"])
@pytest.mark.parametrize("setup", ["tiers", "kv-1.0"])
def test_windowed_and_hybrid_caches_with_tiers_and_kv_offload_equal_transformers(arch, setup, make_source, make_layout):
    """Beside test_default_path's runs of every family (no flags, --offload cpu): a sliding window's
    and a state's cache layers stay on the device while the attention layers' K/V go to host memory
    (PartialOffloadCache moves full-attention layers only), and half the layers are held in host memory."""
    check_equal(layout_and_reference(arch, make_source, make_layout), MORE_SETUPS[setup], 2, "cpu", streamed=LAYERS)
