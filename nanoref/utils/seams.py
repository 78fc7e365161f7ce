"""Exercise seams: run the real engine with a learner's function in place of one of nanoref's own.

A seam is a named place in the layers, ops or engine that asks `seam(name, default)` for the function
to call. Outside a `use(...)` block that is always `default` (one context-variable read and a truthiness
check of an empty mapping, so an unused seam costs nothing measurable); inside it, the learner's function:

    from nanoref.utils.seams import use
    with use(add_rms_norm=my_add_rms_norm):
        llm.generate(...)          # every decoder layer now calls my_add_rms_norm

A `use` block holds for the code that runs inside it, in its own thread (a `contextvars.ContextVar`, so an
asyncio task's block stays in that task too): another thread's engine keeps nanoref's own functions, and
blocks that overlap across threads each end exactly where they began. A new thread starts with none.

The forward an engine runs depends on the replaced seams, so its prefix cache keeps K/V apart per forward
(`forward_key`): K/V computed with a learner's function never serves a step without it, nor the reverse.

This module sits at the bottom of the package beside `utils/context` and imports nothing from
nanoref, so any layer may consult it. `nanoref.exercises` holds the checks the notebooks run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import TypeVar

F = TypeVar("F", bound=Callable)

# name -> where it sits and what the learner's function computes (same signature as the default's).
# One line per seam, grouped by the notebook whose exercise replaces it.
SEAMS: dict[str, str] = {
    # 01_varlen_flattening
    "prefill_metadata": "engine/step_inputs.py: a prefill step's (input_ids, positions, cu_seqlens_q/k, slot_mapping)",
    # 02_rmsnorm
    "rms_norm": "layers/layernorm.py: rms_norm(x, weight, eps) -> normalised x",
    "add_rms_norm": "layers/layernorm.py: add_rms_norm(x, residual, weight, eps) -> (normalised sum, new residual)",
    # 03_triton_kv_store
    "store_kvcache_kernel": "ops/store_kvcache_triton.py: the @triton.jit kernel storing token i's K/V row in its slot "
    "(launched with the constexprs ROW = Hk * D, one row's values, and BLOCK_ROW, its next power of two)",
    # 04_paged_decode_attention
    "paged_decode_attention": "layers/attention.py: decode attention over the paged cache -> (B, 1, H, D)",
    "merge_splits": "ops/attention_triton.py: merge_splits(partial, lse, out): split-KV's log-sum-exp merge into out",
    # 05_scheduler
    "find_cached_prefix": "engine/block_manager.py: the block ids of a prompt's longest cached prefix",
    "choose_preemption_victim": "engine/scheduler.py: the sequence to preempt when seq needs a block and none is free",
    # 06_cuda_graphs
    "pad_decode_batch": "cuda_graphs.py: pad_decode_batch(buffers, input_ids, positions, slot_mapping, "
    "context_lens, block_tables) -> None: a decode batch into its graph bucket's static buffers, padding harmless",
    # 07_model_and_sampling
    "apply_rotary": "layers/rotary.py: apply_rotary(x, cos, sin) -> x rotated by RoPE (neox halves)",
    "silu_and_mul": "layers/activation.py: silu_and_mul(x) -> silu(gate) * up of x = [gate | up]",
    "apply_top_k_top_p": "layers/sampler.py: apply_top_k_top_p(logits, top_k, top_p) -> -inf outside top-k and top-p",
    # 08_tensor_parallel
    "vocab_parallel_embed": "layers/embed_head.py: vocab_parallel_embed(input_ids, weight, vocab_start, vocab_end) -> "
    "(N, hidden): this rank's embedding rows, zeros for ids outside [vocab_start, vocab_end)",
    # 09_moe
    "moe_route": "models/qwen3_moe.py: route(hidden, router_weight, top_k, norm_topk_prob) -> (router_logits, "
    "topk_weights, topk_ids): each token's top-k experts and their weights",
    "moe_experts": "models/qwen3_moe.py: moe_experts(hidden, topk_weights, topk_ids, w_gate_up, w_down) -> "
    "(N, hidden): each token's router-weighted sum of its experts' outputs",
    # 11_serving
    "find_stop_string": "engine/detokenizer.py: find_stop_string(text, stops, start) -> (index, stop) | None: the "
    "stop string that ends first in text among those ending after start",
    "stop_hold_back": "engine/detokenizer.py: stop_hold_back(text, stops) -> how many characters at the end of text "
    "a stop string could begin with",
    # 12_speculative_decoding
    "accept_greedy": "speculative/acceptance.py: accept_greedy(draft_ids, target_ids) -> the tokens a greedy "
    "sequence gains from its k proposals and the target's k + 1 argmax ids",
    "rejection_sample": "speculative/acceptance.py: rejection_sample(p, q, draft_ids, uniforms, noise) -> (accepted, "
    "recovered) per verify row: keep a proposal with probability min(1, p/q), else draw from max(0, p - q)",
    # 13_structured_output
    "apply_token_bitmask": "layers/logits_processors.py: apply_token_bitmask(logits, rows, bitmask) -> (B, V), a new "
    "tensor where each row rows[a] keeps only the tokens bitmask[a] allows (bit t % 32 of word t // 32), others -inf",
    # 14_lora
    "lora_delta": "ops/lora.py: lora_delta(x, lora_a, lora_b, row_slots, scalings) -> (N, out): each token row's "
    "s (x A^T) B^T under its own adapter slot, zero for rows of slot -1",
}

# seams whose function runs on the host beside the forward, never inside it: replacing one changes which blocks are
# shared, which sequence steps back or which token is drawn, but not the K/V a forward writes for given tokens
HOST_SEAMS = frozenset(
    {
        "find_cached_prefix",
        "choose_preemption_victim",
        "apply_top_k_top_p",
        "apply_token_bitmask",
        "find_stop_string",
        "stop_hold_back",
        "accept_greedy",
        "rejection_sample",
    }
)
# seams inside nanoref's Triton kernels: only an engine whose attention backend runs them ever calls these
TRITON_SEAMS = frozenset({"store_kvcache_kernel", "merge_splits"})


class ForwardKey:
    """Which forward made some K/V: the replaced seams that run inside the model, compared by identity.

    It holds the functions themselves, so none of them can be freed (and its id given to another function) while a
    key names it: the prefix cache keeps one per forward whose K/V it holds.
    """

    __slots__ = ("functions", "_ids")

    def __init__(self, functions: Mapping[str, Callable]) -> None:
        self.functions = tuple(sorted(functions.items()))  # ((name, function), ...) sorted by name
        self._ids = tuple((name, id(function)) for name, function in self.functions)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ForwardKey) and self._ids == other._ids

    def __hash__(self) -> int:
        return hash(self._ids)

    def __repr__(self) -> str:
        return f"ForwardKey({', '.join(name for name, _ in self.functions)})"


_NONE: Mapping[str, Callable] = MappingProxyType({})
# the learner's functions in this thread (or asyncio task) while a `use` block runs; immutable, replaced as a whole
_ACTIVE: ContextVar[Mapping[str, Callable]] = ContextVar("nanoref_seams", default=_NONE)
# the forward they make (None: nanoref's own), computed once per block rather than once per step
_FORWARD: ContextVar[ForwardKey | None] = ContextVar("nanoref_forward", default=None)


def seam(name: str, default: F) -> F:
    """The function to call at seam `name`: the learner's inside `use(...)`, else `default`."""
    active = _ACTIVE.get()
    if active:
        return active.get(name, default)
    return default


