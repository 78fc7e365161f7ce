"""Tensor parallelism: which rank this process is, and the few collectives the layers need.

Each of the N ranks holds 1/N of every big weight and runs the same forward on the same flat batch:
- column-parallel (qkv_proj, gate_up_proj): each rank computes its own heads / its own columns of the
  intermediate; nothing to exchange, the next op (attention per head, SwiGLU per column) is local;
- row-parallel (o_proj, down_proj): each rank multiplies its slice of the input features and holds a
  partial sum of the output; one all-reduce adds them up (two per decoder layer);
- vocab-parallel embedding and LM head: each rank holds 1/N of the vocabulary's rows; the embedding
  all-reduces (every token's row lives on exactly one rank), the head gathers the logits to rank 0.

With one rank (the default) every helper here is the identity and no process group exists. The model runner
builds its model inside `tensor_parallel(state)`; each layer keeps the state it was built with and passes it
to the collectives, so two engines in one process (one of them tensor-parallel) never mix their groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # the device's collectives: NCCL on CUDA, gloo on a CPU


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.world_size


@contextmanager
def tensor_parallel(state: ParallelState) -> Iterator[None]:
    """Build (and run) a model as rank `state.rank` of `state.world_size`."""
    global _state
    previous, _state = _state, state
    try:
        yield
    finally:
        _state = previous


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's equal share of `size` rows; the last shards are short when size does not divide."""
    per_rank = -(-size // world_size)  # ceil: every rank allocates the same shape
    start = min(rank * per_rank, size)
    return start, min(start + per_rank, size)


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum x over the ranks, in place (row-parallel outputs, the vocab-parallel embedding)."""
    if state.world_size > 1:
        dist.all_reduce(x, group=state.group)
    return x


def gather_last_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor | None:
    """Rank 0: every rank's x side by side along the last dim (the logits of the whole vocabulary); others: None."""
    if state.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.world_size)] if state.rank == 0 else None
    dist.gather(x, parts, dst=0, group=state.group)  # the group is the whole world: its rank 0 is global rank 0
    return torch.cat(parts, dim=-1) if parts is not None else None
