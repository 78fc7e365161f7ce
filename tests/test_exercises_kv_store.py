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
                       ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # forgets that -1 means "store nothing"
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, tl.load(value_ptr + token * value_stride + cols, mask=mask), mask=mask)


@triton.jit
def no_mask_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                   ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)  # BLOCK_ROW > ROW when ROW is not a power of two: the last lanes spill
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(key_ptr + token * key_stride + cols))
    tl.store(v_cache_ptr + slot * ROW + cols, tl.load(value_ptr + token * value_stride + cols))


@triton.jit
def unstrided_rows_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                        ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(key_ptr + token * ROW + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, tl.load(value_ptr + token * ROW + cols, mask=mask), mask=mask)


def test_nanorefs_own_kernel_passes_with_the_engine():
    check_store_kvcache_kernel(store_kvcache_kernel)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (no_sentinel_kernel, "slot is -1 wrote there.*return before storing"),
        (no_mask_kernel, "ROW=24.*slot \\d+ of k_cache"),
        (unstrided_rows_kernel, "token \\* ROW.*key_stride"),
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
                     ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    raise NotImplementedError()  # what a student copy holds before the exercise is done


def test_an_unwritten_kernel_stops_with_not_implemented_error():
    with pytest.raises(NotImplementedError, match="not written yet"):
        check_store_kvcache_kernel(unwritten_kernel, engine=False)


@triton.jit
def old_names_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     D: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    # a correct kernel from a copy of notebook 03 written when the row width was called D
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    tl.store(k_cache_ptr + slot * D + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * D + cols, tl.load(value_ptr + token * value_stride + cols, mask=mask), mask=mask)


def test_a_kernel_with_the_old_constexpr_names_is_told_the_new_ones():
    with pytest.raises(ExerciseFailure, match="`D` is now called `ROW`, `BLOCK_D` is now called `BLOCK_ROW`"):
        check_store_kvcache_kernel(old_names_kernel, engine=False)


def test_the_launcher_names_the_renamed_constexprs_of_a_seam_kernel():
    """The capstone runs a learner's kernel through the seam without the exercise check: the same message."""
    import torch

    from nanoref.ops.store_kvcache_triton import store_kvcache_triton
    from nanoref.utils.seams import use

    key = torch.randn(3, 2, 4)  # (N, Hk, D)
    k_cache, v_cache = torch.zeros(2, 2, 4, 2, 4)  # (num_blocks, block_size, Hk, D) each
    with use(store_kvcache_kernel=old_names_kernel), pytest.raises(TypeError, match="`D` is now called `ROW`"):
        store_kvcache_triton(key, key, k_cache, v_cache, torch.tensor([0, -1, 5]))
    assert not k_cache.any(), "nothing is stored"
