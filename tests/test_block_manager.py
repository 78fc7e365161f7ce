"""Block manager and scheduler invariants, without a model: ref counts, hash hits, no leaks."""

from __future__ import annotations

import random

import pytest

from nanoref.engine.block_manager import BlockManager, chain_hash
from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence, SequenceStatus
from nanoref.utils.seams import ForwardKey

from .helpers import cached_prompt, new_sequence, prefill

BS = 16


def seq_of(tokens: list[int], max_tokens: int = 8) -> Sequence:
    return new_sequence(tokens, BS, max_tokens)


def scheduler_of(num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int) -> Scheduler:
    """A scheduler over `num_blocks` KV blocks of BS tokens, with no EOS token (every request runs to max_tokens)."""
    return Scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=512,
        num_kvcache_blocks=num_blocks,
        kvcache_block_size=BS,
        eos_token_ids=set(),
    )


def another_forward() -> ForwardKey:
    """A forward other than nanoref's own: a learner's rms_norm (a new function each call, so a new forward)."""
    return ForwardKey({"rms_norm": lambda x, weight, eps: x})


def test_chain_hash_depends_on_every_token_and_the_prefix():
    block = list(range(BS))
    hashes = {chain_hash(block)}
    for position in range(BS):  # one token changed anywhere in the block gives a new hash
        changed = list(block)
        changed[position] += 1000
        hashes.add(chain_hash(changed))
    assert len(hashes) == BS + 1
    assert chain_hash(block, prefix_hash=chain_hash(block)) != chain_hash(block, prefix_hash=chain_hash(block[::-1]))
    assert chain_hash(block, prefix_hash=chain_hash(block)) != chain_hash(block)  # chained != unchained
    assert chain_hash(tuple(block)) == chain_hash(block)  # only the values count, not the container


def test_allocate_and_free_ref_counts():
    manager = BlockManager(num_blocks=8, block_size=BS)
    seq = seq_of(list(range(40)))  # 3 blocks: 16 + 16 + 8
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    assert all(manager.blocks[b].ref_count == 1 for b in seq.block_table)
    manager.check_invariants([seq])
    manager.deallocate(seq)
    assert manager.num_free_blocks == 8 and seq.block_table == []
    manager.check_invariants([])


def test_prefix_hit_shares_blocks_and_counts_refs():
    manager = BlockManager(num_blocks=10, block_size=BS)
    shared = list(range(100, 132))  # two full blocks
    a = cached_prompt(manager, shared + [1, 2, 3])
    assert a.num_prefix_hit_tokens == 0
    b = seq_of(shared + [7, 8])
    manager.allocate(b)
    assert b.num_prefix_hit_tokens == 32 and b.num_computed_tokens == 32
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [manager.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    manager.check_invariants([a, b])
    manager.deallocate(a)
    assert [manager.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    manager.deallocate(b)
    manager.check_invariants([])


def test_no_hit_before_kv_is_computed():
    """Hashes are published only after the K/V is in the cache (a chunk in flight must not be hit)."""
    manager = BlockManager(num_blocks=10, block_size=BS)
    a, b = seq_of(list(range(40))), seq_of(list(range(40)))
    manager.allocate(a)
    manager.allocate(b)
    assert b.num_prefix_hit_tokens == 0


def test_hit_needs_identical_prefix_not_just_identical_block():
    manager = BlockManager(num_blocks=10, block_size=BS)
    cached_prompt(manager, list(range(32)) + [5])
    b = seq_of([999] + list(range(1, 16)) + list(range(16, 32)) + [5])  # block 1 equal, block 0 differs
    manager.allocate(b)
    assert b.num_prefix_hit_tokens == 0


def test_hash_collision_is_caught_by_token_check():
    manager = BlockManager(num_blocks=10, block_size=BS)
    a = cached_prompt(manager, list(range(17)))
    block = manager.blocks[a.block_table[0]]
    block.token_ids = [-1] * BS  # as if another content had produced the same hash
    b = seq_of(list(range(17)))
    manager.allocate(b)
    assert b.num_prefix_hit_tokens == 0


def test_whole_prompt_cached_still_leaves_a_token_to_compute():
    manager = BlockManager(num_blocks=10, block_size=BS)
    cached_prompt(manager, list(range(32)) + [1])
    b = seq_of(list(range(32)))  # exactly the two cached blocks
    manager.allocate(b)
    assert b.num_prefix_hit_tokens == 16  # the last block is recomputed, so the query is never empty
    assert b.num_computed_tokens < b.num_tokens


def test_freed_blocks_stay_hittable_until_reused():
    manager = BlockManager(num_blocks=4, block_size=BS)
    cached_prompt(manager, list(range(33)), release=True)
    b = seq_of(list(range(33)))
    assert manager.can_allocate(b)
    manager.allocate(b)
    assert b.num_prefix_hit_tokens == 32  # revived from the free list
    manager.check_invariants([b])
    manager.deallocate(b)
    c = seq_of(list(range(500, 564)))  # 4 fresh blocks: evicts everything cached
    manager.allocate(c)
    assert manager.hash_to_block_id == {}
    manager.deallocate(c)
    manager.check_invariants([])


def test_forget_cached_prefixes_needs_an_idle_manager_and_drops_every_forwards_hits():
    manager = BlockManager(num_blocks=6, block_size=BS)
    mine = another_forward()
    for forward in (None, mine):
        manager.use_forward(forward)
        cached_prompt(manager, list(range(40)), release=True)
    b = seq_of(list(range(40)))
    manager.allocate(b)
    with pytest.raises(RuntimeError, match="idle"):
        manager.forget_cached_prefixes()  # b's blocks are held: their K/V is still being read
    manager.deallocate(b)
    manager.forget_cached_prefixes()
    assert manager.hash_to_block_id == {} and manager.forward_tables == {} and manager.num_free_blocks == 6
    for forward in (None, mine):
        manager.use_forward(forward)
        c = seq_of(list(range(40)))
        manager.allocate(c)
        assert c.num_prefix_hit_tokens == 0  # the same prompt no longer hits, under either forward
        manager.check_invariants([c])
        manager.deallocate(c)


def test_blocks_computed_by_one_forward_are_never_hit_by_another():
    """Each forward has its own prefix cache: a lookup under nanoref's forward never finds blocks an exercise
    function's forward computed, nor the reverse, and each still hits its own."""
    mine = another_forward()
    manager = BlockManager(num_blocks=12, block_size=BS)
    tokens = list(range(40))
    manager.use_forward(mine)
    cached_prompt(manager, tokens, release=True)
    manager.use_forward(None)  # nanoref's own forward again
    b = seq_of(tokens)
    manager.allocate(b)
    assert b.num_prefix_hit_tokens == 0, "nanoref's forward was served K/V that an exercise function computed"
    prefill(manager, b)
    manager.deallocate(b)
    for forward in (mine, None):
        manager.use_forward(forward)
        c = seq_of(tokens)
        manager.allocate(c)
        assert c.num_prefix_hit_tokens == 32, f"{forward}'s own blocks are not hit"
        manager.check_invariants([c])
        manager.deallocate(c)


def test_a_sequence_whose_forward_changed_mid_prompt_publishes_nothing():
    """Chunked prefill: a block whose K/V two forwards computed belongs to neither cache, even when the forward
    changes back before the block is committed."""
    mine = another_forward()
    manager = BlockManager(num_blocks=12, block_size=BS)
    tokens = list(range(40))
    a = seq_of(tokens)
    manager.allocate(a)
    a.num_computed_tokens = 8  # half of block 0, under nanoref's forward
    manager.commit(a)
    manager.use_forward(mine)
    manager.use_forward(None)  # one step under `mine`, then nanoref's again
    prefill(manager, a)
    assert manager.hash_to_block_id == {} and manager.forward_tables == {}
    manager.deallocate(a)
    b = seq_of(tokens)
    manager.allocate(b)
    assert b.num_prefix_hit_tokens == 0
    manager.check_invariants([b])


def test_an_evicted_forwards_table_is_dropped_with_its_functions():
    manager = BlockManager(num_blocks=4, block_size=BS)
    manager.use_forward(another_forward())
    cached_prompt(manager, list(range(33)), release=True)
    assert len(manager.forward_tables) == 1
    manager.use_forward(None)
    b = seq_of(list(range(500, 564)))  # 4 fresh blocks: evicts everything cached
    manager.allocate(b)
    assert manager.forward_tables == {}, "an empty table (and the functions of its key) stayed"
    manager.check_invariants([b])


@pytest.mark.parametrize("seed", range(5))
def test_scheduler_random_workload_keeps_invariants(seed):
    """Drive the scheduler with a fake model: every request finishes once, with its token count."""
    rng = random.Random(seed)
    num_blocks = rng.choice([6, 10, 40])
    scheduler = scheduler_of(num_blocks, rng.choice([2, 4, 16]), rng.choice([8, 32, 256]))
    prefix = [rng.randrange(50) for _ in range(32)]
    seqs = []
    for _ in range(12):
        prompt = (prefix if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 40))]
        max_tokens = rng.randint(1, 30)
        if scheduler.block_manager.blocks_needed(len(prompt) + max_tokens) > num_blocks:
            continue  # the engine rejects such requests up front
        seq = seq_of(prompt, max_tokens)
        seqs.append(seq)
        scheduler.add(seq)
    finished_order = []
    for _ in range(10_000):
        if scheduler.is_finished():
            break
        batch, is_prefill = scheduler.schedule()
        assert batch and len(batch) <= scheduler.max_num_seqs
        if is_prefill:
            assert sum(s.num_scheduled_tokens for s in batch) <= scheduler.max_num_batched_tokens
        live = [s for s in seqs if s.block_table]
        scheduler.block_manager.check_invariants(live)
        finished_order += scheduler.postprocess(batch, [rng.randrange(50) for _ in batch])
    assert scheduler.is_finished()
    assert sorted(s.seq_id for s in finished_order) == sorted(s.seq_id for s in seqs)  # each exactly once
    for seq in seqs:
        assert seq.status == SequenceStatus.FINISHED
        assert seq.num_completion_tokens == seq.sampling_params.max_tokens
    scheduler.block_manager.check_invariants([])
    assert scheduler.block_manager.num_free_blocks == num_blocks


