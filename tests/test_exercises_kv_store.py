"""Notebook 03's exercise check: nanoref's KV-store kernel passes; plausible wrong kernels fail with a message."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (Linux wheels only)")

from nanoref.exercises import ExerciseFailure, check_store_kvcache_kernel  # noqa: E402
from nanoref.ops.store_kvcache_triton import store_kvcache_kernel  # noqa: E402
from nanoref.ops.triton_setup import import_triton  # noqa: E402

triton = import_triton()
import triton.language as tl  # noqa: E402


@triton.jit
def no_sentinel_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                       D: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # forgets that -1 means "store nothing"
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    tl.store(k_cache_ptr + slot * D + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * D + cols, tl.load(value_ptr + token * value_stride + cols, mask=mask), mask=mask)


@triton.jit
def no_mask_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_D)  # BLOCK_D > D when D is not a power of two: the last lanes spill
    tl.store(k_cache_ptr + slot * D + cols, tl.load(key_ptr + token * key_stride + cols))
    tl.store(v_cache_ptr + slot * D + cols, tl.load(value_ptr + token * value_stride + cols))


@triton.jit
def row_stride_d_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                        D: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    tl.store(k_cache_ptr + slot * D + cols, tl.load(key_ptr + token * D + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * D + cols, tl.load(value_ptr + token * D + cols, mask=mask), mask=mask)


def test_nanorefs_own_kernel_passes_with_the_engine():
    check_store_kvcache_kernel(store_kvcache_kernel)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (no_sentinel_kernel, "slot is -1 wrote there.*return before storing"),
        (no_mask_kernel, "D=24.*slot \\d+ of k_cache"),
        (row_stride_d_kernel, "token \\* D.*key_stride"),
    ],
)
def test_wrong_kernels_fail_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message):
        check_store_kvcache_kernel(wrong, engine=False)


def test_a_plain_function_is_refused():
    with pytest.raises(ExerciseFailure, match="@triton.jit"):
        check_store_kvcache_kernel(lambda *args: None, engine=False)


@triton.jit
def unwritten_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     D: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    raise NotImplementedError()  # what a student copy holds before the exercise is done


def test_an_unwritten_kernel_stops_with_not_implemented_error():
    with pytest.raises(NotImplementedError, match="not written yet"):
        check_store_kvcache_kernel(unwritten_kernel, engine=False)
