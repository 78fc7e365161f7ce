"""CUDA's temperature sampling: the one-pass Triton kernel (ops/sample_triton.py) against the reference path.

    python benchmarks/sampling_kernel.py                     # a CUDA GPU: check, then time; table and JSON
    python benchmarks/sampling_kernel.py --out results.json  # write the JSON somewhere else
    python benchmarks/sampling_kernel.py --quick --out x.json  # anywhere (a CPU: the interpreter): tiny shapes, to
                                                             # exercise the script

Shapes: Qwen3's 151,936-token vocabulary, bf16 logits of random values, temperature 0.6, batch 1 ... 256 (a decode
step's rows). Methods, on the same logits:
- reference: Exp(1) noise drawn into a (B, V) float32 buffer from a generator, then the compiled
  `sample_with_temperature` (softmax, divide, argmax): the sampler's path before the kernel, and still the path
  without Triton;
- kernel: `gumbel_sample_triton`, noise drawn inside from one seed.
First a check: the kernel's draws at the full vocabulary size (three live columns far apart, 20,000 rows) against
softmax's probabilities, every count within 5 standard deviations. Times: `triton.testing.do_bench` (median of its
repetitions, in microseconds; on a CPU the median of three calls); GB/s counts the logits read once, the least
either method must read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 151_936
BATCHES = (1, 8, 64, 256)


def check(gumbel_sample_triton, device: torch.device, vocab: int, rows: int) -> dict:
    """The kernel's frequencies over `rows` rows of `vocab` logits (three live columns far apart) against softmax's
    probabilities: every count within 5 standard deviations."""
    from nanoref.layers.sampler import MIN_TEMPERATURE

    live = torch.tensor([5, vocab // 2, vocab - 1])
    values = torch.tensor([0.0, 1.0986123, -1.0]).bfloat16()
    logits = torch.full((rows, vocab), float("-inf"), device=device, dtype=torch.bfloat16)
    logits[:, live.to(device)] = values.to(device)
    seed = torch.tensor([0], device=device)
    ids = gumbel_sample_triton(logits, torch.ones(rows, device=device), seed, MIN_TEMPERATURE).cpu()
    if not torch.isin(ids, live).all():
        raise SystemExit("the kernel drew a masked column")
    probs = values.float().softmax(-1)
    counts = torch.stack([(ids == column).sum() for column in live]).double()
    spread = 5 * (rows * probs * (1 - probs)).double().sqrt() + 1
    if ((counts - rows * probs).abs() > spread).any():
        raise SystemExit(f"the kernel's frequencies {(counts / rows).tolist()} are not softmax's {probs.tolist()}")
    return dict(frequencies=(counts / rows).tolist(), expected=probs.tolist(), rows=rows)


def reference_draw(sample, logits: torch.Tensor, temperatures: torch.Tensor, generator) -> torch.Tensor:
    """The path before the kernel: (B, V) Exp(1) noise from the generator, then the compiled exponential race."""
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator)
    return sample(logits, temperatures, noise)


def time_us(fn, device: torch.device) -> float:
    """do_bench's median in microseconds after a call that compiles (on a CPU: the median of three calls)."""
    import triton

    fn()
    if device.type != "cuda":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return sorted(times)[1]
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sampling_kernel.json")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a 4,096-token vocabulary, batch 1 and 4)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.quick:
        sys.exit("benchmarks/sampling_kernel.py needs a CUDA GPU (elsewhere --quick runs it on tiny shapes)")
    from nanoref.ops.triton_setup import import_triton, kernel_device

    triton = import_triton()
    from nanoref.layers.sampler import MIN_TEMPERATURE, sample_with_temperature_cuda
    from nanoref.ops.sample_triton import gumbel_sample_triton

    device = kernel_device()
    vocab, batches, check_rows = (4096, (1, 4), 200) if args.quick else (VOCAB, BATCHES, 20_000)
    checked = check(gumbel_sample_triton, device, vocab, check_rows)
    generator = torch.Generator(device).manual_seed(0)
    seed = torch.tensor([123], device=device)
    rows = []
    print("| batch | reference (us) | kernel (us) | kernel / reference | kernel GB/s |\n|---|---|---|---|---|")
    for batch in batches:
        logits = torch.randn(batch, vocab, device=device, generator=generator).bfloat16()
        temperatures = torch.full((batch,), args.temperature, device=device)
        reference = partial(reference_draw, sample_with_temperature_cuda, logits, temperatures, generator)
        kernel = partial(gumbel_sample_triton, logits, temperatures, seed, MIN_TEMPERATURE)
        times = {name: time_us(fn, device) for name, fn in (("reference", reference), ("kernel", kernel))}
        gbps = logits.numel() * logits.element_size() / (times["kernel"] * 1e-6) / 1e9
        rows.append(dict(batch=batch, reference_us=times["reference"], kernel_us=times["kernel"], kernel_GBps=gbps))
        ratio = times["kernel"] / times["reference"]
        print(f"| {batch} | {times['reference']:.1f} | {times['kernel']:.1f} | {ratio:.2f} | {gbps:.0f} |", flush=True)
    record = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d"),
        vocab=vocab,
        temperature=args.temperature,
        check=checked,
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"check: frequencies {[round(f, 4) for f in checked['frequencies']]} (expected "
          f"{[round(p, 4) for p in checked['expected']]}); wrote {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
