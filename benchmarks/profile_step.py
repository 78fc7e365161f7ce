"""Where a decode step goes: nanoref beside Nano-vLLM on one GPU, kernel by kernel.

Each engine runs in its own process on the same random bf16 folder (Qwen3-0.6B's architecture; `--shape 8b`:
Qwen3-8B's) and Nano-vLLM's workload
(see beside_peer.py): all 256 requests are admitted and prefilled, then, in the steady decode state at
batch 256, the script times `--steps` decode steps and profiles `--profile-steps` more with the torch
profiler. Per engine it prints:
- wall time per decode step, and the GPU's busy time per step (the union of its kernels' intervals): the
  difference is time the GPU sat idle, waiting for the host;
- the host's time per step spent waiting for the device (the sync that reads the sampled tokens back);
- the kernels that take the GPU's time, grouped by name, per step.

    python benchmarks/profile_step.py --engine nanoref=. --engine nano-vllm=/tmp/nano-vllm \\
        --engine nanoref-plain=. --out results/profile_step.json

`--phase prefill` profiles prefill steps instead: every request asks for one token, so each step is a prefill of
up to the engine's token budget; one stream of the workload is timed step by step (the device synchronized after
each: the first step of a process shows its one-time costs), then a second, fresh stream is profiled.
`--gemm-shapes` also lists the matmuls by input shapes with the cuBLAS kernel each ran (which GEMM is slow).

`nanoref-FLAG-FLAG` names pick nanoref's options with beside_peer.py's flags (`plain`, `triton`, `flash`,
`hybrid`, `eager`, `blockN`, ...).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from beside_peer import SHAPES, engine_options, make_model, workload  # noqa: E402


def nanoref_engine(folder: str, flags: list[str]):
    from nanoref import LLM, SamplingParams

    llm = LLM(folder, max_num_seqs=512, max_num_batched_tokens=16384, max_model_len=4096, **engine_options(flags))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.6), use_tqdm=False)

    def add(prompt, n):
        llm.add_request(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))

    def step() -> bool:  # True for a decode step
        _, record = llm.step()
        return record.kind == "decode"

    return add, step, llm.is_finished


def nano_vllm_engine(folder: str):
    from nanovllm import LLM, SamplingParams

    llm = LLM(folder, enforce_eager=False, max_model_len=4096)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)

    def add(prompt, n):
        llm.add_request(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))

    def step() -> bool:
        _, num_tokens = llm.step()
        return num_tokens < 0

    return add, step, llm.is_finished


def watch_garbage_collection() -> tuple[list[float], Callable]:
    """Record the duration (ms) of every garbage collection from now on: (the list it fills, the callback to remove
    from gc.callbacks when done)."""
    pauses: list[float] = []
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(callback)
    return pauses, callback


SYNC_NAMES = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def measure(
    name: str, folder: str, steps: int, profile_steps: int, phase: str = "decode", shapes: bool = False
) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if name.startswith("nanoref"):
        add, step, finished = nanoref_engine(folder, name.split("-")[1:])
    else:
        add, step, finished = nano_vllm_engine(folder)
    if phase == "prefill":
        return measure_prefill(add, step, finished, shapes)
    prompts, _ = workload()
    for prompt in prompts:  # every request long enough to stay in the batch throughout
        add(prompt, 1024)
    while not step():  # the prefills
        pass
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    gc_pauses, gc_callback = watch_garbage_collection()  # is a stall in the windows below a full collection?
    windows = []  # wall ms per step in each of 4 windows: shows drift or a stall
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(4):
        window_start = time.perf_counter()
        for _step in range(steps // 4):
            assert step()
        torch.cuda.synchronize()
        windows.append(round((time.perf_counter() - window_start) / (steps // 4) * 1e3, 2))
    wall_ms = (time.perf_counter() - start) / (4 * (steps // 4)) * 1e3
    cpu_ms = (time.process_time() - cpu_start) / (4 * (steps // 4)) * 1e3  # every thread of this process
    gc.callbacks.remove(gc_callback)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes) as prof:
        for _ in range(profile_steps):
            step()
        torch.cuda.synchronize()
    return dict(
        wall_ms=round(wall_ms, 3),
        windows_ms=windows,
        process_cpu_ms=round(cpu_ms, 3),
        load_average=os.getloadavg(),
        gc_pauses_ms=[round(p, 1) for p in gc_pauses if p >= 1.0],  # collections of 1 ms or more while timing
        **profile_summary(prof, profile_steps),
    )


def profile_summary(prof, per_step: int) -> dict:
    """The profiler's events -> GPU busy time, kernel time, host waits and the top kernels and host calls, per step."""
    import torch

    kernels: dict[str, float] = defaultdict(float)
    intervals = []
    sync_us = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.time_range.elapsed_us()
            intervals.append((event.time_range.start, event.time_range.end))
        elif event.name in SYNC_NAMES:
            sync_us += event.time_range.elapsed_us()
    host_calls: dict[str, float] = defaultdict(float)  # the host's own time, by op or CUDA runtime call
    for average in prof.key_averages():
        if average.device_type != torch.autograd.DeviceType.CUDA:
            host_calls[average.key] += average.self_cpu_time_total
    intervals.sort()
    busy, reach = 0.0, float("-inf")
    for begin, end in intervals:  # the union of the kernels' intervals
        if end > reach:
            busy += end - max(begin, reach)
            reach = end
    top = sorted(kernels.items(), key=lambda item: -item[1])[:18]
    gemms: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])  # (shapes, kernel) -> GPU, host
    for event in prof.events():  # (shapes are recorded only under --gemm-shapes)
        if event.name in ("aten::mm", "aten::addmm") and event.input_shapes:
            # (the longest of its kernels: cuBLAS may launch a memset of its workspace first)
            kernel = max(event.kernels, key=lambda k: k.duration).name[:60] if event.kernels else "?"
            gemms[(str(event.input_shapes), kernel)][0] += sum(k.duration for k in event.kernels)
            gemms[(str(event.input_shapes), kernel)][1] += event.cpu_time_total
    return dict(
        gemms=[  # (input shapes, kernel, GPU us per step, host us per step)
            (*k, round(gpu / per_step, 1), round(host / per_step, 1))
            for k, (gpu, host) in sorted(gemms.items(), key=lambda i: -i[1][0])[:20]
        ],
        gpu_busy_ms=round(busy / per_step / 1e3, 3),
        kernel_sum_ms=round(sum(kernels.values()) / per_step / 1e3, 3),
        host_wait_ms=round(sync_us / per_step / 1e3, 3),
        kernels_per_step=round(len(intervals) / per_step, 1),
        top_kernels=[(k[:90], round(v / per_step, 1)) for k, v in top],  # (name, microseconds per step)
        top_host=[(k[:90], round(v / per_step, 1)) for k, v in sorted(host_calls.items(), key=lambda i: -i[1])[:14]],
    )


