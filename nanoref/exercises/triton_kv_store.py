"""Checks for notebook 03's exercise: the KV-store Triton kernel, launched by nanoref's own launcher."""

from __future__ import annotations

import torch

from nanoref.exercises.common import ExerciseFailure, check_generation
from nanoref.ops.store_kvcache import store_kvcache_torch
from nanoref.utils.seams import use


def _case(generator: torch.Generator, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """23 tokens, 6 of them with slot -1, scattered over a stale cache; key and value are views of a fused qkv
    output (rows further apart than ROW = Hk * D), and the cache sits between two guard blocks that must stay
    untouched. Made on `device`, where the kernel runs (moving the views there would copy them into rows exactly ROW
    apart)."""
    blocks, page, n = 6, 8, 23
    qkv = torch.randn(n, 3 * num_kv_heads * head_dim + 8, generator=generator).to(device, dtype)  # (n, > 2 * ROW)
    row = num_kv_heads * head_dim
    key = qkv[:, 8 : 8 + row].view(n, num_kv_heads, head_dim)  # (n, Hk, head_dim), row stride > ROW
    value = qkv[:, 8 + row : 8 + 2 * row].view(n, num_kv_heads, head_dim)
    stale = torch.randn(2, blocks + 2, page, num_kv_heads, head_dim, generator=generator).to(device, dtype)
    slots = torch.randperm(blocks * page, generator=generator)[:n]  # distinct slots, in no order
    slots[torch.randperm(n, generator=generator)[:6]] = -1  # padding tokens: store nothing
    return key, value, stale, slots.to(device)


def _describe(got: torch.Tensor, want: torch.Tensor, key: torch.Tensor, slots: torch.Tensor, name: str) -> str:
    """Which row of the cache (with its two guard blocks) is wrong, and the likely reason."""
    page, row = got.shape[1], got.shape[2] * got.shape[3]
    got_rows, want_rows = got.reshape(-1, row), want.reshape(-1, row)  # guard block, cache, guard block
    bad = (got_rows != want_rows).any(dim=1).nonzero().flatten().tolist()
    first = bad[0]
    slot = first - page  # the guard block before the cache holds `page` rows
    if slot < 0:
        return (
            f"a row just before {name} changed (slot {slot}): a token whose slot is -1 wrote there. Load the slot and "
            "return before storing anything when it is negative"
        )
    if slot >= got_rows.shape[0] - 2 * page:
        return f"a row past the end of {name} changed (slot {slot}): check the slot arithmetic, slot * ROW"
    tokens = (slots == slot).nonzero().flatten().tolist()
    if not tokens:
        lanes = (got_rows[first] != want_rows[first]).nonzero().flatten().tolist()
        return (
            f"slot {slot} of {name} changed though no token maps to it (columns {lanes[:4]}...): a store without "
            "`mask=cols < ROW` writes BLOCK_ROW values and spills into the next slot; or the slot arithmetic is off"
        )
    token = tokens[0]
    message = f"slot {slot} of {name} should hold token {token}'s row, but holds something else"
    contiguous_row = key.as_strided((row,), (1,), key.storage_offset() + token * row)  # token * ROW, ignoring strides
    if torch.equal(got_rows[first], contiguous_row.to(got.dtype)):
        return (
            message + ": it holds the values at token * ROW. key is a view of the fused qkv output, so its rows are "
            "key_stride elements apart: read at key_ptr + token * key_stride + cols"
        )
    return message + ": read token i's row at key_ptr + i * key_stride + cols, write it at slot * ROW + cols"


def _not_implemented(error: BaseException | None) -> bool:
    """Whether a kernel launch failed because the kernel raised NotImplementedError (a student copy's body)."""
    while error is not None:
        if isinstance(error, NotImplementedError) or "NotImplementedError" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def check_store_kvcache_kernel(kernel, *, seed: int = 0, engine: bool = True) -> None:
    """The learner's `@triton.jit` kernel, launched by `store_kvcache_triton` (grid (N,)), against the torch store;
    then the engine on the Triton backend with it."""
    from nanoref.ops.store_kvcache_triton import (  # defines kernels: the interpreter switch
        renamed_constexpr_problem,
        store_kvcache_triton,
    )
    from nanoref.ops.triton_setup import kernel_device

    if not hasattr(kernel, "__getitem__"):
        raise ExerciseFailure(
            f"store_kvcache_kernel should be a @triton.jit kernel, got {type(kernel).__name__}: "
            "put @triton.jit above it"
        )
    if problem := renamed_constexpr_problem(kernel):  # written against an older notebook 03
        raise ExerciseFailure(problem)
    generator = torch.Generator().manual_seed(seed)
    for dtype, (num_kv_heads, head_dim) in [
        (torch.float32, (2, 16)),
        (torch.float32, (3, 8)),
        (torch.bfloat16, (2, 8)),
    ]:
        key, value, stale, slots = _case(generator, num_kv_heads, head_dim, dtype, kernel_device())
        got, want = stale.clone(), stale.clone()
        try:
            with use(store_kvcache_kernel=kernel):
                store_kvcache_triton(key, value, got[0, 1:-1], got[1, 1:-1], slots)  # between the guard blocks
        except NotImplementedError:
            raise
        except Exception as error:
            if _not_implemented(error):  # the interpreter wraps what the kernel raised
                raise NotImplementedError("store_kvcache_kernel: the kernel body is not written yet") from error
            raise ExerciseFailure(f"your kernel failed to run: {type(error).__name__}: {error}") from error
        store_kvcache_torch(key, value, want[0, 1:-1], want[1, 1:-1], slots)
        case = f"{str(dtype).removeprefix('torch.')}, Hk={num_kv_heads}, D={head_dim} (ROW={num_kv_heads * head_dim})"
        for index, (name, source) in enumerate((("k_cache", key), ("v_cache", value))):
            if not torch.equal(got[index], want[index]):
                raise ExerciseFailure(f"{case}: " + _describe(got[index], want[index], source, slots, name))
    if engine:
        check_generation({"store_kvcache_kernel": kernel}, attention_backend="triton")
