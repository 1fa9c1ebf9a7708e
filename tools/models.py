"""The benchmarks' models: random weights in a transformers folder, and zerolite layouts of it.

    make_model(Path("build/llama19/source"), "llama", dict(hidden_size=2048, ...),
               {Path("build/llama19/layout"): {}, Path("build/llama19/layout-int8"): {"weights": "int8"}})
    write_checkpoint(Path("build/dsv3/source"), "deepseek_v3", dict(hidden_size=2048, ...))

Not tests/support/tiny_models.py's: those are tiny float32 models with weights scaled so that tests see
varied tokens; a benchmark wants a model of a real size, in bf16, and only its bytes matter.
"""

from __future__ import annotations

import json
from pathlib import Path

SHARD_BYTES = 4_500_000_000  # write_checkpoint's shards, as the large published checkpoints have them (~4-5 GB)


def make_model(source: Path, model_type: str, config: dict, layouts: dict[Path, dict]) -> None:
    """Saves a bf16 model_type of config's shape with random weights (seed 0) in source, then
    converts it into each folder of layouts with that folder's convert arguments: each only where
    it is missing, so that a model built once serves every later run."""
    # Imported here: a benchmark's own process stays without transformers unless it builds a model.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (source / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config),
                                         dtype=torch.bfloat16).save_pretrained(source)
    convert_missing(source, layouts)


def convert_missing(source: Path, layouts: dict[Path, dict]) -> None:
    from zerolite.convert.writer import convert
    from zerolite.layout.manifest import MANIFEST

    for layout, convert_args in layouts.items():
        if not (layout / MANIFEST).is_file():
            convert(str(source), layout, **convert_args)


def write_checkpoint(source: Path, model_type: str, config: dict, shard_bytes: int = SHARD_BYTES,
                     report=print) -> int:
    """A bf16 model_type of config's shape with random weights in source, in the form its published
    checkpoint has, written shard by shard (never held whole, so it may exceed RAM); returns its bytes.

    - a mixture's experts one tensor per expert and projection, as DeepSeek-V3, Mixtral-style
      checkpoints publish them (mlp.experts.N.gate_proj.weight, up_proj, down_proj), not the fused
      [experts, ...] tensors transformers 5 builds from them while loading;
    - every tensor bf16 but those the model's class keeps in float32 (DeepSeek-V3's router weight and
      its score correction bias), stored as save_pretrained stores them: streamed in place, a tensor
      must be stored in the dtype the run holds it in;
    - decoder layers whole, in order, in shards of at most shard_bytes (one layer may exceed it).
    Random normal weights (std 0.02), norms at 1, correction biases at 0: the same bytes on every
    machine (one generator, seed 0, drawn in a fixed order), so a deleted model can be remade."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model_config = AutoConfig.for_model(model_type, **config, dtype="bfloat16")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16)
    tensors = checkpoint_tensors({name: tuple(t.shape) for name, t in meta.state_dict().items()})
    kept_float32 = {name for name, t in meta.state_dict().items() if t.dtype == torch.float32}
    shards = shard_groups(tensors, shard_bytes)
    source.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for index, group in enumerate(shards):
        shard = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        written = {name: random_tensor(name, tensors[name], generator,
                                       torch.float32 if name in kept_float32 else torch.bfloat16) for name in group}
        save_file(written, source / shard, metadata={"format": "pt"})
        total += sum(t.nbytes for t in written.values())
        weight_map.update(dict.fromkeys(group, shard))
        report(f"wrote {shard} ({total / 1e9:.2f} GB so far)")
        del written
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    model_config.save_pretrained(source)
    return total


def checkpoint_tensors(module_tensors: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The checkpoint's names and shapes for a module's: fused experts ([experts, 2 x intermediate,
    hidden] gate_up_proj, [experts, hidden, intermediate] down_proj) split into one tensor per
    expert and projection, under the names transformers' loading fuses."""
    named = {}
    for name, shape in module_tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.endswith("experts") and leaf == "gate_up_proj":
            experts, both, hidden = shape
            for expert in range(experts):
                named[f"{module}.{expert}.gate_proj.weight"] = (both // 2, hidden)
                named[f"{module}.{expert}.up_proj.weight"] = (both // 2, hidden)
        elif module.endswith("experts") and leaf == "down_proj":
            for expert in range(shape[0]):
                named[f"{module}.{expert}.down_proj.weight"] = shape[1:]
        else:
            named[name] = shape
    return named


def shard_groups(tensors: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """The names each shard holds: what is not in a decoder layer (embeddings, final norm, head)
    with the first layers, then whole layers in order while a shard has room."""
    import math

    def layer_of(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[parts.index("layers") + 1]) if "layers" in parts else None

    by_layer: dict[int | None, list[str]] = {}
    for name in tensors:
        by_layer.setdefault(layer_of(name), []).append(name)
    shards: list[list[str]] = [by_layer.pop(None, [])]
    room = shard_bytes - sum(2 * math.prod(tensors[n]) for n in shards[0])
    for layer in sorted(by_layer):
        nbytes = sum(2 * math.prod(tensors[n]) for n in by_layer[layer])
        if nbytes > room and shards[-1]:
            shards.append([])
            room = shard_bytes
        shards[-1] += by_layer[layer]
        room -= nbytes
    return shards


def random_tensor(name: str, shape: tuple[int, ...], generator, dtype):
    import torch

    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=dtype)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)
