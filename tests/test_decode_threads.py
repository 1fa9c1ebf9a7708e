"""A CPU forward of few rows runs torch's ops on one thread and zerolite's kernels on the threads
torch had (zerolite.runtime.decode_threads); a prefill keeps torch's threads; a forward that
raised leaves them as they were."""

from __future__ import annotations

import pytest
import torch

import zerolite
from zerolite.quant import bf16_linear, cpu_kernels
from zerolite.quant.bf16_linear import Bf16KernelLinear
from zerolite.quant.linear import QuantizedLinear
from zerolite.runtime.decode_threads import FEW_ROWS, tokens_in

THREADS = 2


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def threads_seen(lm, monkeypatch, kind=QuantizedLinear) -> list[tuple[int, int, int]]:
    """(rows, torch's threads, the kernels' threads) at each call of a kind of layer in the model's
    layers (the head's call in a prefill has a row a sequence, as a decode step's calls)."""
    seen = []
    forward = kind.forward
    head = lm.model.get_output_embeddings()

    def recording(self, x):
        if self is not head:
            seen.append((x.reshape(-1, x.shape[-1]).shape[0], torch.get_num_threads(), cpu_kernels.kernel_threads()))
        return forward(self, x)

    monkeypatch.setattr(kind, "forward", recording)
    return seen


def test_a_decode_step_runs_torch_on_one_thread_and_the_kernels_on_all(make_layout, two_threads, monkeypatch):
    layout = make_layout("llama", weights="int4", group_size=32)
    with zerolite.load(layout, device="cpu", offload="cpu", show_progress=False) as lm:
        seen = threads_seen(lm, monkeypatch)
        prompt = torch.randint(3, 100, (2, FEW_ROWS // 2))  # FEW_ROWS tokens: a prefill
        lm.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                    min_new_tokens=3, do_sample=False, pad_token_id=0)
    prefill = {(torch_threads, kernels) for rows, torch_threads, kernels in seen if rows == FEW_ROWS}
    decode = {(torch_threads, kernels) for rows, torch_threads, kernels in seen if rows == 2}
    assert prefill == {(THREADS, THREADS)} and decode == {(1, THREADS)}
    assert torch.get_num_threads() == THREADS and cpu_kernels.kernel_threads() == THREADS


def test_a_bf16_layout_s_decode_step_runs_torch_on_one_thread_too(make_layout, two_threads, monkeypatch):
    """Its layers are Bf16KernelLinear (the kernel below KERNEL_ROWS rows): a step of fewer rows
    than that runs as a quantized layout's does; more rows keep torch's threads; an fp32 layout's
    steps (torch's matmuls) keep them all."""
    monkeypatch.setattr(bf16_linear, "KERNEL_ROWS", 4)
    prompt = torch.randint(3, 100, (2, 5))
    for dtype, batch, expected in [("bf16", 2, (1, THREADS)), ("bf16", 4, (THREADS, THREADS)),
                                   ("fp32", 2, (THREADS, THREADS))]:
        layout = make_layout("llama", dtype=dtype)
        with zerolite.load(layout, device="cpu", offload="cpu", show_progress=False) as lm:
            seen = threads_seen(lm, monkeypatch, Bf16KernelLinear)  # use_bf16_kernel swaps an fp32 layout's too
            lm.generate(input_ids=prompt.repeat(batch // 2, 1), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                        pad_token_id=0)
        decode = {(torch_threads, kernels) for rows, torch_threads, kernels in seen if rows == batch}
        assert decode == {expected}, (dtype, batch)
        assert torch.get_num_threads() == THREADS and cpu_kernels.kernel_threads() == THREADS


def test_a_forward_that_raised_leaves_the_threads_as_they_were(make_layout, two_threads, monkeypatch):
    layout = make_layout("llama", weights="int4", group_size=32)
    with zerolite.load(layout, device="cpu", offload="cpu", show_progress=False) as lm:
        def failing(self, x):
            raise RuntimeError("a layer failed")

        monkeypatch.setattr(QuantizedLinear, "forward", failing)
        with pytest.raises(RuntimeError, match="a layer failed"):
            lm.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False)
        assert torch.get_num_threads() == THREADS and cpu_kernels.kernel_threads() == THREADS


def test_the_tokens_a_forward_was_given():
    ids, embeds = torch.zeros(3, 5, dtype=torch.long), torch.zeros(2, 4, 8)
    assert tokens_in((), {"input_ids": ids}) == 15
    assert tokens_in((), {"inputs_embeds": embeds, "input_ids": None}) == 8
    assert tokens_in((ids,), {}) == 15
    assert tokens_in((), {}) is None
