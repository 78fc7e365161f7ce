"""flash-attn backend (CUDA, when installed) against the naive oracle and the torch backend."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoref import LLM, SamplingParams
from nanoref.ops import naive_padded_attention
from nanoref.ops.backends import resolve_backend
from nanoref.testing import make_tiny_qwen3

from .helpers import cu, random_paged_cache, random_prompts, shared_prefix_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed"),
]
BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256  # Qwen3-0.6B's attention shapes


def test_flash_varlen_and_decode_match_oracle():
    backend = resolve_backend("flash_attn", torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    lens = [1, 100, 257, 600]
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=g).to(BF16).cuda()
    k = torch.randn(sum(lens), KV_HEADS, HEAD_DIM, generator=g).to(BF16).cuda()
    v = torch.randn(sum(lens), KV_HEADS, HEAD_DIM, generator=g).to(BF16).cuda()
    out = backend.varlen(q, k, v, cu(lens).cuda(), cu(lens).cuda(), max(lens), max(lens), causal=True)
    ref = naive_padded_attention(q, k, v, cu(lens).cuda(), cu(lens).cuda())
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)

    k_lens, q_lens = [300, 513, 40], [10, 513, 1]
    k_cache, v_cache, table, k_flat, v_flat = random_paged_cache(k_lens, BLOCK, KV_HEADS, HEAD_DIM, BF16, g)
    k_cache, v_cache, table, k_flat, v_flat = (t.cuda() for t in (k_cache, v_cache, table, k_flat, v_flat))
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=g).to(BF16).cuda()
    out = backend.varlen(
        q,
        k_cache,
        v_cache,
        cu(q_lens).cuda(),
        cu(k_lens).cuda(),
        max(q_lens),
        max(k_lens),
        causal=True,
        block_table=table,
    )
    ref = naive_padded_attention(q, k_flat, v_flat, cu(q_lens).cuda(), cu(k_lens).cuda())
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)

    q = torch.randn(len(k_lens), 1, HEADS, HEAD_DIM, generator=g).to(BF16).cuda()
    seqlens = torch.tensor(k_lens, dtype=torch.int32, device="cuda")
    out = backend.decode(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True)
    ref = naive_padded_attention(q.squeeze(1), k_flat, v_flat, cu([1] * len(k_lens)).cuda(), cu(k_lens).cuda())
    torch.testing.assert_close(out.squeeze(1).float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def qwen3_head128(tmp_path_factory):
    return make_tiny_qwen3(
        tmp_path_factory.mktemp("head128") / "m",
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_size=256,
        max_position_embeddings=2048,
    )


def assert_greedy_up_to_rounding(folder, prompts, outputs, tolerance=0.1):
    """Each token the bf16 engine chose is the argmax of float32 HF logits, or within `tolerance` of it.

    bf16 kernels round differently from the reference, so at a near-tie two correct engines may pick different
    tokens, and from there on their outputs part. Comparing token lists would then fail on a correct kernel
    (or, with a loose threshold, pass a wrong one). Teacher-forcing HF on the engine's own output checks every
    choice on its own: a wrong attention kernel picks tokens far below the argmax at many positions."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        ids = torch.tensor([prompt + output["token_ids"]], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (completion, vocab): what predicts each
        chosen = logits.gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        gap = logits.max(dim=1).values - chosen
        assert gap.max().item() <= tolerance, f"prompt {index}: token {gap.argmax().item()} is {gap.max():.3f} below HF"


@pytest.mark.parametrize("backend", ["flash_attn", "flash_attn+triton"])
@pytest.mark.parametrize("chunked", [False, True])
def test_flash_backend_end_to_end_agrees_with_torch_backend(qwen3_head128, chunked, backend):
    """Plain prefill; or chunked prefill (token budget 200) with prompts sharing a 512-token prefix,
    so that flash-attn's varlen reads cached history through block tables."""
    if chunked:
        prompts = shared_prefix_prompts(seed=15, prefix_len=512, suffix_lens=[3, 260, 40])
        extra = {"max_num_batched_tokens": 200}
    else:
        prompts, extra = random_prompts(seed=14, lengths=[5, 300, 40, 700]), {}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = {"device": "cuda", "dtype": "bfloat16", "kvcache_block_size": BLOCK, "num_kvcache_blocks": 64, **extra}
    flash = LLM(qwen3_head128, attention_backend=backend, **kwargs)
    assert flash.model_runner.backend.name == backend
    reference = LLM(qwen3_head128, attention_backend="torch", **kwargs)
    for _ in range(2 if chunked else 1):  # the second round is served from the prefix cache
        out_flash, out_ref = (llm.generate(prompts, params, use_tqdm=False) for llm in (flash, reference))
        assert [o["token_ids"][:4] for o in out_flash] == [o["token_ids"][:4] for o in out_ref]
        assert_greedy_up_to_rounding(qwen3_head128, prompts, out_flash)
        assert_greedy_up_to_rounding(qwen3_head128, prompts, out_ref)  # the criterion holds for the reference too
    if chunked:
        assert flash.scheduler.block_manager.num_hit_blocks >= 3 * 2


def test_flash_backend_rejects_small_blocks(tiny_model):
    with pytest.raises(ValueError, match="multiple of 256"):
        LLM(tiny_model, attention_backend="flash_attn", kvcache_block_size=16)
