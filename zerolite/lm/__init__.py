"""The Python API: load a model for streamed inference, then generate as with transformers.

    lm = zerolite.load("/nvme/bloom", offload="nvme")
    batch = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    out = lm.generate(**batch, max_new_tokens=100)

zerolite.lm.loading loads (layout, ranks, executor, draft); zerolite.lm.offloaded_lm is the model
it gives; zerolite.lm.generate_call readies a generate call's arguments for streamed weights.
"""

from zerolite.lm.loading import load, load_spec
from zerolite.lm.offloaded_lm import OffloadedLM

__all__ = ["load", "load_spec", "OffloadedLM"]
