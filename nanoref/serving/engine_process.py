"""The engine's loop in a process of its own (vLLM's "engine core"): `AsyncLLM.from_model`'s default form.

Why a process: in one process the engine thread and the server's event loop share one GIL. A GPU decode step takes
~6 ms; around it the engine does per-token Python work (scheduling, sampling's bookkeeping), and the event
loop does its own per chunk (HTTP, JSON, SSE). With hundreds of streams the two together take longer than the step,
so the GPU waits for Python. In two processes each has its own interpreter: the engine's host work overlaps the
event loop's, and the GPU is fed while the responses are written. On a CPU the same holds for the engine's Python
between its forwards (measured on two cores: 0.59-0.64x of offline `generate` against 0.43x for the thread).

What crosses between them is small and batched (engine_loop.py's messages):
- commands in, through one pipe: add (already checked in the server's process against the engine's config, so a
  bad request still raises at `generate`), abort, read, stop. A thread of the server's process writes them (the
  event loop only queues them), what queued up meanwhile as one list, and a thread of the child reads them as
  they come, also during a step;
- ONE `StepMessage` out per step, through another pipe, written by another thread of the child while the next step
  runs, with every request's new tokens, its errors and the engine's stats (no text: the server's side decodes
  it, engine_loop.py says why); a reader thread in the server's process turns it into per-request outputs with
  one hand-off to the event loop per message (`AsyncLLM._on_message`), not one per token.

The child is started with the "spawn" method (a fresh interpreter: CUDA cannot be used in a forked child) through a
context object, so the caller's default start method is left alone. It builds `LLM(model, **settings)` itself and
says "ready" (with its config: the KV block count it measured) or why it failed. When the child dies, the reader
thread sees the pipe close and fails every request in flight; `close()` asks it to stop, then terminates it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from nanoref.config import EngineConfig
from nanoref.llm import LLM
from nanoref.serving.engine_loop import EngineLoop, EngineStats, StepMessage, drain
from nanoref.utils.heap import freeze_heap

# the child's last words when it fails to start: "ready" never comes
_FAILED, _READY = "failed", "ready"


class EngineProcess:
    """An EngineLoop on LLM(model, **settings) in a spawned child process. Blocks until the child's LLM is built;
    a child that fails to start raises its error here (and leaves no process behind).

    on_message(StepMessage) runs in this object's reader thread for every step message; on_exit(reason) runs there
    once, when the child ended without being asked to (killed, crashed)."""

    def __init__(
        self,
        model: str | Path,
        settings: dict,
        on_message: Callable[[StepMessage], None],
        on_exit: Callable[[str], None],
    ) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        commands_out, commands_in = context.Pipe(duplex=False)  # (receiving end, sending end)
        outputs_out, outputs_in = context.Pipe(duplex=False)
        # not a daemon: an LLM with tensor_parallel_size > 1 starts processes of its own
        self.process = context.Process(
            target=serve_engine, args=(str(model), settings, commands_out, outputs_in), name="nanoref-engine"
        )
        with _sigint_ignored():  # (inherited through exec: Ctrl-C during the child's imports prints no traceback)
            self.process.start()
        commands_out.close()  # the child's ends: closed here, so that a dead child closes its pipe
        outputs_in.close()
        self._commands, self._outputs = commands_in, outputs_out
        self._send_lock = threading.Lock()  # (the writer thread, and close)
        self._stopping = False
        try:
            kind, *rest = self._outputs.recv()  # blocks while the child loads the model
        except (EOFError, OSError):
            kind, rest = None, []
        except BaseException:  # Ctrl-C while the child loads: it ignores SIGINT, and would wait for commands for ever
            self._stop(timeout=0)  # (while the interpreter's exit waited for it: a hang)
            self._outputs.close()
            raise
        if kind != _READY:
            self._stop(timeout=5.0)
            self._outputs.close()
            if kind == _FAILED:
                error = rest[0]
                error.add_note("(raised in the engine process, while it built its LLM)")
                raise error
            raise RuntimeError(
                f"the engine process ended while it started ({self._exit_code()}); a script that starts one "
                "needs the `if __name__ == '__main__':` guard, as for any process that multiprocessing spawns"
            )
        self.config: EngineConfig = rest[0]  # the child's, with the KV block count it measured
        self.stats: EngineStats = rest[1]
        # at interpreter exit, before multiprocessing joins its children (it would wait for this one forever)
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_child, args=(self.process, self._commands, self._send_lock), exitpriority=10
        )
        self._on_message, self._on_exit = on_message, on_exit
        self._reader = threading.Thread(target=self._read, name="nanoref-engine-reader", daemon=True)
        self._reader.start()
        self._pending: queue.SimpleQueue = queue.SimpleQueue()  # commands for the writer thread (None: end)
        self._writer = threading.Thread(target=self._write, name="nanoref-engine-writer", daemon=True)
        self._writer.start()

    def send(self, command: tuple) -> None:
        """Queue a command for the engine (the writer thread sends it); a dead engine takes nothing (its requests
        are failed by the reader)."""
        self._pending.put(command)

    def _write(self) -> None:
        """The writer thread: every queued command to the child, what queued up during the last write as one
        list. Never on the event loop: a write blocks while the pipe (64 KiB) is full until the child's reader
        thread drains it, and that thread waits for its process's GIL. Measured on a CPU with 64 requests sent at
        once, writing their commands on the event loop stalled it 40-155 ms per round of 1.3 s, up to 20 ms at a
        time."""
        while True:
            commands = drain(self._pending, wait=True)
            last = None in commands
            commands = [command for command in commands if command is not None]
            try:
                if commands:
                    with self._send_lock:
                        self._commands.send(commands)
            except (OSError, ValueError):  # (a closed pipe: the child is gone)
                return
            if last:
                return

    def is_alive(self) -> bool:
        return not self._stopping and self.process.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (requests in flight end with "abort"), within `timeout`, then terminate it."""
        if self._stopping:
            return
        self._stop(timeout)
        self._finalizer.cancel()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout)

    def _stop(self, timeout: float) -> None:
        self._stopping = True
        _stop_child(self.process, self._commands, self._send_lock, timeout)
        if hasattr(self, "_writer"):  # (none yet when the child failed to start)
            self._pending.put(None)
            self._writer.join(5.0)  # (the child is gone by now: a write blocked on its pipe fails at once)
        self._commands.close()

    def _read(self) -> None:
        """The reader thread: every step message to on_message, until the child closes its pipe."""
        while True:
            try:
                message = self._outputs.recv()
            except (EOFError, OSError):
                break
            try:
                self._on_message(message)
            except Exception as error:  # (handing the message on failed as a whole: one request's output that
                # fails fails that request alone): as a dead engine thread would, fail every request in flight and
                # every later one, rather than leave them
                self._on_exit(f"the server's side failed on a step message ({type(error).__name__}: {error})")
                self._stop(timeout=5.0)
                break
        self._outputs.close()
        if not self._stopping:  # nobody asked it to stop: it died
            self.process.join(5.0)  # (reap it: no zombie)
            self._on_exit(f"the engine process (pid {self.process.pid}) ended unexpectedly ({self._exit_code()})")

    def _exit_code(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while the block runs, in the main thread (elsewhere the handler cannot change: nothing done)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)  # (None: set outside Python)


