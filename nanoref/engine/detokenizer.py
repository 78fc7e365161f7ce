"""A growing completion as text, one token at a time, never showing half a character, and its stop strings.

Byte-level BPE tokens are bytes, not characters: an emoji or a CJK character is often split over two or three
tokens, and decoding the first of them alone gives U+FFFD (the replacement character) in its place. A streamed
piece must never contain that half: the text is held back until the character is complete, so the pieces
concatenate to exactly what decoding the whole completion at once gives (`decode`, what `generate` returns).

Cheap per token: only a window of recent tokens is decoded, never the whole completion (vLLM's prefix_offset /
read_offset). The window starts at a token where an earlier decode ended on a whole character
(`prefix_offset`); the tokens up to `read_offset` are already shown, and their text, decoded from the same start,
is subtracted from the window's. Decoding from the same start matters for decoders that treat a text's first
token differently (SentencePiece's Metaspace drops its leading space): both sides get the same treatment. The
window only grows while tokens keep ending inside a character (or in bytes that are not UTF-8 at all: a lone
continuation byte decodes to U+FFFD, which waits for a token that ends on a whole character or for the end).

Exact, because `decode` is a concatenation at whole-character boundaries: decoding the completion in windows that
meet at such boundaries gives the text decoding it at once gives. That holds for byte-level decoders (bytes, then
UTF-8) and for added tokens (spliced in as their text). It would not hold with `clean_up_tokenization_spaces`,
which rewrites " ." as "." depending on the token after the space: `decode` turns it off, so `generate` and the
stream decode the same way by construction (transformers 5 already ignores it for BPE tokenizers).

Stop strings are matched on this text, across token boundaries: `find_stop` searches what the latest token added
(with the characters before it that a stop string could straddle: `find_stop_string`), and until a stop string is
known not to start at the end of the text those characters are held back from `text` (`stop_hold_back`), so no
piece ever shows part of a stop string that then matches. Both are pure functions behind exercise seams
(notebook 11).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from nanoref.utils.seams import seam

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


def decode(
    tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
) -> str:
    """A completion's text, as offline `generate` returns it (special tokens such as EOS left out unless
    skip_special_tokens is False; no clean-up of spaces before punctuation, which would make a text's end depend on
    the token after it). spaces_between_special_tokens=False (with special tokens shown): the runs of ordinary
    tokens are decoded on their own and the added tokens between them written as their bare text, joined with
    nothing (HF's and vLLM's rule for it), so no decoder puts its spaces around them."""
    if not skip_special_tokens and not spaces_between_special_tokens:
        return "".join(_added_token_runs(tokenizer, token_ids))
    rust = _rust_tokenizer(tokenizer)
    if rust is not None:
        return rust.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def _added_token_runs(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """The text of each run of ordinary tokens (decoded together) and of each added token (its content), in order."""
    added = {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items()}
    pieces, run = [], []
    for token_id in token_ids:
        if token_id in added:
            if run:
                pieces.append(decode(tokenizer, run, skip_special_tokens=False))
                run = []
            pieces.append(added[token_id])
        else:
            run.append(token_id)
    if run:
        pieces.append(decode(tokenizer, run, skip_special_tokens=False))
    return pieces


@functools.cache
def _stock_decode() -> Any:
    """transformers' own decode of a fast (Rust-backed) tokenizer, the function a subclass would override."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast  # transformers 5
    except ImportError:
        from transformers import PreTrainedTokenizerFast as Fast  # transformers 4
    return Fast._decode


