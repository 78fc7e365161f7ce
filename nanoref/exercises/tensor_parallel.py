"""Checks for notebook 08's exercise: the vocab-parallel embedding lookup, one rank's share.

The check runs the learner's function alone for the shards of small vocabularies split over 2 and 4 ranks (the
first shard, a middle one, the last one with its padding rows, a rank none of whose ids come up, tables padded
on every rank, so that the next rank's ids fall within the table's size, and padding of NaN, which an answer that
reads it and multiplies it by 0 keeps), then inside a real two-process engine (tensor_parallel_size=2, gloo on the
CPU), where every rank calls it, against HF. An all-reduce of the learner's own (or another collective, a process
group's method, a send) is named: one that runs raises (no process group here) and gets the hint; one under
`if dist.is_initialized()`, which runs in neither (nanoref's engine makes no default group), is found in the
function's source (`find_collective`, which reads it and its helpers' with `ast` without running them or changing
anything in the process).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import traceback
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoref.exercises.common import (
    ExerciseFailure,
    call_learner,
    check_generation,
    describe_location,
    input_generator,
    random_prompts,
    tiny_model,
)
from nanoref.exercises.tensors import refuse_nan
from nanoref.parallel.state import shard_range

# the engine check's model: a vocabulary that does not split evenly, so the last rank's table has a padding row
ENGINE_VOCAB = 251


def _shard_table(
    full: torch.Tensor, rank: int, world_size: int, generator: torch.Generator, spare: int = 0, nan: bool = False
) -> torch.Tensor:
    """Rank's rows of `full` as the engine allocates them: ceil(V / N) rows, the tail past its shard padding, and
    `spare` more padding rows on every rank (as when each shard is padded for alignment): then the ids of the next
    rank fall within the table's size, and only [vocab_start, vocab_end) tells them apart. The padding holds noise,
    not zeros (`nan`: NaN, as an uninitialised table may): no id maps to it, so a right answer never reads it, and
    one that reads it and multiplies it by 0 keeps NaN there."""
    vocab, hidden = full.shape
    start, end = shard_range(vocab, rank, world_size)
    rows = -(-vocab // world_size) + spare
    table = torch.randn(rows, hidden, generator=generator).to(full.dtype)
    if nan:
        table.fill_(float("nan"))
    table[: end - start] = full[start:end]
    return table


# the last names of torch.distributed's collectives (all_reduce, all_gather_into_tensor, reduce_scatter_tensor ...),
# of its functional ones (funcol.all_reduce, all_gather_tensor ...) and of a ProcessGroup's methods (pg.allreduce,
# allgather_into_tensor, alltoall_base ...), compared with their underscores left out; and its point-to-point sends
_COLLECTIVE_PREFIXES = ("allreduce", "allgather", "reducescatter", "alltoall")
_COLLECTIVE_NAMES = ("broadcast", "broadcast_object_list", "isend", "irecv", "batch_isend_irecv")
# torch.distributed's collectives and sends whose names others share (torch.gather, functools.reduce, a socket's
# send): found as its only, or as a method of a process group (`pg.send`, `group.reduce`, `get_tp_group().gather`)
_DIST_NAMES = (
    "reduce", "gather", "scatter", "gather_object", "scatter_object_list", "send", "recv", "send_object_list",
    "recv_object_list",
)  # fmt: skip


def _called(call: ast.Call, aliases: dict[str, str], env: dict) -> str:
    """What `call` calls, its first name resolved: `dist.all_reduce` (dist a module of the globals, `env`), `ar` (an
    alias of torch.distributed.all_reduce) and `getattr(dist, "all_reduce")` read torch.distributed.all_reduce."""
    func, args = call.func, call.args
    if isinstance(func, ast.Name) and func.id == "getattr" and len(args) > 1 and isinstance(args[1], ast.Constant):
        path = f"{ast.unparse(args[0])}.{args[1].value}"
    else:
        path = ast.unparse(func) if isinstance(func, (ast.Name, ast.Attribute)) else ""
    head, dot, rest = path.partition(".")
    value = env.get(head)
    if head in aliases:  # (imported inside the function)
        head = aliases[head]
    elif isinstance(value, types.ModuleType):
        head = value.__name__
    elif isinstance(value, types.FunctionType) and value.__module__.startswith("torch.distributed"):
        head = f"{value.__module__}.{value.__name__}".replace(".distributed_c10d", "")
    return head + dot + rest


def find_collective(fn: Callable) -> tuple[str, str] | None:
    """(the collective, where: 'your cell, line 7, in helper') for a torch.distributed collective called in the source
    of `fn` or of the functions (and classes' methods) of its own module or notebook that it names; None where there
    is none, or no source to read. Read, not run: one under `if dist.is_initialized()` is found too."""
    todo = [inspect.unwrap(fn)]
    home, env = getattr(todo[0], "__module__", None), getattr(todo[0], "__globals__", {})  # the learner's module
    for obj in todo:  # (todo grows as the loop reads it)
        try:
            lines, start = inspect.getsourcelines(obj)
            nodes = list(ast.walk(ast.parse(textwrap.dedent("".join(lines)))))
        except (OSError, TypeError, SyntaxError):
            continue  # (no source to read: a lambda of exec'd code)
        aliases: dict[str, str] = {}  # `import torch.distributed as tdist`, `from ... import all_reduce as ar`
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                prefix = f"{node.module}." if isinstance(node, ast.ImportFrom) else ""
                aliases.update({alias.asname or alias.name: prefix + alias.name for alias in node.names})
        owner = {  # each node's innermost function (ast.walk reaches the outer ones first)
            inner: getattr(node, "name", "<lambda>")
            for node in nodes
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for inner in ast.walk(node)
        }
        for node in nodes:
            called = _called(node, aliases, env) if isinstance(node, ast.Call) else ""
            owner_path, _, name = called.rpartition(".")
            name = name.lstrip("_")
            on_group = re.search(r"(group|pg)\W*$", owner_path.lower()) is not None  # (pg, tp_group, get_group())
            dist_only = name in _DIST_NAMES and (called.startswith("torch.distributed.") or on_group)
            if name.replace("_", "").startswith(_COLLECTIVE_PREFIXES) or name in _COLLECTIVE_NAMES or dist_only:
                where = (inspect.getfile(obj), start + node.lineno - 1, owner.get(node, obj.__name__))
                return called, describe_location(traceback.FrameSummary(*where))
            named = env.get(node.id) if isinstance(node, ast.Name) else None
            ours = isinstance(named, type) and named.__module__ == home  # a class of the learner's: its methods
            for member in vars(named).values() if ours else [named]:
                value = getattr(member, "__func__", member)  # (a staticmethod's or classmethod's function)
                value = inspect.unwrap(value) if isinstance(value, types.FunctionType) else value
                if isinstance(value, types.FunctionType) and value.__module__ == home and value not in todo:
                    todo.append(value)  # (a helper of the learner's: read once)
    return None


_NO_ALL_REDUCE = (
    "return this rank's share only, with no all-reduce (not even under `if dist.is_initialized()`): "
    "the engine's embedding all-reduces what every rank's vocab_parallel_embed returns"
)


def _index_hint(table: torch.Tensor, start: int, end: int) -> Callable[[Exception], str | None]:
    def hint(error: Exception) -> str | None:
        if "process group" in str(error).replace("ProcessGroup", "process group"):  # a collective in the answer
            return _NO_ALL_REDUCE
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
    collective: tuple[str, str] | None = None,
    nan: bool = False,
) -> torch.Tensor:
    """The learner's output for one rank, checked against the rows that rank must produce; returns it. `collective`:
    what find_collective found in the learner's code, a failure once the call returns; `nan`: padding rows of NaN."""
    vocab, hidden = full.shape
    start, end = shard_range(vocab, rank, world_size)
    table = _shard_table(full, rank, world_size, generator, spare, nan)
    padding = table.shape[0] - (end - start)
    case = (
        f"rank {rank} of {world_size} (vocabulary {vocab}, ids {start}..{end - 1}, a table of {table.shape[0]} rows"
        + (f", the last {padding} of them padding" + (" holding NaN" if nan else "") if padding else "")
        + f", {table.dtype})"
    )
    ids_before, table_before = ids.clone(), table.clone()
    got = call_learner(
        fn, "vocab_parallel_embed", ids, table, start, end, case=case, hint=_index_hint(table, start, end)
    )
    if collective is not None:  # (it ran: an all-reduce where no process group is set up raised, named above)
        name, where = collective
        raise ExerciseFailure(f"your vocab_parallel_embed calls {name} ({where}): {_NO_ALL_REDUCE}")
    same_table = torch.allclose(table, table_before, rtol=0, atol=0, equal_nan=True)  # (padding may be NaN)
    if not torch.equal(ids, ids_before) or not same_table:
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
    mine = (ids >= start) & (ids < end)  # (N,)
    read_padding = got.isnan().any(dim=-1) & ~mine  # (N,): another rank's id whose row came out NaN
    if nan and bool(read_padding.any()):
        row = int(read_padding.nonzero()[0])
        raise ExerciseFailure(
            f"row {row} (id {int(ids[row])}, another rank's) is NaN: you looked it up in a padding row and multiplied "
            "by 0, but padding may hold anything (here NaN, as torch.empty may) and NaN * 0 is NaN\nSend other ranks' "
            "ids to row 0, or zero their rows with torch.where(mine[:, None], rows, 0), which never uses what it drops"
            f"\n{case}"
        )
    refuse_nan(got, f"{case}: vocab_parallel_embed's result")
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
    collective = find_collective(fn)  # (an all-reduce under `if dist.is_initialized()` would run in no call here)
    # (vocabulary, ranks, dtype, padding rows beyond the engine's on every rank, padding of NaN)
    for vocab, world_size, dtype, spare, nan in (
        (11, 2, torch.float32, 0, False),
        (11, 4, torch.bfloat16, 0, False),
        (10, 4, torch.float32, 0, False),
        (10, 2, torch.float32, 3, False),
        (10, 2, torch.float32, 2, True),  # last: an answer that reads padding and multiplies it by 0 fails here
    ):
        full = torch.randn(vocab, hidden, generator=generator).to(dtype)  # (V, hidden): the whole table
        # every id once (both ends of every shard), then some random ones
        ids = torch.cat(
            [torch.randperm(vocab, generator=generator), torch.randint(0, vocab, (5,), generator=generator)]
        )
        total = torch.zeros(len(ids), hidden, dtype=torch.float32)
        for rank in range(world_size):
            total += _check_one(fn, full, ids, rank, world_size, generator, spare, collective, nan).float()
            # a rank none of whose ids come up: the ids of one other rank only
            other_start, other_end = shard_range(vocab, (rank + 1) % world_size, world_size)
            if other_end > other_start:
                others = torch.randint(other_start, other_end, (4,), generator=generator)
                _check_one(fn, full, others, rank, world_size, generator, spare, collective, nan)
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