def _stop_child(process, commands, lock, timeout: float = 5.0) -> None:
    # (the writer thread holds the lock while its write to a full pipe blocks, as it would for a hung child)
    if lock.acquire(timeout=timeout):
        try:
            commands.send([("stop",)])
        except (OSError, ValueError):
            pass
        finally:
            lock.release()
    process.join(timeout)
    if process.is_alive():  # a step that never ends, or a child that ignores the pipe
        process.terminate()
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()


def serve_engine(model: str, settings: dict, commands, outputs) -> None:
    """The child's main: build the LLM, say ready (or why not), run the loop until "stop" or the parent is gone."""
    # Ctrl-C in a terminal reaches the whole process group: the parent decides when this process stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = LLM(model, **settings)
    except BaseException as error:
        outputs.send((_FAILED, _picklable(error)))
        return
    freeze_heap()  # the model and everything imported: out of the garbage collector's full collections (heap.py)

    # Both pipes are worked by threads of their own, so the loop never waits on one: a pipe holds 64 KiB, and a
    # writer blocks when it is full. Commands are read as they come, also while a step runs (else the server's
    # event loop, writing 256 new requests at once, would stall until the step ends), and step messages are
    # written while the next step runs (else a server process busy with its streams would stall the engine).
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    # SIGTERM (systemd's stop reaches the whole process group): a stop, as the parent's, so that the LLM is closed and
    # multiprocessing's exit cleans up (killed, the process left a semaphore that the resource tracker warned of);
    # the process still ends by the signal, last (the server's log says so when it came alone)
    def on_sigterm(signum, frame) -> None:
        inbox.put(("stop",))  # (SimpleQueue.put may be called from a signal handler)
        atexit.register(_end_by, signum)

    signal.signal(signal.SIGTERM, on_sigterm)

    def read_commands() -> None:
        try:
            while True:
                for command in commands.recv():  # (a list: what the parent's writer thread had queued)
                    inbox.put(command)
        except (EOFError, OSError):  # the parent is gone: nobody reads what the loop would make
            inbox.put(("stop",))

    def write_messages() -> None:
        while (message := outbox.get()) is not None:
            try:
                try:
                    outputs.send(message)
                except (pickle.PicklingError, TypeError, AttributeError):  # an error that does not pickle: in words
                    errors = [(key, _picklable(error)) for key, error in message.errors]
                    replies = [(k, _picklable(a) if isinstance(a, BaseException) else a) for k, a in message.replies]
                    outputs.send(message._replace(errors=errors, replies=replies))
            except OSError:  # the parent went away (BrokenPipeError): the reader will say "stop"
                return

    threads = [threading.Thread(target=work, daemon=True) for work in (read_commands, write_messages)]
    try:
        loop = EngineLoop(llm, functools.partial(drain, inbox), outbox.put)
        outputs.send((_READY, llm.config, loop.stats()))
        for thread in threads:
            thread.start()
        loop.run()
        if loop.dead is not None:  # (the parent sees this process end: the server's log says why)
            print(f"nanoref: the engine process stops: {loop.dead}", file=sys.stderr, flush=True)
    except (BrokenPipeError, EOFError):  # the parent went away
        pass
    finally:
        outbox.put(None)  # the writer sends what is queued (the aborts' last deltas), then ends
        if threads[1].is_alive():
            threads[1].join(timeout=10.0)  # (a parent that reads nothing any more must not keep this process)
        llm.close()
        outputs.close()


def _end_by(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _picklable(error: BaseException) -> BaseException:
    """The error itself when it crosses the pipe intact, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
