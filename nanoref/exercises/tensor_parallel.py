"""Checks for notebook 08's exercise: the vocab-parallel embedding lookup, one rank's share.

The check runs the learner's function alone for the shards of small vocabularies split over 2 and 4 ranks (the
first shard, a middle one, the last one with its padding rows, a rank none of whose ids come up, and tables padded
on every rank, so that the next rank's ids fall within the table's size), each call as that rank of a
torch.distributed default group that refuses collectives (an all-reduce of the learner's own, guarded or not, is
named), then inside a real two-process engine (tensor_parallel_size=2, gloo on the CPU), where every rank calls it,
against HF.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanoref.exercises.common import (
    ExerciseFailure,
    call_learner,
    check_generation,
    input_generator,
    random_prompts,
    tiny_model,
)
from nanoref.exercises.tensors import refuse_nan
from nanoref.parallel.state import shard_range

# the engine check's model: a vocabulary that does not split evenly, so the last rank's table has a padding row
ENGINE_VOCAB = 251


def _shard_table(
    full: torch.Tensor, rank: int, world_size: int, generator: torch.Generator, spare: int = 0
) -> torch.Tensor:
    """Rank's rows of `full` as the engine allocates them: ceil(V / N) rows, the tail past its shard padding, and
    `spare` more padding rows on every rank (as when each shard is padded for alignment): then the ids of the next
    rank fall within the table's size, and only [vocab_start, vocab_end) tells them apart. The padding holds noise,
    not zeros: no id maps to it, so a right answer never reads it."""
    vocab, hidden = full.shape
    start, end = shard_range(vocab, rank, world_size)
    rows = -(-vocab // world_size) + spare
    table = torch.randn(rows, hidden, generator=generator).to(full.dtype)
    table[: end - start] = full[start:end]
    return table


class _RefusingGroup(dist.ProcessGroup):
    """The default process group while the check calls the learner's function: it says it has the case's rank and
    world size (so `dist.is_initialized()` is True and `dist.get_world_size()` > 1, as in an engine built on
    torch.distributed's default group), and refuses every collective. An all-reduce guarded by
    `if dist.is_initialized()` then runs here, and fails naming the mistake, instead of passing the check alone and
    adding the ranks' rows up twice in such an engine (nanoref's own engine has groups of its own, so there the
    guard would hide it)."""

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"the check runs vocab_parallel_embed as rank {self.rank()} of a process group of {self.size()} ranks, "
            "and refuses collectives in it"
        )

    allreduce = allreduce_coalesced = allgather = _allgather_base = allgather_into_tensor_coalesced = _refuse
    broadcast = reduce = reduce_scatter = _reduce_scatter_base = reduce_scatter_tensor_coalesced = _refuse
    alltoall = alltoall_base = gather = scatter = barrier = send = recv = _refuse

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return _BACKEND


_BACKEND = "nanoref_exercise"


@contextlib.contextmanager
def _as_rank(rank: int, world_size: int) -> Iterator[None]:
    """Inside: torch.distributed's default group is a `_RefusingGroup` of `world_size` ranks, this process `rank`
    (left alone where a default group exists already, or torch.distributed is missing)."""
    if not dist.is_available() or dist.is_initialized():
        yield
        return
    if not hasattr(dist.Backend, _BACKEND.upper()):  # registered once per process
        make = lambda store, r, size, timeout: _RefusingGroup(r, size)  # noqa: E731
        dist.Backend.register_backend(_BACKEND, make, devices=["cpu"])
    # init_process_group wraps sys.excepthook (every later traceback's lines prefixed "[rankN]: ") and, where
    # TORCH_DIST_INIT_BARRIER=1, waits for the other ranks, which never come: neither outlives the call
    hook, barrier = sys.excepthook, os.environ.pop("TORCH_DIST_INIT_BARRIER", None)
    try:
        dist.init_process_group(_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    finally:
        if barrier is not None:
            os.environ["TORCH_DIST_INIT_BARRIER"] = barrier
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _index_hint(table: torch.Tensor, start: int, end: int) -> Callable[[Exception], str | None]:
    def hint(error: Exception) -> str | None:
        if "process group" in str(error).replace("ProcessGroup", "process group"):  # a collective in the answer
            return (
                "return this rank's share only, with no all-reduce (not even under `if dist.is_initialized()`): "
                "the engine's embedding all-reduces what every rank's vocab_parallel_embed returns"
            )
        if not isinstance(error, (IndexError, RuntimeError)) or "out of" not in str(error):
            return None  # not an index past the table (an index of the wrong dtype, a shape error)
        return (
            f"the table has {table.shape[0]} rows for ids {start}..{end - 1}: subtract vocab_start before the "
            "lookup; send other ranks' ids to a valid row, then zero them"
        )

    return hint


def _check_one(
    fn: Callable,
    full: torch.Tensor,
    ids: torch.Tensor,
    rank: int,
    world_size: int,
    generator: torch.Generator,
    spare: int = 0,
) -> torch.Tensor:
    """The learner's output for one rank, checked against the rows that rank must produce; returns it."""
    vocab, hidden = full.shape
    start, end = shard_range(vocab, rank, world_size)
    table = _shard_table(full, rank, world_size, generator, spare)
    padding = table.shape[0] - (end - start)
    case = (
        f"rank {rank} of {world_size} (vocabulary {vocab}, ids {start}..{end - 1}, a table of {table.shape[0]} rows"
        + (f", the last {padding} of them padding" if padding else "")
        + f", {table.dtype})"
    )
    ids_before, table_before = ids.clone(), table.clone()
    with _as_rank(rank, world_size):
        got = call_learner(
            fn, "vocab_parallel_embed", ids, table, start, end, case=case, hint=_index_hint(table, start, end)
        )
    if not torch.equal(ids, ids_before) or not torch.equal(table, table_before):
        raised = "input_ids" if not torch.equal(ids, ids_before) else "weight"
        raise ExerciseFailure(f"{case}: vocab_parallel_embed changed its {raised} in place; compute new tensors")
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailure(f"{case}: vocab_parallel_embed must return a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != (len(ids), hidden):
        raise ExerciseFailure(
            f"{case}: vocab_parallel_embed returned shape {tuple(got.shape)} for {len(ids)} ids, expected "
            f"{(len(ids), hidden)}: one row of the hidden size per id"
        )
    if got.dtype != table.dtype:
        raise ExerciseFailure(
            f"{case}: vocab_parallel_embed returned dtype {got.dtype}, expected {table.dtype} (the weight's dtype: "
            "did a mask in another dtype promote the result?)"
        )
    refuse_nan(got, f"{case}: vocab_parallel_embed's result")
    mine = (ids >= start) & (ids < end)  # (N,)
    want = torch.zeros(len(ids), hidden, dtype=table.dtype)
    want[mine] = full[ids[mine]]
    for row in range(len(ids)):
        if torch.equal(got[row], want[row]):
            continue
        token = int(ids[row])
        if not mine[row]:
            owner = max(r for r in range(world_size) if shard_range(vocab, r, world_size)[0] <= token)
            looked_up = next((j for j in range(table.shape[0]) if torch.equal(got[row], table[j])), None)
            if looked_up is not None and looked_up == token - start >= end - start:
                raise ExerciseFailure(
                    f"row {row} (id {token}, rank {owner}'s) holds padding row {looked_up}: test the ids against "
                    "[vocab_start, vocab_end), not the table's size (its rows from vocab_end - vocab_start on are "
                    f"padding)\n{case}"
                )
            others = ~mine & (ids != end)  # (N,): the other ranks' ids but vocab_end
            if token == end and others.any() and not got[others].any():  # only vocab_end taken for this rank's
                raise ExerciseFailure(
                    f"{case}: row {row} (id {token}) is not zero, but id {token} is vocab_end, the first id of rank "
                    f"{owner}: the range [vocab_start, vocab_end) excludes it (ids < vocab_end, not <=)"
                )
            if looked_up is None:
                hint = "zero the rows of ids outside [vocab_start, vocab_end)"
            else:
                what = "a padding row" if looked_up >= end - start else f"the row of id {start + looked_up}"
                hint = f"it holds table row {looked_up}, {what}" + (
                    ": sending other ranks' ids to the last row is harmless only where that row is zero padding, "
                    "and most ranks have none"
                    if looked_up == table.shape[0] - 1
                    else ""
                )
                hint += "; zero the rows of ids outside [vocab_start, vocab_end) explicitly"
            raise ExerciseFailure(
                f"{case}: row {row} (id {token}, which belongs to rank {owner}) is not zero. Rank {owner} "
                f"contributes that row and the all-reduce adds every rank's output, so this rank must add zeros: {hint}"
            )
        if not got[row].any():
            edge = " (vocab_start itself: the range includes it, ids >= vocab_start)" if token == start else ""
            raise ExerciseFailure(
                f"{case}: row {row} (id {token}) is zero, but id {token} is this rank's{edge}: look up "
                f"weight[id - vocab_start] for every id in [vocab_start, vocab_end)"
            )
        looked_up = next((j for j in range(table.shape[0]) if torch.equal(got[row], table[j])), None)
        if looked_up is not None:
            raise ExerciseFailure(
                f"{case}: row {row} (id {token}) holds table row {looked_up}"
                + (" (a padding row)" if looked_up >= end - start else "")
                + f", but this rank's row j holds id vocab_start + j, so id {token} is row {token - start}: "
                "subtract vocab_start from the ids before the lookup"
            )
        raise ExerciseFailure(
            f"{case}: row {row} (id {token}) differs from row {token - start} of this rank's table, which holds id "
            f"{token}: look up weight[id - vocab_start] for the ids in [vocab_start, vocab_end)"
        )
    return got


def check_vocab_parallel_embed(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn(input_ids, weight, vocab_start, vocab_end)` for each shard of small vocabularies split over 2 and 4 ranks
    (the ranks' outputs must add up to the whole table's lookup), then greedy generation with it in a two-process
    engine (every rank calls it) against HF transformers."""
    generator = input_generator(seed)
    hidden = 8
    # (vocabulary, ranks, dtype, padding rows beyond the engine's on every rank)
    for vocab, world_size, dtype, spare in (
        (11, 2, torch.float32, 0),
        (11, 4, torch.bfloat16, 0),
        (10, 4, torch.float32, 0),
        (10, 2, torch.float32, 3),
    ):
        full = torch.randn(vocab, hidden, generator=generator).to(dtype)  # (V, hidden): the whole table
        # every id once (both ends of every shard), then some random ones
        ids = torch.cat(
            [torch.randperm(vocab, generator=generator), torch.randint(0, vocab, (5,), generator=generator)]
        )
        total = torch.zeros(len(ids), hidden, dtype=torch.float32)
        for rank in range(world_size):
            total += _check_one(fn, full, ids, rank, world_size, generator, spare).float()
            # a rank none of whose ids come up: the ids of one other rank only
            other_start, other_end = shard_range(vocab, (rank + 1) % world_size, world_size)
            if other_end > other_start:
                others = torch.randint(other_start, other_end, (4,), generator=generator)
                _check_one(fn, full, others, rank, world_size, generator, spare)
        if not torch.equal(total.to(dtype), F.embedding(ids, full)):
            raise ExerciseFailure(
                f"the {world_size} ranks' outputs for a vocabulary of {vocab} do not add up to the whole table's rows"
            )
    if engine:
        model = tiny_model(vocab_size=ENGINE_VOCAB)
        prompts = random_prompts(seed=808, lengths=[5, 23, 17, 40], vocab=ENGINE_VOCAB)  # ids of both ranks
        check_generation(
            {"vocab_parallel_embed": fn}, model=model, prompts=prompts, device="cpu", tensor_parallel_size=2
        )
