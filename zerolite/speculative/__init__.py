"""Speculative decoding: a resident draft proposes, one pass over the streamed weights verifies."""
