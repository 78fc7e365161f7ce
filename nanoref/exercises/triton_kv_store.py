"""Checks for notebook 03's exercise: the KV-store Triton kernel, launched by nanoref's own launcher."""

from __future__ import annotations

import torch

from nanoref.exercises.common import ExerciseFailure, check_generation
from nanoref.ops.store_kvcache import store_kvcache_torch
from nanoref.utils.seams import use

# the cache the kernel writes: _BLOCKS blocks of _PAGE slots, with one guard block before it and _AFTER after it (a
# slot arithmetic off by up to 4.5x, slot * BLOCK_ROW or slot * value_stride where slot * ROW belongs, lands in the
# guard, where the check names it, rather than past the tensor, which would corrupt the process's memory under the
# interpreter: value's rows are 4 * ROW + 8 values apart, at most 4.5 ROW)
_BLOCKS, _PAGE = 6, 8
_AFTER = 5 * _BLOCKS


def _case(generator: torch.Generator, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """23 tokens, 6 of them with slot -1, scattered over a stale cache; key and value are views of fused outputs
    (rows further apart than ROW = Hk * D, value's further than key's: a kernel must read each with its own stride),
    and the cache sits between guard blocks that must stay untouched. Slot 0 and the last slot always hold a
    token (a kernel that skips slot 0, `if slot > 0`, or miscounts the end fails on every seed). Made on `device`,
    where the kernel runs (moving the views there would copy them into rows exactly ROW apart)."""
    blocks, page, n = _BLOCKS, _PAGE, 23
    row = num_kv_heads * head_dim
    qkv = torch.randn(n, 3 * row + 8, generator=generator).to(device, dtype)  # (n, > 2 * ROW)
    key = qkv[:, 8 : 8 + row].view(n, num_kv_heads, head_dim)  # (n, Hk, head_dim), row stride > ROW
    wide = torch.randn(n, 4 * row + 8, generator=generator).to(device, dtype)  # a wider buffer: value_stride > key's
    value = wide[:, 8 + row : 8 + 2 * row].view(n, num_kv_heads, head_dim)
    stale = torch.randn(2, 1 + blocks + _AFTER, page, num_kv_heads, head_dim, generator=generator).to(device, dtype)
    pool = blocks * page
    middle = 1 + torch.randperm(pool - 2, generator=generator)[: n - 2]  # distinct slots 1 .. pool - 2
    slots = torch.cat([torch.tensor([0, pool - 1]), middle])[torch.randperm(n, generator=generator)]  # in no order
    ends = (slots == 0) | (slots == pool - 1)  # (n,): the two tokens at the cache's ends stay live
    others = (~ends).nonzero().flatten()
    slots[others[torch.randperm(len(others), generator=generator)[:6]]] = -1  # padding tokens: store nothing
    return key, value, stale, slots.to(device)


def _describe(
    got: torch.Tensor,
    want: torch.Tensor,
    key: torch.Tensor,
    slots: torch.Tensor,
    name: str,
    other_input: torch.Tensor,
    stale: torch.Tensor,
) -> str:
    """Which row of the cache (with its guard blocks) is wrong, and the likely reason (key: the input this cache
    stores; other_input: the other one, value for k_cache and key for v_cache; stale: the cache before the store)."""
    other_stride = other_input.stride(0)
    page, row = got.shape[1], got.shape[2] * got.shape[3]
    if torch.equal(got, stale):  # not one value written: the kernel stores into the other cache only
        own = "key" if name == "k_cache" else "value"
        return (
            f"nothing was stored into {name}: every token with a slot stores its {own} row there too, "
            f"tl.store({name}_ptr + slot * ROW + cols, ...)"
        )
    got_rows, want_rows = got.reshape(-1, row), want.reshape(-1, row)  # guard block, cache, guard block
    bad = (got_rows != want_rows).any(dim=1).nonzero().flatten().tolist()
    first = bad[0]
    slot = first - page  # the guard block before the cache holds `page` rows
    if slot < 0:
        return (
            f"a row just before {name} changed (slot {slot}): a token whose slot is -1 wrote there. Load the slot and "
            "return before storing anything when it is negative"
        )
    if slot >= _BLOCKS * page:
        return (
            f"a row past the end of {name} changed (slot {slot}): check the slot arithmetic: the cache's rows are ROW "
            "values apart, whatever the inputs' strides, so slot s starts at slot * ROW"
        )
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
    own, other = ("key", "value") if name == "k_cache" else ("value", "key")
    if token * other_stride + row <= key.untyped_storage().nbytes() // key.element_size() - key.storage_offset():
        other_row = key.as_strided((row,), (1,), key.storage_offset() + token * other_stride)
        if torch.equal(got_rows[first], other_row.to(got.dtype)):
            return (
                message + f": it holds the values at token * {other}_stride. {own} has a row stride of its own: "
                f"read at {own}_ptr + token * {own}_stride + cols"
            )
    lanes = (got_rows[first] != want_rows[first]).nonzero().flatten().tolist()
    if lanes == list(range(len(lanes))) and len(lanes) < row:
        return (
            message + f": only its first {len(lanes)} value(s) differ, as when the store of slot {slot - 1} writes "
            "past its ROW values: load and store with `mask=cols < ROW` (and mask exactly cols < ROW)"
        )
    if torch.equal(got_rows[first], stale.reshape(-1, row)[first]):  # nothing was stored there
        if slot == 0:
            return message + ": slot 0 is a slot like any other; only a negative slot means store nothing (slot < 0)"
        return message + ": nothing was stored there; store token i's row at slot_mapping[i] * ROW + cols"
    own_rows, other_rows = key.reshape(len(slots), row), other_input.reshape(len(slots), row)  # (N, ROW)
    which = (own_rows == got_rows[first]).all(dim=1).nonzero().flatten().tolist()
    if which:
        return message + (
            f": it holds token {which[0]}'s row. Token i's row goes to its slot, slot_mapping[i]: write it at "
            f"{name.replace('_cache', '_cache_ptr')} + slot * ROW + cols, not at the token's index"
        )
    if torch.equal(got_rows[first], other_rows[token]):
        own, other_name = ("key", "value") if name == "k_cache" else ("value", "key")
        return message + f": it holds token {token}'s {other_name} row: store {own} rows into {name}"
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
                store_kvcache_triton(key, value, got[0, 1 : 1 + _BLOCKS], got[1, 1 : 1 + _BLOCKS], slots)
        except NotImplementedError:
            raise
        except Exception as error:
            if _not_implemented(error):  # the interpreter wraps what the kernel raised
                raise NotImplementedError("store_kvcache_kernel: the kernel body is not written yet") from error
            raise ExerciseFailure(f"your kernel failed to run: {type(error).__name__}: {error}") from error
        store_kvcache_torch(key, value, want[0, 1 : 1 + _BLOCKS], want[1, 1 : 1 + _BLOCKS], slots)
        case = f"{str(dtype).removeprefix('torch.')}, Hk={num_kv_heads}, D={head_dim} (ROW={num_kv_heads * head_dim})"
        for index, (name, source) in enumerate((("k_cache", key), ("v_cache", value))):
            if not torch.equal(got[index], want[index]):
                other = value if index == 0 else key
                raise ExerciseFailure(
                    f"{case}: " + _describe(got[index], want[index], source, slots, name, other, stale[index])
                )
    if engine:
        check_generation({"store_kvcache_kernel": kernel}, attention_backend="triton")
