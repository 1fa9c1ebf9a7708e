"""Batch generation: prompts in, completions out, durably and resumably."""
