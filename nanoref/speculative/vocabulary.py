"""A draft model's tokens must be the target's: its proposals are token ids the target checks as its own.

A draft with the target's vocabulary size can still number its tokens differently (another tokenizer of the same
size, or the same one with a few ids swapped): the output would stay the target's, but every proposal would be a
wrong guess, and speculation would only cost. So where both folders have a tokenizer, their token -> id maps must
be equal; a folder without one (token-id prompts only) is checked by its vocabulary size alone.
"""

from __future__ import annotations

from pathlib import Path

from nanoref.utils.loader import load_tokenizer


def check_draft_tokenizer(draft_folder: Path, target_folder: Path) -> None:
    """Raise ValueError naming speculative_config's "model" if the two folders' tokenizers map tokens to ids
    differently. Runs before anything is built (nanoref/llm.py), once per engine."""
    same_file = [(folder / "tokenizer.json") for folder in (draft_folder, target_folder)]
    if all(path.is_file() for path in same_file) and same_file[0].read_bytes() == same_file[1].read_bytes():
        return  # (the common case, a draft of the target's family: no tokenizer need be loaded to know)
    draft, target = load_tokenizer(draft_folder), load_tokenizer(target_folder)
    if draft is None or target is None:
        return
    draft_vocab, target_vocab = draft.get_vocab(), target.get_vocab()
    if draft_vocab == target_vocab:
        return
    differing = sorted(
        token for token in draft_vocab.keys() | target_vocab.keys() if draft_vocab.get(token) != target_vocab.get(token)
    )
    example = differing[0]
    raise ValueError(
        f'speculative_config "model": the draft model {draft_folder} has another tokenizer than {target_folder} '
        f"({len(differing)} tokens differ, e.g. {example!r}: id {draft_vocab.get(example)} in the draft, "
        f"{target_vocab.get(example)} in the target): a draft must share the target's tokenizer (its proposals are "
        "the target's token ids)"
    )
