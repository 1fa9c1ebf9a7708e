"""zerolite: run Hugging Face causal LMs larger than memory by streaming blocks from NVMe or RAM."""

__version__ = "0.1.0"
