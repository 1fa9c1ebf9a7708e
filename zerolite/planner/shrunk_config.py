"""A model's config cut down to a few decoder layers and a tiny vocabulary, for timing one layer.

    small = shrunk(config, layers=2)

The layer count is changed the way transformers itself sets it: the config is rebuilt through its
class from its fields, so that whatever the family derives from the count (layer_types,
layers_block_type, a hybrid's pattern of attention and state-space layers) is derived again, and
lists given per layer are cut to their first layers. Setting the fields on a copy instead fails on
families whose layer types are read-only properties (Mamba, Jamba, Bamba, RecurrentGemma).
"""

from __future__ import annotations

import copy

PROBE_VOCAB = 256   # the head's cost is counted apart (the matmul rates): a full vocabulary would only blur a layer's


def shrunk(config, layers: int):
    """config with its text model's first layers decoder layers, the rest of the model as it was."""
    text = config.get_text_config(decoder=True)
    small = rebuilt(text, layers)
    if text is config:
        return small
    outer = copy.deepcopy(config)
    for name in ("text_config", "decoder", "generator"):
        if getattr(config, name, None) is text:
            setattr(outer, name, small)
            return outer
    raise ValueError(f"cannot find the text model's config within {type(config).__name__}")


def rebuilt(text, layers: int):
    fields = text.to_dict()
    count_key = text.attribute_map.get("num_hidden_layers", "num_hidden_layers")
    count = fields[count_key]
    for key, value in fields.items():
        if isinstance(value, (list, tuple)) and len(value) == count:
            fields[key] = value[:layers]  # one entry per layer: the first layers' entries
        elif key.endswith(("layer_indices", "layer_ids")) and isinstance(value, (list, tuple)):
            fields[key] = [i for i in value if i < layers]  # layers named by index: those still there
    fields[count_key] = layers
    fields[text.attribute_map.get("vocab_size", "vocab_size")] = PROBE_VOCAB
    return type(text)(**{key: value for key, value in fields.items() if key not in ("model_type", "transformers_version")})
