"""Prefill warm-up: compile the prefill's kernels when the engine is built, not in the middle of a run.

A prefill step runs one of two attention variants: a prompt seen for the first time reads its keys from the
step's own flat k and v (unpaged); a prompt with history (a later chunk of a chunked prefill, or a prefix-cache
hit) reads every key through its block table from the paged cache (paged). Each variant is its own Triton
kernel, compiled on its first call; the compiled element-wise layers likewise compile on their first prefill.
Compiled mid-run, each costs a step of a second or more (measured on one H200: ~50 ms prefill steps took
1.3-1.7 s), so a server's first chunked request, or a benchmark's first timed run, pays it. `warm_up_prefill`
runs both variants once on a few dummy tokens that write nothing to the cache (slot -1) and read blocks of it
that no sequence holds yet, at two token counts (the compiled layers' first two sizes compile a kernel for every
size), then the sampler at batch 1 and 2 (its Triton kernel; where it is compiled instead, the same as the layers:
the first real prefill of 30 prompts recompiled it, 0.3-0.4 s).

Attached by `nanoref/llm.py` on CUDA, to the target's runner and a draft model's (on a CPU nothing compiles per shape).
"""

from __future__ import annotations

import numpy as np
import torch

from nanoref.engine.step_inputs import StepInputs, prefill_arrays, prefill_metadata
from nanoref.layers.sampler import sample_temperature_only
from nanoref.utils.context import reset_context


@torch.inference_mode()
def warm_up_prefill(runner) -> None:
    """Run one unpaged and one paged prefill forward of dummy tokens through the runner's model, writing nothing.

    The dummy sequence has 2 blocks of tokens: the unpaged step computes its first block; the paged step most of
    its second, with the first read back as history through the block table [0, 1] (whatever those blocks hold: the
    logits are only handed to the sampler, whose draws are thrown away). Returns None (no per-step hook).
    """
    device, block = runner.device, runner.block_size
    tokens = block  # per step: one block
    if 2 * tokens > runner.config.max_model_len or runner.num_kvcache_blocks < 2:
        return None  # (a toy configuration: its first prefills compile what they need)

    def forward(cached: int, new: int) -> torch.Tensor:
        """Prefill `new` dummy tokens after `cached` ones (paged where cached > 0: blocks 0 and 1 as history), built
        and uploaded as a real step's are -> logits (1, V)."""
        arrays = prefill_arrays(prefill_metadata([[0] * (cached + new)], [cached], [new], [[0, 1]], block))
        arrays["slot_mapping"][:] = -1  # store nothing
        if cached:
            arrays["block_tables"] = np.array([[0, 1]], dtype=np.int64)  # (1, 2)
        try:
            input_ids, positions = runner.upload(StepInputs(True, arrays, max_seqlen_q=new, max_seqlen_k=cached + new))
            return runner.model.compute_logits(runner.model(input_ids, positions))
        finally:
            reset_context()

    logits = forward(0, tokens)  # unpaged
    # paged, one token fewer: a second token count makes the compiled layers' copy dynamic in it (an engine without
    # decode graphs would otherwise recompile at its first real prefill)
    forward(tokens, tokens - 1)
    generator = torch.Generator(device)  # its own: the caller's random state stays as it was
    for rows in (1, 2):  # the sampler likewise (compiled without Triton: batch 1, then any batch)
        batch = logits.expand(rows, -1).contiguous()  # (rows, V)
        sample_temperature_only(batch, torch.ones(rows, dtype=torch.float32, device=device), generator)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
