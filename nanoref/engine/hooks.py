"""The hooks the core offers: what a feature gives the engine and its model runner, in one typed place.

The plain engine takes none of them. `nanoref/llm.py` fills them in for the features a config asks for (decode
CUDA graphs, the overlapped or speculative step loop, adapters, ...), so the core never names a feature: it only
calls what it is given, where it says it will.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nanoref.engine.sequence import Sequence
from nanoref.engine.step_inputs import StepInputs

# (the runner and engine these are given to import this module: they are `Any` here, named in the comments)

# called with a step's sequences and inputs after they are uploaded, right before the forward: per-row state the
# forward reads besides the tokens (each row's own weights, say), set on the device for this step
StepHook = Callable[[list[Sequence], StepInputs], None]


@dataclass(frozen=True)
class RunnerHooks:
    """What the model runner is built with."""

    # each called once the model exists, before the KV cache is sized, in order: what one allocates (per-row weights,
    # say) counts as used, and the cache gets what is left, on a CPU and a GPU alike; a returned StepHook as `attach`'s
    attach_before_kv_cache: tuple[Callable[[Any], StepHook | None], ...] = ()  # (each takes the ModelRunner)
    # each called once the model and its KV cache exist, in order; a returned StepHook runs before every forward
    attach: tuple[Callable[[Any], StepHook | None], ...] = ()  # (each takes the ModelRunner)
    # builds the replayer of decode steps (`covers(batch)`, `run(input_ids, positions)`) after `attach`; None: eager
    decode_graphs: Callable[[Any], Any] | None = None  # (takes the ModelRunner)


NO_RUNNER_HOOKS = RunnerHooks()  # the plain runner's


def admit_any(seq: Sequence, running: Iterable[Sequence], scheduled: list[Sequence]) -> bool:
    return True


@dataclass(frozen=True)
class EngineHooks:
    """What the engine is built with (its model runner's hooks go to the runner's builder: `make_runner`)."""

    # builds the loop that runs each step (a StepLoop) from the LLMEngine; None: the plain one (`PlainLoop`)
    make_step_loop: Callable[[Any], Any] | None = None
    # decode reserves K/V slots for this many tokens past each sequence's last one (a step loop that computes
    # several tokens per sequence)
    num_lookahead_tokens: int = 0
    # can_admit(seq, running, scheduled): whether a waiting sequence may start beside the running ones and those
    # this prefill step has scheduled so far (seq last among them): a limit on what one batch may mix, beyond
    # tokens, sequences and blocks. A sequence refused keeps its place in the queue; the ones behind it may start
    can_admit: Callable[[Sequence, Iterable[Sequence], list[Sequence]], bool] = admit_any


NO_ENGINE_HOOKS = EngineHooks()  # the plain engine's
