"""Tensor-parallel processes: rank 0 drives, ranks 1..N-1 follow.

Rank 0 runs the whole engine: requests, scheduler, block manager, sampler. The other ranks only run the
model. Every step, rank 0 broadcasts the step's flat inputs (the host arrays its own model runner is about
to upload: ids, positions, slots, cu_seqlens, block tables), every rank uploads them and runs the forward
with its share of the weights, the layers' all-reduces meet in the middle, and the logits are gathered to
rank 0 alone, which samples. The followers never see a `Sequence`.

Transport: torch.distributed's process groups, made by each engine on its own rendezvous store and called
directly (`RankGroup`, nanoref/parallel/state.py): gloo for CPU tensors (the step messages, pickled) and, on GPUs,
NCCL for CUDA tensors (the layers' collectives). torch.distributed's default group is never created or used, so
two tensor-parallel engines live side by side in one process, and closing one leaves the other alone.

Two ways to start:
- `LLM(..., tensor_parallel_size=N)` in a plain process: this process is rank 0 and spawns N-1 workers on
  this host (`cuda:0` .. `cuda:N-1`). The rendezvous store and gloo listen on 127.0.0.1 only, on ports the OS
  picks; the workers learn the store's port from their arguments, so two engines never fight over a port.
- `torchrun` (one host or many): every process runs the same script; the environment (`MASTER_ADDR`,
  `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`) is the rendezvous. Rank 0's `LLM(...)` returns and
  serves `generate`; on the other ranks `LLM(...)` follows rank 0 until it closes, then exits the process.

Failures: a worker that raises sends its traceback to rank 0 through a pipe and exits; rank 0's pending
collective fails (gloo notices the closed connection at once; for NCCL a monitor thread aborts the group)
and rank 0 raises the worker's error. A worker that hangs makes rank 0's collective time out
(`tensor_parallel_timeout`); rank 0 waits in short slices, so Ctrl-C reaches it meanwhile. Any error or Ctrl-C
in the middle of a step stops the workers: half a forward cannot be resumed, so the engine refuses further steps
and says why. `close()` stops the workers and closes every socket the engine opened; the engine then refuses
every call. Stopping is bounded, whatever state a worker is in: a short grace, SIGTERM, a short grace, SIGKILL
(a stopped or hung worker never acts on SIGTERM), and no wait on a collective whose peer is gone (see
`RankGroup.close`): Ctrl-C or `close()` with a hung worker returns within a few seconds and leaves no process.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from itertools import count
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanoref.parallel.state import (
    CollectiveTimeout,
    ParallelState,
    RankGroup,
    TensorParallelError,
    end_follower_process,
)
from nanoref.utils import seams
from nanoref.utils.heap import freeze_heap

if TYPE_CHECKING:
    from nanoref.config import EngineConfig

__all__ = ["TensorParallelError", "CollectiveTimeout", "Followers", "start_tensor_parallel"]

# the groups' own timeout: a follower waits for the next step for as long as the user leaves the engine idle (rank 0
# bounds each of its own collectives by tensor_parallel_timeout instead)
_GROUP_TIMEOUT = timedelta(days=7)
_STARTUP_TIMEOUT_S = 300.0  # spawning a worker imports torch and nanoref: seconds, not minutes
# close(): idle followers answer the exit message in milliseconds; one that does not within this is stopped
_CLOSE_HANDSHAKE_S = 3.0
_EXIT_GRACE_S = 5.0  # close(): for followers that met the exit barrier to end on their own
_TERMINATE_GRACE_S = 1.0  # between SIGTERM and SIGKILL
_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
CLOSED = "this LLM was closed; create a new LLM"
# a spawned worker that re-imported a script without a main guard exits with this code (see refuse_reimported_main)
_REIMPORTED_MAIN_EXIT = 87
MAIN_GUARD = (
    "put the code that creates the LLM under `if __name__ == '__main__':` (tensor parallelism starts worker "
    "processes with the spawn method, which re-imports your script)"
)
_torchrun_engines = count()  # under torchrun, each engine's keys in the shared store get their own prefix


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARS)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of `rank`: the config's CPU, or one GPU per rank (LOCAL_RANK under torchrun)."""
    device = config.device
    if device.type != "cuda" or config.tensor_parallel_size == 1:
        return device
    if launched_by_torchrun():
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", (device.index or 0) + rank)


