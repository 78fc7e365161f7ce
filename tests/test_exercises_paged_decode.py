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


def scaled_by(rule):
    """nanoref's decode with the softmax scale a learner's rule picks from (softmax_scale, head_dim)."""

    def attention(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
        scale = rule(softmax_scale, q.shape[-1])
        return attention_torch.paged_decode_attention(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, softmax_scale=scale, causal=True
        )

    return attention


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "rule, message",
    [
        (lambda scale, dim: dim**0.5, "scaled by sqrt(head_dim) = 5.657: use softmax_scale=0.3"),
        (lambda scale, dim: 1 / dim, "scaled by 1/head_dim = 0.03125: use softmax_scale=0.3"),
        (
            lambda scale, dim: scale if scale is not None else dim**0.5,
            "scaled by sqrt(head_dim) = 5.657: softmax_scale is None: use 1/sqrt(head_dim) = 0.1768",
        ),
        (
            lambda scale, dim: scale if scale is not None else 1 / dim,
            "scaled by 1/head_dim = 0.03125: softmax_scale is None: use 1/sqrt(head_dim) = 0.1768",
        ),
        (
            lambda scale, dim: 1 / scale if scale is not None else dim**-0.5,
            "scaled by 1/softmax_scale = 3.333: you divided q·k by the scale: use softmax_scale=0.3",
        ),
    ],
    ids=["sqrt_d", "one_over_d", "default_sqrt_d", "default_one_over_d", "divided"],
)
def test_a_wrong_softmax_scale_is_named_on_every_seed(rule, message, seed):
    """sqrt(D) for 1/sqrt(D), 1/D (the root left out), a division by softmax_scale: each is the naive oracle at
    that scale, so the check names the scale used rather than only 'differs from the naive oracle'."""
    with pytest.raises(ExerciseFailure) as failure:
        check_paged_decode_attention(scaled_by(rule), seed=seed, engine=False)
    assert message in str(failure.value).replace("\n", " ")
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


def full_blocks_then_remainder(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
    """Reads the full blocks, then L % block_size tokens of the last one: at a block boundary that is 0, so a history
    of exactly k * block_size tokens loses its whole last block (right for every length but those)."""
    block_size, group = k_cache.shape[1], q.shape[2] // k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b])
        blocks = block_table[b, : (length + block_size - 1) // block_size].long()
        k = torch.cat([k_cache[blocks[:-1]].flatten(0, 1), k_cache[blocks[-1], : length % block_size]])
        v = torch.cat([v_cache[blocks[:-1]].flatten(0, 1), v_cache[blocks[-1], : length % block_size]])
        kh, vh = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b].transpose(0, 1), kh, vh, scale=softmax_scale).transpose(0, 1)
    return out


