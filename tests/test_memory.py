"""Streaming from NVMe on a CPU device holds only the ring, the resident blocks and the KV cache."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from zerolite.layout.folder import Layout

DEPTH = 2
NEW_TOKENS = 4
PROMPT = [5, 17, 33, 9, 44, 61, 70, 12]

# Run in a fresh process, so that its peak RSS (VmHWM) says what loading and generating cost.
# A tiny model of the same architecture runs first, so that code transformers imports on first use
# is not counted; then writing 5 to clear_refs resets the peak to the current RSS.
MEASURE = textwrap.dedent(
    """
    import json, sys, torch, zerolite
    from zerolite.hf import cache_keyword

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def run(layout):
        with zerolite.load(layout, offload="nvme", cpu_memory=0, device="cpu", prefetch_depth=int(sys.argv[3]),
                           show_progress=False) as lm:
            out = lm.generate(input_ids=torch.tensor(json.loads(sys.argv[4])), max_new_tokens=int(sys.argv[5]),
                              do_sample=False, return_dict_in_generate=True)
            return sum(layer.keys.nbytes + layer.values.nbytes for layer in getattr(out, cache_keyword()).layers)

    run(sys.argv[1])
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    kv_bytes = run(sys.argv[2])
    print(json.dumps({"growth": status("VmHWM") - before, "kv_bytes": kv_bytes}))
    """
)


def llama_layout(make_layout, hidden: int, layers: int):
    return make_layout("llama", layers=layers, hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=8,
                       num_key_value_heads=8, max_position_embeddings=64)


def test_peak_rss_stays_within_the_ring_for_a_model_many_times_larger(make_layout):
    warm_up = llama_layout(make_layout, hidden=64, layers=2)
    big = llama_layout(make_layout, hidden=512, layers=18)
    blocks = Layout.open(big).blocks
    layer = max(b.length for b in blocks if b.name.startswith("layers."))
    resident = sum(b.length for b in blocks if not b.name.startswith("layers."))
    model_bytes = sum(b.length for b in blocks)

    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(warm_up), str(big), str(DEPTH), json.dumps([PROMPT]), str(NEW_TOKENS)],
        capture_output=True, text=True, check=True, timeout=300,
    )
    measured = json.loads(result.stdout)
    bound = (DEPTH + 2) * layer + resident + measured["kv_bytes"]
    assert model_bytes > 4 * bound
    assert measured["growth"] < bound, f"peak RSS grew {measured['growth'] / 1e6:.1f} MB, bound {bound / 1e6:.1f} MB"


def test_a_wide_head_over_a_large_batch_costs_its_logits_not_a_copy_per_sequence(make_layout):
    """generate applies the head to the last position only, a strided view of the hidden states:
    torch's slow path for it would expand the 16 MB bf16 head once per sequence (1 GB at batch 64)."""
    batch, vocab = 64, 32000
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
                 max_position_embeddings=64, vocab_size=vocab, tie_word_embeddings=False)
    warm_up = make_layout("llama", layers=2, dtype="bf16", **shape)
    wide = make_layout("llama", layers=3, seed=1, dtype="bf16", **shape)
    blocks = Layout.open(wide).blocks
    layer = max(b.length for b in blocks if b.name.startswith("layers."))
    head = Layout.open(wide).manifest.block("head").length

    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(warm_up), str(wide), str(DEPTH), json.dumps([PROMPT] * batch),
         str(NEW_TOKENS)],
        capture_output=True, text=True, check=True, timeout=300,
    )
    measured = json.loads(result.stdout)
    logits = batch * vocab * 4 * 4  # fp32 logits, a few copies of them while sampling
    bound = (DEPTH + 2) * layer + 2 * head + measured["kv_bytes"] + logits
    assert batch * head > 4 * bound  # what the slow path would add
    assert measured["growth"] < bound, f"peak RSS grew {measured['growth'] / 1e6:.1f} MB, bound {bound / 1e6:.1f} MB"
