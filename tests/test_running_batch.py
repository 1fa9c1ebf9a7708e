"""The running batch against transformers' generate: rows join and leave at step boundaries, their
prompts fed in chunks beside the others' decoding, and each row's greedy tokens are the ones
generate gives its prompt alone."""

from __future__ import annotations

import pytest
import torch

import zerolite
from support.helpers import new_tokens_alone
from support.simulated_device import SimulatedDevice, SimulatedEvent
from support.tiny_models import save_ascii_tokenizer
from zerolite.decoding.running_batch import Row, RunningBatch
from zerolite.decoding.text_stream import TextStream
from zerolite.errors import ZeroliteError
from zerolite.runtime import kv_cache

NEW_TOKENS = 10
LENGTHS = (5, 17, 2, 9, 30, 1)


def prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=generator).tolist() for n in LENGTHS]


def staggered(lm, prompts_: list[list[int]], step_tokens: int, tokens: int = NEW_TOKENS) -> tuple[list[list[int]], int]:
    """Every prompt through one RunningBatch, a new one joining every other step; the tokens and the steps taken."""
    batch = RunningBatch(lm, step_tokens)
    got = {i: [] for i in range(len(prompts_))}
    waiting = list(enumerate(prompts_))
    steps = 0
    while waiting or batch.rows:
        if waiting and steps % 2 == 0:
            i, prompt = waiting.pop(0)
            batch.add([Row(list(prompt), owner=i)])
        for row, logits in batch.step():
            token = int(logits.argmax())
            got[row.owner].append(token)
            row.pending = [token]
        batch.remove([row for row in batch.rows if len(got[row.owner]) == tokens])
        assert batch.cache is None or all(
            layer.keys.shape[2] == batch.width for layer in batch.cache.layers if layer.is_initialized), \
            "the cache is wider than the longest row"
        steps += 1
    return [got[i] for i in range(len(prompts_))], steps


@pytest.mark.parametrize("arch", ["llama", "mistral", "bloom", "opt", "gpt2"])
@pytest.mark.parametrize("step_tokens", [1, 8, 1000])
def test_rows_that_join_and_leave_get_the_tokens_of_their_prompt_alone(make_layout, arch, step_tokens):
    with zerolite.load(make_layout(arch), offload="nvme", device="cpu", show_progress=False) as lm:
        expected = [new_tokens_alone(lm, p, NEW_TOKENS, eos_token_id=None) for p in prompts()]
        got, steps = staggered(lm, prompts(), step_tokens)
    assert got == expected
    assert steps < sum(LENGTHS) + len(LENGTHS) * NEW_TOKENS  # rows shared steps


@pytest.mark.cuda
def test_the_kv_cache_partly_in_host_memory_rebatches_too(make_layout, gpu):
    with zerolite.load(make_layout("llama"), offload="cpu", device=gpu, gpu_memory=0, kv_offload=0.5,
                       show_progress=False) as lm:
        assert lm.plan.streamed == tuple(lm.layout.manifest.layer_names)  # every layer through the ring
        expected = [new_tokens_alone(lm, p, NEW_TOKENS, eos_token_id=None) for p in prompts(1)]
        got, _ = staggered(lm, prompts(1), step_tokens=8)
    assert got == expected