def squeezes_every_axis(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
    """Batched over the sequences through q.squeeze(): (B, H, D) for B > 1, but (H, D) for a batch of one."""
    group = q.shape[2] // k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    k = k_cache[block_table.long().clamp(min=0)].flatten(1, 2).repeat_interleave(group, 2)  # (B, L, H, D)
    v = v_cache[block_table.long().clamp(min=0)].flatten(1, 2).repeat_interleave(group, 2)
    scores = torch.einsum("bhd,blhd->bhl", q.squeeze().float(), k.float()) * scale
    unwritten = torch.arange(k.shape[1])[None, :] >= cache_seqlens[:, None]  # (B, L)
    probs = scores.masked_fill(unwritten[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhl,blhd->bhd", probs, v.float()).unsqueeze(1).to(q.dtype)


@pytest.mark.parametrize("seed", [0, 11, 12345])
def test_a_history_at_a_block_boundary_is_checked_on_every_seed(seed):
    # the histories were 1, 15, 33 and 70 tokens, none a multiple of the block size: this answer passed them all
    with pytest.raises(ExerciseFailure, match=r"(?s)history of 32 tokens.*fills its last block") as failure:
        check_paged_decode_attention(full_blocks_then_remainder, seed=seed, engine=False)
    assert_readable_failure(failure.value)


@pytest.mark.parametrize("seed", [0, 11, 12345])
def test_an_answer_that_fails_for_a_batch_of_one_is_told_so(seed):
    # every case had 4 sequences, and the engine check's decode batches too: q.squeeze() passed them all
    with pytest.raises(ExerciseFailure, match=r"(?s)with B = 1, does a squeeze\(\).*a batch of one") as failure:
        check_paged_decode_attention(squeezes_every_axis, seed=seed, engine=False)
    assert_readable_failure(failure.value)


def test_an_output_without_its_batch_axis_for_a_batch_of_one_is_told_so():
    def drops_the_batch_axis(q, *args, **kwargs):
        out = attention_torch.paged_decode_attention(q, *args, **kwargs)
        return out.squeeze() if q.shape[0] == 1 else out  # (H, D) for B = 1

    with pytest.raises(ExerciseFailure, match=r"batch of one.*shape \(8, 32\), expected \(1, 1, 8, 32\)"):
        check_paged_decode_attention(drops_the_batch_axis, engine=False)


def whole_table_unmasked(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
    """Every entry of the sequence's block-table row, its -1 padding included (k_cache[-1]), and no length mask."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        blocks = block_table[b].long()
        k = k_cache[blocks].flatten(0, 1).repeat_interleave(group, 1).transpose(0, 1)  # (H, W * block_size, D)
        v = v_cache[blocks].flatten(0, 1).repeat_interleave(group, 1).transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b].transpose(0, 1), k, v, scale=scale).transpose(0, 1)
    return out


def kv_heads_repeated_hk_times(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
    """repeat_interleave(Hk) where H // Hk belongs: 2 * Hk heads of keys for H query heads."""
    hk = k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b])
        k = attention_torch.gather_paged(k_cache, block_table[b], length).repeat_interleave(hk, 1).transpose(0, 1)
        v = attention_torch.gather_paged(v_cache, block_table[b], length).repeat_interleave(hk, 1).transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b].transpose(0, 1), k, v, scale=softmax_scale).transpose(0, 1)
    return out


def kv_head_h_over_hk(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
    """Query head h reads KV head h // Hk: past the last KV head once h >= Hk * Hk."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    hk = k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b])
        k = attention_torch.gather_paged(k_cache, block_table[b], length)  # (L, Hk, D)
        v = attention_torch.gather_paged(v_cache, block_table[b], length)
        for h in range(q.shape[2]):
            probs = (k[:, h // hk] @ q[b, 0, h] * scale).softmax(0)  # (L,)
            out[b, 0, h] = probs @ v[:, h // hk]
    return out


@pytest.mark.parametrize("seed", [0, 11, 1, 2])
@pytest.mark.parametrize(
    "wrong, message",
    [
        (whole_table_unmasked, r"every entry of block_table\[b\], its -1 padding too \(k_cache\[-1\]"),
        (kv_heads_repeated_hk_times, r"raised RuntimeError.*H = 8 query heads .* Hk = 2 KV heads.*h // 4"),
        (kv_head_h_over_hk, r"raised IndexError.*H = 8 query heads .* Hk = 2 KV heads.*h // 4"),
    ],
)
def test_a_block_table_read_whole_or_a_wrong_gqa_mapping_is_named_on_every_seed(wrong, message, seed):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_paged_decode_attention(wrong, seed=seed, engine=False)
    assert_readable_failure(failure.value)


def merge_with_max_over_the_batch(partial, lse, out):
    weights = torch.exp2(lse - lse.max(dim=0, keepdim=True).values)  # (B, S, Lq, H): the max varies with the split
    out.copy_((weights[..., None] * partial).sum(1) / weights.sum(1)[..., None])


@pytest.mark.parametrize("seed", [0, 5, 1])
def test_a_merge_taking_the_max_over_the_batch_is_told_the_splits_axis(seed):
    with pytest.raises(ExerciseFailure, match=r"take the max of lse over the splits, axis 1 .*not axis 0"):
        check_merge_splits(merge_with_max_over_the_batch, seed=seed, engine=False)
