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
to the collectives, so two engines in one process never mix their groups.

Each tensor-parallel engine owns its ranks' communication: a `RankGroup` of process groups built on the engine's
own rendezvous store, never torch.distributed's default group (which a process has only one of). Two engines in
one process each have theirs, and closing one closes its group alone; a closed group refuses every collective.
"""

from __future__ import annotations

import multiprocessing.util
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
)

from nanoref.utils.tracing import trace


def end_follower_process(code: int) -> None:
    """End a follower rank's process (a spawned worker, a torchrun follower) at once, without the interpreter's
    teardown: after the group's last barrier a process that exits normally still aborts in C++ static destructors now
    and then ("terminate called without an active exception", exit code -6: about one time in five to twelve on this
    project's CPU machine, torch 2.13), which torchrun reports as a failed rank; and after an error, rank 0 may wait in
    a collective the group's teardown would join. Before it goes: its output flushed, and the named semaphores it made
    (tqdm's lock across processes, made by the weights' progress bar) unregistered from multiprocessing's resource
    tracker, as a normal exit would (otherwise the tracker warns of "leaked semaphore objects" at every
    tensor-parallel run's end). Those are multiprocessing's exit-time finalizers: its `_run_finalizers(0)`, the first
    thing its own exit handler runs."""
    try:
        multiprocessing.util._run_finalizers(0)  # noqa: SLF001 (multiprocessing's exit step, run before os._exit)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, or the engine's ranks can no longer run a step together."""


class CollectiveTimeout(TensorParallelError):
    """Rank 0 waited longer than the engine's timeout for the other ranks to join a collective."""


# how often rank 0, waiting for the other ranks, comes back to Python: Ctrl-C is delivered only between two waits
_POLL = timedelta(milliseconds=100)
_GLOO_SLACK_S = 5.0
# how long close() waits for the groups to go when a collective is still in flight (see RankGroup.close)
_DROP_WAIT_S = 2.0


class RankGroup:
    """One engine's ranks: its own process groups (gloo for CPU tensors, NCCL for CUDA ones on GPUs), made on its own
    rendezvous store. The collectives here call the groups directly, so nothing depends on (or touches)
    torch.distributed's default group.

    timeout_s: rank 0's bound on any one collective (the other ranks must join within it); gloo gets it too, a few
    seconds later, as the operation's own timeout. None on the other ranks: they wait for rank 0's next step as
    long as the user leaves the engine idle, and notice when rank 0 goes away (its connections close).
    Rank 0 waits in short slices, so Ctrl-C reaches it in the middle of a collective."""

    def __init__(self, rank: int, world_size: int, gloo: Any, nccl: Any = None, timeout_s: float | None = None):
        self.rank, self.world_size = rank, world_size
        self._gloo, self._nccl = gloo, nccl
        self.timeout_s = timeout_s
        # gloo's own bound, a little later than rank 0's: it only frees gloo's thread; the error is rank 0's
        self._timeout = None if timeout_s is None else timedelta(seconds=timeout_s + _GLOO_SLACK_S)
        self.closed: str | None = None  # why collectives are refused, once the group is closed
        # a collective left unfinished (rank 0 timed out, or was interrupted, waiting for it): gloo still runs it
        self._in_flight = False

    def close(self, reason: str, peers_gone: bool = False) -> None:
        """Drop this process's groups (their connections and listening socket close with them): every later
        collective raises `reason`.

        A group with a collective still in flight does not go at once: its destructor waits for gloo to end that
        collective, which takes until the other ranks join it, their connections close, or gloo's own timeout (up
        to tensor_parallel_timeout + 5 s). peers_gone: every other rank's process has ended (rank 0 killed its
        spawned workers), so gloo fails that collective at once and the groups go here. Otherwise (torchrun: a rank
        on another host may hang) they are dropped on a thread of their own, which close waits for a short while
        only: a hung peer leaves the thread behind, blocked until gloo gives up."""
        self.closed = self.closed or reason
        groups = [self._gloo, self._nccl]
        self._gloo = self._nccl = None
        if not self._in_flight or peers_gone:
            return
        dropping = threading.Thread(target=groups.clear, name="nanoref-tp-close", daemon=True)
        del groups  # the thread's list holds the last references: the destructors run there
        dropping.start()
        dropping.join(_DROP_WAIT_S)

    @contextmanager
    def bounded(self, timeout_s: float) -> Iterator[None]:
        """Within: rank 0 waits at most timeout_s (or its usual bound, if shorter) for each collective. For the
        exit handshake: idle followers answer in milliseconds, and one that does not is stopped, not waited for."""
        saved = self.timeout_s, self._timeout
        self.timeout_s = timeout_s if saved[0] is None else min(timeout_s, saved[0])
        self._timeout = timedelta(seconds=self.timeout_s + _GLOO_SLACK_S)
        try:
            yield
        finally:
            self.timeout_s, self._timeout = saved

    def abort(self) -> None:
        """Fail the pending NCCL work at once (kernels waiting for a dead rank would spin forever)."""
        if self._nccl is not None:
            self._nccl.abort()

    # -- running and waiting ------------------------------------------------------------------------
    def _run(self, x: torch.Tensor, collective: str, *args: Any) -> None:
        """Start `collective` on the group for x's device (the last of args is its options) and wait for it. No frame
        here keeps the group or its work once this returns or raises: a kept traceback (a notebook's last error)
        must not keep a closed group's sockets open."""
        if self.closed is not None:
            raise TensorParallelError(self.closed)
        on_nccl = x.is_cuda and self._nccl is not None
        bounded = self._timeout is not None and not on_nccl  # NCCL: wait() only orders the streams
        if bounded:
            args[-1].timeout = self._timeout
        work = getattr(self._nccl if on_nccl else self._gloo, collective)(*args)
        try:
            if bounded:
                self._wait(work)
            else:
                work.wait()
        except BaseException:
            self._in_flight = self._in_flight or not work.is_completed()
            raise
        finally:
            work = None

    def _wait(self, work: Any) -> None:
        """Rank 0's wait: in short slices (Ctrl-C is delivered between two), for at most timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    work.wait(_POLL)
                    return
                except RuntimeError:  # this slice timed out, or the collective itself failed
                    if work.is_completed():
                        work.wait()  # raises the collective's own error (or returns: it completed just now)
                        return
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(
                        f"the other tensor-parallel ranks did not join a collective within {self.timeout_s:g} s "
                        "(a rank hangs, or is much slower than rank 0: raise tensor_parallel_timeout if it is only "
                        "slow)"
                    )
        finally:
            work = None

    # -- collectives ----------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        options = AllreduceOptions()
        options.reduceOp = op
        self._run(x, "allreduce", [x], options)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> None:
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self._run(x, "broadcast", [x], options)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's x, by rank; the others: None."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        options = GatherOptions()
        options.rootRank = 0
        self._run(x, "gather", [parts] if parts is not None else [], [x], options)
        return parts

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._run(x, "allgather", [parts], [x], AllgatherOptions())
        return parts

    def barrier(self) -> None:
        self._run(torch.empty(0), "barrier", BarrierOptions())

    def broadcast_bytes(self, payload: bytes | None = None) -> bytes:
        """Rank 0's payload on every rank (rank 0 passes it, the others None): its length, then its bytes."""
        size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
        self.broadcast(size)
        data = torch.empty(int(size), dtype=torch.uint8)
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.broadcast(data)
        return payload if payload is not None else data.numpy().tobytes()

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Rank 0: every rank's payload, by rank; the others: None. (gloo gathers equal sizes: all are padded to
        the longest, whose length every rank learns first.)"""
        sizes = [int(size) for size in self.all_gather(torch.tensor([len(payload)], dtype=torch.int64))]
        padded = torch.zeros(max(*sizes, 1), dtype=torch.uint8)
        if payload:
            padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = self.gather(padded)
        if parts is None:
            return None
        return [part[:size].numpy().tobytes() for part, size in zip(parts, sizes)]


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    group: RankGroup | None = None  # the engine's own groups (None with one rank)


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


def all_reduce(x: torch.Tensor, state: ParallelState, stage: str = "all_reduce") -> torch.Tensor:
    """Sum x over the ranks, in place (row-parallel outputs, the vocab-parallel embedding). `stage` names the
    collective in a shape trace (`nanoref.trace_shapes`), so a trace shows where each all-reduce sits."""
    if state.world_size > 1:
        state.group.all_reduce(x)
        trace(stage, x=x)
    return x


def gather_last_dim(x: torch.Tensor, state: ParallelState, stage: str = "gather") -> torch.Tensor | None:
    """Rank 0: every rank's x side by side along the last dim (the logits of the whole vocabulary); others: None."""
    if state.world_size == 1:
        return x
    parts = state.group.gather(x.contiguous())
    if parts is None:
        return None
    gathered = torch.cat(parts, dim=-1)
    trace(stage, x=x, gathered=gathered)
    return gathered
