"""The model's memory arithmetic, in one place: what its K/V cache, its activations and the
dequantisation of its quantized weights take, from the model's shape and the weights' format.

    shape = ModelShape.of(config)
    kv_bytes_per_token_by_layer(config, torch.bfloat16)  # one position of one sequence, layer by layer
    kv_bytes_per_token(config, torch.bfloat16)           # the same, over every layer
    kv_bytes_per_token(config, torch.bfloat16, bits=4)   # K/V kept at 4 bits, with their scales
    prefill_activation_bytes(shape, 512, torch.bfloat16)  # one sequence's widest moment
    prefill_carried_bytes(shape, 512, torch.bfloat16)     # what it keeps while other micro-batches run

The runtime (--batch-size auto, budgets, preflight) and the planner (its cost model) both ask here,
so that the batch the planner chooses is one the runtime lets run. The weights' own bytes in each
format are what the layout stores (zerolite.quant.quantize's stored_shapes, counted over a meta
model by zerolite.planner.model_costs, or read from a manifest): not estimated here.

The estimates err large where they cannot be exact: a sliding window's K/V is counted in full, and
the prefill's attention scores as materialised in fp32, as the eager and math attention paths do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

SCORE_BYTES = 4    # attention scores and logits: fp32, whatever the weights' dtype
LOGIT_COPIES = 2   # generate's last-position logits in fp32, and the processors' scores made from them


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that its memory depends on, read once from its (text) config."""
    hidden: int
    intermediate: int         # the MLP's width (4 x hidden where the config names none)
    heads: int                # query heads (0: a state-space or recurrent model, no attention)
    kv_heads: int
    head_dim: int
    vocab: int
    growing: tuple[bool, ...]  # per layer: whether its cache grows a position per token (a sliding window's counted)

    @classmethod
    def of(cls, config: PretrainedConfig) -> ModelShape:
        text = config.get_text_config(decoder=True)
        hidden = int(text.hidden_size)
        heads = int(getattr(text, "num_attention_heads", None) or 0)
        if heads:
            # A state-space, recurrent or linear-attention layer keeps a state whose size the tokens
            # do not change: only the layers with a growing cache count.
            layers = DynamicCache(config=text).layers
            growing = tuple(isinstance(layer, DynamicLayer) for layer in layers) or (True,) * text.num_hidden_layers
        else:
            growing = (False,) * text.num_hidden_layers
        return cls(
            hidden=hidden, intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden), heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads) if heads else 0,
            vocab=int(text.vocab_size), growing=growing,
        )

    @property
    def attending_layers(self) -> int:
        return sum(self.growing)

    @property
    def attention_width(self) -> int:
        """Query heads x head width: attention's multiplies per position of context, per token."""
        return self.heads * self.head_dim


KV_BITS = (16, 8, 4)  # --kv-bits: the K/V as computed (16: the model's dtype), or group-wise int8 / int4
# The widest group of a head's channels that shares one scale (and zero, at 4 bits), each token on its
# own: a 128-wide head is one group, whose two bf16 scales take 3% of its 4-bit bytes (64-wide groups
# would take 11%). Every value, and every key at 8 bits, is quantized so.
KV_GROUP = 128
# 4-bit keys are quantized per channel over groups of this many tokens (KIVI): a key's outlying
# channels are outlying in every token, so one scale a token spends its 16 levels on them. The keys
# of the group not yet full wait at 8 bits until it fills. SmolLM2-135M over 2048 tokens: groups of
# 32, 64 and 128 tokens +0.4%, +1.0% and +1.2% perplexity over 16-bit K/V (+15.5% token by token).
# 128 takes the fewest bytes past 1k tokens of context: a 128-wide key at 68 bytes a token (64 at
# 32 tokens, 72 at 64: the group's scales) and 127 waiting at 8 bits at the most (31 at 32, 63 at 64).
KV_KEY_TOKENS = 128


