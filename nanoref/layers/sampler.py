"""Sampling one next token per sequence from the last-token logits.

Logit biases, penalties and min_tokens masks come first, where a row asks for them (`logits_processors.py`).
temperature 0 is greedy (argmax). Otherwise: scale by 1/temperature, keep the tokens at least min_p times as
likely as the most likely one, then the top_k largest logits (ties with the k-th too), then of those the smallest
set whose probability, renormalised over them, reaches top_p (HF's and vLLM's order), then draw. The draw uses
the exponential-race trick (argmax of p / E with E ~ Exp(1) is a sample from p), which needs no sort and lets a
seeded request draw its noise from its own generator, so its output does not depend on its batch.

Which path a batch takes is decided on the host, from facts the engine already knows from each
request's `SamplingParams` (`SamplingBatch`): asking the device (`bool(mask.any())`) would be a host
sync, and the first sync after a CUDA graph replay waits for the whole forward. The step's only sync
is then the final `.tolist()` of the sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nanoref.layers.logits_processors import LogitsProcessing
from nanoref.ops.triton_setup import triton_available
from nanoref.utils.compile import on_cuda
from nanoref.utils.seams import seam


@dataclass
class SamplingBatch:
    """Per-row settings on the device plus what the host knows about them (no device reads needed)."""

    temperatures: torch.Tensor | None  # (B,) float32; None when every row is greedy
    top_k: torch.Tensor | None  # (B,) int64, 0 = off; None when no unseeded row uses top_k or top_p
    top_p: torch.Tensor | None  # (B,) float32, 1.0 = off; None when no unseeded row uses top_k or top_p
    min_p: torch.Tensor | None = None  # (B,) float32, 0 = off; None when no unseeded row uses it
    all_greedy: bool = False  # every row takes the argmax: nothing random at all
    any_greedy: bool = False  # some rows take the argmax, the others sample
    any_filtered: bool = False  # some unseeded sampled row uses top_k, top_p or min_p
    # seeded rows, drawn one by one from their own generator: (row, temperature, top_k, top_p, min_p, generator)
    seeded: list[tuple[int, float, int, float, float, torch.Generator]] = field(default_factory=list)
    # the engine's own generator for unseeded rows, so the caller's global RNG is never touched
    generator: torch.Generator | None = None
    # penalties and min_tokens masks, applied to the logits before anything else (None: no row has any)
    processing: LogitsProcessing | None = None
    # (row, N) of each row whose request asked for logprobs: the model runner's, computed from the raw logits
    logprob_rows: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_host(
        cls,
        temperatures: list[float],
        top_k: list[int],
        top_p: list[float],
        generators: list[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
        default_generator: torch.Generator | None = None,
        min_p: list[float] | None = None,
    ) -> SamplingBatch:
        """Build the batch from host lists (what the model runner reads off SamplingParams; min_p None: all 0)."""
        generators = generators or [None] * len(temperatures)
        min_p = min_p or [0.0] * len(temperatures)
        seeded, any_greedy, any_sampled, any_top, any_min_p = [], False, False, False, False
        for row, (t, k, p, m, generator) in enumerate(zip(temperatures, top_k, top_p, min_p, generators)):
            if t == 0:
                any_greedy = True
            elif generator is not None:
                seeded.append((row, t, k, p, m, generator))
            else:
                any_sampled = True
                any_top |= k > 0 or p < 1.0
                any_min_p |= m > 0.0
        if not any_sampled and not seeded:
            return cls(None, None, None, all_greedy=True)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
            return host.to(device, non_blocking=True)

        return cls(
            temperatures=tensor(temperatures, torch.float32),
            top_k=tensor(top_k, torch.int64) if any_top else None,
            top_p=tensor(top_p, torch.float32) if any_top else None,
            min_p=tensor(min_p, torch.float32) if any_min_p else None,
            any_greedy=any_greedy,
            any_filtered=any_top or any_min_p,
            seeded=seeded,
            generator=default_generator,
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) float32; top_k: (B,) int (0 = off); top_p: (B,) float (1.0 = off) -> masked (B, V).

    One cut after the other, as HF's warpers and vLLM's sampler make them: top-k keeps every token whose logit is at
    least the k-th largest (a tie with it stays), then top-p keeps, of those, the smallest best-ranked set whose
    probability renormalised over them reaches top_p."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # (1, V)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]  # (B, 1): 0 means all
    kth = sorted_logits.gather(-1, k - 1)  # (B, 1): the k-th largest logit
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # (B, V): the top k (and ties)
    probs = sorted_logits.softmax(dim=-1)  # (B, V): renormalised over the top-k survivors
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V): probability of the better-ranked survivors
    # the nucleus already reached top_p without this token; top_p 1.0 is "off", not a threshold: float32
    # sums can reach 1.0 before the tail, which would drop it from rows that never asked for top_p
    # (the most likely token always stays, as in vLLM's sampler: a top_p that float32 rounds to 0 keeps one token)
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) float32, temperature applied; min_p: (B,) float (0 = off) -> (B, V), -inf where a token is
    less than min_p times as likely as the row's most likely one. p_i < min_p * p_max is
    logit_i - logit_max < log(min_p): no softmax needed, and log(0) = -inf keeps every token of a row that is off."""
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log()[:, None]  # (B, 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


# the smallest temperature that scales the logits (vLLM's clamp): below it, 1/temperature would blow float32 logits
# up to inf, and the distribution is the argmax's anyway
MIN_TEMPERATURE = 1e-2


