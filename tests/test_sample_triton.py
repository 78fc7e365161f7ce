"""The one-pass Gumbel-max sampling kernel (ops/sample_triton.py) against the distribution it must draw from.

It draws different random numbers from its reference (`sample_with_temperature`: softmax, divide by Exp(1) noise,
argmax), so the checks are on what a draw must be: frequencies of softmax(logits / T) (the temperature and the
noise's sign both move them far outside the bounds), masked columns never drawn, the largest logit at the smallest
temperature, no NaN from overflowing logits, a row split over chunks, and the same seed giving the same ids.
On a CPU the kernel runs under Triton's interpreter (a few hundred rows: ~10 ms per program).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (Linux wheels only)")

from nanoref.layers.sampler import MIN_TEMPERATURE  # noqa: E402
from nanoref.ops import sample_triton  # noqa: E402
from nanoref.ops.sample_triton import MAX_BLOCK, gumbel_sample_triton  # noqa: E402
from nanoref.ops.triton_setup import kernel_device  # noqa: E402

DEVICE = kernel_device()


def seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


def draw(logits: torch.Tensor, temperature: float, seed_value: int) -> torch.Tensor:
    logits = logits.to(DEVICE)
    temperatures = torch.full((logits.shape[0],), temperature, dtype=torch.float32, device=DEVICE)
    return gumbel_sample_triton(logits, temperatures, seed(seed_value), MIN_TEMPERATURE).cpu()


def assert_frequencies(ids: torch.Tensor, probs: torch.Tensor) -> None:
    """Every column's count within 5 standard deviations of rows * p (the seed is fixed: no flaky draws)."""
    rows = ids.numel()
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    expected = rows * probs.double()
    spread = 5 * (expected * (1 - probs.double())).sqrt() + 1
    assert ((counts - expected).abs() <= spread).all(), f"counts {counts.tolist()}, expected {expected.tolist()}"


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_softmax_of_the_scaled_logits(temperature):
    logits = torch.tensor([0.0] * 7 + [2.0])
    rows = 400
    ids = draw(logits.repeat(rows, 1), temperature, seed_value=7)
    # the last column: 51% at T = 1, 89% at T = 0.5; with the noise's sign flipped (argmax of logits minus Gumbel
    # noise, not plus) 72% at T = 1: 10 standard deviations off
    assert_frequencies(ids, (logits / temperature).softmax(-1))


def test_masked_columns_are_never_drawn_and_a_row_spans_chunks():
    vocab = 2 * MAX_BLOCK + 5  # three blocks, one program each: the finite columns lie in the first and the last
    logits = torch.full((6, vocab), float("-inf"))
    logits[:, 7] = 0.0
    logits[:, 2 * MAX_BLOCK + 2] = 0.5
    ids = draw(logits, 1.0, seed_value=3)
    assert set(ids.tolist()) <= {7, 2 * MAX_BLOCK + 2}, ids.tolist()
    logits[:, 7] = 10.0  # far ahead: at the smallest temperature the draw is the argmax
    assert draw(logits, 0.0, seed_value=3).tolist() == [7] * 6


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the interpreter multiplies in NumPy)
def test_overflowing_logits_give_the_largest_not_nan():
    logits = torch.tensor([[3.0e38, 1.0, -2.0, 3.3e38]], dtype=torch.float32).repeat(4, 1)
    ids = draw(logits, 0.0, seed_value=1)  # 1 / 0.01 scales both giants to inf: clamped, then the noise decides
    assert set(ids.tolist()) <= {0, 3}, ids.tolist()


def test_the_same_seed_gives_the_same_ids_and_another_seed_others():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    first, again, other = draw(logits, 1.0, 11), draw(logits, 1.0, 11), draw(logits, 1.0, 12)
    assert torch.equal(first, again)
    assert (first != other).any()
    assert first.dtype == torch.int64 and first.shape == (64,)


def test_a_rows_draw_does_not_depend_on_how_the_row_is_cut(monkeypatch):
    """Few rows cut each row into more programs than many rows do (TARGET_PROGRAMS); the noise of a column depends
    on its row and place only, so the ids are the same either way."""
    logits = torch.randn(3, 3 * MAX_BLOCK + 5, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(sample_triton, "TARGET_PROGRAMS", 1)  # one program a row
    whole = draw(logits, 1.0, 9)
    monkeypatch.setattr(sample_triton, "TARGET_PROGRAMS", 4096)  # one program a block
    assert torch.equal(draw(logits, 1.0, 9), whole)


def test_strided_rows_and_bfloat16_logits():
    full = torch.randn(8, 2 * 40, generator=torch.Generator().manual_seed(1))
    rows = full[:, :40]  # row stride 80
    assert torch.equal(draw(rows, 1.0, 5), draw(rows.contiguous(), 1.0, 5))
    logits = torch.tensor([0.0, 30.0, 0.0]).repeat(5, 1).bfloat16()
    assert draw(logits, 1.0, 5).tolist() == [1] * 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_large_vocabulary_batch_follows_the_distribution():
    """Qwen3's vocabulary size, 20,000 rows: three live columns far apart in the row, the rest masked."""
    vocab, rows = 151_936, 20_000
    logits = torch.full((rows, vocab), float("-inf"), device="cuda", dtype=torch.bfloat16)
    logits[:, [5, 80_000, vocab - 1]] = torch.tensor([0.0, 1.0986123, -1.0], device="cuda", dtype=torch.bfloat16)
    temperatures = torch.ones(rows, device="cuda")
    ids = gumbel_sample_triton(logits, temperatures, seed(0), MIN_TEMPERATURE).cpu()
    live = torch.tensor([5, 80_000, vocab - 1])
    assert torch.isin(ids, live).all()
    compact = (ids[:, None] == live[None]).long().argmax(dim=1)
    assert_frequencies(compact, torch.tensor([0.0, 1.0986123, -1.0]).bfloat16().float().softmax(-1))
