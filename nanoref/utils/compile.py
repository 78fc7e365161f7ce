"""`torch.compile` where it pays: the element-wise layers and the sampler, on CUDA only.

Eager, one RMSNorm is about eight aten kernels (cast, square, mean, add, rsqrt, multiply, cast,
multiply), each a launch and a round trip of the activations through GPU memory; a decode step of
Qwen3-0.6B runs ~70 such small kernels per layer. Compiled, inductor fuses each of these functions
into one or two kernels, and a decode CUDA graph then replays far fewer of them (measured on one
H200: decode step 10.1 -> 6.5 ms; benchmarks/results/). On a CPU compiling buys little for the
batch sizes a CPU serves and costs seconds of compilation per process, so the CPU keeps the eager
functions, which stay the readable reference that tests compare the compiled ones against.

    rms_norm_cuda = on_cuda(rms_norm)   # rms_norm itself stays eager and importable

Compilation is lazy (on the first CUDA call, which the model runner's warm-up or graph capture
makes). Shapes are left to dynamo's automatic dynamic mode: the first batch size compiles a static
kernel, the second marks the token dimension dynamic, and every later batch size and prefill length
shares that kernel. The hidden and head dimensions stay static: `dynamic=True` would make them
runtime values too, and the kernels would pay for index arithmetic with unknown divisors and lose
persistent reductions.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_enabled = True
OPTIONS: dict = dict(dynamic=None, fullgraph=True)  # torch.compile's arguments for every on_cuda function


def on_cuda(fn: F) -> F:
    """`fn`, run through `torch.compile` when its first argument is a CUDA tensor, eager otherwise.

    Each call's `compile_key` picks a compiled copy of its own (see `_fresh_copy`), so that only the token count
    varies within one copy: however many engines of whatever models a process builds, no copy recompiles more
    than a few times. Should dynamo still refuse to recompile (its per-code-object limit), that key runs eagerly
    from then on, with one warning: an engine never fails because a layer could not be compiled once more."""
    compiled: dict[tuple, Callable] = {}

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args, **kwargs):
        if not _wants_compile(x):
            return fn(x, *args, **kwargs)
        key = compile_key(x, *args, **kwargs)
        run = compiled.get(key)
        if run is None:
            run = compiled[key] = torch.compile(_fresh_copy(fn), **OPTIONS)
        if run is fn:
            return fn(x, *args, **kwargs)
        try:
            return run(x, *args, **kwargs)
        except Exception as error:
            if not _is_recompile_limit(error):
                raise
            compiled[key] = fn
            warnings.warn(
                f"nanoref: {fn.__name__} reached torch.compile's recompile limit ({type(error).__name__}); it runs "
                "eagerly for these inputs from now on (same results, more kernels per step)",
                RuntimeWarning,
                stacklevel=2,
            )
            return fn(x, *args, **kwargs)

    dispatch.eager = fn  # type: ignore[attr-defined]
    return dispatch  # type: ignore[return-value]


def _wants_compile(x: torch.Tensor) -> bool:
    return _enabled and x.is_cuda


def _is_recompile_limit(error: Exception) -> bool:
    """Whether dynamo refused to compile a code object once more (its recompile_limit, 8 by default). Looked up
    here, not at import: importing torch._dynamo costs a second that a CPU-only user never needs."""
    return isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit)


def compile_key(*args, **kwargs) -> tuple:
    """What a compiled copy specialises on, for one call: every tensor's dtype, device and shape past its first
    dimension (the first is the token count, or a table's length, which dynamo makes dynamic after one change),
    every other argument's value, and the grad modes. Two engines of the same model share every copy; a model
    with other head counts, dims or eps gets copies of its own instead of recompiling the first model's."""

    def describe(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dtype, value.device, value.dim(), tuple(value.shape[1:]))
        if isinstance(value, (tuple, list)):
            return tuple(describe(item) for item in value)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value)

    return (
        tuple(describe(arg) for arg in args),
        tuple(sorted((name, describe(value)) for name, value in kwargs.items())),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
    )


def _fresh_copy(fn: Callable) -> Callable:
    """The same function on its own code object. Dynamo keeps at most 8 compiled versions per code object
    (then it raises, with fullgraph=True); a dtype, a rank, a head count, an eps or a grad mode each force a new
    version, so a process that builds engines of several models one after another (a test suite, a notebook)
    would run out. One copy per `compile_key` keeps each copy to the token-count variants alone."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def compiling() -> bool:
    """Whether `on_cuda` functions compile on CUDA right now."""
    return _enabled


@contextlib.contextmanager
def eager_only() -> Iterator[None]:
    """Run every `on_cuda` function eagerly inside the block (to measure what compiling buys)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved
