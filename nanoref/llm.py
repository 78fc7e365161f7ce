"""`LLM`: the user-facing entry point, with vLLM's argument names."""

from __future__ import annotations

from pathlib import Path

import torch

from nanoref.config import EngineConfig
from nanoref.engine.llm_engine import LLMEngine

DEFAULT_MODEL = Path(__file__).parent / "default_model"


class LLM(LLMEngine):
    """A paged, continuously batched Qwen3 engine.

        llm = LLM("path/to/Qwen3-0.6B")
        llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=32))

    device: "cuda" when available, else "cpu" (the environment variable NANOREF_DEVICE, e.g. "cpu", overrides
        that default). dtype: bfloat16 on CUDA, float32 on CPU.
    max_num_seqs, max_num_batched_tokens: sequences per step, and tokens per prefill step (longer prompts are
        prefilled in chunks); default 512 and 16,384 on CUDA (what a GPU needs to be busy), 64 and 4,096 on a CPU.
    num_kvcache_blocks: an explicit count overrides the one derived from memory.
    attention_backend: "torch" (reference), "triton" (GPU; CPU through the interpreter), "cpp" (CPU: nanoref's
        C++ decode kernel, built on first use; needs a C++ compiler and ninja), "flash_attn" (CUDA,
        when installed), "flash_attn+triton" (flash-attn's prefill, nanoref's Triton decode) or "auto"
        (flash_attn+triton where flash-attn serves, else Triton on CUDA; torch on CPU).
    kvcache_block_size: tokens per KV block; default 16, or 256 when flash-attn serves.
    enforce_eager: on CUDA, skip capturing decode CUDA graphs.
    tensor_parallel_timeout: seconds rank 0 waits for the other ranks to join a collective before it stops them
        and raises (a hung worker; one that dies is reported within seconds anyway).
    overlap_scheduling: schedule and launch each decode step while the device still runs the one before.
        None (default): on for CUDA, off on a CPU (where nothing can overlap and the plain loop is simpler).
    seed: seeds the generator that requests without their own `SamplingParams.seed` draw from, so the same seed
        and the same requests give the same tokens (a request's own seed still wins); None (default): fresh
        entropy, so runs differ. Either way the global RNGs (torch, random, numpy) are left alone.
    """

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        enforce_eager: bool = False,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        kvcache_block_size: int | None = None,
        num_kvcache_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
        tensor_parallel_timeout: float = 600.0,
        overlap_scheduling: bool | None = None,
        seed: int | None = None,
    ) -> None:
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            kvcache_block_size=kvcache_block_size,
            num_kvcache_blocks=num_kvcache_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend,
            tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_timeout=tensor_parallel_timeout,
            overlap_scheduling=overlap_scheduling,
            seed=seed,
        )
        super().__init__(config)
