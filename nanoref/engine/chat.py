"""Chat messages as one prompt: the model folder's chat template, rendered by its tokenizer.

A chat model was trained on conversations written in one exact format (Qwen3's ChatML: `<|im_start|>user\\n...
<|im_end|>\\n`). The format is data, not code: the folder's tokenizer_config.json (`chat_template`) or
chat_template.jinja holds it as a Jinja template, and `add_generation_prompt=True` ends the text with the opening
of the assistant's turn, so the model's completion is the assistant's reply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")


def chat_prompt(tokenizer: Any | None, messages: object, folder: str | Path) -> str:
    """messages ([{"role": ..., "content": ...}, ...]) as the prompt text the model's template makes of them."""
    check_messages(messages)
    if tokenizer is None:
        raise ValueError(f"{folder} has no tokenizer: chat needs one, with a chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{folder}'s tokenizer has no chat template: add a `chat_template` to its tokenizer_config.json, or a "
            "chat_template.jinja file (or send plain prompts to completions instead)"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_messages(messages: object) -> None:
    """Raise ValueError/TypeError naming the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise TypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise TypeError(f"messages[{index}] must be a dict with exactly 'role' and 'content', got {message!r:.80}")
        if message["role"] not in ROLES:
            raise ValueError(f"messages[{index}]['role'] must be one of {ROLES}, got {message['role']!r:.40}")
        if not isinstance(message["content"], str):
            raise TypeError(f"messages[{index}]['content'] must be a string, got {type(message['content']).__name__}")
