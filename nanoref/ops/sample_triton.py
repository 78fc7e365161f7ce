"""Temperature sampling in one pass over the logits: the Gumbel-max form of the exponential race, noise drawn in-kernel.

The sampler's draw is argmax_j p_j / E_j with E_j ~ Exp(1) (layers/sampler.py). Taking logs changes no argmax:
log p_j - log E_j = logits_j / T - log Z - log E_j, and log Z is the same for every j of a row, so the draw is
argmax_j (logits_j / T + G_j) with G_j = -log(E_j) = -log(-log U_j), U_j uniform: Gumbel noise. No softmax, no
(B, V) noise tensor in memory: each program reads its slice of a row once, adds noise from Triton's counter-based
generator (`tl.rand4x(seed, counter)`: four numbers per counter, the same seed and counter give the same ones), and
keeps its best score and its column. A second, tiny pass picks each row's best chunk.

`sample_with_temperature` (layers/sampler.py: softmax, divide by drawn Exp(1) noise, argmax) is the reference:
both draw from softmax(logits / T), with different random numbers. Measured on one H100 (2026-12-05, bf16 logits of
Qwen3's 151,936-token vocabulary, `triton.testing.do_bench`; every row cut into 16,384-column programs then):

| batch | reference (noise kernel + compiled passes) | one Philox call per logit | one call per four logits |
|---|---|---|---|
| 1 | 176 us | 49 us | 89 us |
| 8 | 88 us | 78 us | 134 us |
| 64 | 286 us | 106 us | 140 us |
| 256 | 340 us | 268 us | 147 us |

At batch 256 the generator bounds the kernel (a Philox call is ~100 integer operations; the logits are 78 MB, ~26 us
of reading), so one call serves four logits; at small batches too few programs ran (10 for one row), each looping
over its columns, so a row is now cut into more programs the fewer rows there are (TARGET_PROGRAMS: batch 256 runs
8 programs a row, near the 10 measured; batch 1 runs 75; not yet timed).
"""

from __future__ import annotations

import torch

from nanoref.ops.triton_setup import import_triton

triton = import_triton()
import triton.language as tl  # noqa: E402  (after import_triton: the interpreter switch comes first)

# programs a launch aims for: a row is cut into chunks (whole blocks of columns, one program each) until the batch
# has about this many, so that a batch of 1 spreads its row over the GPU and a batch of 256 is not cut finer than needed
TARGET_PROGRAMS = 2048
MAX_BLOCK = 2048  # columns per loop iteration of a program (four quarters, one random-number call per lane)
FLOAT32_MAX = torch.finfo(torch.float32).max


@triton.jit
def add_gumbel_and_keep_best(
    logits_ptr, columns, end, inverse_temperature, uniform, best_score, best_column, FLOAT32_MAX: tl.constexpr
):
    """One slice of a row: scores logits / T + Gumbel noise, and keeps each lane's best score and its column."""
    inside = columns < end
    logits = tl.load(logits_ptr + columns, mask=inside, other=float("-inf"))
    scaled = tl.minimum(logits.to(tl.float32) * inverse_temperature, FLOAT32_MAX)  # inf -> largest; -inf stays
    uniform = tl.minimum(tl.maximum(uniform, 1e-20), 1.0 - 1e-7)  # keep both logs finite
    score = scaled - tl.log(-tl.log(uniform))  # + Gumbel(0, 1)
    better = score > best_score  # strict: the first column of a tie stays
    return tl.where(better, score, best_score), tl.where(better, columns, best_column)