def measure_prefill(add: Callable, step: Callable, finished: Callable, shapes: bool = False) -> dict:
    """Prefill steps: one stream timed step by step (synchronized), then a fresh one profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step_ms = []
    for prompt in workload(1)[0]:  # one output token each: every step is a prefill
        add(prompt, 1)
    while not finished():
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        step_ms.append(round((time.perf_counter() - start) * 1e3, 1))
    for prompt in workload(2)[0]:  # a stream the engine has not served (its prefix cache would skip the work)
        add(prompt, 1)
    num_steps = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes) as prof:
        while not finished():
            step()
            num_steps += 1
        torch.cuda.synchronize()
    return dict(
        wall_ms=round(sum(step_ms[1:]) / max(len(step_ms) - 1, 1), 3),  # a step after the first
        step_ms=step_ms,
        windows_ms=[],
        process_cpu_ms=0.0,
        load_average=os.getloadavg(),
        gc_pauses_ms=[],
        **profile_summary(prof, num_steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", default=[], help="NAME=PYTHONPATH entry (repeatable)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b", help="the random model's architecture")
    parser.add_argument(
        "--gemm-shapes", action="store_true", help="record the matmuls' shapes: their kernels by shape (adds host time)"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = measure(args.worker, args.model, args.steps, args.profile_steps, args.phase, args.gemm_shapes)
        print("RESULT " + json.dumps(result), flush=True)
        return
    import torch

    folder = make_model(Path(tempfile.mkdtemp()) / f"qwen3-{args.shape}-random", args.shape)
    torch.cuda.empty_cache()  # the workers size their KV caches from the free memory (beside_peer.py: parent)
    results = {}
    for spec in args.engine:
        name, path = spec.split("=", 1)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
        command = [sys.executable, __file__, "--worker", name, "--model", str(folder)]
        command += ["--steps", str(args.steps), "--profile-steps", str(args.profile_steps), "--phase", args.phase]
        command += ["--gemm-shapes"] if args.gemm_shapes else []
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"-- {name} failed\n{proc.stderr[-4000:]}", flush=True)
            continue
        results[name] = json.loads(lines[-1].removeprefix("RESULT "))
        r = results[name]
        print(
            f"-- {name}: wall {r['wall_ms']} ms/step, GPU busy {r['gpu_busy_ms']} ms, kernels "
            f"{r['kernels_per_step']}/step, host waits {r['host_wait_ms']} ms; windows {r['windows_ms']}, "
            f"process CPU {r['process_cpu_ms']} ms/step, load {r['load_average']}, GC pauses {r['gc_pauses_ms']} ms",
            flush=True,
        )
        if "step_ms" in r:
            print(f"   prefill steps, ms each (synchronized): {r['step_ms']}")
        for kernel, us in r["top_kernels"]:
            print(f"   {us:9.1f} us  {kernel}")
        for shapes, kernel, gpu_us, host_us in r["gemms"]:
            print(f"   {gpu_us:9.1f} us GPU {host_us:8.1f} us host  {shapes}  {kernel}")
        print("   host, self time per step (under the profiler):")
        for call, us in r["top_host"]:
            print(f"   {us:9.1f} us  {call}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
