"""The benchmarks' models: random weights in a transformers folder, and zerolite layouts of it.

    make_model(Path("build/llama19/source"), "llama", dict(hidden_size=2048, ...),
               {Path("build/llama19/layout"): {}, Path("build/llama19/layout-int8"): {"weights": "int8"}})

Not tests/support/tiny_models.py's: those are tiny float32 models with weights scaled so that tests see
varied tokens; a benchmark wants a model of a real size, in bf16, and only its bytes matter.
"""

from __future__ import annotations

from pathlib import Path


def make_model(source: Path, model_type: str, config: dict, layouts: dict[Path, dict]) -> None:
    """Saves a bf16 model_type of config's shape with random weights (seed 0) in source, then
    converts it into each folder of layouts with that folder's convert arguments: each only where
    it is missing, so that a model built once serves every later run."""
    # Imported here: a benchmark's own process stays without transformers unless it builds a model.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerolite.convert.writer import convert
    from zerolite.layout.manifest import MANIFEST

    if not (source / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config),
                                         dtype=torch.bfloat16).save_pretrained(source)
    for layout, convert_args in layouts.items():
        if not (layout / MANIFEST).is_file():
            convert(str(source), layout, **convert_args)
