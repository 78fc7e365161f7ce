"""A learner with a GPU: every exercise check accepts nanoref's own answer with the engine on CUDA (compiled Triton
kernels read GPU memory; the engine compares with HF in float32). Marked `gpu`; the CPU runs the same checks in the
test_exercises_*.py files."""

from __future__ import annotations

import pytest

from nanoref import exercises
from nanoref.engine.block_manager import find_cached_prefix
from nanoref.engine.model_runner import pad_decode_batch, prefill_metadata
from nanoref.engine.scheduler import choose_preemption_victim
from nanoref.layers.activation import silu_and_mul
from nanoref.layers.embed_head import vocab_parallel_embed
from nanoref.layers.layernorm import add_rms_norm, rms_norm
from nanoref.layers.rotary import apply_rotary
from nanoref.layers.sampler import apply_top_k_top_p
from nanoref.models.qwen3_moe import moe_experts, route
from nanoref.ops import attention_torch
from nanoref.utils.seams import SEAMS

pytestmark = pytest.mark.gpu


def own_answers() -> dict:
    from nanoref.ops import attention_triton
    from nanoref.ops.store_kvcache_triton import store_kvcache_kernel

    return dict(
        prefill_metadata=prefill_metadata,
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        store_kvcache_kernel=store_kvcache_kernel,
        paged_decode_attention=attention_torch.paged_decode_attention,
        merge_splits=attention_triton.merge_splits,
        find_cached_prefix=find_cached_prefix,
        choose_preemption_victim=choose_preemption_victim,
        pad_decode_batch=pad_decode_batch,
        apply_rotary=apply_rotary,
        silu_and_mul=silu_and_mul,
        apply_top_k_top_p=apply_top_k_top_p,
        vocab_parallel_embed=vocab_parallel_embed,
        moe_route=route,
        moe_experts=moe_experts,
    )


@pytest.mark.parametrize("name", list(SEAMS))
def test_every_check_accepts_nanorefs_own_answer_on_a_gpu(name):
    answers = own_answers()
    assert name in answers, f"seam {name!r} has no answer in this test: add it"
    getattr(exercises, f"check_{name}")(answers[name])
