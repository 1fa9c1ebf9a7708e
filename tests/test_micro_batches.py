"""Micro-batches (--micro-batches): one load of each layer serves every micro-batch, the device
computes one micro-batch's rows at a time, and the tokens are transformers' own."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import zerolite
from support.helpers import greedy, left_padded
from support.simulated_device import SimulatedDevice
from zerolite.decoding.running_batch import RunningBatch
from zerolite.errors import ZeroliteError
from zerolite.generate.continuous import why_not_continuous
from zerolite.memory_model import ModelShape, prefill_activation_bytes, prefill_carried_bytes
from zerolite.runtime.batching import MARGIN, largest_batch
from zerolite.runtime.micro_batches import row_ranges
from zerolite.sampling import Sampling

# llama; bloom, whose alibi a layer takes as batch x heads rows; gemma2, whose layers take a mask
# of their own kind (sliding or full) from a mapping
ARCHS = ["llama", "bloom", "gemma2"]
MICRO_BATCHES = 3
ROWS = [[5, 17, 33, 9, 44, 61, 70], [12, 90], [101, 3, 7, 55], [8, 9, 10], [77], [40, 41, 42, 43, 44]]
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, make_source, make_layout):
    return make_layout(request.param), make_source(request.param)


def reference(source, rows: list[list[int]], micro_batches: int, device: str):
    """transformers' generate on the whole batch, and on each micro-batch's rows (padded as in the
    whole batch): the tokens must be the first's; the logits, rounded as the rows were computed
    (a CPU's matmuls round a row differently in a batch of another size), the second's."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(device)
    whole = greedy(model, rows, NEW_TOKENS, exact=True, logits=True, device=device)
    inputs = {name: tensor.to(device) for name, tensor in left_padded(rows).items()}
    parts = [model.generate(**{name: tensor[start:stop] for name, tensor in inputs.items()}, max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
                            return_dict_in_generate=True)
             for start, stop in row_ranges(len(rows), micro_batches)]
    return whole.sequences, [torch.cat(step) for step in zip(*(part.logits for part in parts), strict=True)]


def check_micro_batched(layout, source, device, rows=ROWS, micro_batches=MICRO_BATCHES, lm=None, **setup) -> None:
    """Tokens equal transformers', each layer read once a step, and no layer computing more rows
    at once than a micro-batch has."""
    computing = "cpu" if isinstance(device, SimulatedDevice) else str(device)
    tokens, logits = reference(source, rows, micro_batches, computing)
    with lm or zerolite.load(layout, device=device, gpu_memory=0, micro_batches=micro_batches, show_progress=False,
                             **setup) as lm:
        widest, loads = [], Counter()
        hooks = [module.register_forward_pre_hook(lambda module, args: widest.append(args[0].shape[0]))
                 for module in lm.model.modules() if isinstance(module, nn.Linear) and module is not lm.model.lm_head]
        slots, wait = lm.executor.slots, lm.executor.slots.wait
        slots.wait = lambda name: loads.update([name]) or wait(name)  # a layer's bytes, waited for to be bound
        got = greedy(lm, rows, NEW_TOKENS, exact=True, logits=True, device=computing)
        del slots.wait
        for hook in hooks:
            hook.remove()
        assert torch.equal(got.sequences.cpu(), tokens.cpu())
        for step, (expected, found) in enumerate(zip(logits, got.logits, strict=True)):
            difference = (expected.cpu() - found.cpu()).abs().max()
            assert difference <= 1e-5, f"step {step}: logits differ by {difference}"
        assert max(widest) == max(stop - start for start, stop in row_ranges(len(rows), micro_batches))
        # every layer streamed, each loaded once a step for all the micro-batches
        assert loads == {name: NEW_TOKENS for name in lm.layout.manifest.layer_names}


def test_micro_batches_equal_transformers_on_the_cpu(tiny):
    check_micro_batched(*tiny, "cpu", offload="nvme", cpu_memory=0)


@pytest.mark.cuda
def test_micro_batches_equal_transformers_on_the_device_with_kv_in_host_memory(tiny, gpu):
    check_micro_batched(*tiny, gpu, offload="nvme", cpu_memory=0, kv_offload=1.0)


def test_a_batch_micro_batches_times_larger_than_fits_without_them_runs(make_layout, make_source):
    """On a device with room for one sequence's prefill activations (and its K/V in host memory), 4
    micro-batches run 4 sequences: each computes alone, the others keep only their hidden states."""
    layout, source = make_layout("llama"), make_source("llama")
    rows = [[(7 * row + 3 * i) % 120 + 1 for i in range(40)] for row in range(4)]
    micro_batches = len(rows)

    def fitting(micro_batches: int, device: SimulatedDevice) -> tuple[int, zerolite.OffloadedLM]:
        lm = zerolite.load(layout, device=device, cpu_memory=0, gpu_memory=0, kv_offload=1.0,
                           micro_batches=micro_batches, show_progress=False)
        shape, dtype = ModelShape.of(lm.config), lm.model.dtype
        activations = prefill_activation_bytes(shape, len(rows[0]), dtype)
        carried = prefill_carried_bytes(shape, len(rows[0]), dtype)
        assert len(rows) * carried < activations  # the prompt is long enough that its activations are the most
        device.memory_bytes = device.allocated + int((activations + len(rows) * carried) / (1 - MARGIN)) + 1
        return largest_batch(lm, [len(row) for row in rows], NEW_TOKENS), lm

    alone, lm = fitting(1, SimulatedDevice())
    lm.close()
    assert alone == 1
    device = SimulatedDevice(seed=3)
    with device.watching():
        batch, lm = fitting(micro_batches, device)
        assert batch == micro_batches * alone
        check_micro_batched(layout, source, device, rows, micro_batches, lm=lm)


def test_what_would_share_rows_across_micro_batches_is_refused(make_layout):
    """Beam search reorders rows across micro-batches; the running batch's rows join and leave one
    cache: generate --input runs static batches instead."""
    with zerolite.load(make_layout("llama"), device="cpu", micro_batches=2, show_progress=False) as lm:
        with pytest.raises(ZeroliteError, match="micro_batches"):
            greedy(lm, ROWS[:2], 2, num_beams=2)
        with pytest.raises(ZeroliteError, match="micro_batches"):
            RunningBatch(lm, step_tokens=8)
        assert "micro-batches" in why_not_continuous(lm, Sampling(max_new_tokens=2))
