"""Tiny random models built from transformers configs, for tests that must not touch a model hub."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BloomConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
)

VOCAB = 128


# Mixtures of experts: 8 experts, 2 per token, experts narrower than the attention (qwen2_moe with its
# shared expert beside them).
MOE_SHAPES = {
    "mixtral": dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=24, shared_expert_intermediate_size=48, num_experts=8,
                      num_experts_per_tok=2),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                      head_dim=16),
    "olmoe": dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2),
    # experts transposed, with biases; a router with a bias; sliding-window layers between full ones
    "gpt_oss": dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8),
    # DeepSeek-V3: MLA attention (as many K/V heads as query heads), a shared expert, sigmoid routing
    # limited to 1 of 2 groups of 4 experts with a score correction bias, gate and up fused in one
    # [experts, 2 x 24, hidden] tensor; its first layer dense (first_k_dense_replace)
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4),
    # GLM-4.5: DeepSeek-V3's mixture (shared expert, grouped sigmoid routing, a dense first layer) under
    # grouped-query attention
    "glm4_moe": dict(intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, head_dim=16),
}
# JetMoe's experts (ParallelExperts) are called with token counts, not with the routing: streamed whole.
WHOLE_MOE_SHAPES = {
    "jetmoe": dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, kv_channels=16,
                   num_key_value_heads=4),
    # Llama 4's experts module runs every expert over every token (the unpicked ones on rows scaled to
    # zero by the router), transposed [experts, hidden, 2 x 24] weights, a shared expert beside them:
    # streamed whole.
    "llama4_text": dict(intermediate_size=24, intermediate_size_mlp=96, num_local_experts=8, num_experts_per_tok=1,
                        head_dim=16),
}

# Windowed attention on some layers, full attention on the others (alternating, sliding first): a
# window of 4 tokens, which the tests' prompts and answers run past. With the head tied to the
# embeddings (Gemma's scaled up by sqrt(hidden)) tiny gemma2, gemma3_text and exaone4 repeat the
# prompt's last token whatever the layers do, so their heads are their own.
UNTIED = dict(tie_word_embeddings=False)
SLIDING_SHAPES = {
    "gemma2": dict(intermediate_size=160, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, **UNTIED),
    "gemma3_text": dict(intermediate_size=160, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, **UNTIED),
    "cohere2": dict(intermediate_size=160, sliding_window=4),
    "exaone4": dict(intermediate_size=160, sliding_window=4, **UNTIED),
}
# Layers that carry a state instead of (or beside) K/V: state-space (mamba, mamba2, falcon_mamba),
# state-space between attention layers (jamba with experts, bamba), gated delta-net linear attention
# between attention layers (qwen3_next, with experts), lightning linear attention (minimax, with
# experts), a real-gated recurrence beside windowed attention (recurrent_gemma), RWKV's time mix.
# Hybrids alternate, the stateful kind first; transformers' pure-torch paths run them (no mamba_ssm,
# causal_conv1d or flash-linear-attention kernels on a CPU).
STATE_SHAPES = {
    "mamba": dict(state_size=8),
    "mamba2": dict(state_size=8, num_heads=4, head_dim=32, n_groups=1, chunk_size=8),
    "falcon_mamba": dict(state_size=8),
    "jamba": dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                  expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8),
    "bamba": dict(intermediate_size=160, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=8),
    "qwen3_next": dict(intermediate_size=96, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=24,
                       shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2),
    "minimax": dict(intermediate_size=24, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=4),
    "recurrent_gemma": dict(intermediate_size=160, lru_width=64, attention_window_size=4),
    # rescale_every (6) above the layer count: RWKV divides some layers' weights in place at its
    # first forward in eval mode, which streamed weights do not keep (see ARCHS_LEFT_OUT)
    "rwkv": dict(intermediate_size=160, attention_hidden_size=64, context_length=256),
}
NO_ATTENTION = {"mamba", "mamba2", "falcon_mamba", "rwkv"}
# Families transformers builds that the suite leaves out, and why.
ARCHS_LEFT_OUT = {
    "rwkv with more layers than rescale_every": (
        "RwkvModel divides every rescale_every-th block's output and value weights in place at its first forward "
        "in eval mode (_rescale_layers); a block that is not resident (held in host memory or streamed) is bound "
        "to its home bytes at each pass, undivided, so the tokens differ from transformers' from that block on "
        "(with offload none, every block resident, they are equal)"),
}
DENSE = ["llama", "mistral", "bloom", "opt", "gpt2"]
# Every family tiny_config builds.
ARCHS = DENSE + [*MOE_SHAPES, *WHOLE_MOE_SHAPES, *SLIDING_SHAPES, *STATE_SHAPES]


def layer_pattern(arch: str, layers: int) -> dict:
    """The config fields that say which kind each layer is, alternating the two kinds (the windowed or
    stateful kind first) so that any layer count has both."""
    second = range(1, layers, 2)
    kinds = lambda one, other: [other if i in second else one for i in range(layers)]  # noqa: E731
    if arch in SLIDING_SHAPES:
        return dict(layer_types=kinds("sliding_attention", "full_attention"))
    if arch == "qwen3_next":
        return dict(layer_types=kinds("linear_attention", "full_attention"))
    if arch == "minimax":
        return dict(layer_types=kinds("linear_attention", "full_attention"))
    if arch == "bamba":
        return dict(attn_layer_indices=list(second))
    if arch == "recurrent_gemma":
        return dict(block_types=["recurrent", "attention"])  # repeated over the layers
    return {}  # jamba: its periods above; the others have one kind of layer


def tiny_config(arch: str, layers: int = 3, tie: bool = True, **overrides) -> PretrainedConfig:
    """overrides: config fields for the tests that need a bigger or otherwise shaped model."""
    common = dict(vocab_size=VOCAB, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        config_class, shape = LlamaConfig, dict(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=256)
    elif arch == "mistral":
        config_class, shape = MistralConfig, dict(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=256, sliding_window=None)
    elif arch == "bloom":
        config_class, shape = BloomConfig, dict(hidden_size=64, n_layer=layers, n_head=4)
    elif arch == "opt":
        config_class, shape = OPTConfig, dict(hidden_size=64, ffn_dim=160, num_hidden_layers=layers,
                                              num_attention_heads=4, max_position_embeddings=256,
                                              word_embed_proj_dim=64)
    elif arch == "gpt2":
        config_class, shape = GPT2Config, dict(n_embd=64, n_layer=layers, n_head=4, n_positions=256)
    elif arch in MOE_SHAPES or arch in WHOLE_MOE_SHAPES:
        attention = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
        shape = MOE_SHAPES.get(arch) or WHOLE_MOE_SHAPES[arch]
        return AutoConfig.for_model(arch, **{**common, **attention, **shape, **overrides})
    elif arch in SLIDING_SHAPES or arch in STATE_SHAPES:
        # no attention fields where there is no attention: a planner reading the config must not find any
        attention = dict(hidden_size=64, num_hidden_layers=layers) if arch in NO_ATTENTION else dict(
            hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
        shape = {**(SLIDING_SHAPES.get(arch) or STATE_SHAPES[arch]), **layer_pattern(arch, layers)}
        return AutoConfig.for_model(arch, **{**common, **attention, **shape, **overrides})
    else:
        raise ValueError(arch)
    # Constructor arguments, not attributes set afterwards: configs derive fields (head_dim) from them.
    return config_class(**{**common, **shape, **overrides})


def build_tiny_model(arch: str, seed: int = 0, **config_kwargs) -> torch.nn.Module:
    """A model with weights scaled up from transformers' tiny default init, and norms and biases
    perturbed, so that outputs vary from token to token instead of repeating one (which would
    hide bugs) on every architecture here, BLOOM included."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config_kwargs), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 4.0 / param.shape[-1] ** 0.5)
            else:
                param.add_(torch.randn_like(param), alpha=0.2)
        # a router's score correction (DeepSeek-V3, GLM-4.5): a buffer that checkpoints store, zeros at init
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer), alpha=0.2)
    return model.eval()


def save_tiny_model(arch: str, folder: Path, **kwargs) -> Path:
    build_tiny_model(arch, **kwargs).save_pretrained(folder)
    return folder


# Turns as "<|role|>content" lines, and the assistant's turn opened when asked: enough for the chat
# endpoints and --chat to have something to apply.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_ascii_tokenizer(folder: Path, chat_template: str | None = None) -> None:
    """One token per ASCII character (the tiny vocabulary's 128 ids); anything else is id 0."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(code): code for code in range(VOCAB)}
    characters = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=chr(0)))
    characters.decoder = decoders.Fuse()  # the characters back as they were, not joined by spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=characters)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
