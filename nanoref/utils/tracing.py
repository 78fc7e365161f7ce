"""Shape tracing: show the real shapes that flow through the engine, step by step.

    with nanoref.trace_shapes() as trace:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    trace.steps[0].metadata["cu_seqlens_q"]   # the same facts as data

Each step is numbered as its `StepRecord` in `llm.metrics.steps` (0-based). The engine calls
`trace(stage, **tensors)` at each stage; it costs one attribute check when tracing
is off. Notebooks use this instead of typed-in shape strings, so what they show is what runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from nanoref.utils.context import get_context


@dataclass
class StepTrace:
    """One engine step as the tracer saw it."""

    index: int  # the engine's step index, as its StepRecord has it (0-based, counted from metrics.clear())
    kind: str  # "prefill" or "decode"
    metadata: dict[str, Any]  # short tensors as lists of values, longer ones as shapes (tuples)
    stages: list[tuple[str, dict[str, tuple[int, ...]]]] = field(default_factory=list)  # (stage, {name: shape})

    def stage(self, name: str) -> dict[str, tuple[int, ...]]:
        """The shapes of the first stage called `name` (e.g. "layers.0.attn.decode")."""
        for stage, shapes in self.stages:
            if stage == name:
                return shapes
        recorded = ", ".join(dict.fromkeys(stage for stage, _ in self.stages)) or "none"
        raise KeyError(f"step {self.index} recorded no stage {name!r}; its stages: {recorded}")


@dataclass
class ShapeTracer:
    layers: tuple[int, ...] | None = (0,)  # decoder layers to show; None = all
    max_steps: int | None = None  # record only this many engine steps
    show_metadata: bool = True
    file: TextIO | None = None  # where to print; None = do not print, only record
    steps: list[StepTrace] = field(default_factory=list)
    layer: int | None = None  # the decoder layer running now (None outside the layers)
    _step: int = 0  # steps seen in this block (for max_steps)

    def visible(self) -> bool:
        if self.max_steps is not None and self._step > self.max_steps:
            return False
        if self.layer is not None and self.layers is not None and self.layer not in self.layers:
            return False
        return True

    def print(self, line: str) -> None:
        if self.file is not None:
            print(line, file=self.file)


_TRACER: ShapeTracer | None = None
_SMALL = 24  # metadata tensors up to this many values are shown in full


def tracing_enabled() -> bool:
    return _TRACER is not None


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def trace(stage: str, **tensors: Any) -> None:
    """Record (and print) one stage's tensor shapes; a no-op unless tracing is on."""
    tracer = _TRACER
    if tracer is None or not tracer.visible():
        return
    if not tracer.steps:  # the model called directly, outside an engine step
        tracer.steps.append(StepTrace(0, "forward", {}))
    where = stage if tracer.layer is None else f"layers.{tracer.layer}.{stage}"
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    tracer.steps[-1].stages.append((where, shapes))
    tracer.print(f"  {where:<28} " + "  ".join(f"{name} {_shape_text(shape)}" for name, shape in shapes.items()))


def trace_step(kind: str, index: int, **metadata: Any) -> None:
    """Called once per engine step, before the forward: a header with the step's index and metadata."""
    tracer = _TRACER
    if tracer is None:
        return
    tracer._step += 1
    if not tracer.visible():
        return
    values = {}
    for name, value in metadata.items():
        if isinstance(value, torch.Tensor):
            value = value.tolist() if value.numel() <= _SMALL else tuple(value.shape)
        if value is not None:
            values[name] = value
    tracer.steps.append(StepTrace(index, kind, values))
    tracer.print(f"step {index} [{kind}]")
    if tracer.show_metadata:
        for name, value in values.items():
            tracer.print(f"  {name:<28} {_shape_text(value) if isinstance(value, tuple) else value}")


# The engine's index of the step launched next, as its StepRecord numbers it. Kept while tracing is off too (two
# integers per step), so that a trace block opened at any step numbers its steps as the records do.
_next_index = 0
_last_index: int | None = None  # the index the latest launched step got; None: none since a reset


def trace_step_index(index: int, scheduled: bool = True) -> None:
    """Called by the engine's metrics: the index its next step has.

    scheduled (metrics.begin_step): step `index` was just scheduled. The plain loop launches it next; the
    overlapped loop records a step it launched ahead only after launching it, and then the next launch is index + 1.
    scheduled=False (metrics.clear): the next step launched is `index`.
    """
    global _next_index, _last_index
    if not scheduled:
        _next_index, _last_index = index, None
    elif _last_index is not None and _last_index >= index:  # launched already (ahead)
        _next_index = index + 1
    else:
        _next_index = index


def trace_inputs(is_prefill: bool, seqs: Sequence[Any], input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """The model runner's one call per step, once the step's Context is published: its flat inputs."""
    global _next_index, _last_index
    index = _last_index = _next_index
    _next_index += 1
    if _TRACER is None:
        return
    c = get_context()
    trace_step(
        "prefill" if is_prefill else "decode",
        index,
        seq_ids=[seq.seq_id for seq in seqs],
        input_ids=input_ids,
        positions=positions,
        cu_seqlens_q=c.cu_seqlens_q,
        cu_seqlens_k=c.cu_seqlens_k,
        slot_mapping=c.slot_mapping,
        context_lens=c.context_lens,
        block_tables=c.block_tables,
    )


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
    echo: bool = True,
) -> Iterator[ShapeTracer]:
    """Print every stage's tensor shapes and each step's metadata while the block runs.

    layers: which decoder layers to show (all layers look alike; default: the first only).
    max_steps: show only the first `max_steps` engine steps.
    echo: print (to `file`, default stdout); with echo=False the steps are only recorded.
    Yields the tracer: `tracer.steps` holds a `StepTrace` per step, the same facts as data.
    """
    global _TRACER
    previous = _TRACER
    _TRACER = ShapeTracer(
        layers=None if layers is None else tuple(layers),
        max_steps=max_steps,
        show_metadata=show_metadata,
        file=(file or sys.stdout) if echo else None,
    )
    try:
        yield _TRACER
    finally:
        _TRACER = previous
