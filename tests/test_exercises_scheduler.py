"""Notebook 05's exercise check: nanoref's prefix lookup passes; plausible wrong lookups fail with a message."""

from __future__ import annotations

import pytest

from nanoref.engine.block_manager import chain_hash, find_cached_prefix
from nanoref.exercises import (
    ExerciseFailure,
    check_choose_preemption_victim,
    check_find_cached_prefix,
    check_generation,
)

from .helpers import assert_readable_failure


def test_nanorefs_own_lookup_passes_with_the_engine():
    check_find_cached_prefix(find_cached_prefix)


def lookup_variant(
    *,
    keep_last=False,
    drop_one=False,
    skip_misses=False,
    chained=True,
    check_tokens=True,
    skip_collisions=False,
    indexed=False,
    takes=False,
    objects=False,
):
    def lookup(token_ids, block_size, hash_to_block_id, blocks):
        hits, prefix_hash = [], -1
        count = len(token_ids) // block_size if keep_last else (len(token_ids) - 1) // block_size
        if drop_one:  # "never the block holding the last token" read as "never the last full block"
            count = len(token_ids) // block_size - 1
        for index in range(count):
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            prefix_hash = chain_hash(tokens, prefix_hash if chained else -1)
            # (indexed: a missing hash raises KeyError)
            block_id = hash_to_block_id[prefix_hash] if indexed else hash_to_block_id.get(prefix_hash, -1)
            if skip_collisions and block_id != -1 and blocks[block_id].token_ids != tokens:
                continue  # a collision skipped, the walk going on: the next block would sit in the wrong place
            if block_id == -1 or (check_tokens and blocks[block_id].token_ids != tokens):
                if skip_misses:
                    continue
                break
            if takes:  # "takes" the block itself: the block manager's allocate raises the count again
                blocks[block_id].ref_count += 1
            hits.append(blocks[block_id] if objects else block_id)
        return hits

    return lookup


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lookup_variant(keep_last=True), r"exactly 3 blocks .*expected \[\d+, \d+\]:\s+the last token is always"),
        (lookup_variant(drop_one=True), r"3 full blocks and 1 more token .*expected \[\d+, \d+, \d+\]:.*here 3"),
        (lookup_variant(skip_misses=True), "block 0 of the prompt is no longer cached.*stop at the first block"),
        (lookup_variant(chained=False), "chain_hash\\(its tokens, the hash of block i - 1\\)"),
        (lookup_variant(check_tokens=False), "hash collision.*compare the block's token_ids"),
        (lookup_variant(skip_collisions=True), r"hash collision.*expected \[\d+\]:.*stop at a block that fails"),
        (lambda *args: None, "return a list of block ids"),
        (lookup_variant(indexed=True), "raised KeyError.*a miss, not an error.*hash_to_block_id.get\\(h, -1\\)"),
        (lookup_variant(takes=True), "changed block \\d+ of the pool.*only read the blocks"),
        (lookup_variant(objects=True), "return block ids \\(ints.*got a list holding Block"),
    ],
)
def test_wrong_lookups_fail_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message):
        check_find_cached_prefix(wrong, engine=False)


def test_the_engine_check_catches_a_prompt_served_entirely_from_the_cache():
    prompt = list(range(10, 42))  # exactly 2 blocks of 16: the second request finds both cached
    with pytest.raises(ExerciseFailure, match="engine failed|generates token"):
        check_generation(
            {"find_cached_prefix": lookup_variant(keep_last=True)},
            prompts=[prompt, prompt],
            max_num_batched_tokens=32,
            kvcache_block_size=16,
        )


def test_nanorefs_preemption_choice_passes_with_the_engine():
    from nanoref.engine.scheduler import choose_preemption_victim

    check_choose_preemption_victim(choose_preemption_victim)


def newest_even_of_none(running, seq):  # no case for an empty running
    return running[-1]


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda running, seq: running[0] if running else seq, "chose running\\[0\\].*expected running\\[2\\]"),
        (lambda running, seq: seq, "seq steps back only when no other sequence is running"),
        (lambda running, seq: running.pop() if running else seq, "changed `running`"),
        (lambda running, seq: None, "return one of the sequences you were given"),
        (newest_even_of_none, "raised IndexError.*running may be empty: then return seq"),
    ],
)
def test_wrong_preemption_choices_fail_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message):
        check_choose_preemption_victim(wrong, engine=False)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda running, seq: max(running, key=lambda s: s.seq_id) if running else seq, "admission order"),
        (lambda running, seq: max(running, key=lambda s: s.num_tokens) if running else seq, "admission order"),
        (lambda running, seq: min(running, key=lambda s: s.num_tokens) if running else seq, "oldest first"),
    ],
    ids=["highest seq_id", "most tokens", "fewest tokens"],
)
def test_a_victim_chosen_by_id_or_length_instead_of_running_order_fails(wrong, message):
    """running is in admission order: a sequence admitted again after a preemption is at its end though older
    (a lower seq_id) than others, so the newest of running is not the highest id."""
    with pytest.raises(
        ExerciseFailure, match="(?s)you chose running\\[[01]\\].*expected running\\[2\\].*" + message
    ) as failure:
        check_choose_preemption_victim(wrong, engine=False)
    assert_readable_failure(failure.value)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("blocks", [lambda n, size: n // size - 1, lambda n, size: (n - 2) // size])
def test_a_lookup_that_leaves_out_a_full_block_before_the_last_token_fails_on_every_seed(blocks, seed):
    """The prompts that end one token past a block boundary are the only ones where these off-by-ones differ from
    (len - 1) // block_size; the engine's run cannot tell (fewer hits generate the same tokens)."""

    def lookup(token_ids, block_size, hash_to_block_id, blocks_pool):
        hits, prefix_hash = [], -1
        for index in range(blocks(len(token_ids), block_size)):
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            prefix_hash = chain_hash(tokens, prefix_hash)
            block_id = hash_to_block_id.get(prefix_hash, -1)
            if block_id == -1 or blocks_pool[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    with pytest.raises(ExerciseFailure, match="(?s)1 more token.*only the block holding the last token is left out"):
        check_find_cached_prefix(lookup, seed=seed, engine=False)
