"""The persistent block-table array (`BlockTables`) against the Python lists it mirrors.

The block manager writes a sequence's row only when the sequence gains blocks and clears it when the blocks go
back; the model runner reads decode metadata from those rows. Checked two ways: random allocate / append /
free sequences on a bare block manager (rows equal the lists padded by hand after every operation, through
array growth, prefix sharing and row reuse), and the real engine under a tight KV budget (preemptions, chunked
prefill, the overlapped loop), where every decode step's metadata must equal the one rebuilt from the lists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoref import LLM, SamplingParams
from nanoref.engine.block_manager import BlockManager, BlockTables
from nanoref.engine.sequence import Sequence
from nanoref.utils.context import get_context, upload_arrays

from .helpers import new_sequence, prefill


def padded_by_hand(seqs: list[Sequence]) -> list[list[int]]:
    width = max(len(seq.block_table) for seq in seqs)
    return [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]


operations = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 1_000), st.integers(1, 40)), max_size=60
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(operations, st.sampled_from([1, 2, 4]))
def test_rows_mirror_the_lists_under_random_operations(ops, block_size):
    manager = BlockManager(num_blocks=48, block_size=block_size)
    manager.tables = BlockTables(num_rows=1, num_cols=1)  # tiny: every run grows it in both directions
    live: list[Sequence] = []
    for op, pick, size in ops:
        if op == "add":  # prompts over a 2-token alphabet share prefixes: prefix-cache hits share blocks
            seq = new_sequence([(pick >> i) & 1 for i in range(size)], block_size)
            if manager.can_allocate(seq):
                manager.allocate(seq)
                prefill(manager, seq)  # publishes its full blocks' hashes
                live.append(seq)
        elif op == "grow" and live:  # decode: a few more tokens, a new block each time one fills up
            seq = live[pick % len(live)]
            for _ in range(size % 5):
                seq.append_token(pick & 1)
                if not manager.can_append(seq):
                    break
                manager.may_append(seq)
        elif op == "free" and live:  # finish or preemption: the row goes back
            seq = live.pop(pick % len(live))
            manager.deallocate(seq)
            assert seq.table_row == -1
        manager.check_invariants(live)
        if live:
            assert manager.tables.padded(live).tolist() == padded_by_hand(live)
    for seq in live:
        manager.deallocate(seq)
    assert not manager.tables.num_blocks.any() and (manager.tables.array == -1).all()
    assert sorted(manager.tables.free_rows) == list(range(manager.tables.array.shape[0]))


def test_a_freed_row_is_reused_and_cleared():
    manager = BlockManager(num_blocks=8, block_size=2)
    a, b = (new_sequence(list(range(n)), block_size=2) for n in (5, 2))
    manager.allocate(a)
    manager.deallocate(a)
    manager.allocate(b)
    assert b.table_row == 0 and manager.tables.array[0, :4].tolist() == [b.block_table[0], -1, -1, -1]


def decode_metadata_by_hand(seqs: list[Sequence], block_size: int, ahead: int) -> dict[str, list]:
    """What a decode step must see, from the Python lists alone (the pre-array prepare_decode)."""
    lens = [seq.num_tokens + ahead for seq in seqs]
    slots = [seq.block_table[(n - 1) // block_size] * block_size + (n - 1) % block_size for seq, n in zip(seqs, lens)]
    return dict(context_lens=lens, slot_mapping=slots, block_tables=padded_by_hand(seqs))


def manager_hits(llm: LLM) -> int:
    return llm.scheduler.block_manager.num_hit_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_metadata_equals_the_lists_under_preemption(tiny_model, monkeypatch, overlap):
    llm = LLM(
        tiny_model,
        device="cpu",
        kvcache_block_size=16,
        num_kvcache_blocks=8,  # tight: running sequences preempt each other
        max_num_seqs=5,
        max_num_batched_tokens=40,  # long prompts are chunked
        overlap_scheduling=overlap,
    )
    runner = llm.model_runner
    prepare_decode, upload = runner.prepare_decode, runner.upload
    checked, decoding = [], []

    def recording_prepare_decode(seqs, ahead=False):
        decoding.append((seqs, ahead))
        return prepare_decode(seqs, ahead)

    def checking_upload(step, next_ids=None):
        input_ids, positions = upload(step, next_ids)
        if step.is_prefill:
            return input_ids, positions
        seqs, ahead = decoding.pop()
        assert ahead == (next_ids is not None)
        context = get_context()
        got = dict(
            context_lens=context.context_lens.tolist(),
            slot_mapping=context.slot_mapping.tolist(),
            block_tables=context.block_tables.tolist(),
        )
        assert got == decode_metadata_by_hand(seqs, runner.block_size, int(ahead))
        assert positions.tolist() == [n - 1 for n in got["context_lens"]]
        if next_ids is None:
            assert input_ids.tolist() == [seq.last_token for seq in seqs]
        assert context.block_tables.dtype == torch.int32 and context.slot_mapping.dtype == torch.int64
        checked.append(len(seqs))
        return input_ids, positions

    monkeypatch.setattr(runner, "prepare_decode", recording_prepare_decode)
    monkeypatch.setattr(runner, "upload", checking_upload)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 100, size=int(n)).tolist() for n in rng.integers(3, 60, size=9)]
    prompts[3] = prompts[1][:40] + prompts[3]  # a shared prefix: prefix-cache hits
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in rng.integers(10, 40, size=9)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0 and manager_hits(llm) > 0 and len(checked) > 10
    assert [len(o["token_ids"]) for o in outputs] == [p.max_tokens for p in params]
    manager = llm.scheduler.block_manager
    manager.check_invariants([])
    assert not manager.tables.num_blocks.any()


@given(sizes=st.lists(st.integers(min_value=1, max_value=37), min_size=1, max_size=6), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None, derandomize=True)
def test_uploaded_arrays_keep_their_values_and_start_16_byte_aligned(sizes, seed):
    """upload_arrays packs a step's arrays into one buffer; each view must start on a 16-byte boundary whatever the
    sizes before it (Triton compiles a kernel variant per pointer alignment: an offset that moves with the batch
    would compile new variants mid-run)."""
    rng = np.random.default_rng(seed)
    arrays = {f"a{i}": rng.integers(-1, 2**20, size=(size,) if i % 2 else (1, size)) for i, size in enumerate(sizes)}
    uploaded = upload_arrays(arrays, torch.device("cpu"))
    for name, array in arrays.items():
        tensor = uploaded[name]
        assert tensor.dtype == torch.int32 and tuple(tensor.shape) == array.shape
        assert np.array_equal(tensor.numpy(), array), name
        assert tensor.data_ptr() % 16 == 0, f"{name} starts at a misaligned address"