def make_group(
    config: EngineConfig, store: dist.Store, rank: int, loopback: bool, timeout_s: float | None
) -> RankGroup:
    """This rank's groups on `store`: gloo always, NCCL too on GPUs. loopback: every rank is on this host, so gloo
    listens on 127.0.0.1 alone (under torchrun it listens where torch.distributed would: GLOO_SOCKET_IFNAME, or
    the address of the host's name, which other hosts can reach)."""
    world_size = config.tensor_parallel_size
    gloo_store = dist.PrefixStore("gloo", store)
    if loopback:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _GROUP_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        gloo = dist.ProcessGroupGloo(gloo_store, rank, world_size, options)
    else:
        gloo = dist.ProcessGroupGloo(gloo_store, rank, world_size, _GROUP_TIMEOUT)
    nccl = None
    if config.device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _GROUP_TIMEOUT
        options.is_high_priority_stream = False
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)
    return RankGroup(rank, world_size, gloo, nccl, timeout_s=timeout_s)


# -- rank 0 ---------------------------------------------------------------------------------------


class Followers:
    """Rank 0's handle on ranks 1..N-1, and the owner of the engine's tensor-parallel life: it sends them steps and
    calls, notices when one fails, stops them, and closes the engine's groups and rendezvous store."""

    def __init__(
        self,
        world_size: int,
        procs: list | None = None,
        conns: list[Connection] | None = None,
        store: dist.Store | None = None,
        group: RankGroup | None = None,
    ) -> None:
        self.world_size = world_size
        self.procs = procs if procs is not None else []  # spawned workers (none under torchrun: not our processes)
        self.conns = conns if conns is not None else []  # one pipe per spawned worker: its traceback when it fails
        self.group = group  # the engine's process groups (set once every rank has joined)
        self._store = store  # the rendezvous store this process serves (spawned workers), closed with the group
        self.closed = False
        self.broken: str | None = None  # why steps can no longer run, once they cannot
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._failure_seen = threading.Event()
        self._sent = False  # whether the step in `guard` has sent anything to the followers yet
        self._sent_seams: dict[str, Callable] = {}  # the exercise functions the followers run (see send_seams)
        # seams the followers' backend never calls (set by the model runner): not sent. A learner's Triton kernel
        # compiled for a GPU holds locks and cannot be pickled, and a torch-backend engine has no use for it
        self.unused_seams: frozenset[str] = frozenset()

    def start_monitor(self) -> None:
        """Watch the spawned workers from a thread: one that dies unblocks rank 0 (see `_monitor`)."""
        threading.Thread(target=self._monitor, name="nanoref-tp-monitor", daemon=True).start()

    # -- sending --------------------------------------------------------------------------------
    def send(self, message: tuple) -> None:
        """Broadcast one message to every follower (pickled here first: a message that cannot be pickled raises
        before anything is sent, and the followers wait on as before)."""
        self.check()
        payload = pickle.dumps(message)
        self._sent = True
        self.group.broadcast_bytes(payload)

    def send_step(self, step: Any, next_ids: torch.Tensor | None) -> None:
        """One step's host inputs, then (overlapped decode) its input ids still on rank 0's device."""
        self.send_seams()
        self.send(("step", step, None if next_ids is None else int(next_ids.shape[0])))
        if next_ids is not None:
            self.group.broadcast(next_ids)

    def call(self, fn: Callable, args: tuple) -> None:
        """Send fn(runner, *args) to every follower. fn and args go by value (cloudpickle), so a lambda or a
        notebook's function works too; one that cannot be pickled is a TypeError before anything is sent."""
        import cloudpickle

        try:
            payload = cloudpickle.dumps((fn, args))
        except Exception as error:
            raise TypeError(
                f"run_on_all_ranks cannot send {getattr(fn, '__qualname__', repr(fn))} (or its arguments) to the other "
                f"ranks, which are other processes: {type(error).__name__}: {error}"
            ) from None
        self.check()
        self.send_seams()
        self.send(("call", payload))

    def send_seams(self) -> None:
        """Mirror rank 0's exercise seams on every rank (a learner's function runs in each rank's layers). The
        functions usually live in a notebook, which the workers cannot import: cloudpickle sends them by value.
        Sent only when they change, so an engine without exercises pays one dict comparison per step."""
        functions = {name: fn for name, fn in seams.active().items() if name not in self.unused_seams}
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
            # a worker's report may trail the collective that failed on its closed connection; none follows a
            # timeout (the worker is alive) or Ctrl-C
            waits = isinstance(error, Exception) and not isinstance(error, CollectiveTimeout)
            failure = self.failure(wait_s=5.0 if waits else 0.0)
            reason = failure or f"{type(error).__name__}: {error}"
            self.shutdown(f"a tensor-parallel step failed ({reason.strip().splitlines()[-1]})")
            if failure is not None:
                raise TensorParallelError(f"a tensor-parallel worker failed:\n{failure}") from error
            raise

    @contextmanager
    def joining(self) -> Iterator[None]:
        """Around a collective of the engine's construction (the KV block count, the last barrier): where it fails
        because a follower failed while building its runner (its weights, its KV cache), raise that follower's error
        rather than the collective's ("Connection closed by peer")."""
        try:
            yield
        except Exception as error:
            # a follower's report may trail the collective that failed on its closed connection (a hung one: none)
            failure = self.failure(wait_s=0.0 if isinstance(error, CollectiveTimeout) else 5.0)
            if failure is None:
                raise
            raise TensorParallelError(
                f"a tensor-parallel worker failed while the engine was built:\n{failure}"
            ) from error

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
        group = self.group
        if not self.closed and group is not None:
            # NCCL kernels waiting for the dead rank would spin forever: aborting the group makes them fail
            try:
                group.abort()
            except Exception:
                pass

    # -- stopping -------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell every follower to exit, wait for them, then close the engine's groups and rendezvous store (their
        sockets close now, not at some later garbage collection). Every later call raises `CLOSED`. Bounded: the
        exit handshake waits `_CLOSE_HANDSHAKE_S` at most, and a follower that does not exit is stopped (see
        `_stop_processes`), so a hung follower costs a few seconds, never the collectives' timeout."""
        with self._lock:
            if self.closed:
                return
            met = False
            try:
                if self.broken is None and self.group is not None:
                    try:
                        with self.group.bounded(_CLOSE_HANDSHAKE_S):
                            self.group.broadcast_bytes(pickle.dumps(("exit",)))
                            self.group.barrier()  # the followers leave once all ranks are here (runner.py: serve)
                        met = True
                    except Exception:
                        pass
            finally:  # (also after Ctrl-C in the barrier)
                self.closed = True
                self.broken = self.broken or CLOSED
                self._stop_processes(grace_s=_EXIT_GRACE_S if met else 0.5)
                self._release()

    def shutdown(self, reason: str) -> None:
        """Stop the followers after a failure; every later step raises `reason`."""
        with self._lock:
            self.broken = self.broken or f"{reason}; the engine cannot run more steps: create a new LLM"
            self.closed = True
            # the followers wait in a collective rank 0 will not join (or for a message it will not send): nothing
            # would end them but a signal, so a short grace for any that are exiting already, then the signals
            self._stop_processes(grace_s=0.5)
            self._release()

    def _stop_processes(self, grace_s: float) -> None:
        """End every spawned follower within about grace_s + `_TERMINATE_GRACE_S`: those still running after grace_s
        get SIGTERM, those still running after that SIGKILL. A follower that is stopped (SIGSTOP, a debugger) or
        stuck in C code never acts on SIGTERM, and rank 0 must not wait for it: its connections close when it
        dies, which also frees gloo's work still waiting on it (`RankGroup.close`)."""
        _join_all(self.procs, grace_s)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        _join_all(self.procs, _TERMINATE_GRACE_S)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        _join_all(self.procs, 5.0)  # (SIGKILL ends even a stopped process at once: this is the kernel's reaping)
        for conn in self.conns:
            conn.close()

    def _release(self) -> None:
        """Drop this process's groups and store, once no follower is left to use them: their listening sockets
        close with them."""
        if self.group is not None:
            peers_gone = bool(self.procs) and not any(proc.is_alive() for proc in self.procs)
            self.group.close(self.broken or CLOSED, peers_gone=peers_gone)
        self._store = None