def test_rebatching_the_kv_cache_in_host_memory_pins_nothing_and_waits_for_nothing_mid_forward(make_layout,
                                                                                             monkeypatch):
    """Rows joining and leaving change every host buffer's size (issue 37, defect 5): once the
    first rows have grown the pool, the buffers serve the new sizes as they are, unpinning and
    pinning nothing; and no forward waits on the host for a K/V copy: the running batch waited
    for them as it changed the rows, and room for a step's tokens is made before its fetch."""
    monkeypatch.setattr(kv_cache, "MIN_TOKENS", 4)  # the buffers outgrown within a few steps
    sim = SimulatedDevice(seed=5)
    pins, unpins, waits, forwarding = [], [], [], []
    pinned_empty, free = sim.pinned_empty, sim._free
    monkeypatch.setattr(sim, "pinned_empty", lambda nbytes: pins.append(nbytes) or pinned_empty(nbytes))
    monkeypatch.setattr(sim, "_free", lambda address, record, *sizes: (unpins.append(1) if record.pinned else None,
                                                                       free(address, record, *sizes)))
    synchronize = SimulatedEvent.synchronize
    monkeypatch.setattr(SimulatedEvent, "synchronize",
                        lambda event: (waits.append(event.stream.name) if forwarding else None, synchronize(event)))
    with sim.watching(), zerolite.load(make_layout("llama"), offload="none", device=sim, kv_offload=1.0,
                                       show_progress=False) as lm:
        lm.model.register_forward_pre_hook(lambda *_: forwarding.append(1))
        lm.model.register_forward_hook(lambda *_: forwarding.clear())
        batch = RunningBatch(lm, step_tokens=64)

        def steps(count: int) -> None:
            for _ in range(count):
                for row, logits in batch.step():
                    row.pending = [int(logits.argmax())]

        batch.add([Row(list(range(3, 3 + n))) for n in (7, 3, 5, 6)])
        steps(9)  # the prompts in, then decoding: the buffers grown twice, past MIN_TOKENS
        grown, before = len(pins), len(unpins)
        waits.clear()  # growing past the buffers waits for the last step's copies, once per doubling
        batch.remove(batch.rows[1:2])
        steps(2)
        batch.add([Row([5, 6, 7])])
        steps(2)
        batch.remove(batch.rows[:2])
        steps(2)
        batch.reset()  # a new cache, at another batch size: the pool's buffers serve it
        batch.add([Row([9, 10, 11, 12]), Row([13, 14])])
        steps(2)
        assert (len(pins), len(unpins)) == (grown, before)
    assert waits == []


def test_a_sliding_window_bounds_the_columns(make_layout):
    layout = make_layout("mistral", sliding_window=48)
    with zerolite.load(layout, offload="nvme", device="cpu", show_progress=False) as lm:
        batch = RunningBatch(lm, step_tokens=64)
        assert batch.max_columns == 47
        expected = [new_tokens_alone(lm, p, 16, eos_token_id=None) for p in prompts(2)]
        got, _ = staggered(lm, prompts(2), step_tokens=64, tokens=16)
    assert got == expected


def test_a_cache_of_other_state_is_refused(monkeypatch, make_layout):
    class Recurrent:  # a state per sequence, as linear attention and SSM layers keep: no columns to rebatch
        pass

    class Cache:
        layers = [Recurrent()]

    with zerolite.load(make_layout("llama"), offload="none", device="cpu", show_progress=False) as lm:
        monkeypatch.setattr(lm, "new_cache", lambda: Cache())
        with pytest.raises(ZeroliteError, match="Recurrent layers"):
            RunningBatch(lm, 8)


@pytest.fixture(scope="module")
def ascii_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("ascii")
    save_ascii_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_text_comes_in_pieces_that_hold_back_a_stop_string_until_it_is_settled(ascii_tokenizer):
    text = TextStream(ascii_tokenizer, stop=["cd", "xyz"])   # the longest is 3: 2 characters held back
    pieces = [text.add(ord(c)) for c in "abcxcd"]
    assert pieces == [("", False), ("", False), ("a", False), ("b", False), ("c", False), ("x", True)]


def test_text_without_stop_strings_flows_token_by_token(ascii_tokenizer):
    text = TextStream(ascii_tokenizer)
    assert [text.add(ord(c)) for c in "hi!"] == [("h", False), ("i", False), ("!", False)]
    assert text.finish() == ""


def test_the_step_budget_settles_where_the_compute_meets_the_reads():
    from zerolite.decoding.step_budget import CEILING, StepBudget

    def step_s(tokens: int, read_s: float, per_token_s: float) -> float:
        return max(read_s, tokens * per_token_s)

    disk = StepBudget(None)  # a CPU: 0.65 s of reads, 4.7 ms a token
    for _ in range(40):
        disk.observe(16, step_s(16, 0.65, 0.0047))                      # decoding rows
        disk.observe(disk.tokens, step_s(disk.tokens, 0.65, 0.0047))    # a prompt joining, at the budget
    assert 0.65 / 0.0047 * 0.6 <= disk.tokens <= 0.65 / 0.0047 * 1.5

    gpu = StepBudget(None)  # compute 1000x faster than the reads need
    for _ in range(40):
        gpu.observe(gpu.tokens, step_s(gpu.tokens, 0.65, 4.7e-6))
    assert gpu.tokens == CEILING

    fixed = StepBudget(512)
    fixed.observe(512, 100.0)
    assert fixed.tokens == 512
