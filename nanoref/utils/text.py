"""Whether a Python string is text: JSON (and Python's own escapes) can spell half of a UTF-16 surrogate pair,
"\\ud800", which no text holds, which UTF-8 cannot encode, and which a tokenizer refuses with a message that does not
say so. Every place that takes a caller's text checks it with these."""

from __future__ import annotations


def is_utf8(text: str) -> bool:
    """Whether the string can be UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate(text: str) -> str | None:
    """The first lone UTF-16 surrogate in `text` as \\uXXXX, or None where it has none (where it is UTF-8)."""
    if text.isascii() or is_utf8(text):
        return None
    return next(f"\\u{ord(char):04x}" for char in text if 0xD800 <= ord(char) <= 0xDFFF)


def check_text(text: str, what: str) -> None:
    """ValueError naming `what` where the string holds a lone surrogate."""
    bad = lone_surrogate(text)
    if bad is not None:
        raise ValueError(f"{what} holds a lone UTF-16 surrogate ({bad}): it is not text")
