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
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_enabled = True
OPTIONS: dict = dict(dynamic=None, fullgraph=True)  # torch.compile's arguments for every on_cuda function


def on_cuda(fn: F) -> F:
    """`fn`, run through `torch.compile` when its first argument is a CUDA tensor, eager otherwise."""
    compiled: dict[tuple, Callable] = {}

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args, **kwargs):
        if not (_enabled and x.is_cuda):
            return fn(x, *args, **kwargs)
        key = (x.dtype, x.dim(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        if key not in compiled:
            compiled[key] = torch.compile(_fresh_copy(fn), **OPTIONS)
        return compiled[key](x, *args, **kwargs)

    dispatch.eager = fn  # type: ignore[attr-defined]
    return dispatch  # type: ignore[return-value]


def _fresh_copy(fn: Callable) -> Callable:
    """The same function on its own code object. Dynamo keeps at most 8 compiled versions per code object
    (then it raises, with fullgraph=True); dtype, rank and grad mode each force a new version, so a process
    that serves a float32 and a bf16 model, or runs tests in several grad modes, would run out. One copy
    per (dtype, rank, grad mode) keeps each copy to the batch-size variants alone."""
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
