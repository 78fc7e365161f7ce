"""Checks for notebook 05's exercises: the block manager's prefix-cache lookup and the preemption choice."""

from __future__ import annotations

import random
from collections.abc import Callable

from nanoref.engine.block_manager import Block, chain_hash, find_cached_prefix
from nanoref.exercises.common import ExerciseFailure, call_learner, check_generation, random_prompts


class _Cache:
    """A pool of blocks and the hash table, filled by hand: what the block manager keeps."""

    def __init__(self, num_blocks: int, block_size: int, rng: random.Random) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)  # block ids in no order

    def store(self, tokens: list[int], prefix_hash: int = -1, chained: bool = True) -> tuple[int, int]:
        """Put one full block's tokens in a free block and register its hash; returns (block id, hash)."""
        block = self.blocks[self.free.pop()]
        block.hash = chain_hash(tokens, prefix_hash if chained else -1)
        block.token_ids = list(tokens)
        self.hash_to_block_id[block.hash] = block.block_id
        return block.block_id, block.hash

    def store_prefix(self, token_ids: list[int], num_blocks: int) -> list[int]:
        ids, prefix_hash = [], -1
        for index in range(num_blocks):
            block_id, prefix_hash = self.store(token_ids[index * self.block_size : (index + 1) * self.block_size],
                                               prefix_hash)  # fmt: skip
            ids.append(block_id)
        return ids


def _cases(rng: random.Random, block_size: int):
    """(description, hint if wrong, token_ids, cache) for each situation the lookup must get right."""

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(n)]

    prompt = tokens(4 * block_size + 3)
    cache = _Cache(24, block_size, rng)
    cache.store_prefix(prompt, 3)
    yield ("3 of a prompt's 4 full blocks are cached",
           "walk the full blocks in order and hash block i with chain_hash(its tokens, the hash of block i - 1), "
           "as the block manager registered them", prompt, cache)  # fmt: skip
    exact = tokens(3 * block_size)
    cache = _Cache(24, block_size, rng)
    cache.store_prefix(exact, 3)
    yield (
        f"a prompt of exactly 3 blocks ({3 * block_size} tokens), all 3 cached",
        "the last token is always recomputed (its logits start generation), so only the full blocks before the "
        "last token count: (len(token_ids) - 1) // block_size of them, here 2",
        exact,
        cache,
    )
    # one token past 3 full blocks: all 3 count, so leaving out the block before the last token's (len // block_size
    # - 1, or (len - 2) // block_size) fails here on every run; the prompts above end where those agree
    one_more = tokens(3 * block_size + 1)
    cache = _Cache(24, block_size, rng)
    cache.store_prefix(one_more, 3)
    yield (
        f"a prompt of 3 full blocks and 1 more token ({3 * block_size + 1} tokens), all 3 cached",
        "only the block holding the last token is left out: a full block before it counts, "
        "(len(token_ids) - 1) // block_size of them, here 3",
        one_more,
        cache,
    )
    cache = _Cache(24, block_size, rng)
    cache.store_prefix(prompt, 3)
    first = cache.hash_to_block_id.pop(chain_hash(prompt[:block_size]))  # block 0 evicted; blocks 1, 2 still there
    cache.blocks[first].hash = -1
    yield ("block 0 of the prompt is no longer cached but blocks 1 and 2 are",
           "stop at the first block that misses: a later block's K/V is only valid after the same earlier tokens",
           prompt, cache)  # fmt: skip
    cache = _Cache(24, block_size, rng)
    cache.store(prompt[:block_size])
    for index in (1, 2):  # blocks 1 and 2 registered under their own tokens' hash, not chained on block 0
        cache.store(prompt[index * block_size : (index + 1) * block_size], chained=False)
    yield ("blocks 1 and 2 are registered only under unchained hashes",
           "hash block i with chain_hash(its tokens, the hash of block i - 1): a hit must mean the same whole prefix",
           prompt, cache)  # fmt: skip
    cache = _Cache(24, block_size, rng)
    # blocks 0..2 registered, block 1 then a hash collision (same hash, other tokens): block 2 stays a hit, so a walk
    # that skips the collided block and goes on (`continue` where a miss breaks) takes it and fails on every run
    block_ids = cache.store_prefix(prompt, 3)
    cache.blocks[block_ids[1]].token_ids = tokens(block_size)
    yield ("block 1's hash is found but the block holds other tokens (a hash collision); block 2 is cached",
           "compare the block's token_ids with the prompt's tokens before taking it, and stop at a block that fails "
           "(a collision is a miss): block j of the result must hold the request's block j, and block 2's K/V was "
           "computed after block 1's real tokens", prompt, cache)  # fmt: skip
    cache = _Cache(24, block_size, rng)
    yield ("an empty cache", "nothing is cached: return []", prompt, cache)


def _state(block: Block) -> tuple:
    return block.ref_count, block.hash, list(block.token_ids), block.forward


def _missing_hash_hint(error: Exception) -> str | None:
    """The fix for hash_to_block_id[h] on a hash that is not cached."""
    if isinstance(error, KeyError):
        return (
            "a hash that is not in hash_to_block_id is a miss, not an error: look it up with "
            "hash_to_block_id.get(h, -1) and stop the walk there"
        )
    return None


