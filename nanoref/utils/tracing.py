"""Shape tracing: print the real shapes that flow through the engine, step by step.

    with nanoref.trace_shapes():
        llm.generate(["Hello"], SamplingParams(max_tokens=2))

The engine calls `trace(stage, **tensors)` at each stage; it costs one attribute check when tracing
is off. Notebooks use this instead of typed-in shape strings, so what they show is what runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch


@dataclass
class _Tracer:
    layers: tuple[int, ...] | None = (0,)  # decoder layers to show; None = all
    max_steps: int | None = None  # stop printing after this many engine steps
    show_metadata: bool = True
    file: TextIO = field(default_factory=lambda: sys.stdout)
    step: int = 0
    layer: int | None = None  # the decoder layer running now (None outside the layers)

    def visible(self) -> bool:
        if self.max_steps is not None and self.step > self.max_steps:
            return False
        if self.layer is not None and self.layers is not None and self.layer not in self.layers:
            return False
        return True


_TRACER: _Tracer | None = None


def tracing_enabled() -> bool:
    return _TRACER is not None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        shape = "(" + ", ".join(str(s) for s in value.shape) + ("," if value.dim() == 1 else "") + ")"
        return shape
    return str(value)


def _small(value: Any) -> str:
    """Metadata is worth seeing in full when it is short: print values, not just shapes."""
    if isinstance(value, torch.Tensor):
        if value.numel() <= 24:
            return str(value.tolist())
        return _describe(value)
    return str(value)


def trace(stage: str, **tensors: Any) -> None:
    """Print one stage's tensors as `name (shape)`; a no-op unless tracing is on."""
    tracer = _TRACER
    if tracer is None or not tracer.visible():
        return
    where = stage if tracer.layer is None else f"layers.{tracer.layer}.{stage}"
    parts = "  ".join(f"{k} {_describe(v)}" for k, v in tensors.items())
    print(f"  {where:<28} {parts}", file=tracer.file)


def trace_step(kind: str, **metadata: Any) -> None:
    """Called once per engine step, before the forward: a header with the step's metadata."""
    tracer = _TRACER
    if tracer is None:
        return
    tracer.step += 1
    if not tracer.visible():
        return
    print(f"step {tracer.step} [{kind}]", file=tracer.file)
    if tracer.show_metadata:
        for name, value in metadata.items():
            if value is not None:
                print(f"  {name:<28} {_small(value)}", file=tracer.file)


def trace_layer(index: int | None) -> None:
    """The model marks which decoder layer runs, so the tracer can show only some layers."""
    if _TRACER is not None:
        _TRACER.layer = index


@contextmanager
def trace_shapes(
    layers: Sequence[int] | None = (0,),
    max_steps: int | None = None,
    show_metadata: bool = True,
    file: TextIO | None = None,
) -> Iterator[None]:
    """Print every stage's tensor shapes and each step's metadata while the block runs.

    layers: which decoder layers to print (all layers look alike; default: the first only).
    max_steps: print only the first `max_steps` engine steps.
    """
    global _TRACER
    previous = _TRACER
    _TRACER = _Tracer(
        layers=None if layers is None else tuple(layers),
        max_steps=max_steps,
        show_metadata=show_metadata,
        file=file or sys.stdout,
    )
    try:
        yield
    finally:
        _TRACER = previous
