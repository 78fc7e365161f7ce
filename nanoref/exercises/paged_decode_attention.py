"""Checks for notebook 04's exercises: paged decode attention in torch, and the split-KV log-sum-exp merge."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable

import torch

from nanoref.exercises.common import ExerciseFailure, call_learner, check_generation, random_prompts
from nanoref.exercises.tensors import expect_tensor
from nanoref.ops.attention_torch import gather_paged
from nanoref.ops.naive import naive_padded_attention
from nanoref.ops.triton_setup import import_triton, kernel_device, triton_available
from nanoref.utils.seams import use

_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _paged_case(generator: torch.Generator, lens: list[int], block_size: int, dtype: torch.dtype):
    """K/V of sequences with `lens` tokens in shuffled physical blocks (plus spare blocks nobody owns)."""
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    blocks_per_seq = [math.ceil(n / block_size) for n in lens]
    pool = sum(blocks_per_seq) + 3
    k_cache, v_cache = torch.randn(2, pool, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    free = torch.randperm(pool, generator=generator).tolist()
    table = torch.full((len(lens), max(blocks_per_seq)), -1, dtype=torch.int32)  # (B, max_blocks), -1 padded
    for b, count in enumerate(blocks_per_seq):
        table[b, :count] = torch.tensor([free.pop() for _ in range(count)])
    q = torch.randn(len(lens), 1, num_heads, head_dim, generator=generator).to(dtype)  # (B, 1, H, D)
    return q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), table


def _oracle(q, k_cache, v_cache, seqlens, table, scale):
    """naive_padded_attention on the histories gathered into one flat key stream: (B, 1, H, D)."""
    lens = seqlens.tolist()
    k_flat = torch.cat([gather_paged(k_cache, table[b], n) for b, n in enumerate(lens)])  # (sum(lens), Hk, D)
    v_flat = torch.cat([gather_paged(v_cache, table[b], n) for b, n in enumerate(lens)])
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32)  # one query per sequence
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return naive_padded_attention(q.squeeze(1), k_flat, v_flat, cu_q, cu_k, softmax_scale=scale).unsqueeze(1)


def _mistake(q, k_cache, v_cache, seqlens, table, scale, mistake: str) -> torch.Tensor:
    """What a common mistake computes, in float64: (B, 1, H, D)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[2] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, length in enumerate(seqlens.tolist()):
        if mistake == "no length mask":  # every slot of the sequence's blocks, the unwritten tail included
            length = int((table[b] >= 0).sum()) * block_size
        elif mistake == "one key short":  # cache_seqlens taken to exclude the new token
            length -= 1
        elif mistake == "one key too many":  # at a full last block there is no next key: what it reads is not defined
            length = length + 1 if length % block_size else 0
        elif mistake == "whole blocks only":  # length // block_size blocks: the partly written last one dropped
            length = length // block_size * block_size
        elif mistake == "full last block dropped":  # the last block read as its L % block_size tokens: 0 when full
            length -= block_size if length % block_size == 0 else 0
        elif mistake == "top-left causal":  # SDPA's is_causal with 1 query and L keys: the query sees key 0 only
            length = min(length, 1)
        if length < 1:  # no key at all, or a mistake not defined here: NaN, compared on the other rows only
            out[b] = float("nan")
            continue
        if mistake == "physical order":  # the first blocks of the cache, whatever the block table says
            k, v = k_cache.flatten(0, 1)[:length], v_cache.flatten(0, 1)[:length]
        elif mistake == "whole block table":  # every entry of the row, unmasked: -1 indexes the cache's last block
            blocks = table[b].long()
            k, v = k_cache[blocks].flatten(0, 1), v_cache[blocks].flatten(0, 1)
        else:
            k, v = gather_paged(k_cache, table[b], length), gather_paged(v_cache, table[b], length)  # (L, Hk, D)
        heads = torch.arange(q.shape[2])
        kv_of = heads % num_kv_heads if mistake == "gqa tiled" else heads // group  # (H,)
        k, v = k.double()[:, kv_of], v.double()[:, kv_of]  # (L, H, D)
        scores = torch.einsum("hd,lhd->hl", q[b, 0].double(), k) * scale  # (H, L)
        out[b, 0] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


