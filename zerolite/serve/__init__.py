"""The OpenAI-compatible server and its continuous batching."""
