"""Layers against their HF transformers counterparts, and the shape tracer."""

from __future__ import annotations

import io

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from nanoref import LLM, SamplingParams, trace_shapes
from nanoref.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from nanoref.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_hf(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    ours, theirs = RMSNorm(64, eps=1e-6), Qwen3RMSNorm(64, eps=1e-6)
    weight = torch.randn(64, generator=g).to(dtype)
    ours.weight.data, theirs.weight.data = weight.clone(), weight.clone()
    assert torch.equal(ours(x), theirs(x))


def test_fused_add_rmsnorm_equals_add_then_norm():
    g = torch.Generator().manual_seed(1)
    x, residual, weight = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g), torch.randn(32, generator=g)
    out, new_residual = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, rms_norm(x + residual, weight, 1e-6))


def test_rmsnorm_upcasts_half_precision():
    """Values whose squares overflow fp16 (> 65504) still normalise correctly."""
    x = torch.full((2, 16), 300.0, dtype=torch.float16)
    out = rms_norm(x, torch.ones(16, dtype=torch.float16), 1e-6)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), torch.ones(2, 16))


def test_rotary_matches_hf():
    g = torch.Generator().manual_seed(2)
    head_dim, theta = 32, 10_000.0
    positions = torch.tensor([0, 1, 2, 7, 0, 3, 300])  # flat tokens of several sequences
    q = torch.randn(len(positions), 4, head_dim, generator=g)  # (N, H, D)
    k = torch.randn(len(positions), 2, head_dim, generator=g)  # (N, Hk, D)
    rope = RotaryEmbedding(head_dim, 512, theta)
    q_ours, k_ours = rope(positions, q, k)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # HF's (N, D) layout
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )  # HF works on (1, H, N, D)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1))
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1))


def test_trace_shapes_prints_real_flat_shapes(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    buffer = io.StringIO()
    with trace_shapes(file=buffer) as tracer:
        llm.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    text = buffer.getvalue()
    assert "step 0 [prefill]" in text and "step 1 [decode]" in text and "step 2" not in text
    assert "cu_seqlens_q                 [0, 5, 8]" in text
    assert "embed_tokens                 input_ids (8,)  hidden (8, 64)" in text
    assert "layers.0.attn.decode         q (2, 1, 4, 16)" in text  # the decode query's length-1 axis
    assert "layers.1." not in text  # only the first layer by default
    assert "lm_head                      hidden (2, 64)  logits (2, 256)" in text  # last tokens only
    # the same facts as data
    prefill, decode = tracer.steps
    assert (prefill.kind, decode.kind) == ("prefill", "decode")
    assert prefill.metadata["cu_seqlens_q"] == [0, 5, 8] and prefill.metadata["positions"] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert decode.metadata["context_lens"] == [6, 4]
    assert decode.stage("layers.0.attn.decode")["q"] == (2, 1, 4, 16)
    assert prefill.stage("lm_head") == {"hidden": (2, 64), "logits": (2, 256)}
    before = len(buffer.getvalue())
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(buffer.getvalue()) == before and len(tracer.steps) == 2  # off outside the block
    with trace_shapes(echo=False) as quiet:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(buffer.getvalue()) == before and [s.kind for s in quiet.steps] == ["prefill", "decode"]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain loop", "overlapped loop"])
def test_a_trace_numbers_each_step_as_its_step_record_does(tiny_model, overlap):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16, overlap_scheduling=overlap)
    llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    llm.add_request([4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.metrics.clear()
    traced = []  # one trace block per step, as a notebook shows them
    while not llm.is_finished():
        with trace_shapes(echo=False) as tracer:
            _, record = llm.step()
        traced += [(step.index, step.kind) for step in tracer.steps]
        if not overlap:  # (the overlapped loop's block also shows the step it launches ahead)
            assert [step.index for step in tracer.steps] == [record.index]
    assert traced == [(record.index, record.kind) for record in llm.metrics.steps]
    with trace_shapes(echo=False) as tracer:  # generate clears the records: its steps count from 0 again
        llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [step.index for step in tracer.steps] == [record.index for record in llm.metrics.steps] == [0, 1, 2]
