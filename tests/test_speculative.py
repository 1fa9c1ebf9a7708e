"""Speculative decoding: a resident draft proposes, the streamed target checks several tokens in
one pass over its weights; greedy output stays the target's own, token for token, and sampled
output keeps the target's distribution."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

import zerolite
import zerolite.hf
import zerolite.speculative.draft
from support.cli_runner import assert_one_line_error, run, run_tool
from support.helpers import greedy
from zerolite.errors import ZeroliteError
from zerolite.layout.folder import Layout
from zerolite.quant.linear import Int8Linear
from zerolite.speculative.decoding import LONGEST_DRAFT, DraftLength, judge

ARCHS = ["llama", "mistral", "bloom", "opt", "gpt2"]
PROMPT = torch.tensor([[5, 17, 33, 9, 44, 61, 70]])
NEW_TOKENS = 16


def plain_and_drafted(layout, draft, draft_group_size=None, **setup):
    with zerolite.load(layout, show_progress=False, **setup) as lm:
        plain, plain_bytes = greedy(lm, PROMPT, NEW_TOKENS, exact=True), lm.bytes_read
    with zerolite.load(layout, draft=draft, draft_group_size=draft_group_size, show_progress=False, **setup) as lm:
        assert lm.draft is not None and lm.draft.plan.on_disk == ()  # the draft is held resident
        drafted = greedy(lm, PROMPT, NEW_TOKENS, exact=True)
        return plain, drafted, plain_bytes, lm.bytes_read


@pytest.mark.parametrize("arch", ARCHS)
def test_a_self_int4_draft_leaves_greedy_output_as_it_was(arch, make_layout):
    layout = make_layout(arch, layers=4, fresh=True)  # the draft is converted beside it
    # group 64: the tiny models' 160-wide MLP ends in a partial group
    plain, drafted, _, _ = plain_and_drafted(layout, "self-int4", 64, device="cpu", offload="nvme", cpu_memory=0)
    assert torch.equal(plain, drafted)


@pytest.mark.parametrize("arch", ARCHS)
def test_another_model_drafting_with_kv_offload_leaves_greedy_output_as_it_was(arch, make_layout):
    """Another model's guesses are often wrong: rejected tokens are rolled back from the K/V cache,
    half of whose layers live in host memory, and the output is the model's own."""
    layout, other = make_layout(arch, layers=4), make_layout(arch, layers=2, seed=1)
    plain, drafted, _, _ = plain_and_drafted(layout, str(other), device="cpu", offload="nvme", cpu_memory=0,
                                             kv_offload=0.5)
    assert torch.equal(plain, drafted)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_rejected_guesses_are_rolled_back_past_a_sliding_window(arch, make_layout):
    """The prompt and answer run past the tiny models' windows (4 and 8 tokens): a window's layer
    keeps what a rollback needs only while it records its past (transformers' assisted decoding
    turns that on too), and each round's crop trims it back."""
    layout, other = make_layout(arch, layers=4), make_layout(arch, layers=2, seed=1)
    if not zerolite.hf.sliding_cache_rewinds():  # transformers up to 5.17 (the GPU machines' image)
        with pytest.raises(ZeroliteError, match="sliding-window layers"):
            plain_and_drafted(layout, str(other), device="cpu", offload="nvme", cpu_memory=0)
        return
    plain, drafted, _, _ = plain_and_drafted(layout, str(other), device="cpu", offload="nvme", cpu_memory=0)
    assert torch.equal(plain, drafted)


def test_before_transformers_5_18_a_draft_for_a_sliding_window_model_is_refused(make_layout, monkeypatch):
    """Up to 5.17 a sliding window's cache cannot be rewound (its next pass fails in attention):
    refused in one line before loading, naming the release that can."""
    monkeypatch.setattr(zerolite.hf, "sliding_cache_rewinds", lambda: False)
    with pytest.raises(ZeroliteError, match=r"sliding-window layers.*transformers>=5.18"):
        zerolite.load(make_layout("gemma2"), draft="self-int8", device="cpu", show_progress=False)


@pytest.mark.parametrize("arch, why", [("jamba", "carry a recurrent state"),
                                       ("recurrent_gemma", "carry a recurrent state|sliding-window"),
                                       ("minimax", "class of its own"), ("rwkv", "class of its own")])
def test_a_draft_for_a_model_whose_cache_cannot_be_rewound_is_refused(arch, why, make_layout):
    """A recurrent state cannot be cropped back past rejected guesses (it would give other tokens),
    and MiniMax and RWKV take no cache but their own: refused before anything loads."""
    with pytest.raises(ZeroliteError, match=why):
        zerolite.load(make_layout(arch), draft="self-int8", device="cpu", show_progress=False)