def check_find_cached_prefix(fn: Callable, *, seed: int = 0, engine: bool = True) -> None:
    """`fn(token_ids, block_size, hash_to_block_id, blocks) -> list of block ids` against nanoref's, then the
    engine with shared prefixes, one prompt per prefill step and a KV budget small enough to preempt."""
    rng = random.Random(seed)
    for block_size in (4, 16):
        for description, hint, token_ids, cache in _cases(rng, block_size):
            want = find_cached_prefix(token_ids, block_size, cache.hash_to_block_id, cache.blocks)
            table_before = dict(cache.hash_to_block_id)
            blocks_before = [_state(block) for block in cache.blocks]
            got = call_learner(
                fn, "find_cached_prefix", list(token_ids), block_size, cache.hash_to_block_id, cache.blocks,
                case=description, hint=_missing_hash_hint,
            )  # fmt: skip
            if cache.hash_to_block_id != table_before:
                raise ExerciseFailure(f"{description}: your function changed hash_to_block_id; only read it")
            changed = next((b for b, before in zip(cache.blocks, blocks_before) if _state(b) != before), None)
            if changed is not None:
                raise ExerciseFailure(
                    f"{description}: your function changed block {changed.block_id} of the pool (ref_count, hash or "
                    "token_ids): only read the blocks; the block manager takes the ones you return (allocate raises "
                    "their ref_count), and a count raised here too keeps them held after their requests finish"
                )
            if not isinstance(got, (list, tuple)):
                raise ExerciseFailure(f"return a list of block ids, got {type(got).__name__}")
            if not all(hasattr(block_id, "__index__") for block_id in got):  # (an int, a numpy or 0-d torch int)
                kind = next(type(block_id).__name__ for block_id in got if not hasattr(block_id, "__index__"))
                raise ExerciseFailure(
                    f"return block ids (ints: blocks[i].block_id is i), got a list holding {kind} (on {description})"
                )
            if list(got) != want:
                raise ExerciseFailure(
                    f"block_size {block_size}, {len(token_ids)}-token prompt, {description}: you returned the "
                    f"blocks {list(got)}, expected {want}: {hint}"
                )
    if engine:
        prefix = random_prompts(seed=31, lengths=[40], vocab=256)[0]
        prompts = [prefix + tail for tail in random_prompts(seed=32, lengths=[5, 12, 3, 20], vocab=256)]
        check_generation(
            {"find_cached_prefix": fn},
            prompts=prompts,
            max_tokens=12,
            num_kvcache_blocks=9,
            max_num_batched_tokens=48,
            kvcache_block_size=16,
        )


def _sequences(count: int, start: int = 0) -> list:
    from nanoref.engine.sequence import Sequence
    from nanoref.sampling_params import SamplingParams

    return [Sequence([start + i + 1] * (3 + i), SamplingParams(temperature=0), block_size=16) for i in range(count)]


def _victim_cases():
    """(running, seq, note) queues: running oldest first, as the scheduler keeps it. The last is a queue after a
    re-admission: the sequence admitted again after its preemption went to the end of running though it is older
    (a lower seq_id) than one before it, and it holds neither the most nor the fewest tokens, so only running's
    order names the newest."""
    for num_running in (3, 1, 0):
        *running, seq = _sequences(num_running + 1)
        yield running, seq, ""
    seq, older, readmitted, newer = _sequences(4)  # seq_ids in this order, ascending
    older.token_ids += [7] * 6  # 10 tokens
    readmitted.token_ids += [7] * 2  # 7 tokens, 2 of them generated before its preemption
    readmitted.num_preemptions = 1
    newer.token_ids = newer.token_ids[:3]  # 3 tokens
    yield (
        [older, newer, readmitted],
        seq,
        "running is in admission order, and a sequence admitted again after a preemption joins its end whatever its "
        "seq_id or length: the newest is running[-1]. ",
    )


def check_choose_preemption_victim(fn: Callable, *, engine: bool = True) -> None:
    """`fn(running, seq) -> the sequence to preempt` against nanoref's policy, then the engine with a KV budget so
    small that it preempts."""
    from nanoref.engine.scheduler import choose_preemption_victim

    for running, seq, note in _victim_cases():
        num_running = len(running)
        names = {id(s): f"running[{i}] (seq_id {s.seq_id}, {s.num_tokens} tokens)" for i, s in enumerate(running)}
        names[id(seq)] = "seq (the one needing a block)"
        given = list(running)
        got = call_learner(
            fn, "choose_preemption_victim", given, seq, case=f"{num_running} other running sequences",
            hint=lambda error: "running may be empty: then return seq" if isinstance(error, IndexError) else None,
        )  # fmt: skip
        want = choose_preemption_victim(list(running), seq)
        if given != running:
            raise ExerciseFailure("your function changed `running`; return the victim, the scheduler removes it")
        if got is want:
            continue
        if id(got) not in names:
            raise ExerciseFailure(f"return one of the sequences you were given (one of running, or seq), got {got!r}")
        what = f"with {num_running} other running sequences you chose {names[id(got)]}, expected {names[id(want)]}"
        if got is seq:
            raise ExerciseFailure(f"{what}: seq steps back only when no other sequence is running")
        raise ExerciseFailure(
            f"{what}: preempt the newest (running is oldest first)\n{note}The newest has the least work to lose, and "
            "the oldest requests finish first"
        )
    if engine:
        calls = []

        def counted(running, seq):
            calls.append(len(running))
            return fn(running, seq)

        check_generation({"choose_preemption_victim": counted}, max_tokens=12, num_kvcache_blocks=5)
        assert calls, "the engine never had to preempt: the check's setup is wrong, not your function"