_HINTS = {
    "no length mask": "it attends to every slot of the sequence's blocks: mask the positions >= cache_seqlens[b] "
    "(the last block is only partly written)",
    "whole block table": "it attends to every entry of block_table[b], its -1 padding too (k_cache[-1] is the "
    "cache's last block, not nothing): gather only the first ceil(L / block_size) blocks and read their first "
    "L = cache_seqlens[b] tokens",
    "physical order": "it reads the cache's blocks in physical order: find token p of sequence b in block "
    "block_table[b, p // block_size], offset p % block_size",
    "gqa tiled": "query head h reads KV head h % Hk: with grouped-query attention it reads KV head h // (H // Hk) "
    "(repeat_interleave, not repeat)",
    "one key short": "one key too few: cache_seqlens[b] counts the new token, so read keys 0 .. cache_seqlens[b] - 1",
    "one key too many": "one key too many: read keys 0 .. cache_seqlens[b] - 1 (position cache_seqlens[b] is not "
    "written yet)",
    "whole blocks only": "the partly written last block is dropped: L tokens span (L + block_size - 1) // block_size "
    "blocks",
    "full last block dropped": "a history of exactly k * block_size tokens fills its last block: that block holds "
    "block_size tokens there, not L % block_size = 0 (read the first L tokens of the gathered blocks)",
    "top-left causal": "the query sees key 0 only: is_causal aligns the mask top-left; in decode the new token sees "
    "every key, no mask",
}


def _head(t: torch.Tensor, b: int, h: int) -> str:
    """'[0.1234, -0.5, 0.25, ...]': the first values of sequence b's query head h."""
    return "[" + ", ".join(f"{v:.4g}" for v in t[b, 0, h, :3].double().tolist()) + ", ...]"


def _heads_hint(num_heads: int, num_kv_heads: int) -> Callable[[Exception], str | None]:
    """The GQA head mapping, for an error that a wrong one raises: a KV head index past Hk, or H query heads against
    a number of repeated KV heads that is not H."""
    group = num_heads // num_kv_heads

    def hint(error: Exception) -> str | None:
        text = str(error)
        past_hk = re.search(rf"out of bounds for dimension \d+ with size {num_kv_heads}\b", text)
        if not (past_hk or ("must match the size" in text and f"({num_heads})" in text)):
            return None
        return (
            f"q has H = {num_heads} query heads and the cache Hk = {num_kv_heads} KV heads: query head h reads KV head "
            f"h // (H // Hk) = h // {group}, so repeat each KV head H // Hk = {group} times (repeat_interleave)"
        )

    return hint


def _batch_of_one_hint(error: Exception) -> str:
    return "it runs for several sequences: with B = 1, does a squeeze() without an axis drop the batch axis too?"