def test_a_sequence_that_steps_back_itself_frees_its_blocks_for_those_after_it():
    """A victim policy that always preempts `seq` itself, even with others still waiting for their token: the blocks
    it gives back serve the next sequence in the same step, as in a loop that preempts as it goes."""
    from nanoref.utils.seams import use

    scheduler = scheduler_of(num_blocks=4, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = (seq_of(list(range(start, start + BS))) for start in (0, 100, 200))  # one full block each
    for seq in (a, b, c):
        scheduler.add(seq)
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and batch == [a, b, c]
    scheduler.postprocess(batch, [1, 2, 3])  # each now needs a second block; one block is free
    with use(choose_preemption_victim=lambda running, seq: seq):
        batch, is_prefill = scheduler.schedule()
    assert not is_prefill
    assert batch == [a, c] and scheduler.preempted == [b.seq_id]  # c took the block b gave back
    scheduler.block_manager.check_invariants([a, c])


def test_a_request_that_does_not_fit_yet_keeps_those_behind_it_waiting():
    """First come, first served: when the head of the queue does not fit in the free blocks, a smaller request behind
    it is not admitted past it (it would take the blocks the head waits for, and a stream of small requests would
    starve a large one). The head goes first once blocks free up."""
    scheduler = scheduler_of(num_blocks=4, max_num_seqs=4, max_num_batched_tokens=256)
    a = seq_of(list(range(32)), max_tokens=2)  # 2 blocks now, 3 once it decodes past 32 tokens
    big, small = seq_of(list(range(100, 140))), seq_of(list(range(200, 210)))  # 3 blocks (2 left free); 1 block
    scheduler.add(a)
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and batch == [a]
    scheduler.postprocess(batch, [7])
    scheduler.add(big)
    scheduler.add(small)
    batch, is_prefill = scheduler.schedule()
    assert not is_prefill and batch == [a], "a request was admitted past the head of the queue"
    assert list(scheduler.waiting) == [big, small] and not big.block_table and not small.block_table
    scheduler.postprocess(batch, [8])  # a's second token: max_tokens reached, its blocks are back
    assert a.status == SequenceStatus.FINISHED
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and batch == [big, small]
    scheduler.block_manager.check_invariants([big, small])
