"""The model runner as one rank of several: the plain runner plus a broadcast of each step, and the followers' loop.

Rank 0 prepares every step as usual (`prepare_prefill` / `prepare_decode`), sends the host inputs to the other
ranks right before uploading them (`upload`), and runs its shard; each follower receives the same inputs, uploads
them and runs its shard (`serve`); the layers' all-reduces meet in the middle. The core runner
(`nanoref/engine/model_runner.py`) knows none of this: only the layers do, through `parallel/state.py`.
"""

from __future__ import annotations

import pickle
import traceback
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from nanoref.config import EngineConfig
from nanoref.engine.hooks import NO_RUNNER_HOOKS, RunnerHooks
from nanoref.engine.model_runner import ModelRunner, StepInputs
from nanoref.parallel.state import ParallelState, tensor_parallel
from nanoref.parallel.tensor_parallel import (
    CLOSED,
    TensorParallelError,
    rank_device,
    receive,
    receive_next_ids,
    start_tensor_parallel,
)
from nanoref.utils.seams import TRITON_SEAMS, replace_active


class TensorParallelRunner(ModelRunner):
    def __init__(
        self,
        config: EngineConfig,
        parallel: ParallelState | None = None,
        build: Callable[..., ModelRunner] | None = None,
        hooks: RunnerHooks = NO_RUNNER_HOOKS,
    ) -> None:
        """parallel: this process's rank, for a follower; None on rank 0, which starts (or, under torchrun, joins)
        the other ranks, each of which makes its runner with build(config, parallel=its state)."""
        self.followers = None
        if parallel is None:
            parallel, self.followers = start_tensor_parallel(config, build or TensorParallelRunner)
            if self.followers is not None:  # an engine dropped without close(), or the end of the script
                weakref.finalize(self, self.followers.close)
        self.parallel = parallel
        self.rank, self.world_size = parallel.rank, parallel.world_size
        device = rank_device(config, self.rank)
        if self.rank > 0 and device.type == "cuda":
            torch.cuda.set_device(device)  # a follower's process: its collectives run on its own GPU
        try:
            with tensor_parallel(parallel):  # the layers build (and later run) this rank's shard
                super().__init__(config, device, hooks)
            with self._joining():  # every rank has built its runner: one that failed fails LLM(...), not its first step
                parallel.group.barrier()
        except BaseException:
            self.close_after_failure("rank 0 failed while building the engine")
            raise
        if self.followers is not None and "triton" not in self.backend.name:
            self.followers.unused_seams = TRITON_SEAMS  # (their functions need not, or cannot, travel)

    def count_kv_blocks(self) -> int:
        """One block table serves every rank: each holds the fewest blocks any rank has room for."""
        count = torch.tensor([super().count_kv_blocks()])
        with self._joining():
            self.parallel.group.all_reduce(count, dist.ReduceOp.MIN)
        return int(count)

    # -- rank 0 ---------------------------------------------------------------------------------
    def upload(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Send the step to the other ranks (from rank 0), then upload it here."""
        if self.followers is not None:
            self.followers.send_step(step, input_ids)
        return super().upload(step, input_ids)

    def launch(self, seqs, is_prefill, input_ids=None) -> torch.Tensor:
        with self._collective():
            return super().launch(seqs, is_prefill, input_ids)

    def _joining(self):
        """Around a collective while the ranks build their runners (see Followers.joining)."""
        return self.followers.joining() if self.followers is not None else nullcontext()

    def _collective(self):
        """Around rank 0's part of anything every rank runs together (see Followers.guard)."""
        return self.followers.guard() if self.followers is not None else nullcontext()

    def run_on_all_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(runner, *args) on every rank's model runner -> the results, by rank. fn and args travel by value
        (cloudpickle: a lambda or a notebook's function works); the results must pickle. One that cannot be sent is
        a TypeError before anything is sent; fn raising on any rank raises here (a follower's error as a
        TensorParallelError with its traceback), after every rank has finished: the engine keeps serving."""
        with self._collective():
            if self.followers is not None:
                self.followers.call(fn, args)
            error, gathered = self._call_here(lambda: fn(self, *args))
        if error is not None:
            raise error
        for rank, (kind, value) in enumerate(gathered):
            if kind == "error":
                name = getattr(fn, "__qualname__", repr(fn))
                raise TensorParallelError(f"run_on_all_ranks({name}) raised on rank {rank}:\n{value}")
        return [value for _, value in gathered]

    def close(self) -> None:
        """Stop the other ranks and close the engine's groups."""
        if self.followers is not None:
            self.followers.close()

    def close_after_failure(self, reason: str) -> None:
        if self.followers is not None:  # they wait in a collective this rank will never join
            self.followers.shutdown(reason)

    # -- ranks 1..N-1 ---------------------------------------------------------------------------
    def serve(self) -> None:
        """A follower's life: run each step rank 0 sends, until it says exit; then meet rank 0 at the group's last
        barrier (no rank tears its connections down while another still uses them) and close this rank's groups."""
        group = self.parallel.group
        while True:
            message = receive(group)
            kind = message[0]
            if kind == "exit":
                group.barrier()
                group.close(CLOSED)
                return
            if kind == "step":
                _, step, num_next_ids = message
                next_ids = None if num_next_ids is None else receive_next_ids(group, num_next_ids, self.device)
                self.run_forward([], step, next_ids, self.decode_graphs)  # rank 0 alone gets the logits
            elif kind == "call":
                self._call_here(partial(_run_call, self, message[1]))
            elif kind == "seams":  # rank 0 entered or left a `use(...)` block of exercise functions
                replace_active(pickle.loads(message[1]))

    def _call_here(self, run: Callable[[], Any]) -> tuple[Exception | None, list[tuple[str, Any]] | None]:
        """Run one call on this rank and gather every rank's outcome to rank 0: ("ok", result) or ("error", its
        traceback). An error is gathered like a result, so every rank still meets rank 0 and the ranks stay in
        step. Rank 0 keeps its own error (the exception itself) -> (it, the outcomes by rank); the others None."""
        error = None
        try:
            outcome: tuple[str, Any] = ("ok", run())
            payload = pickle.dumps(outcome) if self.rank > 0 else b""  # (rank 0's result stays here)
        except Exception as raised:
            error = raised if self.rank == 0 else None
            payload = pickle.dumps(("error", f"{type(raised).__name__}: {raised}\n{traceback.format_exc()}"))
            outcome = ("error", None)
        parts = self.parallel.group.gather_bytes(payload)
        if parts is None:
            return None, None
        return error, [outcome] + [pickle.loads(part) for part in parts[1:]]


def _run_call(runner: TensorParallelRunner, payload: bytes) -> Any:
    """A follower's part of run_on_all_ranks: the function and its arguments as rank 0 pickled them."""
    fn, args = pickle.loads(payload)
    return fn(runner, *args)
