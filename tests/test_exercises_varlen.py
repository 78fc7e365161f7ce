"""Notebook 01's exercise check: nanoref's `prefill_metadata` passes; plausible wrong answers fail in words."""

from __future__ import annotations

import pytest

from nanoref.engine.step_inputs import prefill_metadata
from nanoref.exercises import ExerciseFailure, check_generation, check_prefill_metadata

from .helpers import assert_readable_failure


def test_nanorefs_own_function_passes_with_the_engine():
    check_prefill_metadata(prefill_metadata)


def variant(
    *,
    ids_from_zero=False,
    positions_from_zero=False,
    keys_without_history=False,
    slot_without_size=False,
    keys_extra=0,
    queries_extra=0,
    keys_to_the_end=False,
):
    def wrong(token_ids, num_cached, num_new, block_tables, block_size):
        ids, positions, slots, cu_q, cu_k = [], [], [], [0], [0]
        for tokens, start, count, table in zip(token_ids, num_cached, num_new, block_tables):
            end = start + count
            ids.extend(tokens[:count] if ids_from_zero else tokens[start:end])
            positions.extend(range(count) if positions_from_zero else range(start, end))
            for t in range(start, end):
                block = table[t // block_size]
                slots.append(block + t % block_size if slot_without_size else block * block_size + t % block_size)
            cu_q.append(cu_q[-1] + count + queries_extra)
            keys = len(tokens) if keys_to_the_end else count if keys_without_history else end
            cu_k.append(cu_k[-1] + keys + keys_extra)
        return ids, positions, cu_q, cu_k, slots

    return wrong


@pytest.mark.parametrize(
    "wrong, message",
    [
        (variant(keys_without_history=True), r"row 2 of cu_seqlens_k is .*did you count the prefix-cached tokens"),
        (variant(positions_from_zero=True), r"positions\[\d+\] \(sequence 1's new token 0.*continue after"),
        (variant(ids_from_zero=True), r"input_ids\[\d+\] \(sequence 1.*skipping the cached tokens"),
        (variant(slot_without_size=True), r"slot_mapping\[\d+\] .*block_tables\[0\]"),
        (lambda *args: prefill_metadata(*args)[:4], "return 5 values"),
        (lambda *args: prefill_metadata(*args)._replace(cu_seqlens_q=prefill_metadata(*args).cu_seqlens_q[1:]),
         r"cu_seqlens_q has 4 entries, expected 5 \(num_seqs \+ 1\)"),
    ],
)  # fmt: skip
def test_wrong_answers_fail_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_prefill_metadata(wrong, engine=False)
    assert_readable_failure(failure.value)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (variant(keys_extra=1), r"row 1 of cu_seqlens_k is \d+, expected \d+: off by one: cu_seqlens_k\[0 \+ 1\]"),
        (variant(keys_extra=-1), r"row 1 of cu_seqlens_k .*: off by one"),
        (variant(queries_extra=1), r"row 1 of cu_seqlens_q .*: off by one: cu_seqlens_q\[0 \+ 1\] = "),
    ],
)
def test_an_off_by_one_on_a_sequence_without_cached_tokens_is_called_one(wrong, message):
    # sequence 0 is a fresh prompt: its keys are its new tokens, so "did you count the cached tokens?" would mislead
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_prefill_metadata(wrong, engine=False)
    assert "prefix-cached" not in str(failure.value)
    assert_readable_failure(failure.value)


@pytest.mark.parametrize("seed", [0, 5, 47, 50, 128])
def test_keys_counted_to_the_end_of_the_sequence_fail_on_every_seed(seed):
    # len(token_ids[b]) equals num_cached + num_new except on a chunk that stops short of the sequence's end; the
    # later chunk always does, so no seed passes it (47, 50 and 128 did, when the chunk could reach the end)
    with pytest.raises(ExerciseFailure, match=r"(?s)cu_seqlens_k .*not len\(token_ids\[b\]\)") as failure:
        check_prefill_metadata(variant(keys_to_the_end=True), seed=seed, engine=False)
    assert_readable_failure(failure.value)


def test_the_engine_check_catches_what_the_unit_check_would():
    # the engine run has prefix-cache hits and chunked prefill: ignoring the history breaks generation
    with pytest.raises(ExerciseFailure, match="generates token|engine failed"):
        check_generation(
            {"prefill_metadata": variant(positions_from_zero=True)},
            prompts=[list(range(3, 43)), list(range(3, 43)) + [7, 8]],
            max_num_batched_tokens=24,
            kvcache_block_size=16,
        )


def slot_offset_from_the_chunk_start(token_ids, num_cached, num_new, block_tables, block_size):
    """The block from the token's position, the offset from its index in the chunk: right wherever the chunk starts
    at a block boundary (fresh prompts, prefix hits), wrong for a chunk that starts mid-block."""
    flat = prefill_metadata(token_ids, num_cached, num_new, block_tables, block_size)
    slots = []
    for start, count, table in zip(num_cached, num_new, block_tables):
        slots.extend(
            table[t // block_size] * block_size + (t - start) % block_size for t in range(start, start + count)
        )
    return flat._replace(slot_mapping=slots)


@pytest.mark.parametrize("seed", [0, 5, 13, 21, 99])
def test_a_slot_offset_counted_from_the_chunk_start_fails_on_every_seed(seed):
    # the later chunk could start at a block boundary (seed 5 did, for both block sizes), where this answer is right
    with pytest.raises(ExerciseFailure, match=r"slot_mapping\[\d+\] \(sequence 2's .*% \d+ \(its block tables") as f:
        check_prefill_metadata(slot_offset_from_the_chunk_start, seed=seed, engine=False)
    assert_readable_failure(f.value)


@pytest.mark.parametrize("argument", ["num_cached", "block_tables"])
def test_an_answer_that_changes_its_inputs_is_told_so(argument):
    # the expected values were computed after the call, from the changed inputs: a zeroed num_cached was reported as
    # wrong input_ids "at position 0", a sorted block table as a wrong slot
    def changes_its_inputs(token_ids, num_cached, num_new, block_tables, block_size):
        flat = prefill_metadata(token_ids, num_cached, num_new, block_tables, block_size)
        if argument == "num_cached":
            num_cached[:] = [0] * len(num_cached)
        else:
            for table in block_tables:
                table.sort()
        return flat

    with pytest.raises(ExerciseFailure, match=f"changed its {argument} argument in place") as failure:
        check_prefill_metadata(changes_its_inputs, engine=False)
    assert_readable_failure(failure.value)


def per_sequence_counts(token_ids, num_cached, num_new, block_tables, block_size):
    """cu_seqlens holding each sequence's own count, [0, n0, n1, ...], not the running totals."""
    ids, positions, cu_q, cu_k, slots = prefill_metadata(token_ids, num_cached, num_new, block_tables, block_size)
    return ids, positions, [0, *num_new], [0, *(c + n for c, n in zip(num_cached, num_new))], slots


@pytest.mark.parametrize("seed", [0, 5, 47, 128])
def test_cu_seqlens_of_per_sequence_counts_are_told_they_are_running_totals(seed):
    with pytest.raises(ExerciseFailure, match=r"row 2 of cu_seqlens_q .*holds running totals") as failure:
        check_prefill_metadata(per_sequence_counts, seed=seed, engine=False)
    assert_readable_failure(failure.value)