def sampling_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one sampling distribution: logits (B, V) (penalties and masks already applied); temperatures (B,) float32;
    top_k (B,) int (0 = off), top_p (B,) float (1.0 = off), or None for neither; min_p (B,) float (0 = off) or None
    -> probabilities (B, V) float32. min_p comes before top_k and top_p (vLLM's order).

    Every sampler uses it: the plain step's, a seeded row's, the speculative target's p and the draft's q. It never
    gives NaN for valid settings: the temperature is clamped to MIN_TEMPERATURE, a logit that still overflows is
    the largest float32 instead of inf, and top-p keeps the most likely token."""
    scaled = logits.float() / temperatures.clamp(min=MIN_TEMPERATURE)[:, None]  # (B, V)
    scaled = scaled.clamp(max=torch.finfo(torch.float32).max)  # inf -> the largest finite (-inf stays: masked)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if top_k is not None:
        scaled = seam("apply_top_k_top_p", apply_top_k_top_p)(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def sample_with_temperature(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits: (B, V); temperatures: (B,) float32; noise: (B, V) float32 Exp(1) draws -> sampled ids (B,).

    Scale, softmax, divide by the noise, argmax: the caller's logits stay as they were (seeded rows and greedy rows
    of the same batch read them after this).
    """
    return sampling_probs(logits, temperatures).div_(noise).argmax(dim=-1)  # (B,)


# eager this is ~6 kernels over (B, V) float32 buffers (V = 151,936 for Qwen3); compiled, inductor fuses the
# scale, softmax, division and argmax into a couple of passes over the logits (utils/compile.py). The noise is
# drawn outside, from the engine's own generator: compiled random ops would draw from the global RNG.
sample_with_temperature_cuda = on_cuda(sample_with_temperature)


def sample_temperature_only(
    logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """logits: (B, V); temperatures: (B,) float32 -> ids (B,) drawn from softmax(logits / T), the noise from
    `generator` (None: torch's default one).

    On CUDA with Triton: one kernel reads the logits once and draws Gumbel noise inside (ops/sample_triton.py: the
    log form of the same exponential race), seeded by one number drawn from `generator`. Elsewhere: Exp(1) noise
    drawn into a (B, V) buffer, then `sample_with_temperature`."""
    if logits.is_cuda and triton_available():
        from nanoref.ops.sample_triton import gumbel_sample_triton

        seed = torch.randint(2**62, (1,), device=logits.device, generator=generator)  # (1,) int64: this draw's seed
        return gumbel_sample_triton(logits, temperatures, seed, MIN_TEMPERATURE)
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # (B, V)
    noise.exponential_(generator=generator)
    return sample_with_temperature_cuda(logits, temperatures, noise)


def sample_seeded_row(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator, min_p: float = 0.0
) -> torch.Tensor:
    """logits: (V,) -> a 0-d id, from this request's own generator: the same whatever else is in the batch."""
    device = logits.device
    # (1,) settings made by fill kernels on the device: torch.tensor([x], device=...) would copy from pageable memory,
    # which waits for the device, i.e. for this step's forward (the overlapped loop would lose its overlap)
    filtered = top_k > 0 or top_p < 1.0
    top_k_t = torch.full((1,), top_k, dtype=torch.int64, device=device) if filtered else None
    top_p_t = torch.full((1,), top_p, dtype=torch.float32, device=device) if filtered else None
    min_p_t = torch.full((1,), min_p, dtype=torch.float32, device=device) if min_p > 0.0 else None
    temperature_t = torch.full((1,), temperature, dtype=torch.float32, device=device)
    probs = sampling_probs(logits[None, :], temperature_t, top_k_t, top_p_t, min_p_t)[0]  # (V,)
    noise = torch.empty_like(probs).exponential_(generator=generator)  # (V,)
    return (probs / noise).argmax()


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor | None = None,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        generators: list[torch.Generator | None] | None = None,
        default_generator: torch.Generator | None = None,
        *,
        min_p: torch.Tensor | None = None,
        batch: SamplingBatch | None = None,
    ) -> torch.Tensor:
        """logits: (B, V) -> next token ids (B,).

        The engine passes `batch` (host facts included); the tensors-only form is for direct use and
        reads the settings back to the host once to learn the same facts. generators: a seeded request's
        own generator per row (None: unseeded); unseeded rows draw from `default_generator`; min_p: (B,) or None.
        """
        if batch is None:
            batch = SamplingBatch.from_host(
                temperatures.tolist(),
                top_k.tolist(),
                top_p.tolist(),
                generators,
                device=logits.device,
                default_generator=default_generator,
                min_p=None if min_p is None else min_p.tolist(),
            )
        if batch.processing is not None:  # penalties and masks first: every path below samples what they leave
            logits = batch.processing.apply(logits)  # (B, V) float32
        if batch.all_greedy:
            return logits.argmax(dim=-1)  # (B,)
        if batch.any_filtered:  # the general path (top_k / top_p: a sort per row)
            noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # (B, V)
            noise.exponential_(generator=batch.generator)
            probs = sampling_probs(logits, batch.temperatures, batch.top_k, batch.top_p, batch.min_p)  # (B, V)
            sampled_ids = probs.div_(noise).argmax(dim=-1)  # (B,)
        else:
            sampled_ids = sample_temperature_only(logits, batch.temperatures, batch.generator)
        for row, temperature, k, p, m, generator in batch.seeded:
            sampled_ids[row] = sample_seeded_row(logits[row], temperature, k, p, generator, m)
        if batch.any_greedy:
            return torch.where(batch.temperatures > 0, sampled_ids, logits.argmax(dim=-1))
        return sampled_ids
