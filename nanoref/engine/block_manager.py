"""Paged KV blocks with prefix caching.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a list of block ids
(its block table); token t of the sequence lives in slot `block_table[t // block_size] * block_size
+ t % block_size`.

Prefix caching: once a *full* block's K/V has been computed, the block gets a hash chained over
every token before it: hash(previous block's hash, this block's tokens). A later sequence whose
prompt starts with the same tokens finds the same chain of hashes and shares those blocks (ref
counts) instead of recomputing them. Token ids are compared too, so a hash collision cannot serve
wrong K/V. Freed blocks keep their hash and content until they are reused for something else (lazy
eviction), so a finished request's prefix can still be hit.

The K/V of given tokens depends on the forward that computed them: inside `seams.use(rms_norm=...)` a learner's
function runs in every layer. So each forward (`seams.forward_key()`) has its own hash table, nanoref's own being
`hash_to_block_id`: a block is registered only in the table of the forward that computed all of its sequence's
K/V, and a lookup searches the table of the forward about to run (the chain hashes themselves are the same for every
forward, so a learner's `find_cached_prefix` reads any forward's table as it is). The engine tells the manager
which forward each step runs (`use_forward`); a sequence whose K/V was started by another forward publishes nothing
more. A sequence with a `cache_salt` (K/V that depends on more than its tokens) has a table of its own too, per
forward and salt.

Every block table is also mirrored in one persistent array (`BlockTables`), a row per sequence holding blocks:
the model runner reads a decode step's padded tables from it with one numpy index, instead of re-padding every
sequence's Python list every step.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from nanoref.engine.block_tables import BlockTables
from nanoref.engine.invariants import check_block_invariants
from nanoref.engine.sequence import Sequence
from nanoref.utils.seams import ForwardKey, seam


def chain_hash(token_ids: list[int], prefix_hash: int = -1) -> int:
    """64-bit hash of a full block's tokens, chained on the previous block's hash."""
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not (yet) reusable through the prefix cache
        self.token_ids: list[int] = []
        self.forward: object = None  # whose table the hash is registered in (BlockManager._key; None: nanoref's)

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []
        self.forward = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={'-' if self.hash == -1 else hex(self.hash)[:8]})"


def find_cached_prefix(
    token_ids: list[int], block_size: int, hash_to_block_id: dict[int, int], blocks: list[Block]
) -> list[int]:
    """Block ids holding the longest cached prefix of a prompt, by chained hash plus a token check.

    Only full blocks before the last token count: the step that follows needs the last token's logits, so a
    prompt is never served entirely from the cache. The walk stops at the first block that misses.
    """
    hits: list[int] = []
    prefix_hash = -1
    for index in range((len(token_ids) - 1) // block_size):
        block_tokens = token_ids[index * block_size : (index + 1) * block_size]
        prefix_hash = chain_hash(block_tokens, prefix_hash)
        block_id = hash_to_block_id.get(prefix_hash, -1)
        if block_id == -1 or blocks[block_id].token_ids != block_tokens:  # a miss, or a hash collision
            break
        hits.append(block_id)
    return hits


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold num_tokens tokens."""
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}  # the prefix cache of nanoref's own forward
        # the prefix caches of other forwards (exercise functions in place of nanoref's), dropped when they empty
        # (and of sequences with a cache_salt: keyed by (forward, salt))
        self.forward_tables: dict[object, dict[int, int]] = {}
        # the forward the current step runs, and how many times it changed: a sequence publishes its blocks only if
        # every step since its allocation ran the forward of the same epoch
        self.forward: ForwardKey | None = None
        self.forward_epoch = 0
        # Free blocks, oldest freed first (LRU eviction), as an ordered set: a prefix-cache hit takes its block back
        # out of the middle, where a deque's remove() scans the whole free list. With 16-token blocks a GPU holds
        # tens of thousands of blocks, and re-sent prompts hit thousands of them (on the CPU, a repeated generate of
        # 128 cached prompts with 16-token blocks: 1.46 -> 0.81 s).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        # counters for metrics and notebooks
        self.num_hit_blocks = 0
        self.tables = BlockTables()  # every block table, mirrored as one array's rows (for the model runner)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    # -- which forward ------------------------------------------------------------------------
    def use_forward(self, forward: ForwardKey | None) -> None:
        """The next step runs `forward` (`seams.forward_key()`): look up and publish blocks in its table from now.

        Called before every step. When the forward changes, the sequences already holding K/V made by the old one
        can never publish again (their later blocks would mix both forwards): the epoch moves on.
        """
        if forward != self.forward:
            self.forward = forward
            self.forward_epoch += 1

    def _key(self, seq: Sequence) -> object:
        """Whose prefix cache seq reads and writes: the forward the step runs and the sequence's cache_salt."""
        return self.forward if seq.cache_salt is None else (self.forward, seq.cache_salt)

    def _table(self, key: object) -> dict[int, int]:
        """The hash table of `key`'s prefix cache (an empty one, not kept, if it has none yet)."""
        return self.hash_to_block_id if key is None else self.forward_tables.get(key, {})

    # -- allocation ---------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)  # the least recently freed
        block = self.blocks[block_id]
        if block.hash != -1:
            table = self._table(block.forward)
            if table.get(block.hash) == block_id:
                del table[block.hash]  # evicted: its content is about to be overwritten
                if not table and block.forward is not None:
                    del self.forward_tables[block.forward]  # (which lets the forward's functions go)
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq (see find_cached_prefix)."""
        lookup = seam("find_cached_prefix", find_cached_prefix)
        return lookup(seq.token_ids, self.block_size, self._table(self._key(seq)), self.blocks)

    def can_allocate(self, seq: Sequence) -> bool:
        return self._fits(seq, self._find_cached_prefix(seq))

    def _fits(self, seq: Sequence, hits: list[int]) -> bool:
        revived = sum(1 for block_id in hits if block_id not in self.used_block_ids)  # hits sitting in the free list
        return self.num_free_blocks - revived >= seq.num_blocks - len(hits)

    def allocate(self, seq: Sequence) -> None:
        """Give seq a block table covering all its tokens, sharing cached prefix blocks.

        Looks everything up first and changes nothing when that fails (a learner's find_cached_prefix raising,
        or returning blocks that do not fit or do not exist)."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        hits = self._find_cached_prefix(seq)
        if not all(0 <= block_id < self.num_blocks for block_id in hits):
            raise RuntimeError(f"the cached prefix {hits} names blocks outside [0, {self.num_blocks})")
        if not self._fits(seq, hits):
            raise RuntimeError(f"sequence {seq.seq_id} does not fit in the free KV blocks: check can_allocate first")
        self.num_hit_blocks += len(hits)
        for block_id in hits:
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:  # freed earlier but not yet overwritten: take it back out of the free list
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
                block.ref_count = 1
            seq.block_table.append(block_id)
        for _ in range(len(hits), seq.num_blocks):
            seq.block_table.append(self._take_free_block())
        self.tables.write(seq)
        seq.num_computed_tokens = len(hits) * self.block_size
        # the first admission's hits (vLLM's num_cached_tokens): a recomputed sequence's are partly its own K/V
        seq.num_prefix_hit_tokens = seq.num_prefix_hit_tokens if seq.num_preemptions else seq.num_computed_tokens
        seq.num_hashed_blocks = len(hits)
        seq.forward_epoch = self.forward_epoch  # its K/V (the hits included) is the current forward's

    def deallocate(self, seq: Sequence) -> None:
        """Give back seq's blocks: each one goes to the free list when its last holder lets go.

        Checked before anything changes: a table that names a block no one holds raises with every count intact,
        instead of freeing half the table."""
        blocks = [self.blocks[block_id] for block_id in reversed(seq.block_table)]
        for block in blocks:
            assert block.ref_count > 0 and block.block_id in self.used_block_ids, f"block {block.block_id} freed twice"
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block.block_id)
                self.free_block_ids[block.block_id] = None  # the most recently freed: evicted last
        seq.block_table.clear()
        self.tables.release(seq)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    # -- decode -------------------------------------------------------------------------------
    def can_append(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Room to grow seq's block table to hold num_tokens tokens (default: the tokens it has)."""
        return self.num_free_blocks >= self.blocks_to_append(seq, num_tokens)

    def blocks_to_append(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """The free blocks may_append(seq, num_tokens) takes."""
        num_blocks = seq.num_blocks if num_tokens is None else self.blocks_needed(num_tokens)
        return max(num_blocks - len(seq.block_table), 0)

    def may_append(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Grow seq's block table to hold num_tokens tokens (default: the tokens it has)."""
        start = len(seq.block_table)
        for _ in range(self.blocks_to_append(seq, num_tokens)):
            seq.block_table.append(self._take_free_block())
        if len(seq.block_table) > start:
            self.tables.write(seq, start)

    # -- after a step -------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Register the hashes of seq's blocks whose K/V is now fully computed.

        Hashes are published only once the K/V is really in the cache: a block hashed at allocation
        could be hit by another sequence before (or, with chunked prefill, several steps before) its
        K/V has been written. They go to the table of the forward that computed them, and only if no step of seq
        ran another forward since its allocation (commit follows the step it is for: with steps run ahead, a forward
        change in between also stops the publication, which costs a cache entry, never a wrong hit).
        """
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_hashed_blocks
        if num_full <= start:
            return  # no block filled up since the last commit (most decode steps)
        if seq.forward_epoch != self.forward_epoch:
            return  # part of its K/V comes from another forward: it matches no forward's cache
        key = self._key(seq)
        table = self.hash_to_block_id if key is None else self.forward_tables.setdefault(key, {})
        prefix_hash = self.blocks[seq.block_table[start - 1]].hash if start else -1
        for index in range(start, num_full):
            block = self.blocks[seq.block_table[index]]
            token_ids = seq.block(index)
            block.hash = chain_hash(token_ids, prefix_hash)
            block.token_ids = token_ids
            block.forward = key
            table[block.hash] = block.block_id
            prefix_hash = block.hash
        seq.num_hashed_blocks = num_full

    def forget_cached_prefixes(self) -> None:
        """Make every cached block unreachable, whatever forward computed it (its K/V stays until the block is
        reused): for a benchmark whose every run must prefill its whole prompts. Needs an idle engine."""
        if self.used_block_ids:
            raise RuntimeError("forget_cached_prefixes needs an idle engine: some blocks are still held")
        for block in self.blocks:
            block.hash = -1
            block.token_ids = []
            block.forward = None
        self.hash_to_block_id.clear()
        self.forward_tables.clear()

    def check_invariants(self, live: list[Sequence] = ()) -> None:
        """Assert every count of the manager against the live sequences (engine/invariants.py; tests, notebooks)."""
        check_block_invariants(self, live)
