"""Speculative decoding: a resident draft proposes, the streamed target checks several tokens in
one pass over its weights, and greedy output stays the target's own, token for token."""

from __future__ import annotations

import json

import pytest
import torch

import zerolite
from cli_runner import run
from zerolite.errors import ZeroliteError

ARCHS = ["llama", "mistral", "bloom", "opt", "gpt2"]
PROMPT = torch.tensor([[5, 17, 33, 9, 44, 61, 70]])
NEW_TOKENS = 16


def greedy(lm, input_ids=PROMPT):
    return lm.generate(input_ids=input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                       pad_token_id=0)


def plain_and_drafted(layout, draft, draft_group_size=None, **setup):
    with zerolite.load(layout, show_progress=False, **setup) as lm:
        plain, plain_bytes = greedy(lm), lm.bytes_read
    with zerolite.load(layout, draft=draft, draft_group_size=draft_group_size, show_progress=False, **setup) as lm:
        assert lm.draft is not None and lm.draft.plan.on_disk == ()  # the draft is held resident
        drafted = greedy(lm)
        return plain, drafted, plain_bytes, lm.bytes_read


@pytest.mark.parametrize("arch", ARCHS)
def test_a_self_int4_draft_leaves_greedy_output_as_it_was(arch, make_layout):
    layout = make_layout(arch, layers=4, fresh=True)  # the draft is converted beside it
    # The tiny models' MLP is 160 wide: groups of 32 divide it.
    plain, drafted, _, _ = plain_and_drafted(layout, "self-int4", 32, device="cpu", offload="nvme", cpu_memory=0)
    assert torch.equal(plain, drafted)


def test_a_draft_that_guesses_right_saves_passes_over_the_weights(make_layout):
    """The model drafting for itself (a copy of its own layout) is always right: each target pass
    then checks several tokens, so far fewer bytes are read for the same tokens."""
    layout = make_layout("llama", layers=4)
    copy = make_layout("llama", layers=4, fresh=True)
    plain, drafted, plain_bytes, drafted_bytes = plain_and_drafted(layout, str(copy), device="cpu", offload="nvme",
                                                                   cpu_memory=0)
    assert torch.equal(plain, drafted)
    assert drafted_bytes < plain_bytes / 3, (drafted_bytes, plain_bytes)


@pytest.mark.cuda
def test_a_draft_on_a_gpu_with_kv_offload_leaves_greedy_output_as_it_was(make_layout, gpu):
    """Rejected tokens are rolled back from the K/V cache, its host layers included."""
    layout = make_layout("llama", layers=4, fresh=True)
    plain, drafted, _, _ = plain_and_drafted(layout, "self-int8", device=gpu, offload="nvme", cpu_memory=0,
                                             gpu_memory=0, kv_offload=0.5)
    assert torch.equal(plain, drafted)


def test_speculation_refuses_a_batch(make_layout):
    with zerolite.load(make_layout(fresh=True), draft="self-int8", device="cpu", show_progress=False) as lm:
        with pytest.raises(ZeroliteError, match="speculative decoding runs at batch 1"):
            greedy(lm, PROMPT.repeat(2, 1))


def test_a_draft_with_another_vocabulary_is_refused(make_layout):
    other = make_layout("llama", vocab_size=96)
    with pytest.raises(ZeroliteError, match="does not share the target's tokenizer"):
        zerolite.load(make_layout(), draft=str(other), device="cpu", show_progress=False)


def test_a_self_draft_at_the_targets_own_precision_is_refused(make_layout):
    int4 = make_layout("llama", weights="int4", group_size=32)
    with pytest.raises(ZeroliteError, match="would be the target itself"):
        zerolite.load(int4, draft="self-int4", draft_group_size=32, device="cpu", show_progress=False)


def test_generate_with_a_draft_says_how_many_tokens_each_pass_made(capsys, monkeypatch, tmp_path, make_layout):
    """A copy of the model drafts for it: every guess is kept, so a pass makes several tokens."""
    layout, copy = make_layout("llama", layers=4), make_layout("llama", layers=4, fresh=True)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": 0, "input_ids": PROMPT[0].tolist()}) + "\n")
    common = ["generate", "--model", layout, "--device", "cpu", "--cpu-memory", "0", "--input", prompts,
              "--max-new-tokens", str(NEW_TOKENS)]
    assert run(capsys, monkeypatch, *common, "--output", tmp_path / "plain.jsonl", "--stats-json", tmp_path / "plain.json").code == 0
    assert run(capsys, monkeypatch, *common, "--draft", copy, "--output", tmp_path / "drafted.jsonl",
               "--stats-json", tmp_path / "drafted.json").code == 0
    tokens = [json.loads((tmp_path / f"{name}.jsonl").read_text())["token_ids"] for name in ("plain", "drafted")]
    assert tokens[0] == tokens[1]
    plain, drafted = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "drafted"))
    assert plain["tokens_per_pass"] == 1
    assert drafted["tokens_per_pass"] > 2, drafted


def test_a_draft_with_a_batch_size_is_one_clear_error(capsys, monkeypatch, make_layout):
    result = run(capsys, monkeypatch, "generate", "hi", "--model", make_layout(), "--device", "cpu",
                 "--draft", "self-int8", "--batch-size", "4")
    assert result.code != 0 and "--draft runs prompts one at a time" in result.stderr
