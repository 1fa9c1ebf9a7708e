"""A model's config cut down to a few of its decoder layers and a tiny vocabulary, for timing a layer.

    small, shares = shrunk(config, layers=2)   # shares: each kept layer's part of the model's layers

The config is rebuilt through its class from its fields, as transformers sets a layer count, so
that whatever the family derives from the count (layer_types, layers_block_type, a hybrid's pattern
of attention and state-space layers) is derived again. Setting the fields on a copy instead fails
on families whose layer types are read-only properties (Mamba, Jamba, Bamba, RecurrentGemma).

Where the config lists its layers' kinds (layer_types, layers_block_type, the indices of its
attention layers), the layers kept are the first of each of the commonest kinds, not merely the
first layers: Qwen3-Next's first three layers are linear attention, and a model of those alone
does not run (its forward asks the cache for a length that only attention layers keep). Each
kept layer's share says how many of the model's layers it stands for, so that their times weigh
as the model's own mix does. Where the pattern is derived instead (Jamba's period and offset),
the first layers are kept, each standing for an equal part.
"""

from __future__ import annotations

import copy
from collections import Counter

PROBE_VOCAB = 256   # the head's cost is counted apart (the matmul rates): a full vocabulary would only blur a layer's
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def shrunk(config, layers: int):
    """(config with layers of its text model's decoder layers, the rest of the model as it was;
    each kept layer's share of the model's layers)."""
    text = config.get_text_config(decoder=True)
    small, shares = rebuilt(text, layers)
    if text is config:
        return small, shares
    outer = copy.deepcopy(config)
    for name in ("text_config", "decoder", "generator"):
        if getattr(config, name, None) is text:
            setattr(outer, name, small)
            return outer, shares
    raise ValueError(f"cannot find the text model's config within {type(config).__name__}")


def rebuilt(text, layers: int):
    fields = text.to_dict()
    count = text.num_hidden_layers
    per_layer = [key for key, value in fields.items() if isinstance(value, (list, tuple)) and len(value) == count]
    by_index = [key for key, value in fields.items()
                if key.endswith(("layer_indices", "layer_ids")) and isinstance(value, (list, tuple))]
    kinds = [tuple(fields[key][i] for key in per_layer) + tuple(i in fields[key] for key in by_index)
             for i in range(count)]
    kept = chosen(kinds, layers)
    for key in per_layer:
        fields[key] = [fields[key][i] for i in kept]
    for key in by_index:
        fields[key] = [kept.index(i) for i in fields[key] if i in kept]  # the kept layers' new places
    for key in TOKEN_IDS:
        if key in fields and not fits(fields[key]):
            fields[key] = None  # an id past the tiny vocabulary: an embedding's padding_idx refuses it (Phi-3's 32000)
    count_key = text.attribute_map.get("num_hidden_layers", "num_hidden_layers")
    if count_key in fields:  # else the count follows the per-layer list just cut (NemotronH's layers_block_type)
        fields[count_key] = len(kept)
    fields[text.attribute_map.get("vocab_size", "vocab_size")] = PROBE_VOCAB
    small = type(text)(**{key: value for key, value in fields.items()
                          if key not in ("model_type", "transformers_version")})
    every, alike = Counter(kinds), Counter(kinds[i] for i in kept)
    return small, [every[kinds[i]] / alike[kinds[i]] / count for i in kept]


def chosen(kinds: list[tuple], layers: int) -> list[int]:
    """The indices of layers layers: the first of each of the commonest kinds, then the earliest others."""
    firsts = {}
    for i, kind in enumerate(kinds):
        firsts.setdefault(kind, i)
    frequent = sorted(firsts, key=lambda kind: (-kinds.count(kind), firsts[kind]))[:layers]
    kept = [firsts[kind] for kind in frequent]
    kept += [i for i in range(len(kinds)) if i not in kept][:layers - len(kept)]
    return sorted(kept)


def fits(token_id) -> bool:
    ids = token_id if isinstance(token_id, (list, tuple)) else [token_id]
    return all(i is None or i < PROBE_VOCAB for i in ids)