# num_chunks and chunk_size change with the batch size: unspecialised, so that no batch size compiles a variant of its
# own mid-run (Triton otherwise specialises integers equal to 1 or divisible by 16)
@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])
def gumbel_argmax_kernel(
    logits_ptr,  # (B, V), any float dtype
    row_stride,
    temperatures_ptr,  # (B,) float32
    min_temperature,  # the clamp: 1 / temperature below it would overflow float32 logits
    seed_ptr,  # (1,) int64: this step's seed
    best_score_ptr,  # (B, num_chunks) float32 out
    best_column_ptr,  # (B, num_chunks) int32 out
    vocab,
    num_chunks,
    chunk_size,  # columns per program, a multiple of BLOCK
    BLOCK: tl.constexpr,
    FLOAT32_MAX: tl.constexpr,
):
    row = tl.program_id(0)  # grid (B, num_chunks)
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr)
    inverse_temperature = 1.0 / tl.maximum(tl.load(temperatures_ptr + row), min_temperature)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    best_score = tl.full((QUARTER,), float("-inf"), tl.float32)
    best_column = tl.zeros((QUARTER,), tl.int32)
    chunk_start = chunk * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, vocab)
    blocks_per_row = tl.cdiv(vocab, BLOCK)
    for start in range(chunk_start, chunk_end, BLOCK):
        # one Philox call gives four numbers: the block's four quarters share a counter (its row, block and lane),
        # so the noise of a row does not depend on the chunking, and the generator runs once per four logits
        counters = (row * blocks_per_row + start // BLOCK) * QUARTER + lanes
        u0, u1, u2, u3 = tl.rand4x(seed, counters)
        columns = start + lanes
        best_score, best_column = add_gumbel_and_keep_best(
            row_ptr, columns, chunk_end, inverse_temperature, u0, best_score, best_column, FLOAT32_MAX
        )
        best_score, best_column = add_gumbel_and_keep_best(
            row_ptr, columns + QUARTER, chunk_end, inverse_temperature, u1, best_score, best_column, FLOAT32_MAX
        )
        best_score, best_column = add_gumbel_and_keep_best(
            row_ptr, columns + 2 * QUARTER, chunk_end, inverse_temperature, u2, best_score, best_column, FLOAT32_MAX
        )
        best_score, best_column = add_gumbel_and_keep_best(
            row_ptr, columns + 3 * QUARTER, chunk_end, inverse_temperature, u3, best_score, best_column, FLOAT32_MAX
        )
    top = tl.max(best_score, axis=0)
    column = tl.min(tl.where(best_score == top, best_column, vocab), axis=0)  # the lowest column reaching the top
    column = tl.minimum(column, vocab - 1)  # (an all -inf chunk: any column, its score -inf loses to other chunks)
    tl.store(best_score_ptr + row * num_chunks + chunk, top)
    tl.store(best_column_ptr + row * num_chunks + chunk, column)


def gumbel_sample_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seed: torch.Tensor, min_temperature: float
) -> torch.Tensor:
    """logits: (B, V) (rows may be strided, columns contiguous); temperatures: (B,) float32, clamped to
    min_temperature (the sampler's MIN_TEMPERATURE); seed: (1,) int64 on the logits' device -> sampled ids (B,)
    int64, a draw from softmax(logits / T) per row. The same seed and logits give the same ids."""
    num_rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(vocab)))
    blocks = triton.cdiv(vocab, block)
    chunks_wanted = min(blocks, max(1, TARGET_PROGRAMS // max(num_rows, 1)))
    chunk_size = block * triton.cdiv(blocks, chunks_wanted)  # whole blocks
    num_chunks = triton.cdiv(vocab, chunk_size)
    best_score = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_column = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    if num_rows:
        gumbel_argmax_kernel[(num_rows, num_chunks)](
            logits, logits.stride(0), temperatures, min_temperature, seed, best_score, best_column, vocab, num_chunks,
            chunk_size, BLOCK=block, FLOAT32_MAX=FLOAT32_MAX,
        )  # fmt: skip
    best_chunk = best_score.argmax(dim=1, keepdim=True)  # (B, 1): the first chunk of a tie, as in one pass
    return best_column.gather(1, best_chunk).squeeze(1).long()  # (B,)