def _install(functions: Mapping[str, Callable]) -> tuple:
    """Make exactly `functions` the replaced seams of this context -> the tokens that undo it."""
    in_forward = {name: function for name, function in functions.items() if name not in HOST_SEAMS}
    forward = ForwardKey(in_forward) if in_forward else None
    return _ACTIVE.set(MappingProxyType(dict(functions))), _FORWARD.set(forward)


@contextlib.contextmanager
def use(**functions: Callable) -> Iterator[None]:
    """Install learner functions by seam name for the duration of the block, in this thread only (blocks may
    nest: an inner block adds to, or replaces, the outer one's functions until it ends)."""
    unknown = sorted(set(functions) - set(SEAMS))
    if unknown:
        raise ValueError(f"no exercise seam named {', '.join(map(repr, unknown))}; the seams are: {', '.join(SEAMS)}")
    for name, function in functions.items():
        if not callable(function):
            raise TypeError(f"use({name}=...) needs a function, got {type(function).__name__}")
    active_token, forward_token = _install({**_ACTIVE.get(), **functions})
    try:
        yield
    finally:
        _FORWARD.reset(forward_token)
        _ACTIVE.reset(active_token)


def active() -> dict[str, Callable]:
    """The seams replaced right now in this thread (a copy), e.g. for a notebook to show what runs."""
    return dict(_ACTIVE.get())


def forward_key() -> ForwardKey | None:
    """The forward a step started now runs: None for nanoref's own, else the replaced seams inside the model."""
    return _FORWARD.get()


def replace_active(functions: Mapping[str, Callable]) -> None:
    """Make exactly `functions` the replaced seams of this context, for good: a tensor-parallel worker's serving
    loop mirrors rank 0's `use` blocks (the worker runs nothing else)."""
    _install(functions)
