"""Where a whole run's time goes: nanoref on Nano-vLLM's workload, step by step, against the bytes-moved floor.

One process (a fresh one is what a user starts): the engine is built (its construction time is recorded: with cold
compile caches it includes every `torch.compile` and graph capture), warmed up on a short prompt, then serves one run
of Nano-vLLM's bench.py workload (seed `--seed`, prompts it has never seen; see beside_peer.py). Every engine step is
timed from the host (`LLM.step` wrapped from outside; its record says prefill or decode and who ran), and the run is
cut into phases:
- prefill steps;
- decode steps grouped by batch size (256, 128-255, ..., 1-7): the tail where few sequences remain is the last rows;
- host gaps: the run's wall time not inside any step (admission, output building, the generate loop).
For each decode group the script prints the time per step beside the floor of that step: the weights read once plus
every running sequence's K/V (its context length counted from the step records), at the measured device-to-device
copy bandwidth. The table says which phase loses the most time against its floor.

    python benchmarks/timeline.py --model path/to/Qwen3-0.6B --out results/timeline.json [--plot figures/t.png]
    python benchmarks/timeline.py --make-model /tmp/q06   # a random Qwen3-0.6B bf16 folder to run it on
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

BUCKETS = ((256, 10**9), (128, 255), (64, 127), (32, 63), (8, 31), (1, 7))


def bucket_of(batch: int) -> str:
    for low, high in BUCKETS:
        if low <= batch <= high:
            return f"decode {low}+" if high > 256 else f"decode {low}-{high}"
    return "decode ?"


def run(args: argparse.Namespace) -> dict:
    import torch
    from beside_peer import copy_bandwidth, engine_options, workload

    from nanoref import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, **engine_options(args.options.split("-") if args.options else []))
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.6), use_tqdm=False)
    warmup_s = time.perf_counter() - start

    steps: list[tuple[float, float, object]] = []
    inner = llm.step

    def timed_step():  # the engine's own step, timed from the host
        begin = time.perf_counter()
        finished, record = inner()
        steps.append((begin, time.perf_counter(), record))
        return finished, record

    llm.step = timed_step
    prompts, max_tokens = workload(args.seed)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - start
    llm.step = inner

    bandwidth = copy_bandwidth()
    config = llm.config.hf_config
    weights = sum(p.numel() * p.element_size() for p in llm.model_runner.model.parameters())
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    context: dict[int, int] = defaultdict(int)  # seq_id -> tokens whose K/V exist
    phases: dict[str, dict] = defaultdict(lambda: dict(steps=0, seconds=0.0, tokens=0, floor_s=0.0))
    trace = []
    for begin, end, record in steps:
        name = "prefill" if record.kind == "prefill" else bucket_of(record.num_seqs)
        phase = phases[name]
        phase["steps"] += 1
        phase["seconds"] += end - begin
        phase["tokens"] += record.num_tokens
        if record.kind == "decode":
            kv = sum(context[seq_id] + n for seq_id, n in record.seqs)
            phase["floor_s"] += (weights + kv * kv_per_token) / bandwidth
        for seq_id, n in record.seqs:
            context[seq_id] += n
        trace.append(dict(t=begin - steps[0][0], ms=(end - begin) * 1e3, kind=record.kind, seqs=record.num_seqs))
    in_steps = sum(end - begin for begin, end, _ in steps)
    return dict(
        model=args.model,
        device=torch.cuda.get_device_name(),
        build_s=build_s,
        warmup_s=warmup_s,
        total_s=total_s,
        host_gaps_s=total_s - in_steps,
        output_tokens=sum(max_tokens),
        bandwidth=bandwidth,
        weights=weights,
        phases=dict(phases),
        trace=trace,
    )


def table(result: dict) -> str:
    total = result["total_s"]
    lines = [
        f"{result['device']}: engine built in {result['build_s']:.1f} s, warm-up {result['warmup_s']:.1f} s; "
        f"run {total:.2f} s, {result['output_tokens'] / total:,.0f} output tok/s "
        f"(copy bandwidth {result['bandwidth'] / 1e12:.2f} TB/s)",
        "",
        "| phase | steps | seconds | share | ms/step | floor ms/step | of floor |",
        "|---|---|---|---|---|---|---|",
    ]
    order = ["prefill", *(bucket_of(low) for low, _ in BUCKETS)]
    for name in order:
        phase = result["phases"].get(name)
        if not phase:
            continue
        ms = phase["seconds"] / phase["steps"] * 1e3
        floor = phase["floor_s"] / phase["steps"] * 1e3 if phase["floor_s"] else None
        lines.append(
            f"| {name} | {phase['steps']} | {phase['seconds']:.2f} | {phase['seconds'] / total:.0%} | {ms:.2f} | "
            + (f"{floor:.2f} | {floor / ms:.0%} |" if floor else "- | - |")
        )
    lines.append(f"| host gaps | - | {result['host_gaps_s']:.2f} | {result['host_gaps_s'] / total:.0%} | - | - | - |")
    floor = sum(p["floor_s"] for p in result["phases"].values())
    lines.append(f"\nDecode floor of the whole run {floor:.2f} s: the run is at {floor / total:.0%} of it.")
    return "\n".join(lines)


def plot(result: dict, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for kind, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
        points = [p for p in result["trace"] if p["kind"] == kind]
        ax.scatter([p["t"] for p in points], [p["ms"] for p in points], s=3, color=color, label=f"{kind} step")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("step wall time (ms)")
    ax.set_yscale("log")
    twin = ax.twinx()
    twin.plot([p["t"] for p in result["trace"]], [p["seqs"] for p in result["trace"]], color="gray", lw=0.8)
    twin.set_ylabel("sequences in the step")
    ax.legend(loc="upper center")
    ax.set_title(f"nanoref on Nano-vLLM's workload, {result['device']}")
    fig.tight_layout()
    fig.savefig(target, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Qwen3 folder")
    parser.add_argument("--options", default="", help="beside_peer.py's dash-separated engine flags, e.g. plain-eager")
    parser.add_argument("--seed", type=int, default=1, help="the workload's stream (0 is bench.py's own)")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--plot", type=Path, help="draw the step timeline here")
    parser.add_argument("--from-json", type=Path, help="print (and plot) a saved result instead of running")
    parser.add_argument("--make-model", type=Path, help="write a random Qwen3-0.6B bf16 folder here and exit")
    args = parser.parse_args()
    if args.make_model:
        from beside_peer import make_model

        print(make_model(args.make_model))
        return
    result = json.loads(args.from_json.read_text()) if args.from_json else run(args)
    if args.out:
        args.out.write_text(json.dumps(result))
    print(table(result))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
