"""Temperature sampling in one pass over the logits: the Gumbel-max form of the exponential race, noise drawn in-kernel.

The sampler's draw is argmax_j p_j / E_j with E_j ~ Exp(1) (layers/sampler.py). Taking logs changes no argmax:
log p_j - log E_j = logits_j / T - log Z - log E_j, and log Z is the same for every j of a row, so the draw is
argmax_j (logits_j / T + G_j) with G_j = -log(E_j) = -log(-log U_j), U_j uniform: Gumbel noise. No softmax, no
(B, V) noise tensor in memory: each program reads its slice of a row once, adds noise from Triton's counter-based
generator (`tl.rand(seed, offset)`: the same seed and offset give the same number), and keeps its best score and
its column. A second, tiny pass picks each row's best chunk.

`sample_with_temperature` (layers/sampler.py: softmax, divide by drawn Exp(1) noise, argmax) is the reference:
both draw from softmax(logits / T), with different random numbers. On one GPU, per decode step at batch 256 and
Qwen3's 151,936-token vocabulary, the reference's noise kernel and three passes over (B, V) float32 buffers took
~315 us; this reads the logits once.
"""

from __future__ import annotations

import torch

from nanoref.ops.triton_setup import import_triton

triton = import_triton()
import triton.language as tl  # noqa: E402  (after import_triton: the interpreter switch comes first)

# columns of a row per program: Qwen3's 151,936 logits are 10 programs a row, so that even one row fills the GPU
CHUNK = 16384
MIN_TEMPERATURE = 1e-2  # layers/sampler.py's clamp (1 / temperature would overflow float32 logits below it)
FLOAT32_MAX = 3.4028234663852886e38


@triton.jit
def gumbel_argmax_kernel(
    logits_ptr,  # (B, V), any float dtype
    row_stride,
    temperatures_ptr,  # (B,) float32
    seed_ptr,  # (1,) int64: this step's seed
    best_score_ptr,  # (B, num_chunks) float32 out
    best_column_ptr,  # (B, num_chunks) int32 out
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    MIN_TEMPERATURE: tl.constexpr,
    FLOAT32_MAX: tl.constexpr,
):
    row = tl.program_id(0)  # grid (B, num_chunks)
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr)
    inverse_temperature = 1.0 / tl.maximum(tl.load(temperatures_ptr + row), MIN_TEMPERATURE)
    best_score = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_column = tl.zeros((BLOCK,), tl.int32)
    chunk_start = chunk * CHUNK
    chunk_end = tl.minimum(chunk_start + CHUNK, vocab)
    for start in range(chunk_start, chunk_end, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        inside = columns < chunk_end
        logits = tl.load(logits_ptr + row.to(tl.int64) * row_stride + columns, mask=inside, other=float("-inf"))
        scaled = tl.minimum(logits.to(tl.float32) * inverse_temperature, FLOAT32_MAX)  # inf -> largest; -inf stays
        # one counter per (row, column): a row's noise does not depend on the chunking
        uniform = tl.rand(seed, row * vocab + columns)
        uniform = tl.minimum(tl.maximum(uniform, 1e-20), 1.0 - 1e-7)  # keep both logs finite
        score = scaled - tl.log(-tl.log(uniform))  # + Gumbel(0, 1)
        better = score > best_score  # strict: the first column of a tie stays
        best_score = tl.where(better, score, best_score)
        best_column = tl.where(better, columns, best_column)
    top = tl.max(best_score, axis=0)
    column = tl.min(tl.where(best_score == top, best_column, vocab), axis=0)  # the lowest column reaching the top
    column = tl.minimum(column, vocab - 1)  # (an all -inf chunk: any column, its score -inf loses to other chunks)
    tl.store(best_score_ptr + row * num_chunks + chunk, top)
    tl.store(best_column_ptr + row * num_chunks + chunk, column)


def gumbel_sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) (rows may be strided, columns contiguous); temperatures: (B,) float32, clamped to
    MIN_TEMPERATURE; seed: (1,) int64 on the logits' device -> sampled ids (B,) int64, a draw from
    softmax(logits / T) per row. The same seed and logits give the same ids."""
    num_rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_chunks = triton.cdiv(vocab, CHUNK)
    best_score = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_column = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    if num_rows:
        gumbel_argmax_kernel[(num_rows, num_chunks)](
            logits, logits.stride(0), temperatures, seed, best_score, best_column, vocab, num_chunks,
            CHUNK=CHUNK, BLOCK=min(2048, triton.next_power_of_2(vocab)), MIN_TEMPERATURE=MIN_TEMPERATURE,
            FLOAT32_MAX=FLOAT32_MAX,
        )  # fmt: skip
    best_chunk = best_score.argmax(dim=1, keepdim=True)  # (B, 1): the first chunk of a tie, as in one pass
    return best_column.gather(1, best_chunk).squeeze(1).long()  # (B,)
