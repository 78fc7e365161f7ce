"""The block manager's invariants, checked against the live sequences (by tests and notebooks, after any workload)."""

from __future__ import annotations

import numpy as np


def check_block_invariants(manager, live=()) -> None:
    """Every block's reference count is the number of live tables that hold it, each block is used or free (never
    both, never neither), every prefix-cache entry names a block holding that hash, and the tables' array mirrors
    every live table exactly."""
    refs = [0] * manager.num_blocks
    for seq in live:
        for block_id in seq.block_table:
            refs[block_id] += 1
    for block in manager.blocks:
        assert block.ref_count == refs[block.block_id], f"{block}: expected ref {refs[block.block_id]}"
        assert (block.ref_count > 0) == (block.block_id in manager.used_block_ids), f"{block} used/free mismatch"
    assert manager.used_block_ids.isdisjoint(manager.free_block_ids), "a block is both used and free"
    assert len(manager.used_block_ids) + len(manager.free_block_ids) == manager.num_blocks, "a block leaked"
    for forward, table in [(None, manager.hash_to_block_id), *manager.forward_tables.items()]:
        assert forward is None or table, f"an empty table is kept for {forward}"
        for h, block_id in table.items():
            block = manager.blocks[block_id]
            assert block.hash == h and block.forward == forward, f"stale hash entry for block {block_id}"
    for seq in live:  # the array mirrors every live table exactly
        row, count = seq.table_row, len(seq.block_table)
        assert row >= 0 and manager.tables.num_blocks[row] == count, f"{seq}: table row {row} out of date"
        assert manager.tables.array[row, :count].tolist() == seq.block_table, f"{seq}: table row {row} differs"
    rows = {seq.table_row for seq in live}
    assert len(rows) == len(live) and rows.isdisjoint(manager.tables.free_rows), "a table row is shared or free"
    held = np.flatnonzero(manager.tables.num_blocks)
    assert set(held.tolist()) <= rows, "a table row is held by no live sequence"
