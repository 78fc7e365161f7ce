"""Notebook 13's exercise check: nanoref's own bitmask and its readable reference pass; each usual mistake fails
with the hint that names it, on every draw of the random cases (worked cases catch it first); a mask wrong in the
engine fails the generation against nanoref's own; the engine calls the seam inside `use(...)` only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'nanoref[structured]')")

from nanoref import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanoref.exercises import ExerciseFailure, check_apply_token_bitmask  # noqa: E402
from nanoref.exercises.structured_output import check_structured_generation  # noqa: E402
from nanoref.layers.logits_processors import apply_token_bitmask, apply_token_bitmask_reference  # noqa: E402
from nanoref.utils import seams  # noqa: E402

from .helpers import Counting  # noqa: E402


def test_nanorefs_own_bitmask_and_the_reference_pass():
    check_apply_token_bitmask(apply_token_bitmask)
    for seed in range(3):
        check_apply_token_bitmask(apply_token_bitmask_reference, seed=seed, engine=False)


# -- plausible wrong answers, each one mistake ------------------------------------------------------------------------
def bits_of(bitmask, vocab, bit_order=range(32)):
    """(A, V) bool from each word's bits taken in bit_order (the right order: 0..31, least significant first)."""
    shifts = torch.tensor(list(bit_order), dtype=torch.int32)
    return (((bitmask[:, :, None] >> shifts) & 1).reshape(len(bitmask), -1)[:, :vocab]).bool()


def masked(logits, rows, allowed, fill=float("-inf")):
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, fill)
    return out


def most_significant_first(logits, rows, bitmask):
    return masked(logits, rows, bits_of(bitmask, logits.shape[1], range(31, -1, -1)))


def numpy_unpackbits(logits, rows, bitmask):  # np.unpackbits reads each byte's bits from its top by default
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1)[:, : logits.shape[1]]
    return masked(logits, rows, torch.from_numpy(bits).bool())


def sign_bit_missed(logits, rows, bitmask):  # word & (1 << 31) is negative in int32: "> 0" misses it
    powers = 1 << torch.arange(32, dtype=torch.int32)
    allowed = (bitmask[:, :, None] & powers) > 0
    return masked(logits, rows, allowed.reshape(len(rows), -1)[:, : logits.shape[1]])


def powers_built_in_int32(logits, rows, bitmask):  # 2**31 does not fit an int32: torch refuses to build it
    powers = torch.tensor([1 << i for i in range(32)], dtype=torch.int32)
    allowed = (bitmask[:, :, None] & powers) != 0
    return masked(logits, rows, allowed.reshape(len(rows), -1)[:, : logits.shape[1]])


def every_row_masked(logits, rows, bitmask):  # rows not in `rows` get no allowed token at all
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    keep[rows] = bits_of(bitmask, logits.shape[1])
    return logits.masked_fill(~keep, float("-inf"))


def row_a_not_rows_a(logits, rows, bitmask):  # bitmask[a] applied to logits row a
    return masked(logits, torch.arange(len(rows)), bits_of(bitmask, logits.shape[1]))


def zero_not_minus_inf(logits, rows, bitmask):
    return masked(logits, rows, bits_of(bitmask, logits.shape[1]), fill=0.0)


def large_negative(logits, rows, bitmask):
    return masked(logits, rows, bits_of(bitmask, logits.shape[1]), fill=-1e4)


def whole_words_only(logits, rows, bitmask):  # V // 32 words: the last, partial word's tokens are never allowed
    vocab = logits.shape[1]
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
    full = vocab // 32 * 32
    allowed[:, :full] = bits_of(bitmask[:, : vocab // 32], full)
    return masked(logits, rows, allowed)


def every_bit_unpacked(logits, rows, bitmask):  # 32 * W bits for V tokens: no cut at the vocabulary
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(len(rows), -1).bool()
    return masked(logits, rows, allowed)


def in_place(logits, rows, bitmask):
    logits[rows] = logits[rows].masked_fill(~bits_of(bitmask, logits.shape[1]), float("-inf"))
    return logits


def masks_paired_with_sorted_rows(logits, rows, bitmask):  # bitmask[a] applied to the a-th smallest row
    return apply_token_bitmask(logits, rows.sort().values, bitmask)


def masked_fill_on_a_copy(logits, rows, bitmask):  # out[rows] with a tensor index is a copy: out never changes
    out = logits.clone()
    out[rows].masked_fill_(~bits_of(bitmask, logits.shape[1]), float("-inf"))
    return out


def in_float64(logits, rows, bitmask):
    return apply_token_bitmask(logits.double(), rows, bitmask)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (most_significant_first, "bit order: token 32 \\* w \\+ i is bit i of word w counted from the least"),
        (numpy_unpackbits, "bit order: token 32 \\* w \\+ i is bit i of word w counted from the least"),
        (sign_bit_missed, "bit 31 of an int32 word is its sign bit"),
        (powers_built_in_int32, "1 << 31 does not fit an int32"),
        (every_row_masked, "row 1 is not in rows \\(its request has no grammar\\): return it exactly as it was"),
        (row_a_not_rows_a, "bitmask row a is the mask of logits row rows\\[a\\] \\(here rows = \\[1\\]\\)"),
        (zero_not_minus_inf, "must get -inf, not 0"),
        (large_negative, "must get -inf, not a finite -1e\\+04"),
        (whole_words_only, "the vocabulary \\(70 tokens\\) ends inside word 2, which holds tokens 64..69"),
        (every_bit_unpacked, "unpack every word, then keep the first V bits"),
        (in_place, "changed logits in place: return a new tensor"),
        (in_float64, "dtype torch.float64, expected torch.float32"),
        (masked_fill_on_a_copy, "your answer masked nothing.*out\\[rows\\].masked_fill_\\(...\\) or"),
        (masks_paired_with_sorted_rows, "in the order of rows \\(here \\[3, 0, 2\\]\\): your answer paired the masks"),
    ],
)
def test_a_wrong_bitmask_fails_with_its_hint_on_every_draw(wrong, hint):
    for seed in (None, 0, 1):
        with pytest.raises(ExerciseFailure, match=hint):
            check_apply_token_bitmask(wrong, seed=seed, engine=False)


def test_a_mask_that_masks_nothing_fails_in_the_engine():
    # (the engine also warns as each constrained sample takes a token its grammar does not allow, and ends it)
    with pytest.warns(RuntimeWarning, match="which its grammar does not allow"):
        with pytest.raises(ExerciseFailure, match="where nanoref's own mask writes"):
            check_structured_generation({"apply_token_bitmask": lambda logits, rows, bitmask: logits.clone()})


def test_the_engine_calls_the_bitmask_seam_only_inside_use():
    """Left here by tests/test_exercise_seams_engine.py: a grammar needs a tokenizer, which the tiny random Qwen3
    lacks, so the built-in model runs a constrained request beside a free one."""
    llm = LLM(device="cpu", num_kvcache_blocks=64)
    prompts = ["Beautiful is better than", "Errors should never"]
    choice = StructuredOutputsParams(choice=["Beautiful", "Explicit", "Simple"])
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, structured_outputs=choice)]
    reference = llm.generate(prompts, params, use_tqdm=False)
    counting = Counting(apply_token_bitmask)
    with seams.use(apply_token_bitmask=counting):
        assert llm.generate(prompts, params, use_tqdm=False) == reference
    assert counting.calls, "the engine never called apply_token_bitmask"
    calls = counting.calls
    assert llm.generate(prompts, params, use_tqdm=False) == reference
    assert counting.calls == calls and not seams.active(), "apply_token_bitmask was used outside the block"