@pytest.mark.alone  # the draft's length follows measured timings
def test_a_draft_that_guesses_right_saves_passes_over_the_weights(make_layout):
    """The model drafting for itself (a copy of its own layout) is always right: each target pass
    then checks several tokens, so far fewer bytes are read for the same tokens. (Beside a draft
    the ring is deeper, and its reads ahead for a pass that never comes add up to one pass.)"""
    layout = make_layout("llama", layers=4)
    copy = make_layout("llama", layers=4, fresh=True)
    plain, drafted, plain_bytes, drafted_bytes = plain_and_drafted(layout, str(copy), device="cpu", offload="nvme",
                                                                   cpu_memory=0)
    assert torch.equal(plain, drafted)
    manifest = Layout.open(layout).manifest
    assert drafted_bytes <= plain_bytes / 3 + manifest.nbytes(manifest.layer_names), (drafted_bytes, plain_bytes)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "bloom"])
def test_a_draft_on_a_gpu_with_kv_offload_leaves_greedy_output_as_it_was(arch, make_layout, gpu):
    """Rejected tokens are rolled back from the K/V cache, its host layers included."""
    layout, other = make_layout(arch, layers=4), make_layout(arch, layers=2, seed=1)
    plain, drafted, _, _ = plain_and_drafted(layout, str(other), device=gpu, offload="nvme", cpu_memory=0,
                                             gpu_memory=0, kv_offload=0.5)
    assert torch.equal(plain, drafted)



@pytest.mark.cuda
def test_a_self_int8_draft_on_a_gpu_keeps_its_head_unquantized_and_the_output_as_it_was(make_layout, gpu):
    """On a CPU the head is quantized as the draft loads (its kernel reads int8); a GPU would
    dequantise it at every guess, gigabytes of temporaries for a large vocabulary: it stays as stored."""
    layout = make_layout("llama", layers=4, fresh=True)
    plain, drafted, _, _ = plain_and_drafted(layout, "self-int8", device=gpu, offload="nvme", cpu_memory=0,
                                             gpu_memory=0)
    assert torch.equal(plain, drafted)
    for device, quantized in ((gpu, False), ("cpu", True)):
        with zerolite.load(layout, draft="self-int8", device=device, show_progress=False) as lm:
            assert isinstance(lm.draft.model.get_output_embeddings(), Int8Linear) is quantized


SAMPLES = 600
TOP_K = 4


def test_speculative_sampling_keeps_the_models_distribution(make_layout, monkeypatch):
    """Another model drafts (its guesses are often rejected). The first two sampled tokens, with
    top-k 4, fall on at most 16 pairs whose probabilities the model gives exactly; the second
    token comes out of a round of one guess and the rejection rule. Their counts over SAMPLES
    runs against those probabilities: Pearson's chi-square, at the 0.001 level (fixed seeds). This
    checks the wiring (the processors applied alike to the model's and the draft's scores, the
    positions, the caches); the rule's own arithmetic is held far tighter by the test below."""
    layout, other = make_layout("llama", layers=4), make_layout("llama", layers=2, seed=1)
    prompt = PROMPT[:, :4]
    # always a guess: so wrong a draft would soon be left out (DraftLength), and the rule not run
    monkeypatch.setattr(DraftLength, "choose", lambda self: 1)
    with zerolite.load(layout, draft=str(other), device="cpu", offload="cpu", show_progress=False) as lm:
        exact = pair_probabilities(lm.model, prompt)
        torch.manual_seed(0)
        counts = Counter()
        for _ in range(SAMPLES):
            out = lm.generate(input_ids=prompt, max_new_tokens=3, min_new_tokens=3, do_sample=True, top_k=TOP_K,
                              top_p=1.0, temperature=1.0, pad_token_id=0)
            counts[tuple(out[0, 4:6].tolist())] += 1
        spec = lm.speculator.stats
    assert 0 < spec.accepted < spec.drafted, spec  # both of the rule's branches ran
    assert set(counts) <= set(exact)
    chi2 = sum((counts[pair] - SAMPLES * p) ** 2 / (SAMPLES * p) for pair, p in exact.items())
    assert chi2 < chi2_critical(len(exact) - 1), (chi2, counts, exact)


def pair_probabilities(model, prompt) -> dict[tuple[int, int], float]:
    """P(t1, t2) under top-k sampling from the model itself."""
    def top_k(logits):
        kept = logits.topk(TOP_K).indices
        return {int(t): float(p) for t, p in zip(kept, logits[kept].softmax(-1))}

    with torch.no_grad():
        first = top_k(model(input_ids=prompt).logits[0, -1])
        return {(t1, t2): p1 * p2 for t1, p1 in first.items()
                for t2, p2 in top_k(model(input_ids=torch.cat([prompt, torch.tensor([[t1]])], 1)).logits[0, -1])
                .items()}


