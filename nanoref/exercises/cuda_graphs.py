"""Checks for notebook 06's exercise: a decode batch padded into its CUDA-graph bucket's static buffers.

The check fills the buffers with what an earlier, larger step left there (live-looking slots, context lengths
and block ids), runs the learner's function on a bucket's views of them, and says what is wrong: a row not
copied, a padding row that would write into the cache or attend to something, a buffer replaced instead of
written (a graph replays on the recorded addresses), rows written past the bucket. Then the real engine runs
greedy generation with it, decode padded to buckets (`enable_bucketed_decode` in `nanoref/cuda_graphs.py`,
the graphs' path without the graphs, so it runs on a CPU too), against HF transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoref.cuda_graphs import STATIC_INPUTS, enable_bucketed_decode, pad_decode_batch
from nanoref.exercises.common import (
    ExerciseFailure,
    call_learner,
    check_generation,
    input_generator,
    random_prompts,
    tiny_model,
)


def _stale_buffers(max_rows: int, max_blocks: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Static buffers as a previous, full step left them: every row looks like a live sequence."""
    return dict(
        input_ids=torch.randint(0, 256, (max_rows,), generator=generator),
        positions=torch.randint(0, 64, (max_rows,), generator=generator),
        slot_mapping=torch.randint(0, 512, (max_rows,), generator=generator),
        context_lens=torch.randint(1, 64, (max_rows,), generator=generator, dtype=torch.int32),
        block_tables=torch.randint(0, 32, (max_rows, max_blocks), generator=generator, dtype=torch.int32),
    )


def _shape_hint(error: Exception) -> str | None:
    if not isinstance(error, RuntimeError) or "size" not in str(error):
        return None
    return (
        "the step has B rows and its block tables W columns, the bucket's buffers S >= B rows and max_blocks >= W "
        "columns: write into buffers[name][:B], and into buffers['block_tables'][:B, :W]"
    )


def check_pad_decode_batch(fn: Callable, *, engine: bool = True) -> None:
    """`fn(buffers, input_ids, positions, slot_mapping, context_lens, block_tables)` fills a bucket in place."""
    generator = input_generator()
    max_rows, max_blocks = 16, 6
    for batch, bucket, width in [(5, 8, 3), (8, 8, 6), (1, 1, 1), (9, 16, 2)]:
        full = _stale_buffers(max_rows, max_blocks, generator)
        before = {name: tensor.clone() for name, tensor in full.items()}
        addresses = {name: tensor.data_ptr() for name, tensor in full.items()}
        views = {name: full[name][:bucket] for name in STATIC_INPUTS}
        step = dict(
            input_ids=torch.randint(0, 256, (batch,), generator=generator),
            positions=torch.randint(0, 64, (batch,), generator=generator),
            slot_mapping=torch.randint(512, 1024, (batch,), generator=generator),
            context_lens=torch.randint(1, 64, (batch,), generator=generator, dtype=torch.int32),
            block_tables=torch.randint(32, 64, (batch, width), generator=generator, dtype=torch.int32),
        )
        where = f"(a batch of {batch} in a bucket of {bucket}, block tables {width} wide of {max_blocks})"
        returned = call_learner(
            fn, "pad_decode_batch", views, *(step[name] for name in STATIC_INPUTS), case=where, hint=_shape_hint
        )
        if returned is not None:
            raise ExerciseFailure(
                f"pad_decode_batch returned a {type(returned).__name__}: it must fill `buffers` in place and return "
                "None, because the recorded graph reads those buffers, never a return value"
            )
        for name in STATIC_INPUTS:
            if views[name].data_ptr() != full[name].data_ptr():
                raise ExerciseFailure(
                    f'buffers["{name}"] was replaced by a new tensor {where}: the graph replays on the addresses it '
                    "recorded, so write into the buffer (slice assignment or copy_), never rebind it"
                )
            if full[name].data_ptr() != addresses[name]:
                raise ExerciseFailure(f'buffers["{name}"] moved in memory {where}: write into it in place')
            if not torch.equal(full[name][bucket:], before[name][bucket:]):
                raise ExerciseFailure(
                    f'rows {bucket}.. of buffers["{name}"] changed {where}: only the bucket\'s own {bucket} rows '
                    "belong to this replay; the views you get are already the bucket's"
                )
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            got, want = full[name][:batch], step[name]
            if not torch.equal(got, want.to(got.dtype)):
                row = int((got != want.to(got.dtype)).nonzero()[0])
                raise ExerciseFailure(
                    f'buffers["{name}"][{row}] is {int(got[row])}, the step\'s {name}[{row}] is {int(want[row])} '
                    f"{where}: copy the batch's {batch} rows into the first {batch} rows"
                )
        got_tables = full["block_tables"][:batch, :width]
        if not torch.equal(got_tables, step["block_tables"]):
            row = int((got_tables != step["block_tables"]).any(dim=1).nonzero()[0])
            raise ExerciseFailure(
                f'buffers["block_tables"][{row}, :{width}] is {got_tables[row].tolist()}, expected '
                f"{step['block_tables'][row].tolist()} {where}: the step's tables are narrower than the buffer, "
                "so copy them into the first `width` columns"
            )
        slots = full["slot_mapping"][batch:bucket]
        if (slots != -1).any():
            row = batch + int((slots != -1).nonzero()[0])
            raise ExerciseFailure(
                f"padding row {row} has slot {int(full['slot_mapping'][row])} {where}: the replay stores its K/V "
                "there, over a live sequence's cache entry. Padding rows need slot -1 (the KV store skips those)"
            )
        for name in ("input_ids", "positions"):  # the replay embeds and rotates every row, padding rows too
            values = full[name][batch:bucket]
            if (values < 0).any():
                row = batch + int((values < 0).nonzero()[0])
                raise ExerciseFailure(
                    f"padding row {row} has {name} {int(full[name][row])}: the replay still looks up every row's "
                    "token id (embedding) and position (RoPE), so padding rows keep valid ones (what an earlier step "
                    f"left); only slot_mapping takes -1\n{where}"
                )
        lens = full["context_lens"][batch:bucket]
        if (lens != 0).any():
            row = batch + int((lens != 0).nonzero()[0])
            raise ExerciseFailure(
                f"padding row {row} has context length {int(full['context_lens'][row])} {where}: it would attend to "
                "blocks that belong to nobody (or to someone else). Padding rows need context length 0"
            )
    if engine:
        prompts = random_prompts(seed=606, lengths=[5, 23, 17, 40, 9], vocab=256)  # 5 rows: a bucket of 8
        check_generation(
            {"pad_decode_batch": fn},
            prompts=prompts,
            model=tiny_model(),
            prepare=lambda llm: enable_bucketed_decode(llm.model_runner),
            max_num_seqs=8,
        )


__all__ = ["check_pad_decode_batch", "pad_decode_batch"]