def _rust_tokenizer(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` under a transformers fast tokenizer whose decode is transformers' own (else None).
    Its decode is exactly what `tokenizer.decode(..., clean_up_tokenization_spaces=False)` returns, less the Python
    around it (argument conversion, keyword handling): half the time of a call of a few tokens, and a server
    decodes every stream's new tokens after every step."""
    if getattr(type(tokenizer), "_decode", None) is not _stock_decode():
        return None
    return getattr(tokenizer, "_tokenizer", None)


def hidden_stop_tokens(params: Any, eos_token_ids: set[int] | frozenset[int]) -> frozenset[int]:
    """The token ids whose text a completion never shows: the token that ends the completion (EOS unless ignore_eos,
    a stop_token_ids entry), special or not and whatever skip_special_tokens says, as in vLLM, unless
    include_stop_str_in_output. Such a token always ends its completion (it is masked before min_tokens), so
    leaving it out of the text never hides one in the middle. params: SamplingParams."""
    if params.include_stop_str_in_output:
        return frozenset()
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))


def find_stop_string(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The stop string of `stops` that ends first in `text` among those that end after index `start` (the text
    before `start` was searched already; a stop string may begin before it and straddle it) -> (the index where it
    begins, the stop string), or None. Where two end at the same place, the one that begins first (the longer)."""
    found = None  # (end, begin, stop string)
    for stop in stops:
        begin = text.find(stop, max(start - len(stop) + 1, 0))  # the first one that ends at start + 1 or later
        if begin >= 0 and (found is None or (begin + len(stop), begin) < found[:2]):
            found = (begin + len(stop), begin, stop)
    return None if found is None else (found[1], found[2])


def stop_hold_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the beginning of a stop string: the length of the longest
    end of `text` that some stop string begins with (a whole stop string counts), 0 when none does."""
    for length in range(min(max(map(len, stops), default=0), len(text)), 0, -1):
        tail = text[-length:]
        if any(stop.startswith(tail) for stop in stops):
            return length
    return 0


def decode_many(
    tokenizer: Any,
    token_lists: list[list[int]],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> list[str]:
    """`decode` of each list; through a fast tokenizer, in one Rust call that releases the GIL while it runs (a
    server's other threads go on meanwhile)."""
    rust = _rust_tokenizer(tokenizer)
    if rust is not None and (skip_special_tokens or spaces_between_special_tokens):
        return rust.decode_batch(token_lists, skip_special_tokens=skip_special_tokens)
    return [decode(tokenizer, ids, skip_special_tokens, spaces_between_special_tokens) for ids in token_lists]


def add_many(detokenizers: list[IncrementalDetokenizer], token_lists: list[list[int]]) -> list[str]:
    """`detokenizers[i].add(token_lists[i])` for every i -> the pieces, with two batched decodes per kind of
    decoding (skip_special_tokens, spaces_between_special_tokens: nearly always one kind) in all (the windows, then
    the new prefixes) rather than two per detokenizer. They must share one tokenizer. Every decode runs before any
    detokenizer changes: when one raises (a tokenizer that cannot decode some id), each is as it was, and each may
    then be tried alone (`delta_texts` does, to fail only the request at fault)."""
    if not detokenizers:
        return []
    tokenizer = detokenizers[0].tokenizer
    if any(detokenizer.tokenizer is not tokenizer for detokenizer in detokenizers):
        raise ValueError("add_many needs detokenizers that share one tokenizer")
    kinds: dict[tuple[bool, bool], list[int]] = {}
    new_ids, window_ids = [], []  # each one's new tokens, and its window after the add
    for i, (detokenizer, token_ids) in enumerate(zip(detokenizers, token_lists, strict=True)):
        hidden = detokenizer.hidden
        new = [t for t in token_ids if t not in hidden] if hidden else token_ids
        new_ids.append(new)
        window_ids.append(detokenizer.token_ids[detokenizer.prefix_offset :] + new)
        kinds.setdefault(detokenizer.decoding, []).append(i)
    windows: list[str] = [""] * len(detokenizers)
    prefixes: list[str | None] = [None] * len(detokenizers)  # the next prefix_text, where the window advances
    for decoding, members in kinds.items():
        advancing, prefix_ids = [], []
        for i, window in zip(members, decode_many(tokenizer, [window_ids[i] for i in members], *decoding)):
            windows[i] = window
            detokenizer = detokenizers[i]
            if not detokenizer._waits(window):
                advancing.append(i)  # its next prefix: the window's tokens from read_offset on (`_advance`'s ids)
                prefix_ids.append(window_ids[i][detokenizer.read_offset - detokenizer.prefix_offset :])
        for i, text in zip(advancing, decode_many(tokenizer, prefix_ids, *decoding)):
            prefixes[i] = text
    pieces = []
    for detokenizer, new, window, prefix in zip(detokenizers, new_ids, windows, prefixes):
        detokenizer.token_ids.extend(new)
        pieces.append(detokenizer._advance(window)[0])
        if prefix is not None:
            detokenizer.prefix_text = prefix
    return pieces


class IncrementalDetokenizer:
    """One sequence's completion text, grown token by token: `text` is what may be shown so far.

    stop: strings that end the completion (see `find_stop`); include_stop: keep the matched string in the text.
    skip_special_tokens, spaces_between_special_tokens: as `decode`'s. hidden: token ids whose text never shows
    (the stop tokens: `hidden_stop_tokens`)."""

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        hidden: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.decoding = (skip_special_tokens, spaces_between_special_tokens)
        self.hidden = hidden
        self.token_ids: list[int] = []
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.stop_reason: str | None = None  # the stop string that matched, once one has
        self.text = ""  # the text that may be shown: whole characters, no possible start of a stop string
        self.decoded = ""  # all whole characters decoded so far (text plus what is held back)
        self.prefix_offset = 0  # the window's first token: an earlier decode ended on a whole character here
        self.read_offset = 0  # the tokens before it are in `decoded`
        self.prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._search_from = 0  # where in `decoded` the latest token's new text can start a stop string

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens -> the new text they let `text` show ("" while a character is half made)."""
        self.token_ids.extend(t for t in token_ids if t not in self.hidden)
        piece, prefix_ids = self._advance(decode(self.tokenizer, self.token_ids[self.prefix_offset :], *self.decoding))
        if prefix_ids is not None:
            self.prefix_text = decode(self.tokenizer, prefix_ids, *self.decoding)
        return piece

    def _advance(self, window: str) -> tuple[str, list[int] | None]:
        """Take the decoded window -> (the new piece, the ids whose text is the next `prefix_text`, or None when
        the window waits for the rest of a character). `add` in two halves around its decodes (see add_many)."""
        if self._waits(window):
            self._search_from = len(self.decoded)  # nothing new to search
            return "", None  # wait for the rest of the character
        self._extend(window[len(self.prefix_text) :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._show(self._held_back()), self.token_ids[self.prefix_offset : self.read_offset]

    def _waits(self, window: str) -> bool:
        """The decoded window shows nothing new yet: it ends in half a character, or adds no text."""
        return window.endswith(REPLACEMENT_CHAR) or len(window) <= len(self.prefix_text)

    def find_stop(self) -> str | None:
        """The stop string the latest `add` completed, if any: the text is cut before it (just after it with
        include_stop) and it becomes `stop_reason`. Where two complete in the same token, the one that ends first
        wins (it would have stopped the text first), and of those the one that starts first."""
        if not self.stop or self.stop_reason is not None:
            return self.stop_reason
        found = seam("find_stop_string", find_stop_string)(self.decoded, self.stop, self._search_from)
        self._search_from = len(self.decoded)
        if found is None:
            return None
        begin, self.stop_reason = found
        self.decoded = self.decoded[: begin + len(self.stop_reason) if self.include_stop else begin]
        self._show(0)
        return self.stop_reason

    def finish(self) -> str:
        """The sequence ended: whatever is held back is final now (a half character as U+FFFD, as `decode` writes
        it; a possible start of a stop string as itself) -> the last piece. After a stop string, nothing more."""
        if self.stop_reason is None:
            window = decode(self.tokenizer, self.token_ids[self.prefix_offset :], *self.decoding)
            self._extend(window[len(self.prefix_text) :])
            self.prefix_offset = self.read_offset = len(self.token_ids)
            self.prefix_text = ""
        return self._show(0)

    def _extend(self, new_text: str) -> None:
        self._search_from = len(self.decoded)
        self.decoded += new_text

    def _held_back(self) -> int:
        """How many characters at the end of `decoded` could be the start of a stop string."""
        if not self.stop:
            return 0
        return seam("stop_hold_back", stop_hold_back)(self.decoded, self.stop)

    def _show(self, held_back: int) -> str:
        """Let `text` show all of `decoded` but its last `held_back` characters -> the piece that adds."""
        shown = len(self.decoded) - held_back
        piece = self.decoded[len(self.text) : shown]
        self.text = self.decoded[:shown]
        return piece
