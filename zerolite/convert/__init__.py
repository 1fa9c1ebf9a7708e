"""Checkpoints (safetensors, pickles, GGUF) turned into layouts, once."""