def kv_group_size(width: int) -> int:
    """The channels of one head's key or value (width of them) that share a scale: width split into
    equal groups of at most KV_GROUP (128 stays one group, 256 makes two, 160 two of 80)."""
    groups = -(-width // KV_GROUP)
    while width % groups:
        groups += 1
    return width // groups


def kv_row_bytes(width: int, dtype: torch.dtype, bits: int) -> int:
    """Bytes one head's value (or key at 8 bits) of width channels takes for one token at bits: at 16
    the states as they are; at 8 an int8 code a channel and a scale in dtype a group; at 4 a nibble a
    channel and a scale and a zero in dtype a group, rounded up to whole elements of dtype so that
    the scales (stored first) stay aligned in every row (zerolite.quant.kv_codec's layout)."""
    if bits == 16:
        return width * dtype.itemsize
    groups = width // kv_group_size(width)
    scales = groups * dtype.itemsize * (2 if bits == 4 else 1)
    codes = width if bits == 8 else -(-width // 2)
    return -(-(scales + codes) // dtype.itemsize) * dtype.itemsize


def kv_key_share(width: int, tokens: int) -> int:
    """Elements of dtype each token's row carries of its key group's scales and zeros (a scale and a
    zero a channel, 2 x width, spread over the group's tokens rows)."""
    return -(-2 * width // tokens)


def kv_key_row_bytes(width: int, dtype: torch.dtype, bits: int, tokens: int | None = None) -> int:
    """Bytes one head's key of width channels takes for one token at bits, once its group (of tokens,
    KV_KEY_TOKENS unless given) is full: at 4 a nibble a channel and its share of the group's scales
    and zeros (kv_key_share); else as a value."""
    if bits != 4:
        return kv_row_bytes(width, dtype, bits)
    share = kv_key_share(width, tokens or KV_KEY_TOKENS) * dtype.itemsize
    return -(-(share + -(-width // 2)) // dtype.itemsize) * dtype.itemsize


def kv_bytes_per_token_by_layer(config: PretrainedConfig, dtype: torch.dtype, bits: int = 16) -> list[int]:
    """Bytes of K/V one token adds to each layer's cache, kept at bits (their scales included): none
    in a state-space, recurrent or linear-attention layer, a sliding window's counted in full (at most;
    its keys are quantized token by token, in no more bytes than a group's)."""
    shape = ModelShape.of(config)
    if not shape.heads:
        return [0] * len(shape.growing)
    per_layer = shape.kv_heads * (kv_key_row_bytes(shape.head_dim, dtype, bits)
                                  + kv_row_bytes(shape.head_dim, dtype, bits))
    return [per_layer if grows else 0 for grows in shape.growing]


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, bits: int = 16) -> int:
    """Bytes of K/V one token adds to the cache at bits, over every layer. A model with no attention
    heads (mamba, rwkv) adds none."""
    return sum(kv_bytes_per_token_by_layer(config, dtype, bits))


def kv_waiting_bytes(config: PretrainedConfig, dtype: torch.dtype, bits: int) -> int:
    """What one sequence's K/V takes at its most beside kv_bytes_per_token's count, at 4 bits: the keys
    of the KV_KEY_TOKENS - 1 tokens of a group not yet full, waiting at 8 bits where the count has them
    at 4. None at 16 and 8 bits, where every token is stored as it comes."""
    shape = ModelShape.of(config)
    if bits != 4 or not shape.heads:
        return 0
    per_token = kv_row_bytes(shape.head_dim, dtype, 8) - kv_key_row_bytes(shape.head_dim, dtype, bits)
    return (KV_KEY_TOKENS - 1) * shape.kv_heads * per_token * sum(shape.growing)


def kv_filling_group_bytes(config: PretrainedConfig, dtype: torch.dtype, bits: int) -> int:
    """What one sequence's group of tokens not yet full takes at its most at 4 bits, over every layer:
    KV_KEY_TOKENS - 1 tokens, keys waiting at 8 bits, values at 4. A layer whose K/V is on disk holds
    it in memory, where the rest of its K/V is not. None at 16 and 8 bits."""
    if bits != 4:
        return 0
    return (KV_KEY_TOKENS - 1) * kv_bytes_per_token(config, dtype, bits) + kv_waiting_bytes(config, dtype, bits)


def kv_decode_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, bits: int) -> int:
    """What reading quantized K/V takes beside it, per token of context: the layer being attended
    holds its keys and values decoded into dtype (decoded in place, so nothing wider). None at
    16 bits, where attention reads the cache itself."""
    return 0 if bits == 16 else max(kv_bytes_per_token_by_layer(config, dtype), default=0)


def prefill_activation_bytes(shape: ModelShape, prompt_tokens: int, dtype: torch.dtype) -> int:
    """One sequence's activations at the prefill, a run's widest moment: the hidden states, the
    attention's projections and the MLP's three intermediates for each prompt token, the attention
    scores of every head over the prompt in fp32, and the last position's logits as generate keeps them."""
    per_token = (6 * shape.hidden + 3 * shape.intermediate) * dtype.itemsize
    scores = shape.heads * prompt_tokens * prompt_tokens * SCORE_BYTES
    return prompt_tokens * per_token + scores + LOGIT_COPIES * shape.vocab * SCORE_BYTES


def prefill_carried_bytes(shape: ModelShape, prompt_tokens: int, dtype: torch.dtype) -> int:
    """What one sequence holds through the prefill's whole pass over the layers when they run in
    micro-batches, beside the micro-batch running: its hidden states into the layer and out of it
    (twice out, while the micro-batches' outputs are joined), and its last position's logits."""
    return 3 * prompt_tokens * shape.hidden * dtype.itemsize + LOGIT_COPIES * shape.vocab * SCORE_BYTES


def quantized_weight_count(weights: str, nbytes: int) -> int:
    """How many weights nbytes of a quantized format's codes hold (int4 packs two a byte, a partial
    last group's padding included: what dequantising them makes)."""
    return nbytes * (2 if weights == "int4" else 1)


def dense_weight_bytes(weights: int, dtype: torch.dtype) -> int:
    """What quantized weights take dequantised into dtype (a GPU keeps resident ones so)."""
    return weights * dtype.itemsize


def dequantize_workspace(weights: str | None, largest_weight: int, dtype: torch.dtype, packed_layer_bytes: int) -> int:
    """The most device memory streamed quantized layers take for their matmuls on a GPU: the
    scratch buffer (the largest weight, largest_weight of them, in dtype) with the temporaries of
    one weight's dequantisation (int8: none past the scratch; int4: its nibbles, a byte a weight)
    or of its packing for the fused kernel (the unpacked codes and their pairs, under 2 + itemsize
    bytes a weight), counted as 1 + 2 * itemsize bytes a weight for int4 and 2 * itemsize for
    int8; and for int4 the fused kernel's packings a layer keeps while it runs, as large as its
    quantized weights (packed_layer_bytes, the largest layer's). weights: "int8", "int4", or None
    for weights stored as they are, which need none."""
    if weights is None:
        return 0
    int4 = weights == "int4"
    per_weight = 1 + 2 * dtype.itemsize if int4 else 2 * dtype.itemsize
    return largest_weight * per_weight + (packed_layer_bytes if int4 else 0)


def cpu_dequantize_workspace(weights: str | None, largest_weight: int, dtype: torch.dtype) -> int:
    """The most host memory a CPU's quantized layers take for a prefill's matmuls (from
    zerolite.quant.linear's row thresholds on): int4's scratch buffer, the largest weight's
    transpose in bf16 for bf16 rows, else fp32; int8's weight widened into the rows' dtype and then
    scaled, two temporaries of the largest weight. weights: "int8", "int4", or None (none)."""
    if weights is None:
        return 0
    if weights == "int4":
        return largest_weight * (2 if dtype == torch.bfloat16 else 4)
    return largest_weight * 2 * dtype.itemsize


def quantized_bytes_per_weight(weights: str, dtype: torch.dtype, group_size: int | None = None) -> float:
    """What a wide weight takes stored in a quantized format (zerolite.quant.quantize), its scales
    included: int8 a byte (its scale is one per output row, nothing per weight); int4 half a byte,
    and a scale and a zero point in dtype per group of group_size input columns."""
    if weights == "int8":
        return 1.0
    return 0.5 + 2 * dtype.itemsize / group_size
