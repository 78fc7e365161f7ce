"""The incremental detokenizer: streamed pieces concatenate to the offline decode, never show half a character,
and cost a small window of tokens per token, not the whole completion."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoref.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, add_many, decode
from nanoref.utils.loader import load_tokenizer

DEFAULT_MODEL = Path(__file__).parents[1] / "nanoref" / "default_model"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


def gpt2_byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): a token string maps back to its bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


@pytest.fixture(scope="module")
def byte_token(tokenizer) -> dict[int, int]:
    """byte -> the id of the token that is that single byte."""
    return {byte: tokenizer.convert_tokens_to_ids(char) for byte, char in gpt2_byte_chars().items()}


def stream(tokenizer, token_ids: list[int], offline: str) -> list[str]:
    """Feed token_ids one at a time; after each, the text shown is a prefix of the offline text -> the pieces."""
    detokenizer, pieces = IncrementalDetokenizer(tokenizer), []
    for token_id in token_ids:
        pieces.append(detokenizer.add([token_id]))
        assert offline.startswith(detokenizer.text), f"{detokenizer.text!r} is not how {offline!r} starts"
    pieces.append(detokenizer.finish())
    assert detokenizer.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("text", ["🙂🎉 party", "日本語のテキスト", "naïve café — 日本 🙂 ok\n\tend", "👩‍👩‍👧 family"])
def test_pieces_of_emoji_cjk_and_mixed_text_concatenate_to_the_offline_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids, decode(tokenizer, ids))
    assert "".join(pieces) == decode(tokenizer, ids) == text
    assert REPLACEMENT_CHAR not in "".join(pieces)


def test_a_character_split_into_single_bytes_waits_until_its_last_byte(tokenizer, byte_token):
    ids = [byte_token[b] for b in "a🙂b".encode()]  # a, then the emoji's 4 bytes as 4 tokens, then b
    pieces = stream(tokenizer, ids, "a🙂b")
    assert pieces == ["a", "", "", "", "🙂", "b", ""]


def test_invalid_utf8_bytes_stream_as_the_offline_decode_writes_them(tokenizer, byte_token):
    # a lone continuation byte, a truncated emoji followed by ASCII, an overlong encoding, a truncated emoji at the end
    runs = [b"x\x80y", b"\xf0\x9f\x99z", b"\xc0\xafq", b"ok\xf0\x9f"]
    for run in runs:
        ids = [byte_token[b] for b in run]
        offline = decode(tokenizer, ids)
        assert offline == run.decode("utf-8", errors="replace")  # (what the model's bytes mean)
        assert "".join(stream(tokenizer, ids, offline)) == offline


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 1023), max_size=40))
def test_random_token_ids_stream_to_their_offline_decode(tokenizer, ids):
    offline = decode(tokenizer, ids)
    assert "".join(stream(tokenizer, ids, offline)) == offline


@settings(max_examples=300, deadline=None)
@given(data=st.lists(st.binary(min_size=1, max_size=3), max_size=30))
def test_random_byte_runs_stream_to_their_offline_decode(tokenizer, byte_token, data):
    ids = [byte_token[b] for chunk in data for b in chunk]
    offline = decode(tokenizer, ids)
    assert offline == b"".join(data).decode("utf-8", errors="replace")
    assert "".join(stream(tokenizer, ids, offline)) == offline


class CountingTokenizer:
    """Records how many tokens each decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, token_ids, **kwargs):
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


def test_each_token_decodes_a_small_window_not_the_whole_completion(tokenizer):
    ids = tokenizer.encode("日本語 and 🙂 emoji in a long text. " * 60)
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting)
    for token_id in ids:
        detokenizer.add([token_id])
    detokenizer.finish()
    assert len(ids) > 500
    assert detokenizer.text == decode(tokenizer, ids)
    assert max(counting.lengths) <= 8, "a decode call was given more than a few recent tokens"


