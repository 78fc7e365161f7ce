"""A growing completion as text, one token at a time, never showing half a character.

Byte-level BPE tokens are bytes, not characters: an emoji or a CJK character is often split over two or three
tokens, and decoding the first of them alone gives U+FFFD (the replacement character) in its place. A streamed
piece must never contain that half: the text is held back until the character is complete, so the pieces
concatenate to exactly what decoding the whole completion at once gives (`decode`, what `generate` returns).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


def decode(tokenizer: Any, token_ids: list[int]) -> str:
    """A completion's text, as offline `generate` returns it (special tokens such as EOS left out)."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """One sequence's completion text, grown token by token: `text` is what may be shown so far."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # the completion's text so far, complete characters only

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens -> the new text they complete ("" while a character is still half made)."""
        self.token_ids.extend(token_ids)
        full = decode(self.tokenizer, self.token_ids)
        if full.endswith(REPLACEMENT_CHAR) or not full.startswith(self.text):
            return ""  # wait for the rest of the character
        delta, self.text = full[len(self.text) :], full
        return delta

    def finish(self) -> str:
        """The sequence ended: whatever is held back is final now -> the last piece."""
        full = decode(self.tokenizer, self.token_ids)
        delta, self.text = full[len(self.text) :], full
        return delta
