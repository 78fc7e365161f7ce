"""Every block table mirrored in one persistent array, a row per sequence holding blocks.

The model runner reads a decode step's padded tables from it with one numpy index, instead of re-padding every
sequence's Python list every step; the block manager writes a row only when its sequence gains or gives back blocks.
"""

from __future__ import annotations

import numpy as np

from nanoref.engine.sequence import Sequence


class BlockTables:
    """Every sequence's block table as a row of one persistent int32 array, padded with -1.

    The block manager writes a row only when its sequence gains blocks (`write`, from allocate and may_append)
    and clears it when the sequence gives them back (`release`, on finish, preemption or abort); the row is then
    free for the next sequence. `seq.block_table` stays the list everything else reads; this is its mirror for
    the per-step metadata: a decode step's tables are `array[rows, :width]`, one numpy index for the whole batch.
    The array grows (doubling) when it runs out of rows or columns.
    """

    def __init__(self, num_rows: int = 8, num_cols: int = 8) -> None:
        self.array = np.full((num_rows, num_cols), -1, dtype=np.int32)  # (rows, max blocks per sequence)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)  # (rows,): how many entries of each row are set
        self.free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: lowest row first

    def _grow(self, num_rows: int, num_cols: int) -> None:
        old_rows, old_cols = self.array.shape
        array = np.full((num_rows, num_cols), -1, dtype=np.int32)
        array[:old_rows, :old_cols] = self.array
        self.array = array
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(num_rows - old_rows, dtype=np.int64)])
        self.free_rows = list(range(num_rows - 1, old_rows - 1, -1)) + self.free_rows

    def write(self, seq: Sequence, start: int = 0) -> None:
        """Copy seq.block_table[start:] into seq's row (taking a free row first if seq has none)."""
        if seq.table_row < 0:
            if not self.free_rows:
                self._grow(2 * self.array.shape[0], self.array.shape[1])
            seq.table_row = self.free_rows.pop()
            start = 0
        end = len(seq.block_table)
        if end > self.array.shape[1]:
            self._grow(self.array.shape[0], max(end, 2 * self.array.shape[1]))
        self.array[seq.table_row, start:end] = seq.block_table[start:end]
        self.num_blocks[seq.table_row] = end

    def release(self, seq: Sequence) -> None:
        """seq gave its blocks back: clear its row and free it."""
        if seq.table_row < 0:
            return
        self.array[seq.table_row, : self.num_blocks[seq.table_row]] = -1
        self.num_blocks[seq.table_row] = 0
        self.free_rows.append(seq.table_row)
        seq.table_row = -1

    def padded(self, seqs: list[Sequence]) -> np.ndarray:
        """(len(seqs), width) int32: each sequence's row, width = the longest table among them, -1 padded."""
        rows = np.fromiter((seq.table_row for seq in seqs), dtype=np.int64, count=len(seqs))
        width = int(self.num_blocks[rows].max())
        return self.array[rows, :width]