def test_decode_never_cleans_up_spaces_before_punctuation(tokenizer):
    """Clean-up rewrites " ." as ".", which depends on the token after the space: a stream that showed the space
    could not take it back. Forced on for this tokenizer, decode still leaves the text as the tokens spell it."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)  # (a copy of its own: the module's stays as it is)
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tokenizer.encode("a , b . c !")
    assert tokenizer.decode(ids) != "a , b . c !", "the clean-up was meant to be on"
    pieces = stream(tokenizer, ids, decode(tokenizer, ids))
    assert "".join(pieces) == decode(tokenizer, ids) == "a , b . c !"


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=12))
def test_decode_through_the_rust_tokenizer_equals_the_tokenizers_own_decode(tokenizer, ids):
    """decode skips transformers' Python around its Rust decode (a server decodes every stream every step): the
    text must be what tokenizer.decode gives, special tokens (EOS, <|im_start|>) included in the ids."""
    ids = ids + [tokenizer.eos_token_id] + ids[:3]
    assert decode(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_decode_goes_through_the_rust_tokenizer_only_where_decode_is_transformers_own(tokenizer):
    from nanoref.engine.detokenizer import _rust_tokenizer

    assert _rust_tokenizer(tokenizer) is tokenizer.backend_tokenizer
    counting = CountingTokenizer(tokenizer)  # a decode of its own: called, not bypassed
    assert decode(counting, [65, 66]) == decode(tokenizer, [65, 66]) and counting.lengths == [2]
    overriding = type("Overriding", (type(tokenizer),), {"_decode": lambda self, token_ids, **kw: "mine"})
    mine = load_tokenizer(DEFAULT_MODEL)
    mine.__class__ = overriding
    assert _rust_tokenizer(mine) is None and decode(mine, [65, 66]) == "mine"


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_add_many_gives_each_detokenizer_what_its_own_adds_give(tokenizer, byte_token, data):
    """A server decodes every stream's new tokens of a step in one batched call: each stream must show the pieces
    it would show on its own, half characters (single UTF-8 bytes) held back the same way."""
    text_ids = tokenizer.encode("日本 🙂 naïve, ok")
    pool = [*text_ids, *(byte_token[b] for b in "🙂é".encode()), tokenizer.eos_token_id]
    num_streams = data.draw(st.integers(1, 5))
    steps = data.draw(st.lists(st.lists(st.lists(st.sampled_from(pool), max_size=3), min_size=num_streams,
                                        max_size=num_streams), min_size=1, max_size=8))  # fmt: skip
    batched = [IncrementalDetokenizer(tokenizer) for _ in range(num_streams)]
    alone = [IncrementalDetokenizer(tokenizer) for _ in range(num_streams)]
    for step in steps:
        assert add_many(batched, step) == [d.add(ids) for d, ids in zip(alone, step)]
    assert [d.finish() for d in batched] == [d.finish() for d in alone]
    assert [d.text for d in batched] == [decode(tokenizer, d.token_ids) for d in alone]


def test_add_many_without_a_rust_tokenizer_and_with_two_tokenizers(tokenizer):
    counting = CountingTokenizer(tokenizer)
    detokenizers = [IncrementalDetokenizer(counting) for _ in range(3)]
    assert add_many(detokenizers, [[65], [66, 67], []]) == [decode(tokenizer, [65]), decode(tokenizer, [66, 67]), ""]
    assert add_many([], []) == []
    with pytest.raises(ValueError, match="share one tokenizer"):
        add_many([IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(counting)], [[65], [66]])


@pytest.mark.parametrize("failing_call", range(1, 5))
def test_a_decode_that_raises_leaves_every_detokenizer_of_add_many_as_it_was(tokenizer, failing_call):
    """The k-th decode of a step raises: the two windows' (calls 1, 2), or the new prefixes' (3, 4). Each detokenizer
    is as before the step (it used to hold the step's tokens already), so each may be tried alone (as the server's
    side does, to fail only the request at fault) and streams on to the whole decode's text."""
    ids = tokenizer.encode("Hello, wonderful world! 日本語")
    counting = CountingTokenizer(tokenizer)
    detokenizers = [IncrementalDetokenizer(counting) for _ in range(2)]
    add_many(detokenizers, [ids[:2], ids[:3]])
    before = [dict(vars(d), token_ids=list(d.token_ids)) for d in detokenizers]
    calls = len(counting.lengths)

    def raising(token_ids, **kwargs):
        counting.lengths.append(len(token_ids))
        if len(counting.lengths) == calls + failing_call:
            raise IndexError("piece id is out of range")
        return tokenizer.decode(token_ids, **kwargs)

    counting.decode = raising
    with pytest.raises(IndexError):
        add_many(detokenizers, [ids[2:5], ids[3:6]])
    assert [dict(vars(d), token_ids=list(d.token_ids)) for d in detokenizers] == before
    counting.decode = tokenizer.decode
    for detokenizer, start in zip(detokenizers, (2, 3)):
        for token_id in ids[start:]:
            add_many([detokenizer], [[token_id]])
        detokenizer.finish()
        assert detokenizer.text == decode(tokenizer, ids)


def wordpiece_tokenizer():
    """A WordPiece tokenizer (BERT's kind), whose decoder puts spaces between tokens, special ones included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    rust = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer, rust.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


def test_skip_special_tokens_and_spaces_between_special_tokens_decode_as_vllm():
    tokenizer = wordpiece_tokenizer()
    ids = [1, 3, 5, 2, 1, 4, 2, 2]
    assert decode(tokenizer, ids) == "hellos world"
    assert decode(tokenizer, ids, skip_special_tokens=False) == "[CLS] hellos [SEP] [CLS] world [SEP] [SEP]"
    bare = decode(tokenizer, ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert bare == "[CLS]hellos[SEP][CLS]world[SEP][SEP]"
    for skip, spaces in ((True, True), (False, True), (False, False)):  # the stream agrees with the whole decode
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        pieces = [detokenizer.add([token_id]) for token_id in ids]
        assert "".join(pieces) + detokenizer.finish() == decode(tokenizer, ids, skip, spaces)
        batched = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        plain = IncrementalDetokenizer(tokenizer)
        both = [add_many([batched, plain], [[token_id], [token_id]]) for token_id in ids]
        assert "".join(b[0] for b in both) + batched.finish() == decode(tokenizer, ids, skip, spaces)
        assert "".join(b[1] for b in both) + plain.finish() == decode(tokenizer, ids)


def test_hidden_tokens_never_show():
    tokenizer = wordpiece_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, hidden=frozenset({2}))
    text = "".join(detokenizer.add([token_id]) for token_id in [1, 3, 2]) + detokenizer.finish()
    assert text == "[CLS] hello"
