"""zerolite: run Hugging Face causal LMs larger than memory by streaming blocks from NVMe or RAM.

    import zerolite
    lm = zerolite.load("/nvme/bloom", offload="nvme")
    out = lm.generate(**lm.tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=100)
"""

from zerolite.openmp import prefer_passive_waits

prefer_passive_waits()  # before anything loads torch: see zerolite/openmp.py

__version__ = "0.1.0"

__all__ = ["load", "OffloadedLM"]


def __getattr__(name: str):
    # torch and transformers load only when the API is first used, so `zerolite --help` stays quick.
    if name in __all__:
        from zerolite import api

        return getattr(api, name)
    raise AttributeError(f"module 'zerolite' has no attribute {name!r}")
