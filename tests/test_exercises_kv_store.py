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


@triton.jit
def skips_slot_0_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                        ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot <= 0:  # slot 0 taken for "no slot": its token's K/V is never stored
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, tl.load(value_ptr + token * value_stride + cols, mask=mask), mask=mask)


@triton.jit
def value_at_key_stride_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                               slot_mapping_ptr, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, tl.load(value_ptr + token * key_stride + cols, mask=mask), mask=mask)


@triton.jit
def mask_one_too_wide_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                             slot_mapping_ptr, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols <= ROW  # one lane too many: the first value of the next slot
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, tl.load(value_ptr + token * value_stride + cols, mask=mask), mask=mask)


@triton.jit
def slot_times_block_row_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                                slot_mapping_ptr, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    tl.store(k_cache_ptr + slot * BLOCK_ROW + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * BLOCK_ROW + cols, tl.load(value_ptr + token * value_stride + cols, mask=mask),
             mask=mask)  # fmt: skip


# seeds 8, 10 and 11 drew slot 0 for no live token, when the slots were all random: the slot-0 kernel passed there
@pytest.mark.parametrize("seed", [0, 3, 8, 10, 11])
@pytest.mark.parametrize(
    "wrong, message",
    [
        (skips_slot_0_kernel, "slot 0 of k_cache .*only a negative slot means store nothing"),
        (value_at_key_stride_kernel, "v_cache .*at token \\* key_stride. value has a row stride of its own"),
        (mask_one_too_wide_kernel, "ROW=24.*slot \\d+ of k_cache"),
    ],
)
def test_slips_fail_on_every_seed(wrong, message, seed):
    with pytest.raises(ExerciseFailure, match="(?s)" + message):
        check_store_kvcache_kernel(wrong, seed=seed, engine=False)


def test_a_slot_arithmetic_past_the_cache_lands_in_the_guard_blocks():
    # slot * BLOCK_ROW overshoots by up to 2x: the last slot (always live) writes into the trailing guard blocks,
    # named by the check, instead of past the tensor (memory corruption under the interpreter)
    with pytest.raises(ExerciseFailure, match="ROW=24.*slot \\d+ of k_cache"):
        check_store_kvcache_kernel(slot_times_block_row_kernel, engine=False)


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


@triton.jit
def stores_at_the_token_index_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                                     slot_mapping_ptr, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    tl.store(k_cache_ptr + token * ROW + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + token * ROW + cols, tl.load(value_ptr + token * value_stride + cols, mask=mask), mask=mask)


@triton.jit
def swapped_caches_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                          ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    tl.store(v_cache_ptr + slot * ROW + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(value_ptr + token * value_stride + cols, mask=mask), mask=mask)


@triton.jit
def cache_rows_at_input_strides_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                                       slot_mapping_ptr, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    key = tl.load(key_ptr + token * key_stride + cols, mask=mask)
    value = tl.load(value_ptr + token * value_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * key_stride + cols, key, mask=mask)  # the cache's rows are ROW apart
    tl.store(v_cache_ptr + slot * value_stride + cols, value, mask=mask)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(
    "wrong, message",
    [
        # both were told "slot 0 is a slot like any other; only a negative slot means store nothing": slot 0 always
        # holds a token, so it was the first wrong row whatever the mistake
        (
            stores_at_the_token_index_kernel,
            r"slot 0 of k_cache .*holds token \d+'s row\. Token i's row goes to its slot",
        ),
        (swapped_caches_kernel, r"slot 0 of k_cache .*holds token \d+'s value row: store key rows into k_cache"),
        # value's rows are up to 4.5 ROW apart: slot * value_stride wrote past the guard blocks, corrupting memory
        # under the interpreter (its message changed from run to run)
        (cache_rows_at_input_strides_kernel, r"slot \d+ of k_cache .*nothing was stored there"),
    ],
)
def test_a_kernel_writing_at_the_wrong_row_is_told_which_row_it_wrote(wrong, message, seed):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_store_kvcache_kernel(wrong, seed=seed, engine=False)
    assert "slot 0 is a slot like any other" not in str(failure.value)


@triton.jit
def stores_key_only_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                           ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW
    tl.store(k_cache_ptr + slot * ROW + cols, tl.load(key_ptr + token * key_stride + cols, mask=mask), mask=mask)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_kernel_that_never_stores_the_value_is_told_so_not_about_slot_0(seed):
    with pytest.raises(ExerciseFailure, match=r"nothing was stored into v_cache: .*its value row") as failure:
        check_store_kvcache_kernel(stores_key_only_kernel, seed=seed, engine=False)
    assert "slot 0" not in str(failure.value)
