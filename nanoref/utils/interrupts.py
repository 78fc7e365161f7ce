"""Hold Ctrl-C back while the engine's bookkeeping runs, so an interrupt lands only where a step can fail.

Python raises KeyboardInterrupt wherever it happens to be when SIGINT arrives. Between two lines of the scheduler's
or the block manager's bookkeeping that leaves a sequence in no queue, or a block counted twice, and every later
step fails. So the engine runs a step inside `held_interrupts()`: SIGINT is only noted there, and raised when the
block ends, with the bookkeeping complete. Two kinds of work inside a step are run through `interruptibly(fn, ...)`
instead, where an interrupt acts at once (and one noted earlier is raised before fn starts): the forward pass,
which can take seconds on a CPU, and a learner's exercise function, which may loop forever. The engine aborts the
step's requests when either raises (see LLMEngine.step).

    with held_interrupts():
        decide_and_apply()                  # Ctrl-C here waits for the block's end
        result = interruptibly(forward)     # Ctrl-C here raises at once; the caller aborts the step

Holding happens only in the main thread (the one Python raises KeyboardInterrupt in) and only while SIGINT has
Python's default handler; a caller's own handler is left to do what it does. The outermost block puts the default
handler back when it ends, so the caller's handler is the same object afterwards.

Why a flag read by our handler instead of a handler swap around each interruptible call: `signal.signal` costs
several microseconds and the forward runs every step; a module global costs nothing. Why a plain function with
try/finally for `interruptibly` and not a context manager: Python checks for signals when a function starts, so an
interrupt could land at the start of a context manager's exit method, before it has reset the flag; a `finally`
in the same frame starts without such a check.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_depth = 0  # nesting of held_interrupts() blocks that hold (main thread only)
_interruptible = False  # inside interruptibly(): our handler raises like the default one
_pending = False  # a SIGINT arrived while held: raise it at the end of the outermost block


def _on_sigint(signum: int, frame: object) -> None:
    global _pending
    if _interruptible:
        raise KeyboardInterrupt
    _pending = True


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class held_interrupts:
    """Context manager: a SIGINT during the block raises KeyboardInterrupt when the block ends. Blocks nest."""

    __slots__ = ("_holds", "_was_interruptible")

    def __enter__(self) -> held_interrupts:
        global _depth, _interruptible, _pending
        self._holds = False
        if not _in_main_thread():
            return self
        if _depth == 0:
            _pending = False
            previous = signal.signal(signal.SIGINT, _on_sigint)
            if previous not in (signal.default_int_handler, _on_sigint):  # the caller's own handler or SIG_IGN
                signal.signal(signal.SIGINT, previous)
                return self
        self._holds = True
        self._was_interruptible, _interruptible = _interruptible, False
        _depth += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _depth, _interruptible, _pending
        if not self._holds:
            return
        _depth -= 1
        _interruptible = self._was_interruptible
        if _depth == 0:
            replaced = signal.signal(signal.SIGINT, signal.default_int_handler)
            if replaced is not _on_sigint:  # code in the block installed a handler of its own: it stays
                signal.signal(signal.SIGINT, replaced)
        elif not _interruptible:
            return  # still held by an outer block: it raises the interrupt when it ends
        if _pending:
            _pending = False
            raise KeyboardInterrupt


def interruptibly(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs), with Ctrl-C raising at once even inside `held_interrupts()`: for work the caller can
    undo when it raises. An interrupt held since the block began is raised here, before fn starts."""
    global _interruptible, _pending
    if not _depth or not _in_main_thread():
        return fn(*args, **kwargs)
    was_interruptible = _interruptible
    try:
        _interruptible = True
        if _pending:
            _pending = False
            raise KeyboardInterrupt
        return fn(*args, **kwargs)
    finally:
        _interruptible = was_interruptible
