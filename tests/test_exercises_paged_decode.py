"""Notebook 04's exercise checks: nanoref's own functions pass; plausible wrong answers fail with a message."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanoref.exercises import ExerciseFailure, check_merge_splits, check_paged_decode_attention
from nanoref.ops import attention_torch

from .helpers import assert_readable_failure


def decode_variant(
    *,
    mask_length=True,
    use_table=True,
    gqa_interleave=True,
    scaled=True,
    own_scale=False,
    extra_keys=0,
    whole_blocks=False,
    is_causal=False,
):
    """A torch paged decode attention with one of the usual mistakes switched on."""

    def attention(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
        scale = softmax_scale if softmax_scale is not None and not own_scale else 1.0 / math.sqrt(q.shape[-1])
        group = q.shape[2] // k_cache.shape[2]  # query heads per KV head
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            blocks = block_table[b][block_table[b] >= 0].long() if use_table else torch.arange(block_table.shape[1])
            if whole_blocks:  # length // block_size blocks: the partly written last one dropped (none for L < 16)
                blocks = blocks[: int(cache_seqlens[b]) // k_cache.shape[1]]
            k = k_cache[blocks].flatten(0, 1)  # (blocks * block_size, Hk, D)
            v = v_cache[blocks].flatten(0, 1)
            if mask_length:
                k, v = k[: cache_seqlens[b] + extra_keys], v[: cache_seqlens[b] + extra_keys]
            expand = (lambda t: t.repeat_interleave(group, 1)) if gqa_interleave else (lambda t: t.repeat(1, group, 1))
            kh, vh = expand(k).transpose(0, 1), expand(v).transpose(0, 1)  # (H, L, D)
            qh = q[b].transpose(0, 1)  # (H, 1, D)
            out[b] = F.scaled_dot_product_attention(
                qh, kh, vh, scale=scale if scaled else 1.0, is_causal=is_causal
            ).transpose(0, 1)
        return out

    return attention


def test_nanorefs_own_functions_pass_with_the_engine():
    check_paged_decode_attention(attention_torch.paged_decode_attention)
    check_paged_decode_attention(decode_variant())  # a different correct answer passes too


@pytest.mark.parametrize(
    "wrong, message",
    [
        (decode_variant(mask_length=False), "sequence 0 .*mask the positions >= cache_seqlens"),
        (decode_variant(use_table=False), "block_table\\[b, p // block_size\\]"),
        (decode_variant(gqa_interleave=False), "KV head h // \\(H // Hk\\)"),
        (decode_variant(scaled=False), "scaled by no scale at all: use softmax_scale=0.3"),
        (decode_variant(own_scale=True), "scaled by 1/sqrt\\(head_dim\\): use softmax_scale=0.3"),
        (decode_variant(extra_keys=-1), "one key too few: cache_seqlens\\[b\\] counts the new token"),
        (decode_variant(extra_keys=1), "one key too many"),
        (decode_variant(whole_blocks=True), "the partly written last block is dropped"),
        (decode_variant(is_causal=True), "the query sees key 0 only: is_causal aligns the mask top-left"),
    ],
)
def test_wrong_decode_attention_fails_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_paged_decode_attention(wrong, engine=False)
    assert_readable_failure(failure.value)


def merge_variant(*, base=2.0, subtract_max=True, normalise=True, write=True):
    def merge(partial, lse, out):
        shifted = lse - lse.max(dim=1, keepdim=True).values if subtract_max else lse
        weights = torch.pow(torch.tensor(base), shifted)  # (B, S, Lq, H)
        merged = (weights[..., None] * partial).sum(1)
        if normalise:
            merged = merged / weights.sum(1)[..., None]
        if write:
            out.copy_(merged)
        return merged

    return merge


def test_a_torch_merge_passes_with_the_engine():
    check_merge_splits(merge_variant())


@pytest.mark.parametrize(
    "wrong, message",
    [
        (merge_variant(base=math.e), "base 2"),
        (merge_variant(subtract_max=False), "overflows float32; subtract the largest lse"),
        (merge_variant(normalise=False), "divide by the sum of the weights"),
        (merge_variant(write=False), "out is still untouched"),
    ],
)
def test_wrong_merge_fails_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message):
        check_merge_splits(wrong, engine=False)


def test_nanorefs_triton_merge_passes():
    pytest.importorskip("triton", reason="Triton is not installed (Linux wheels only)")
    from nanoref.ops.attention_triton import merge_splits

    check_merge_splits(merge_splits, engine=False)
