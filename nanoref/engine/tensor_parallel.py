"""Tensor-parallel processes: rank 0 drives, ranks 1..N-1 follow.

Rank 0 runs the whole engine: requests, scheduler, block manager, sampler. The other ranks only run the
model. Every step, rank 0 broadcasts the step's flat inputs (the host arrays its own model runner is about
to upload: ids, positions, slots, cu_seqlens, block tables), every rank uploads them and runs the forward
with its share of the weights, the layers' all-reduces meet in the middle, and the logits are gathered to
rank 0 alone, which samples. The followers never see a `Sequence`.

Transport: torch.distributed only, one process group with two backends: gloo for CPU tensors (the step
messages, pickled) and, on GPUs, NCCL for CUDA tensors (the layers' collectives).

Two ways to start:
- `LLM(..., tensor_parallel_size=N)` in a plain process: this process is rank 0 and spawns N-1 workers on
  this host (`cuda:0` .. `cuda:N-1`). A `TCPStore` on port 0 lets the OS pick a free port; the workers
  learn it from their arguments, so two engines (or a stale one) never fight over a fixed port.
- `torchrun` (one host or many): every process runs the same script; the environment (`MASTER_ADDR`,
  `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`) is the rendezvous. Rank 0's `LLM(...)` returns and
  serves `generate`; on the other ranks `LLM(...)` follows rank 0 until it closes, then exits the process.

Failures: a worker that raises sends its traceback to rank 0 through a pipe and exits; rank 0's pending
collective fails (gloo notices the closed connection at once; for NCCL a monitor thread aborts the group)
and rank 0 raises the worker's error. Any error or Ctrl-C in the middle of a step stops the workers:
half a forward cannot be resumed, so the engine refuses further steps and says why.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanoref.utils import seams
from nanoref.utils.parallel import ParallelState

if TYPE_CHECKING:
    from nanoref.config import EngineConfig

# a follower waits for the next step for as long as the user leaves the engine idle: no short timeout on that
_GROUP_TIMEOUT = timedelta(days=7)
_STARTUP_TIMEOUT_S = 300.0  # spawning a worker imports torch and nanoref: seconds, not minutes
_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, or the engine's ranks can no longer run a step together."""


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARS)


def _backend(device: torch.device) -> str:
    # CPU tensors (step messages, scalars) always go through gloo; CUDA tensors through NCCL
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of `rank`: the config's CPU, or one GPU per rank (LOCAL_RANK under torchrun)."""
    device = config.device
    if device.type != "cuda" or config.tensor_parallel_size == 1:
        return device
    if launched_by_torchrun():
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", (device.index or 0) + rank)


# -- rank 0 ---------------------------------------------------------------------------------------


