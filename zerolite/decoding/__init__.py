"""The running batch and the loop that decodes it, one for both front ends: `zerolite serve`
(requests arriving) and `zerolite generate --input` (an input file's prompts, continuous batching)."""
