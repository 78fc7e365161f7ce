"""Exercise seams: run the real engine with a learner's function in place of one of nanoref's own.

A seam is a named place in the layers, ops or engine that asks `seam(name, default)` for the function
to call. Outside a `use(...)` block that is always `default` (one truthiness check of an empty dict,
so an unused seam costs nothing measurable); inside it, the learner's function:

    from nanoref.utils.seams import use
    with use(add_rms_norm=my_add_rms_norm):
        llm.generate(...)          # every decoder layer now calls my_add_rms_norm

This module sits at the bottom of the package beside `utils/context` and imports nothing from
nanoref, so any layer may consult it. `nanoref.exercises` holds the checks the notebooks run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

F = TypeVar("F", bound=Callable)

# name -> where it sits and what the learner's function computes (same signature as the default's).
# One line per seam, grouped by the notebook whose exercise replaces it.
SEAMS: dict[str, str] = {
    # 01_varlen_flattening
    "prefill_metadata": "engine/model_runner.py: a prefill step's (input_ids, positions, cu_seqlens_q/k, slot_mapping)",
    # 02_rmsnorm
    "rms_norm": "layers/layernorm.py: rms_norm(x, weight, eps) -> normalised x",
    "add_rms_norm": "layers/layernorm.py: add_rms_norm(x, residual, weight, eps) -> (normalised sum, new residual)",
    # 03_triton_kv_store
    "store_kvcache_kernel": "ops/store_kvcache_triton.py: the @triton.jit kernel storing token i's K/V row in its slot",
    # 04_paged_decode_attention
    "paged_decode_attention": "layers/attention.py: decode attention over the paged cache -> (B, 1, H, D)",
    "merge_splits": "ops/attention_triton.py: merge_splits(partial, lse, out): split-KV's log-sum-exp merge into out",
    # 05_scheduler
    "find_cached_prefix": "engine/block_manager.py: the block ids of a prompt's longest cached prefix",
    "choose_preemption_victim": "engine/scheduler.py: the sequence to preempt when seq needs a block and none is free",
    # 06_cuda_graphs
    "pad_decode_batch": "engine/model_runner.py: pad_decode_batch(buffers, input_ids, positions, slot_mapping, "
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
}

_ACTIVE: dict[str, Callable] = {}  # the learner's functions while a `use` block runs


def seam(name: str, default: F) -> F:
    """The function to call at seam `name`: the learner's inside `use(...)`, else `default`."""
    if _ACTIVE:
        return _ACTIVE.get(name, default)
    return default


@contextlib.contextmanager
def use(**functions: Callable) -> Iterator[None]:
    """Install learner functions by seam name for the duration of the block (blocks may nest)."""
    unknown = sorted(set(functions) - set(SEAMS))
    if unknown:
        raise ValueError(f"no exercise seam named {', '.join(map(repr, unknown))}; the seams are: {', '.join(SEAMS)}")
    for name, function in functions.items():
        if not callable(function):
            raise TypeError(f"use({name}=...) needs a function, got {type(function).__name__}")
    saved = dict(_ACTIVE)
    _ACTIVE.update(functions)
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(saved)


def active() -> dict[str, Callable]:
    """The seams replaced right now (a copy), e.g. for a notebook to show what runs."""
    return dict(_ACTIVE)


def replace_active(functions: dict[str, Callable]) -> None:
    """Make exactly `functions` the replaced seams: a tensor-parallel worker mirrors rank 0's `use` blocks."""
    _ACTIVE.clear()
    _ACTIVE.update(functions)
