"""Checks for notebook 01's exercise: `prefill_metadata`, a prefill step's flat inputs."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import torch

from nanoref.engine.step_inputs import prefill_metadata
from nanoref.exercises.common import ExerciseFailure, call_learner, check_generation, random_prompts

_INPUTS = ("token_ids", "num_cached", "num_new", "block_tables")
_FIELDS = ("input_ids", "positions", "cu_seqlens_q", "cu_seqlens_k", "slot_mapping")


def _as_list(value: object, name: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ExerciseFailure(f"{name} should be 1-D, got shape {tuple(value.shape)}")
        return value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ExerciseFailure(f"{name} should be a list of ints, got {type(value).__name__}")
    return list(value)


def _case(rng: random.Random, block_size: int, num_blocks: int):
    """A step of 4 sequences: fresh prompts, prefix-cache hits (whole blocks) and mid-prompt chunks. The later
    chunk always stops short of the sequence's end (tokens after it that this step does not compute), so keys counted
    as len(token_ids[b]) instead of num_cached[b] + num_new[b] fail on every seed; it starts mid-block, so a slot offset
    counted from the chunk's start instead of the token's position fails on every seed too."""
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered blocks, as after a while of serving
    token_ids, num_cached, num_new, block_tables = [], [], [], []
    for kind in ("fresh", "prefix hit", "later chunk", "fresh"):
        length = rng.randint(block_size + 3, 4 * block_size - 1)
        cached = 0
        if kind == "prefix hit":
            cached = block_size * rng.randint(1, (length - 1) // block_size)
        elif kind == "later chunk":  # starting mid-block, as a chunk cut by the token budget does
            cached = rng.choice([c for c in range(3, length - 1) if c % block_size])
        new = length - cached if kind != "later chunk" else rng.randint(1, length - cached - 1)
        token_ids.append([rng.randrange(1, 256) for _ in range(length)])
        num_cached.append(cached)
        num_new.append(new)
        blocks = (length + block_size - 1) // block_size
        block_tables.append([free.pop() for _ in range(blocks)])
    return token_ids, num_cached, num_new, block_tables


def _hint(field: str, index: int, got: int, want: int, case: tuple, block_size: int) -> str:
    token_ids, num_cached, num_new, block_tables = case
    if field in ("cu_seqlens_q", "cu_seqlens_k"):
        seq = index - 1
        where = f"row {index} of {field} is {got}, expected {want}"
        if index == 0:
            return f"{where}: cu_seqlens starts with a 0"
        # the rows before matched, so the learner's step for this sequence is got minus the row before
        if field == "cu_seqlens_q":
            before, want_step = sum(num_new[:seq]), num_new[seq]
        else:
            before, want_step = sum(num_cached[:seq]) + sum(num_new[:seq]), num_cached[seq] + num_new[seq]
        step = got - before
        rule = (
            f"cu_seqlens_q[{seq} + 1] = cu_seqlens_q[{seq}] + num_new[{seq}]"
            if field == "cu_seqlens_q"
            else f"cu_seqlens_k[{seq} + 1] = cu_seqlens_k[{seq}] + num_cached[{seq}] + num_new[{seq}]"
        )
        cached = num_cached[seq]
        counts = f"\nsequence {seq} has {cached} cached and {num_new[seq]} new tokens; yours adds {step}"
        if field == "cu_seqlens_q" and cached and step == want_step + cached:
            return f"{where}: cu_seqlens_q adds up the new tokens only: cached tokens are not recomputed" + counts
        if field == "cu_seqlens_k" and cached and step == want_step - cached:
            return f"{where}: did you count the prefix-cached tokens? {rule}" + counts
        if field == "cu_seqlens_k" and step == len(token_ids[seq]) != want_step:
            return (
                f"{where}: keys run to the end of this step's chunk, num_cached + num_new, not len(token_ids[b]): "
                f"sequence {seq}'s tokens after the chunk are computed by a later step" + counts
            )
        if before and got == want_step:
            return (
                f"{where}: {field} holds running totals, each row the one before plus this sequence's count, not "
                f"sequence {seq}'s own count ({want_step}): {rule}" + counts
            )
        if abs(step - want_step) == 1:
            return f"{where}: off by one: {rule}, {want_step} for sequence {seq}" + counts
        return f"{where}: {rule}, {want_step} for sequence {seq}" + counts
    seq, offset = 0, index
    while offset >= num_new[seq]:
        offset, seq = offset - num_new[seq], seq + 1
    position = num_cached[seq] + offset
    where = f"{field}[{index}] (sequence {seq}'s new token {offset}, at position {position}) is {got}, expected {want}"
    if field == "input_ids":
        return f"{where}: take token_ids[{seq}][num_cached : num_cached + num_new], skipping the cached tokens"
    if field == "positions":
        return f"{where}: positions count inside each sequence and continue after its {num_cached[seq]} cached tokens"
    return (
        f"{where}: the slot is block_tables[{seq}][{position} // {block_size}] * {block_size} + "
        f"{position} % {block_size} (its block tables are {block_tables[seq]})"
    )


def check_prefill_metadata(fn: Callable, *, seed: int = 0, engine: bool = True) -> None:
    """`fn(token_ids, num_cached, num_new, block_tables, block_size)` against nanoref's, then in the engine."""
    rng = random.Random(seed)
    for block_size in (4, 16):
        case = _case(rng, block_size, num_blocks=64)
        expected = prefill_metadata(*case, block_size)
        before = copy.deepcopy(case)
        result = call_learner(fn, "prefill_metadata", *case, block_size, case=f"block_size {block_size}")
        for name, given, original in zip(_INPUTS, case, before):
            if given != original:
                raise ExerciseFailure(
                    f"block_size {block_size}: your prefill_metadata changed its {name} argument in place; the engine "
                    "passes each sequence's own token_ids and block_table lists, so read the inputs and build new lists"
                )
        if not (isinstance(result, (tuple, list)) and len(result) == 5):
            raise ExerciseFailure(f"return 5 values {_FIELDS}, got {type(result).__name__}")
        for field, got, want in zip(_FIELDS, result, expected):
            got = _as_list(got, field)
            if len(got) != len(want):
                what = (
                    "N, the sum of num_new" if field in ("input_ids", "positions", "slot_mapping") else "num_seqs + 1"
                )
                raise ExerciseFailure(
                    f"block_size {block_size}: {field} has {len(got)} entries, expected {len(want)} ({what}); "
                    f"num_cached = {case[1]}, num_new = {case[2]}"
                )
            for index, (a, b) in enumerate(zip(got, want)):
                if a != b:
                    raise ExerciseFailure(f"block_size {block_size}: " + _hint(field, index, a, b, case, block_size))
    if engine:
        # shared prefixes (prefix-cache hits) and a small token budget (chunked prefill): keys run ahead of queries
        prefix = random_prompts(seed=99, lengths=[36], vocab=256)[0]
        prompts = [prefix + tail for tail in random_prompts(seed=100, lengths=[5, 11, 2], vocab=256)]
        prompts.append(random_prompts(seed=101, lengths=[7], vocab=256)[0])
        check_generation({"prefill_metadata": fn}, prompts=prompts, max_num_batched_tokens=24, kvcache_block_size=16)