def _join_all(procs: list, timeout_s: float) -> None:
    """Wait for every process to end, for timeout_s in all (not each)."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def start_tensor_parallel(config: EngineConfig, runner: Callable) -> tuple[ParallelState, Followers | None]:
    """Join or create the ranks of a tensor-parallel engine. Returns this process's state and, on rank 0, its
    handle on the followers (None on the other ranks of a torchrun launch). `runner(config, parallel=...)` makes the
    model runner each spawned follower serves (passed in: this module sits below the runner and never imports it)."""
    world_size = config.tensor_parallel_size
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} processes but tensor_parallel_size is {world_size}: "
                "start exactly one process per rank"
            )
        rank = int(os.environ["RANK"])
        # the launcher's store (MASTER_ADDR:MASTER_PORT); this engine's keys under a prefix of their own
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=config.tensor_parallel_timeout)))
        store = dist.PrefixStore(f"nanoref/engine{next(_torchrun_engines)}", store)
        group = make_group(config, store, rank, loopback=False, timeout_s=_rank_timeout(config, rank))
        state = ParallelState(rank=rank, world_size=world_size, group=group)
        return state, Followers(world_size, group=group) if rank == 0 else None
    refuse_reimported_main()
    followers = _spawn_workers(config, runner)
    return ParallelState(rank=0, world_size=world_size, group=followers.group), followers


def _rank_timeout(config: EngineConfig, rank: int) -> float | None:
    return config.tensor_parallel_timeout if rank == 0 else None


def refuse_reimported_main() -> None:
    """Inside a process that the spawn method is starting, while it re-imports the parent's script: a script that
    creates its LLM without a main guard. Starting workers from here would fail (and the parent would only see this
    worker exit): say what to do, and end with the exit code the parent recognises."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.write(f"nanoref: a tensor-parallel worker re-imported the script that started it: {MAIN_GUARD}\n")
        sys.stderr.flush()
        os._exit(_REIMPORTED_MAIN_EXIT)