class Followers:
    """Rank 0's handle on ranks 1..N-1: sends them steps and calls, notices when one fails, stops them."""

    def __init__(self, world_size: int, procs: list | None = None, conns: list[Connection] | None = None) -> None:
        self.world_size = world_size
        self.procs = procs or []  # spawned workers (empty under torchrun: their processes are not ours)
        self.conns = conns or []  # one pipe per spawned worker: its traceback when it fails
        self.closed = False
        self.broken: str | None = None  # why steps can no longer run, once they cannot
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._failure_seen = threading.Event()
        self._sent = False  # whether the step in `guard` has sent anything to the followers yet
        self._sent_seams: dict[str, Callable] = {}  # the exercise functions the followers run (see send_seams)
        if self.procs:
            threading.Thread(target=self._monitor, name="nanoref-tp-monitor", daemon=True).start()

    # -- sending --------------------------------------------------------------------------------
    def send(self, message: tuple) -> None:
        """Broadcast one message to every follower (a pickled object over gloo)."""
        self.check()
        self._sent = True
        dist.broadcast_object_list([message], src=0)

    def send_step(self, step: Any, next_ids: torch.Tensor | None) -> None:
        """One step's host inputs, then (overlapped decode) its input ids still on rank 0's device."""
        self.send_seams()
        self.send(("step", step, None if next_ids is None else int(next_ids.shape[0])))
        if next_ids is not None:
            dist.broadcast(next_ids, src=0)

    def call(self, fn: Callable, args: tuple) -> None:
        self.send_seams()
        self.send(("call", fn, args))

    def send_seams(self) -> None:
        """Mirror rank 0's exercise seams on every rank (a learner's function runs in each rank's layers). The
        functions usually live in a notebook, which the workers cannot import: cloudpickle sends them by value.
        Sent only when they change, so an engine without exercises pays one dict comparison per step."""
        functions = seams.active()
        if functions == self._sent_seams:
            return
        import cloudpickle

        self.send(("seams", cloudpickle.dumps(functions)))
        self._sent_seams = functions

    def check(self) -> None:
        if self.broken is not None:
            raise TensorParallelError(self.broken)

    # -- failures -------------------------------------------------------------------------------
    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run rank 0's part of a collective step. On an error after the step went out to the followers the ranks
        are out of step (some may wait in a collective rank 0 will never join): stop the followers, and raise a
        worker's own error if one failed first. An error before anything was sent (a bad input, a learner's
        function raising while rank 0 prepares the step) leaves the followers waiting as usual: no harm done."""
        self.check()
        self._sent = False
        try:
            yield
            if self._failure is not None:  # NCCL: an aborted group may let the step "finish" on garbage
                raise TensorParallelError("a tensor-parallel worker died during the step")
        except BaseException as error:
            if not self._sent and self._failure is None:
                raise
            failure = self.failure(wait_s=5.0 if isinstance(error, Exception) else 0.0)
            reason = failure or f"{type(error).__name__}: {error}"
            self.shutdown(f"a tensor-parallel step failed ({reason.strip().splitlines()[-1]})")
            if failure is not None:
                raise TensorParallelError(f"a tensor-parallel worker failed:\n{failure}") from error
            raise

    def failure(self, wait_s: float = 0.0) -> str | None:
        """A follower's error report (its traceback, or how it died), waiting up to wait_s for one."""
        if self.procs:
            self._failure_seen.wait(wait_s)
        return self._failure

    def _monitor(self) -> None:
        """Wait for any worker to die; if that was not a shutdown, record why and unblock rank 0."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels))
        if self.closed:
            return
        rank = sentinels[ready[0]]
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        message = None
        try:
            if conn.poll(1.0):
                kind, message = conn.recv()
        except (EOFError, OSError):
            pass
        proc.join(1.0)
        self._failure = message or f"rank {rank} exited with code {proc.exitcode} without a report"
        self._failure_seen.set()
        if not self.closed and torch.cuda.is_available() and dist.is_initialized():
            # NCCL kernels waiting for the dead rank would spin forever: aborting the group makes them fail
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:
                pass

    # -- stopping -------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell every follower to exit, wait for them, and leave torch.distributed as it was found."""
        with self._lock:
            if self.closed:
                return
            clean = self.broken is None and dist.is_initialized()
            if clean:
                try:
                    dist.broadcast_object_list([("exit",)], src=0)
                except Exception:
                    clean = False
            self.closed = True
            release_group(clean)  # the followers meet rank 0 at the group's last barrier, then exit
            self._stop_processes()

    def shutdown(self, reason: str) -> None:
        """Stop the followers after a failure; every later step raises `reason`."""
        with self._lock:
            self.broken = self.broken or f"{reason}; the engine cannot run more steps: create a new LLM"
            self.closed = True
            # the followers wait in a collective rank 0 will not join (or for a message it will not send): nothing
            # would end them but a signal, so a short grace for any that are exiting already, then SIGTERM
            self._stop_processes(grace_s=0.5)
            release_group(clean=False)

    def _stop_processes(self, grace_s: float = 10.0) -> None:
        for proc in self.procs:
            proc.join(grace_s)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()


_created_group = False  # whether nanoref initialized torch.distributed's default group in this process


def init_group(config: EngineConfig, **kwargs: Any) -> None:
    global _created_group
    dist.init_process_group(_backend(config.device), timeout=_GROUP_TIMEOUT, **kwargs)
    _created_group = True


def release_group(clean: bool = True) -> None:
    """Destroy the default group if nanoref made it (one a launcher or the caller made stays). A process that
    exits with a live gloo group can abort in its C++ teardown, so every rank calls this before it ends.
    clean: every rank is here (a normal close): meet at a barrier first, so no rank tears its connections
    down while another still uses them."""
    global _created_group
    if _created_group and dist.is_initialized():
        try:
            if clean:
                dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass
    _created_group = False