def check_paged_decode_attention(fn: Callable, *, seed: int = 0, engine: bool = True) -> None:
    """`fn(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal)` against the naive oracle,
    then in the engine in place of the backend's decode."""
    generator = torch.Generator().manual_seed(seed)
    # 32: a history at a block boundary, whose last block is full; then a batch of one sequence, as when one runs
    many, one = [1, 15, 32, 33, 70], [21]
    for dtype, scale, lens in (
        (torch.float32, 0.3, many),
        (torch.float32, None, many),
        (torch.bfloat16, 0.2, many),
        (torch.float32, None, one),
    ):
        q, k_cache, v_cache, seqlens, table = _paged_case(generator, lens, 16, dtype)
        case = f"{str(dtype).removeprefix('torch.')}, softmax_scale={scale}, histories of {lens} tokens"
        if len(lens) == 1:
            case = f"a batch of one sequence (q of shape {tuple(q.shape)}), " + case
        args = (q.clone(), k_cache.clone(), v_cache.clone())
        got = call_learner(
            fn, "paged_decode_attention", *args, case=case,
            hint=_batch_of_one_hint if len(lens) == 1 else _heads_hint(q.shape[2], k_cache.shape[2]),
            cache_seqlens=seqlens.clone(), block_table=table.clone(), softmax_scale=scale, causal=True,
        )  # fmt: skip
        if len(lens) == 1 and isinstance(got, torch.Tensor) and tuple(got.shape) != tuple(q.shape):
            raise ExerciseFailure(
                f"{case}: the output has shape {tuple(got.shape)}, expected {tuple(q.shape)}: with B = 1, squeeze() "
                "without an axis drops the batch axis too; squeeze(1) and unsqueeze(1) name the query-length axis"
            )
        got = expect_tensor(got, f"{case}: the output", q.shape, dtype)
        if not (torch.equal(args[1], k_cache) and torch.equal(args[2], v_cache)):
            raise ExerciseFailure(f"{case}: your function changed the KV cache; attention only reads it")
        effective = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        want = _oracle(q, k_cache, v_cache, seqlens, table, effective)
        tol = _TOLERANCE[dtype]
        bad = ~torch.isclose(got.double(), want.double(), atol=tol, rtol=tol)  # (B, 1, H, D)
        if not bad.any():
            continue
        b, _, h, _ = (int(i) for i in bad.nonzero()[0])
        summary = f"sequence {b} (history of {lens[b]} tokens), query head {h} differs from the naive oracle"
        values = f"\n{case}\nsequence {b}, head {h}: got {_head(got, b, h)}, expected {_head(want, b, h)}"
        dim = q.shape[-1]
        # the scale the learner used instead of the one passed: none at all, always the default, the default's
        # square root inverted or left out, or the softmax_scale passed divided by instead of multiplied
        for used, instead in (
            (1.0, "no scale at all"),
            (dim**-0.5, "1/sqrt(head_dim)"),
            (dim**0.5, f"sqrt(head_dim) = {dim**0.5:.4g}"),
            (1.0 / dim, f"1/head_dim = {1 / dim:.4g}"),
            (1.0 / effective, f"1/softmax_scale = {1 / effective:.4g}: you divided q·k by the scale"),
        ):
            if math.isclose(used, effective):
                continue
            other = _oracle(q, k_cache, v_cache, seqlens, table, used)
            if not torch.allclose(got.double(), other.double(), atol=tol, rtol=tol):
                continue
            given = f"softmax_scale is None: use 1/sqrt(head_dim) = {dim**-0.5:.4g}" if scale is None else ""
            given = given or f"use softmax_scale={scale}"
            raise ExerciseFailure(
                f"the scores are scaled by {instead}: {given} (multiply q·k by it before the softmax)" + values
            )
        for mistake, hint in _HINTS.items():
            wrong = _mistake(q, k_cache, v_cache, seqlens, table, effective, mistake)
            defined = ~wrong.isnan()  # (B, 1, H, D): a sequence left without keys by the mistake is not compared
            if torch.allclose(got.double()[defined], wrong[defined], atol=tol, rtol=tol):
                raise ExerciseFailure(f"sequence {b} (history of {lens[b]} tokens), query head {h}: {hint}" + values)
        raise ExerciseFailure(summary + values)
    if engine:
        check_generation({"paged_decode_attention": fn})


