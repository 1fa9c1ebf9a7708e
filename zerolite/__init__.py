"""zerolite: run Hugging Face causal LMs larger than memory by streaming blocks from NVMe or RAM.

    import zerolite
    lm = zerolite.load("/nvme/bloom", offload="nvme")
    out = lm.generate(**lm.tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=100)
    # every rank calls generate_file alike, under torchrun
    zerolite.generate_file(lm, "prompts.jsonl", "out.jsonl", zerolite.Sampling(max_new_tokens=64))
"""

from zerolite.huge_pages import prefer_huge_pages
from zerolite.openmp import prefer_passive_waits

prefer_passive_waits()  # before anything loads torch: see zerolite/openmp.py
prefer_huge_pages()  # before torch allocates: see zerolite/huge_pages.py

__version__ = "0.1.0"

__all__ = ["load", "OffloadedLM", "generate_file", "Sampling"]
HOMES = {"load": "lm", "OffloadedLM": "lm", "generate_file": "generate.job", "Sampling": "sampling"}


def __getattr__(name: str):
    # torch and transformers load only when the API is first used, so `zerolite --help` stays quick.
    if name in HOMES:
        import importlib

        return getattr(importlib.import_module(f"zerolite.{HOMES[name]}"), name)
    raise AttributeError(f"module 'zerolite' has no attribute {name!r}")
