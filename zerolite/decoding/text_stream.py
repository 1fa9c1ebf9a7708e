"""A sequence's text as its tokens come, in pieces that are safe to send: never half a character,
never the start of a stop string that may yet complete.

    text = TextStream(tokenizer, stop=["\\n\\n"])
    piece, stopped = text.add(token)   # text to send now; stopped: a stop string ended the sequence
    piece = text.finish()              # whatever was held back, once the sequence ends otherwise

New tokens are decoded together with the tokens of the last piece sent, not the whole sequence
again (text-generation-inference's incremental decoding): a tokenizer may merge a token with its
neighbours (leading spaces, byte pieces), and a byte-level piece may end inside a character,
which decodes to U+FFFD until the next tokens complete it.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1   # characters a stop string may still grow from
        self.tokens: list[int] = []
        self.prefix = 0          # first token of the context decoded with the new ones
        self.read = 0            # first token not yet turned into text
        self.pending = ""        # text decoded but not sent: it may begin a stop string

    def add(self, token: int) -> tuple[str, bool]:
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix:self.read])
        after = self._decode(self.tokens[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return "", False     # no new text yet, or a character not yet complete
        self.pending += after[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        found = [at for at in (self.pending.find(stop) for stop in self.stop) if at >= 0]
        if found:
            piece, self.pending = self.pending[:min(found)], ""
            return piece, True
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return "", False
        piece, self.pending = self.pending[:cut], self.pending[cut:]
        return piece, False

    def finish(self) -> str:
        piece, self.pending = self.pending, ""
        return piece

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
