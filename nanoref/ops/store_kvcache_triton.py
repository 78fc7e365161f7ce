"""The KV-store Triton kernel: one program per token copies its K and V rows into their cache slot.

Same arguments as `store_kvcache_torch` (its reference, in store_kvcache.py). The cache layer
`(num_blocks, block_size, Hk, D)` (D = head_dim) is viewed as rows of `ROW = Hk * D` values: slot
`s = block_id * block_size + offset` is row `s`, so program `i` reads token i's row and writes it
at `slot_mapping[i] * ROW + tl.arange(0, ROW)`. A slot of -1 means "do not store" (the padding tokens
of a CUDA-graph batch): that program returns at once.
"""

from __future__ import annotations

import torch

from nanoref.ops.store_kvcache import check_kvcache_layout, to_cache_dtype
from nanoref.ops.triton_setup import import_triton, interpreting
from nanoref.utils.seams import seam
from nanoref.utils.tracing import trace

triton = import_triton()
import triton.language as tl  # noqa: E402  (after import_triton: the interpreter switch comes first)

# The constexprs were once called D and BLOCK_D, when D meant the row width; D is head_dim everywhere now.
RENAMED_CONSTEXPRS = {"D": "ROW", "BLOCK_D": "BLOCK_ROW"}


@triton.jit
def store_kvcache_kernel(
    key_ptr,
    key_stride,  # elements from one token's key row to the next
    value_ptr,
    value_stride,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    ROW: tl.constexpr,  # Hk * D (D = head_dim): one token's K or V row
    BLOCK_ROW: tl.constexpr,  # ROW rounded up to a power of two (tl.arange needs one)
    SATURATE: tl.constexpr = 0.0,  # > 0: an 8-bit float cache's largest value (kv_cache_dtype="fp8"): clamp to it
):
    token = tl.program_id(0)  # grid (N,): program i stores token i
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * ROW can pass 2**31
    if slot < 0:  # -1: a padding token, nothing to store
        return
    cols = tl.arange(0, BLOCK_ROW)
    in_row = cols < ROW
    key = tl.load(key_ptr + token * key_stride + cols, mask=in_row)  # (BLOCK_ROW,)
    value = tl.load(value_ptr + token * value_stride + cols, mask=in_row)
    if SATURATE > 0:  # then rounded to nearest (even), as store_kvcache_torch's to_cache_dtype
        key = tl.clamp(key.to(tl.float32), -SATURATE, SATURATE)
        value = tl.clamp(value.to(tl.float32), -SATURATE, SATURATE)
    tl.store(k_cache_ptr + slot * ROW + cols, key.to(k_cache_ptr.dtype.element_ty), mask=in_row)
    tl.store(v_cache_ptr + slot * ROW + cols, value.to(v_cache_ptr.dtype.element_ty), mask=in_row)


def renamed_constexpr_problem(kernel) -> str | None:
    """What is wrong with a seam kernel that still takes a constexpr under its old name, or None.

    The launcher passes ROW and BLOCK_ROW by keyword; a kernel written against an older copy of notebook 03 takes
    D and BLOCK_D, and Triton's own error for that names neither the cause nor the fix."""
    names = getattr(kernel, "arg_names", None)  # a @triton.jit kernel's parameters, compiled or interpreted
    if names is None:
        return None
    old = [name for name in RENAMED_CONSTEXPRS if name in names and RENAMED_CONSTEXPRS[name] not in names]
    if not old:
        return None
    renames = ", ".join(f"`{name}` is now called `{RENAMED_CONSTEXPRS[name]}`" for name in old)
    return (
        f"store_kvcache_kernel takes the constexpr {renames} (one token's K/V row: Hk * D values, D = head_dim): "
        "rename the parameter and its uses in the kernel body"
    )


def store_kvcache_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value: (N, Hk, D); caches: (num_blocks, block_size, Hk, D); slot_mapping: (N,), -1 = skip."""
    check_kvcache_layout(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    kernel = seam("store_kvcache_kernel", store_kvcache_kernel)
    # An 8-bit cache on a GPU: this kernel clamps and rounds as it stores (converting first would add kernels to
    # every layer of a decode step). Elsewhere convert in torch: one rounding rule (the interpreter's casts truncate)
    in_kernel = k_cache.dtype.itemsize == 1 and kernel is store_kvcache_kernel and not interpreting()
    if key.dtype != k_cache.dtype and not in_kernel:
        key, value = to_cache_dtype(key, k_cache.dtype), to_cache_dtype(value, v_cache.dtype)
    saturate = {"SATURATE": torch.finfo(k_cache.dtype).max} if in_kernel else {}
    if num_tokens:
        if kernel is not store_kvcache_kernel and (problem := renamed_constexpr_problem(kernel)):
            raise TypeError(problem)  # a learner's kernel (the exercise seam): before Triton's launch error
        kernel[(num_tokens,)](
            key, key.stride(0), value, value.stride(0), k_cache, v_cache, slot_mapping,
            ROW=row, BLOCK_ROW=triton.next_power_of_2(row), **saturate,
        )  # fmt: skip
    trace("store_kvcache", key=key, slot_mapping=slot_mapping, k_cache=k_cache)