def start_tensor_parallel(config: EngineConfig) -> tuple[ParallelState, Followers | None]:
    """Join or create the ranks of a tensor-parallel engine. Returns this process's state and, on rank 0, its
    handle on the followers (None on the other ranks of a torchrun launch)."""
    world_size = config.tensor_parallel_size
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} processes but tensor_parallel_size is {world_size}: "
                "start exactly one process per rank"
            )
        rank = int(os.environ["RANK"])
        if not dist.is_initialized():
            init_group(config, init_method="env://")
        state = ParallelState(rank=rank, world_size=world_size, group=dist.group.WORLD)
        return state, Followers(world_size) if rank == 0 else None
    if dist.is_initialized():
        raise TensorParallelError(
            "torch.distributed is already initialized in this process (another tensor-parallel LLM?): close() it "
            "first, or start the script with torchrun"
        )
    followers = _spawn_workers(config)
    return ParallelState(rank=0, world_size=world_size, group=dist.group.WORLD), followers


def _spawn_workers(config: EngineConfig) -> Followers:
    world_size = config.tensor_parallel_size
    # port 0: the OS picks a free port for the rendezvous store; the workers are told which one
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=_GROUP_TIMEOUT)
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
    procs, conns = [], []
    for rank in range(1, world_size):
        parent_end, child_end = context.Pipe(duplex=False)
        proc = context.Process(
            target=worker_main,
            args=(config, rank, store.port, child_end),
            name=f"nanoref-tp-rank{rank}",
            daemon=True,
        )
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    followers = Followers(world_size, procs, conns)
    try:
        _wait_started(followers)
        init_group(config, store=store, rank=0, world_size=world_size)
    except BaseException:
        followers.shutdown("the tensor-parallel workers did not start")
        raise
    return followers


def _wait_started(followers: Followers) -> None:
    """Wait until every worker reports it is joining the group (or fails: import errors, a bad config)."""
    pending = dict(zip(followers.conns, range(1, followers.world_size)))
    while pending:
        ready = wait(list(pending), timeout=_STARTUP_TIMEOUT_S)
        if not ready:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(pending.values())} did not start in time")
        for conn in ready:
            rank = pending.pop(conn)
            try:
                kind, message = conn.recv()
            except EOFError:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited while starting") from None
            if kind == "error":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed while starting:\n{message}")


# -- ranks 1..N-1 ---------------------------------------------------------------------------------


def worker_main(config: EngineConfig, rank: int, port: int, conn: Connection) -> None:
    """A spawned follower: join the group, build this rank's model runner, serve rank 0 until it says exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        if config.device.type == "cuda":
            torch.cuda.set_device(rank_device(config, rank))
        store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=_GROUP_TIMEOUT)
        conn.send(("started", None))
        init_group(config, store=store, rank=rank, world_size=config.tensor_parallel_size)
        from nanoref.engine.model_runner import ModelRunner

        state = ParallelState(rank=rank, world_size=config.tensor_parallel_size, group=dist.group.WORLD)
        ModelRunner(config, parallel=state).serve()
    except BaseException:
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)  # do not run the group's teardown: rank 0 may be waiting in a collective with us
    conn.close()
    release_group()
    # End without the interpreter's teardown, like a torchrun follower (llm_engine.py): after the group's last
    # barrier, a worker that exits normally still aborts in C++ teardown now and then ("terminate called without an
    # active exception", exit code -6: seen about one time in twelve on this project's CPU machine, torch 2.13)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def receive() -> tuple:
    """A follower's next message from rank 0."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def receive_next_ids(count: int, device: torch.device) -> torch.Tensor:
    next_ids = torch.empty(count, dtype=torch.int64, device=device)
    dist.broadcast(next_ids, src=0)
    return next_ids


# -- inspection (notebook 08): functions every rank can run through ModelRunner.run_on_all_ranks --------


def weight_shapes(runner: Any) -> dict[str, tuple[int, ...]]:
    """This rank's parameter shapes, by name."""
    return {name: tuple(param.shape) for name, param in runner.model.named_parameters()}


def rank_weights(runner: Any, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Copies of this rank's parameters, by name: all of them, or those in `names` (their halves rebuild tp=1's)."""
    params = dict(runner.model.named_parameters())
    return {name: params[name].detach().clone() for name in (names if names is not None else params)}


def rank_layout(runner: Any) -> dict[str, Any]:
    """What this rank holds: its query and KV heads (per layer), its rows of the vocabulary, its KV cache's shape."""
    attention = runner.model.model.layers[0].self_attn
    embed = runner.model.model.embed_tokens
    return {
        "rank": runner.rank,
        "heads": attention.num_heads,
        "kv_heads": attention.num_kv_heads,
        "vocab_rows": (embed.vocab_start, embed.vocab_end),
        "table_rows": embed.weight.shape[0],
        "kv_cache": tuple(runner.kv_cache.shape),
    }