def _serve_store(config: EngineConfig) -> tuple[dist.TCPStore, int]:
    """The rendezvous store, listening on 127.0.0.1 alone (every rank is on this host), on a port the OS picks."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    fd = listener.detach()  # the store owns the socket from here on, and closes it when it is destroyed
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            config.tensor_parallel_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=config.tensor_parallel_timeout),
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise
    return store, port


def _spawn_workers(config: EngineConfig, runner: Callable) -> Followers:
    world_size = config.tensor_parallel_size
    store, port = _serve_store(config)
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
    procs, conns = [], []
    followers = Followers(world_size, procs, conns, store=store)
    try:
        for rank in range(1, world_size):
            parent_end, child_end = context.Pipe(duplex=False)
            proc = context.Process(
                target=worker_main,
                args=(config, rank, port, child_end, runner),
                name=f"nanoref-tp-rank{rank}",
                daemon=True,
            )
            conns.append(parent_end)
            proc.start()
            child_end.close()
            procs.append(proc)
        # the monitor starts only once every worker has reported: until then _wait_started alone reads the pipes
        # and reaps a worker that dies (two threads joining one process race: the loser sees exit code None)
        _wait_started(followers, _STARTUP_TIMEOUT_S)
        followers.start_monitor()
        followers.group = make_group(config, store, 0, loopback=True, timeout_s=config.tensor_parallel_timeout)
    except BaseException:
        followers.shutdown("the tensor-parallel workers did not start")
        raise
    return followers


def _wait_started(followers: Followers, timeout_s: float) -> None:
    """Wait until every worker reports it is joining the group (or fails: import errors, a bad config)."""
    pending = dict(zip(followers.conns, range(1, followers.world_size)))
    while pending:
        ready = wait(list(pending), timeout=timeout_s)
        if not ready:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(pending.values())} did not start in time")
        for conn in ready:
            rank = pending.pop(conn)
            try:
                kind, message = conn.recv()
            except EOFError:
                proc = followers.procs[rank - 1]
                proc.join(5.0)
                if proc.exitcode == _REIMPORTED_MAIN_EXIT:
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} re-imported the script that creates the LLM: {MAIN_GUARD}"
                    ) from None
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} exited while starting (exit code {proc.exitcode})"
                ) from None
            if kind == "error":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed while starting:\n{message}")


# -- ranks 1..N-1 ---------------------------------------------------------------------------------


def worker_main(config: EngineConfig, rank: int, port: int, conn: Connection, runner: Callable) -> None:
    """A spawned follower: join the group, build this rank's model runner (`runner(config, parallel=...)`, the
    function rank 0 builds its own with: its module is imported here, before joining, since rank 0 waits for us from
    then on), serve rank 0 until it says exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        if config.device.type == "cuda":
            torch.cuda.set_device(rank_device(config, rank))
        timeout = timedelta(seconds=config.tensor_parallel_timeout)
        store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=timeout)
        conn.send(("started", None))
        group = make_group(config, store, rank, loopback=True, timeout_s=None)

        state = ParallelState(rank=rank, world_size=config.tensor_parallel_size, group=group)
        follower = runner(config, parallel=state)
        freeze_heap()  # this process is nanoref's: its model and imports out of full garbage collections (heap.py)
        follower.serve()
    except BaseException:
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except OSError:
            pass
        end_follower_process(1)  # not the group's teardown: rank 0 may be waiting in a collective with us
    conn.close()
    end_follower_process(0)  # (without the interpreter's teardown, like a torchrun follower: see there why)


def receive(group: RankGroup) -> tuple:
    """A follower's next message from rank 0."""
    return pickle.loads(group.broadcast_bytes())


def receive_next_ids(group: RankGroup, count: int, device: torch.device) -> torch.Tensor:
    next_ids = torch.empty(count, dtype=torch.int64, device=device)
    group.broadcast(next_ids)
    return next_ids


# -- inspection (notebook 08): functions every rank can run through run_on_all_ranks ---------------------


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