def chi2_critical(freedom: int) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty approximation)."""
    z = 3.0902
    return freedom * (1 - 2 / (9 * freedom) + z * math.sqrt(2 / (9 * freedom))) ** 3


def test_the_rejection_rule_leaves_each_token_distributed_as_the_model_says():
    """judge() alone, on fixed distributions: the first token kept follows p, whatever q drafted it."""
    generator = torch.Generator().manual_seed(3)
    p = torch.tensor([[[0.5, 0.3, 0.1, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]]])
    q = [torch.tensor([[0.1, 0.1, 0.4, 0.2, 0.2]])]
    torch.manual_seed(4)
    firsts = Counter()
    trials = 20000
    for _ in range(trials):
        guess = torch.multinomial(q[0][0], 1, generator=generator)[None]
        _, tokens = judge(guess, p, q, sample=True)
        firsts[int(tokens[0, 0])] += 1
    observed = torch.tensor([firsts[t] / trials for t in range(5)])
    assert (observed - p[0, 0]).abs().max() < 0.015, observed


def test_greedy_judging_keeps_guesses_up_to_the_first_the_model_disagrees_with():
    scores = torch.zeros(1, 4, 6)
    for i, token in enumerate([3, 1, 5, 2]):
        scores[0, i, token] = 1.0
    kept, tokens = judge(torch.tensor([[3, 1, 4]]), scores, [], sample=False)
    assert kept == 2 and tokens.tolist() == [[3, 1, 5]]
    kept, tokens = judge(torch.tensor([[3, 1, 5]]), scores, [], sample=False)
    assert kept == 3 and tokens.tolist() == [[3, 1, 5, 2]]


def test_the_draft_length_follows_acceptance_and_costs():
    """Long drafts where guesses are kept and cheap; short ones where they are rejected or dear."""
    def settled(kept_share: float, draft_step_s: float, target_pass_s: float) -> int:
        length = DraftLength()
        for _ in range(60):
            k = length.choose()
            kept = round(k * kept_share)
            length.record(k, kept, k * draft_step_s, target_pass_s)
        return length.choose()

    assert settled(1.0, 0.001, 0.2) == LONGEST_DRAFT
    assert settled(0.0, 0.001, 0.2) <= 2
    assert settled(0.9, 0.1, 0.2) < settled(0.9, 0.005, 0.2)


def test_speculation_refuses_a_batch(make_layout):
    with zerolite.load(make_layout(fresh=True), draft="self-int8", device="cpu", show_progress=False) as lm:
        with pytest.raises(ZeroliteError, match="speculative decoding runs at batch 1"):
            greedy(lm, PROMPT.repeat(2, 1), NEW_TOKENS, exact=True)


@pytest.mark.parametrize("asked", [dict(num_beams=2), dict(return_dict_in_generate=True)])
def test_what_speculation_does_not_do_is_refused(make_layout, asked):
    with zerolite.load(make_layout(), draft=str(make_layout(layers=2, seed=1)), device="cpu",
                       show_progress=False) as lm:
        with pytest.raises(ZeroliteError, match="greedily or by sampling"):
            lm.generate(input_ids=PROMPT, max_new_tokens=4, **asked)


def test_a_draft_with_another_vocabulary_is_refused(make_layout):
    other = make_layout("llama", vocab_size=96)
    with pytest.raises(ZeroliteError, match="does not share the target's tokenizer"):
        zerolite.load(make_layout(), draft=str(other), device="cpu", show_progress=False)


def test_a_self_draft_at_the_targets_own_precision_is_refused(make_layout):
    int4 = make_layout("llama", weights="int4", group_size=32)
    with pytest.raises(ZeroliteError, match="would be the target itself"):
        zerolite.load(int4, draft="self-int4", draft_group_size=32, device="cpu", show_progress=False)


@pytest.mark.alone  # the draft's length follows measured timings: a busy neighbour shortens it
def test_generate_with_a_draft_says_how_many_tokens_each_pass_made(capsys, monkeypatch, tmp_path, make_layout):
    """A copy of the model drafts for it: every guess is kept, so a pass makes several tokens."""
    layout, copy = make_layout("llama", layers=4), make_layout("llama", layers=4, fresh=True)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": 0, "input_ids": PROMPT[0].tolist()}) + "\n")
    common = ["generate", "--model", layout, "--device", "cpu", "--cpu-memory", "0", "--input", prompts,
              "--max-new-tokens", str(NEW_TOKENS)]
    assert run(capsys, monkeypatch, *common, "--output", tmp_path / "plain.jsonl", "--stats-json",
               tmp_path / "plain.json").code == 0
    assert run(capsys, monkeypatch, *common, "--draft", copy, "--output", tmp_path / "drafted.jsonl",
               "--stats-json", tmp_path / "drafted.json").code == 0
    tokens = [json.loads((tmp_path / f"{name}.jsonl").read_text())["token_ids"] for name in ("plain", "drafted")]
    assert tokens[0] == tokens[1]
    plain, drafted = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "drafted"))
    assert plain["tokens_per_pass"] == 1 and "acceptance_rate" not in plain
    assert drafted["tokens_per_pass"] > 2, drafted
    assert drafted["acceptance_rate"] == 1.0 and drafted["accepted_tokens"] == drafted["draft_tokens"] > 0
    assert drafted["draft_s"] > 0 and drafted["target_s"] > 0


def test_a_draft_larger_than_the_memory_left_is_one_clear_error(capsys, monkeypatch, make_layout):
    monkeypatch.setattr(zerolite.speculative.draft, "memory_left", lambda device: (1000, "host memory"))
    result = run(capsys, monkeypatch, "generate", "hi", "--model", make_layout(), "--device", "cpu",
                 "--draft", str(make_layout(layers=2, seed=1)))
    assert_one_line_error(result, "holds", "more than the 0.00 GB of host memory left", "smaller model")


def test_a_draft_with_a_batch_size_is_one_clear_error(capsys, monkeypatch, make_layout):
    result = run(capsys, monkeypatch, "generate", "hi", "--model", make_layout(), "--device", "cpu",
                 "--draft", "self-int8", "--batch-size", "4")
    assert result.code != 0 and "--draft runs prompts one at a time" in result.stderr


def test_profile_with_a_draft_reports_its_guesses_on_a_track_of_their_own(capsys, monkeypatch, tmp_path, make_layout):
    layout, copy = make_layout("llama", layers=4), make_layout("llama", layers=4, fresh=True)
    trace_file = tmp_path / "trace.json"
    result = run(capsys, monkeypatch, "profile", "--model", layout, "--device", "cpu", "--cpu-memory", "0",
                 "--draft", copy, "--new-tokens", "12", "--json", "--trace", trace_file)
    assert result.code == 0, result.stderr
    speculation = json.loads(result.stdout)["speculation"]
    assert speculation["acceptance_rate"] == 1.0 and speculation["tokens_per_pass"] > 2, speculation
    assert speculation["draft_s"] > 0 and speculation["target_s"] > 0
    trace = json.loads(trace_file.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name"}
    drafts = [e for e in trace["traceEvents"] if e["ph"] == "X" and tracks[e["tid"]] == "draft (guesses)"]
    assert drafts and all(e["args"]["tokens"] >= 1 for e in drafts)


def test_a_draft_deepens_the_ring_to_read_on_while_it_guesses_but_never_holds_every_layer(make_layout):
    """The tiny model's layers are small and a guess is slow beside reading one: the ring grows
    to all layers but one, so every step still streams every layer."""
    layout, copy = make_layout("llama", layers=6), make_layout("llama", layers=2, seed=1)
    with zerolite.load(layout, draft=str(copy), device="cpu", cpu_memory=0, show_progress=False) as lm:
        assert lm.policy.prefetch_depth == 5
        greedy(lm, PROMPT, NEW_TOKENS, exact=True)
        per_pass = lm.layout.manifest.nbytes(lm.layout.manifest.layer_names)
        assert lm.bytes_read >= lm.speculator.stats.passes * per_pass
    with zerolite.load(layout, draft=str(copy), device="cpu", offload="cpu", show_progress=False) as lm:
        assert lm.policy.prefetch_depth == 2  # nothing streams from disk: the ring stays as asked


def test_the_benchmark_runs_end_to_end_and_finds_the_tokens_unchanged(capsys, monkeypatch, make_layout, tmp_path):
    """tools/bench_speculative.py on a tiny layout (no tokenizer: random prompts), plain and with
    another model drafting, each run a zerolite process of its own."""
    layout, other = make_layout("llama", layers=4), make_layout("llama", layers=2, seed=1)
    figures = tmp_path / "figures.json"
    # The machine's page cache left as it is (as root the tool drops it before each run): dropping it
    # would slow every test running beside this one, and a tiny layout's reads time nothing here.
    monkeypatch.setattr("bench_speculative.drop_page_cache", lambda: True)
    done = run_tool(capsys, monkeypatch, "bench_speculative", "--model", layout, "--prompts", "2", "--new-tokens", "8",
                    "--drafts", other, "--json", figures)
    assert done.code == 0, done.stderr
    runs = json.loads(figures.read_text())["runs"]
    assert list(runs) == ["plain", str(other)]
    drafted = runs[str(other)]
    assert drafted["tokens"] == runs["plain"]["tokens"] and drafted["differences"] == []
    assert 0 <= drafted["agreement"]["top1"] <= 1 and drafted["stats"]["draft_tokens"] > 0
    assert "speculative decoding" in done.stdout
