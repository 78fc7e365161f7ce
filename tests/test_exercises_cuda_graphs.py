"""Notebook 06's exercise: its checker accepts nanoref's own padding and names each wrong answer's mistake."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams, exercises
from nanoref.cuda_graphs import pad_decode_batch
from nanoref.exercises import ExerciseFailure, check_pad_decode_batch

from .helpers import (
    Counting,
    assert_called_every_decode_step,
    assert_readable_failure,
    enable_bucketed_decode,
    hf_greedy,
    random_prompts,
)


def copies_without_padding(buffers, input_ids, positions, slot_mapping, context_lens, block_tables):
    batch, width = block_tables.shape
    for name, rows in [("input_ids", input_ids), ("positions", positions), ("slot_mapping", slot_mapping)]:
        buffers[name][:batch] = rows
    buffers["context_lens"][:batch] = context_lens
    buffers["block_tables"][:batch, :width] = block_tables


def pads_only_slots(buffers, *args):
    pad_decode_batch(buffers, *args)
    buffers["context_lens"][len(args[0]) :] = 7


def rebinds_a_buffer(buffers, *args):
    pad_decode_batch(buffers, *args)
    buffers["slot_mapping"] = buffers["slot_mapping"].clone()


def writes_the_whole_buffer(buffers, *args):
    pad_decode_batch(buffers, *args)
    buffers["block_tables"][:, :] = buffers["block_tables"].clone()  # harmless: stays inside the bucket


def returns_the_buffers(buffers, *args):
    pad_decode_batch(buffers, *args)
    return buffers


def pads_every_buffer_with_minus_one(buffers, *args):
    pad_decode_batch(buffers, *args)
    for name in ("input_ids", "positions"):
        buffers[name][len(args[0]) :] = -1  # -1 everywhere, as for the slots: not a valid index


def copies_all_columns(buffers, input_ids, positions, slot_mapping, context_lens, block_tables):
    pad_decode_batch(buffers, input_ids, positions, slot_mapping, context_lens, block_tables)
    buffers["block_tables"][: len(input_ids)] = block_tables  # the buffer is max_blocks wide, the step's W


def test_reference_passes_alone_and_in_the_engine():
    check_pad_decode_batch(pad_decode_batch)


def test_in_bucket_rewrite_is_accepted():
    check_pad_decode_batch(writes_the_whole_buffer, engine=False)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (copies_without_padding, "Padding rows need slot -1"),
        (pads_only_slots, "Padding rows need context length 0"),
        (rebinds_a_buffer, "never rebind it"),
        (returns_the_buffers, "in place and return None"),
    ],
)
def test_wrong_answers_are_named(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message):
        check_pad_decode_batch(wrong, engine=False)


def test_padding_ids_or_positions_of_minus_one_are_named_before_the_engine_runs():
    # they passed the check alone; the engine then failed with a bare "IndexError: index out of range in self"
    # (on a GPU a device-side assert, which ends the process)
    with pytest.raises(ExerciseFailure, match=r"padding row 5 has input_ids -1: .*token id \(embedding\)") as failure:
        check_pad_decode_batch(pads_every_buffer_with_minus_one, engine=False)
    assert_readable_failure(failure.value)


def test_block_tables_copied_at_the_buffers_width_are_told_the_columns():
    with pytest.raises(ExerciseFailure, match=r"(?s)raised RuntimeError.*\['block_tables'\]\[:B, :W\]") as failure:
        check_pad_decode_batch(copies_all_columns, engine=False)
    assert_readable_failure(failure.value)


def test_bucketed_decode_on_cpu_matches_hf_with_preemption(tiny_model):
    """The graphs' decode path (batches padded to buckets in static buffers) run eagerly on a CPU, under a KV
    budget tight enough to preempt, so batches shrink and padding rows hold what larger steps left behind; a
    learner's pad_decode_batch (here nanoref's own, counted) pads every decode step."""
    prompts = random_prompts(seed=66, lengths=[12, 30, 7, 21, 16])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=12, kvcache_block_size=16, max_num_seqs=8)
    enable_bucketed_decode(llm)
    padding = Counting(pad_decode_batch)
    with exercises.use(pad_decode_batch=padding):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_called_every_decode_step(llm, padding)
    assert llm.scheduler.num_preemptions > 0, "the budget should force preemptions"
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens)