def _merge_reference(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(B, S, Lq, H, D), (B, S, Lq, H) base 2 -> (B, Lq, H, D) in float64."""
    lse = lse.double()
    top = lse.max(dim=1, keepdim=True).values  # (B, 1, Lq, H)
    weights = torch.exp2(lse - top)  # (B, S, Lq, H): 0 for an empty split
    return (weights[..., None] * partial.double()).sum(1) / weights.sum(1)[..., None]


def check_merge_splits(fn: Callable, *, seed: int = 0, engine: bool = True) -> None:
    """`fn(partial, lse, out)` writes the merge into out; against a float64 reference, then in the engine on the
    Triton backend with every decode step cut into 2 splits."""
    generator = torch.Generator().manual_seed(seed)
    batch, splits, len_q, heads, dim = 3, 4, 1, 4, 16
    partial = torch.randn(batch, splits, len_q, heads, dim, generator=generator)  # float32
    lse = 200 + 8 * torch.randn(batch, splits, len_q, heads, generator=generator)  # base 2: 2**200 overflows float32
    partial[0, 2:], lse[0, 2:] = 0.0, -math.inf  # sequence 0's last two splits lie past its end: empty
    untouched = -12345.0
    out = torch.full((batch, len_q, heads, dim), untouched)
    if triton_available():  # the merge may be a Triton kernel: on a GPU it reads GPU memory
        import_triton()
        partial, lse, out = partial.to(kernel_device()), lse.to(kernel_device()), out.to(kernel_device())
    call_learner(fn, "merge_splits", partial.clone(), lse.clone(), out)
    want = _merge_reference(partial, lse)
    if (out == untouched).all():
        raise ExerciseFailure("out is still untouched: write the merged result into it (out.copy_(...) or out[...] =)")
    if not torch.allclose(out.double(), want, atol=1e-5, rtol=1e-5):
        message = "the merged output differs from the reference"
        if out.isnan().any() or out.isinf().any():
            rows = sorted({int(i) for i in (out.isnan() | out.isinf()).nonzero()[:, 0]})
            if rows == [0]:
                hint = (
                    "only sequence 0 has NaN or inf, and its last two splits are empty (lse = -inf, partial 0): "
                    "subtract the largest lse over the splits before exp2, so an empty split weighs 2**-inf = 0"
                )
            else:
                hint = (
                    "NaN or inf in sequences " + str(rows) + ": lse values are around 200 and 2**200 overflows "
                    "float32; subtract the largest lse over the splits before exp2"
                )
            raise ExerciseFailure(f"{message}: {hint}")
        natural = torch.exp(lse.double() - lse.double().max(dim=1, keepdim=True).values)
        natural_merge = (natural[..., None] * partial.double()).sum(1) / natural.sum(1)[..., None]
        if torch.allclose(out.double(), natural_merge, atol=1e-5, rtol=1e-5):
            raise ExerciseFailure(f"{message}: lse is in base 2 (the kernel's exp2), so weight split s by "
                                  "2**(lse_s - max lse), not e**(...)")  # fmt: skip
        weights = torch.exp2(lse.double() - lse.double().max(dim=1, keepdim=True).values)
        if torch.allclose(out.double(), (weights[..., None] * partial.double()).sum(1), atol=1e-5, rtol=1e-5):
            raise ExerciseFailure(f"{message}: divide by the sum of the weights (each partial is already normalised "
                                  "over its own split; the weights must add up to 1)")  # fmt: skip
        for axis in (0, 2, 3):  # the max over another axis than the splits' varies from split to split
            top = lse.double().amax(dim=axis, keepdim=True)
            weights = torch.exp2(lse.double() - top)
            merged = (weights[..., None] * partial.double()).sum(1) / weights.sum(1)[..., None]
            if torch.allclose(out.double(), merged, atol=1e-5, rtol=1e-5):
                raise ExerciseFailure(
                    f"{message}: take the max of lse over the splits, axis 1 of (B, S, Lq, H), not axis {axis}: "
                    "2**(lse_s - max) must subtract the same number from every split of a row"
                )
        raise ExerciseFailure(f"{message} (first: sequence 0, head 0: got {out[0, 0, 0, :3].tolist()}..., expected "
                              f"{want[0, 0, 0, :3].float().tolist()}...)")  # fmt: skip
    if engine:
        from nanoref.ops import attention_triton  # defines the kernels: the interpreter switch first

        calls = []

        def counted(partial, lse, out):
            calls.append(partial.shape[1])
            return fn(partial, lse, out)

        # contexts past one 64-key tile, cut into 2 splits; the short prompt's second split is empty
        prompts = random_prompts(seed=7, lengths=[70, 9, 100], vocab=256)
        with use(paged_decode_attention=functools.partial(attention_triton.paged_decode_attention, num_splits=2)):
            check_generation({"merge_splits": counted}, prompts=prompts, attention_backend="triton")
        assert calls, "the engine never merged splits: the check's setup is wrong, not your function"
