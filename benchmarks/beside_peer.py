"""nanoref beside Nano-vLLM and HF transformers on Nano-vLLM's own benchmark, in one lease.

The workload is Nano-vLLM's bench.py: 256 requests, prompts of 100-1024 random ids, 100-1024 output
tokens each, temperature 0.6, ignore_eos, on Qwen3-0.6B's architecture with random bf16 weights (`--shape 8b`:
Qwen3-8B's).
Every engine runs in its own process (Nano-vLLM sets process-wide torch defaults), on the same model
folder; each process warms up on a short prompt, then times `--runs-per-process` `generate` calls.

No timed run replays a prompt its engine has already served: both engines keep a prefix cache, so a
second call with bench.py's prompts would be answered partly from it. Timed run r of a process draws
its own prompts and lengths from bench.py's distribution with seed r (run 0 is bench.py's own stream),
in a process that has served nothing but the warm-up; each run's tok/s is its own output tokens over
its wall time, and nanoref's runs record their prefix-cache hits (0 is what makes them honest).
Processes alternate (A B B A ...), so neither engine always runs on a cooler or warmer GPU; the table
reports medians over every timed run.

    python benchmarks/beside_peer.py --out-dir results/ \\
        --engine nanoref=. --engine nano-vllm=/tmp/nano-vllm --engine nanoref-peer=.

`--engine NAME=PATH` puts PATH first on the worker's PYTHONPATH: `nanoref*` names run nanoref's
`LLM` from there, with its defaults or with options named by dash-separated flags (`eager-layers`
first: the element-wise layers and the sampler left uncompiled; then any of `peer` (Nano-vLLM's
settings: 512 sequences, 16,384 batched tokens, max_model_len 4096), `overlap`/`plain`
(overlap_scheduling True/False), `triton`/`flash`/`hybrid` (attention_backend "triton",
"flash_attn", "flash_attn+triton"), `eager` (no CUDA graphs), `fp8` (kv_cache_dtype "fp8"), `nocascade`
(disable_cascade_attn), `blockN` (KV blocks of N tokens); other words only label the run; e.g.
`nanoref-plain-flash`),
`nano-vllm` runs Nano-vLLM's, at its defaults. The engines named by --alternate run alternately,
--rounds processes each; the others once. HF transformers `generate` runs a scaled-down subset
(`--hf-seqs` prompts of the same distribution, seed 1000, `--hf-tokens` output tokens each, one padded
batch), and nanoref the same subset after its timed runs (prompts it has not seen), for the ratio. The
script also measures the device-to-device copy bandwidth and prints the workload's bytes-moved floor
(for run 0's stream): every decode step reads the weights once and each running sequence's K/V.

    python benchmarks/beside_peer.py --plot results/beside_peer.json figures/beside_peer_h200.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from random import randint, seed

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# -- the workload, as plain host data (each engine builds its own SamplingParams) ---------------------
HF_SUBSET_SEED = 1000  # the HF subset's stream: prompts no timed run has served
SHARED_PREFIX_SEED = 5000  # run r's shared system prompt (--shared-prefix-runs) draws from stream 5000 + r
SHARED_PREFIX: dict[int, int] = {}  # timed run index -> tokens of the system prompt shared by all its requests


def workload(
    run: int = 0, num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024
) -> tuple[list, list]:
    """Nano-vLLM bench.py's random stream, seeded with `run` (0: bench.py's own): (prompts as id lists, max_tokens
    per request). Each timed run of a process takes the next seed, so it serves prompts its engine never saw."""
    seed(run)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [randint(100, max_output_len) for _ in range(num_seqs)]
    if SHARED_PREFIX.get(run):  # one system prompt of its own for every request of this run
        seed(SHARED_PREFIX_SEED + run)
        system = [randint(0, 10000) for _ in range(SHARED_PREFIX[run])]
        prompts = [system + prompt for prompt in prompts]
    return prompts, max_tokens


def hf_subset(num_seqs: int, tokens: int) -> tuple[list, list]:
    prompts, _ = workload(HF_SUBSET_SEED)
    return prompts[:num_seqs], [tokens] * num_seqs


# -- workers: one engine, one process ------------------------------------------------------------------
FLAGS = {  # nanoref engine names' flags -> LLM options (nanoref-FLAG-FLAG...)
    "peer": dict(max_num_seqs=512, max_num_batched_tokens=16384, max_model_len=4096),  # Nano-vLLM's settings
    "overlap": dict(overlap_scheduling=True),
    "plain": dict(overlap_scheduling=False),  # the plain loop: the host waits for each step's tokens
    "triton": dict(attention_backend="triton"),
    "flash": dict(attention_backend="flash_attn"),
    "hybrid": dict(attention_backend="flash_attn+triton"),
    "eager": dict(enforce_eager=True),  # no decode CUDA graphs
    "fp8": dict(kv_cache_dtype="fp8"),  # K/V stored as 8-bit floats (e4m3): half the bytes decode attention reads
    "nocascade": dict(disable_cascade_attn=True),  # every sequence reads a shared prefix on its own
}


def engine_options(words: list[str]) -> dict:
    """LLM options from an engine name's words: FLAGS, blockN (KV blocks of N tokens); other words only label it."""
    options: dict = {}
    for word in words:
        if word.startswith("block") and word[5:].isdigit():
            options["kvcache_block_size"] = int(word[5:])
        elif word in FLAGS:
            options.update(FLAGS[word])
    return options


def run_nanoref(folder: str, variant: str, runs: int, subset: tuple[int, int]) -> dict:
    import contextlib

    import torch

    from nanoref import LLM, SamplingParams

    guard = contextlib.nullcontext()
    if "eager-layers" in variant:
        from nanoref.utils.compile import eager_only

        guard = eager_only()
    options = engine_options(variant.removeprefix("eager-layers").split("-"))
    with guard:
        start = time.perf_counter()
        llm = LLM(folder, **options)
        load_s = time.perf_counter() - start
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.6), use_tqdm=False)  # warm-up

        def timed(prompts: list, max_tokens: list) -> dict:
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
            hits_before = llm.scheduler.block_manager.num_hit_blocks
            torch.cuda.synchronize()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            assert sum(len(o["token_ids"]) for o in outputs) == sum(max_tokens)
            decode = [s.elapsed for s in llm.metrics.steps if s.kind == "decode"] or [0.0]
            hits = llm.scheduler.block_manager.num_hit_blocks - hits_before
            return dict(time=elapsed, tokens=sum(max_tokens), decode_ms=statistics.mean(decode) * 1e3, hits=hits)

        results = [timed(*workload(run)) for run in range(runs)]
        sub = timed(*hf_subset(*subset)) if subset[0] else dict(time=None)
    return dict(
        times=[r["time"] for r in results],
        output_tokens=[r["tokens"] for r in results],
        decode_step_ms=[r["decode_ms"] for r in results],
        prefix_cache_hit_blocks=[r["hits"] for r in results],
        subset_time=sub["time"],
        load_s=load_s,
        backend=llm.model_runner.backend.name,
        # (a checkout from before decode graphs moved out of the model runner kept them in `graphs`)
        graphs=bool(getattr(llm.model_runner, "decode_graphs", None) or getattr(llm.model_runner, "graphs", None)),
        block_size=llm.config.kvcache_block_size,
        kv_blocks=llm.config.num_kvcache_blocks,
        max_num_seqs=llm.config.max_num_seqs,
        max_num_batched_tokens=llm.config.max_num_batched_tokens,
        options={key: str(value) for key, value in options.items()},
    )


def run_nano_vllm(folder: str, runs: int) -> dict:
    from nanovllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(folder, enforce_eager=False, max_model_len=4096)
    load_s = time.perf_counter() - start
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # bench.py's warm-up
    times, tokens = [], []
    for run in range(runs):
        prompts, max_tokens = workload(run)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)  # its generate ends with a host sync (.tolist())
        tokens.append(sum(max_tokens))
    return dict(times=times, output_tokens=tokens, load_s=load_s, kv_blocks=llm.model_runner.config.num_kvcache_blocks)


def run_hf(folder: str, subset: tuple[int, int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    prompts, max_tokens = hf_subset(*subset)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    kwargs = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=subset[1], min_new_tokens=subset[1], **kwargs)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == subset[1]
    return dict(subset_time=elapsed)


def worker(args: argparse.Namespace) -> None:
    subset = (args.hf_seqs, args.hf_tokens)
    SHARED_PREFIX.update((run, args.shared_prefix_len) for run in args.shared_prefix_runs)
    if args.worker.startswith("nanoref"):
        variant = args.worker.removeprefix("nanoref").lstrip("-")
        result = run_nanoref(args.model, variant, args.runs_per_process, subset)
    elif args.worker == "nano-vllm":
        result = run_nano_vllm(args.model, args.runs_per_process)
    elif args.worker == "hf":
        result = run_hf(args.model, subset)
    else:
        raise SystemExit(f"unknown worker {args.worker!r}")
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent: model folder, bandwidth, floor, the alternating runs ---------------------------------
def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10 after warm-up)."""
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def bytes_moved(folder: Path, kv_bytes: int = 2) -> dict:
    """Bytes the workload must move at least: per decode step the weights once plus every running K/V, of
    `kv_bytes` bytes a value (2: bf16; 1: kv_cache_dtype="fp8")."""
    config = json.loads((folder / "config.json").read_text())
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * kv_bytes
    prompts, max_tokens = workload()
    total = 0
    for step in range(1, max(max_tokens)):  # decode step s makes token s + 1 of every request still running
        running = [(len(p), n) for p, n in zip(prompts, max_tokens) if n > step]
        total += weights + kv_per_token * sum(p + step for p, _ in running)
    return dict(weights=weights, kv_per_token=kv_per_token, total=total, output_tokens=sum(max_tokens))


SHAPES = {"0.6b": "Qwen3-0.6B", "8b": "Qwen3-8B"}  # --shape: the random model's architecture


def make_model(folder: Path, shape: str = "0.6b") -> Path:
    """A random bf16 model of Qwen3-0.6B's or Qwen3-8B's architecture, with the built-in model's tokenizer."""
    import torch

    sys.path.insert(0, str(REPO))
    from nanoref.testing import QWEN3_0_6B, QWEN3_8B, make_random_qwen3

    make_random_qwen3(folder, QWEN3_8B if shape == "8b" else QWEN3_0_6B, dtype=torch.bfloat16, device="cuda")
    for name in TOKENIZER_FILES:  # Nano-vLLM loads a tokenizer (for its warm-up prompt and eos only)
        shutil.copy(REPO / "nanoref" / "default_model" / name, folder / name)
    return folder


def launch(name: str, path: str, args: argparse.Namespace, folder: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, __file__, "--worker", name, "--model", str(folder)]
    command += ["--runs-per-process", str(args.runs_per_process), "--hf-seqs", str(args.hf_seqs)]
    command += ["--hf-tokens", str(args.hf_tokens), "--shared-prefix-len", str(args.shared_prefix_len)]
    command += ["--shared-prefix-runs", *map(str, args.shared_prefix_runs)]
    print(f"-- {name} ({path})", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(proc.stdout[-3000:], proc.stderr[-6000:], flush=True)
        return dict(error=proc.stderr[-500:])
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["process_s"] = round(time.perf_counter() - start, 1)
    print(f"   {json.dumps(result)}", flush=True)
    return result


def parent(args: argparse.Namespace) -> None:
    import torch

    args.out_dir.mkdir(parents=True, exist_ok=True)
    folder = make_model(Path(tempfile.mkdtemp()) / f"qwen3-{args.shape}-random", args.shape)
    bandwidth = copy_bandwidth()
    # the workers size their KV caches from the GPU's free memory: what this process's allocator still caches
    # (building the model on the GPU, the copy's buffers: ~50 GB for Qwen3-8B) would count as used by another
    # process and shrink both engines' caches (preempting, on an 80 GB card)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    print(f"GPU memory in use before the workers: {(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
    floor = bytes_moved(folder)
    floor["seconds"] = floor["total"] / bandwidth
    floor["tok_per_s"] = floor["output_tokens"] / floor["seconds"]
    floor["fp8_tok_per_s"] = floor["output_tokens"] / (bytes_moved(folder, kv_bytes=1)["total"] / bandwidth)
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {floor['seconds']:.2f} s = {floor['tok_per_s']:.0f} tok/s"
        f" (an fp8 KV cache's: {floor['fp8_tok_per_s']:.0f} tok/s)"
    )
    engines = dict(spec.split("=", 1) for spec in args.engine)
    paired = [name for name in args.alternate if name in engines]
    order: list[str] = []
    for round_ in range(args.rounds):
        order += paired if round_ % 2 == 0 else paired[::-1]
    order += [name for name in engines if name not in paired]
    if args.hf_seqs:
        order.append("hf")
    runs: list[dict] = []
    for name in order:
        runs.append(dict(engine=name, **launch(name, engines.get(name, ""), args, folder)))
        summary = dict(
            model=f"random {SHAPES[args.shape]} bf16",
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            copy_bandwidth=bandwidth,
            floor=floor,
            subset=dict(seqs=args.hf_seqs, tokens=args.hf_tokens),
            shared_prefix_runs=args.shared_prefix_runs,
            shared_prefix_len=args.shared_prefix_len,
            runs=runs,
            medians=medians(runs, args.hf_seqs * args.hf_tokens),
        )
        # written after every process, so a run cut short by a time limit still leaves what it measured
        (args.out_dir / "beside_peer.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))


def medians(runs: list[dict], subset_tokens: int) -> dict:
    """Per engine: every timed run's tok/s (its own output tokens over its time, in the order they ran) and
    their median."""
    by_engine: dict[str, dict] = {}
    for run in runs:
        entry = by_engine.setdefault(run["engine"], dict(tok_per_s=[], subset_times=[], decode_step_ms=[], by_run={}))
        rates = [round(n / t) for n, t in zip(run.get("output_tokens", []), run.get("times", []))]
        entry["tok_per_s"] += rates
        for index, rate in enumerate(rates):  # timed run r of every process serves the same workload
            entry["by_run"].setdefault(str(index), []).append(rate)
        entry["decode_step_ms"] += run.get("decode_step_ms", [])
        if run.get("subset_time"):
            entry["subset_times"].append(run["subset_time"])
    for entry in by_engine.values():
        if entry["tok_per_s"]:
            entry["median_tok_per_s"] = round(statistics.median(entry["tok_per_s"]))
        if entry["subset_times"]:
            entry["subset_tok_per_s"] = round(subset_tokens / statistics.median(entry["subset_times"]))
        if entry["decode_step_ms"]:
            entry["median_decode_step_ms"] = round(statistics.median(entry["decode_step_ms"]), 2)
        entry["median_by_run"] = {index: round(statistics.median(rates)) for index, rates in entry["by_run"].items()}
    return by_engine


def table(summary: dict) -> str:
    rows = [
        "| engine | output tok/s (each run) | median tok/s | decode step (ms) | subset tok/s |",
        "|---|---|---|---|---|",
    ]
    for name, entry in summary["medians"].items():
        each = " / ".join(f"{v:,}" for v in entry.get("tok_per_s", []))
        rows.append(
            f"| {name} | {each} | {entry.get('median_tok_per_s', '')} | {entry.get('median_decode_step_ms', '')} "
            f"| {entry.get('subset_tok_per_s', '')} |"
        )
    runs = sorted({index for entry in summary["medians"].values() for index in entry.get("median_by_run", {})}, key=int)
    if len(runs) > 1:  # each timed run index is one workload: its median per engine, and the ratio to the first engine
        rows += [
            "",
            "| timed run (workload) | " + " | ".join(summary["medians"]) + " |",
            "|---|" + "---|" * len(summary["medians"]),
        ]
        for index in runs:
            values = [entry.get("median_by_run", {}).get(index) for entry in summary["medians"].values()]
            rows.append(f"| {index} | " + " | ".join(f"{v:,}" if v else "" for v in values) + " |")
    return "\n".join(rows)


LABELS = {  # engine names as a figure shows them
    "nanoref": "nanoref, its defaults",
    "nanoref-peer": "nanoref, Nano-vLLM's settings",
    "nano-vllm": "Nano-vLLM, its defaults",
    "nanoref-fp8": 'nanoref, kv_cache_dtype="fp8"',
}


WORKLOADS = {  # a timed run index's workload as a figure names it (runs past these: "run r")
    "0": "bench.py's prompts",
    "1": "fresh prompts, same distribution",
}


def plot(source: Path, target: Path) -> None:
    """Bars: each engine's median output tok/s, one group per timed run index (one workload each) when the runs
    differ by workload, else one bar per engine; dots: the single runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(source.read_text())
    shared = set(map(str, summary.get("shared_prefix_runs", [])))
    entries = [(name, e) for name, e in summary["medians"].items() if e.get("median_tok_per_s")]
    entries.sort(key=lambda item: item[1]["median_tok_per_s"])
    runs = sorted({index for _, e in entries for index in e.get("by_run", {})}, key=int) or ["all"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(entries) * len(runs) + 0.5 * len(runs) + 1.6))
    colors = ["#4c72b0", "#dd8452", "#55a868", "#8172b3"]
    ticks, labels, row = [], [], 0.0
    for group, index in enumerate(runs):
        for color, (name, entry) in zip(colors, entries):
            rates = entry["tok_per_s"] if index == "all" else entry["by_run"].get(index, [])
            if not rates:
                continue
            ax.barh(row, statistics.median(rates), color=color, label=LABELS.get(name, name) if group == 0 else None)
            ax.scatter(rates, [row] * len(rates), color="black", s=12, zorder=3)
            row += 1
        workload = "every run" if index == "all" else WORKLOADS.get(index, f"run {index}")
        if index in shared:
            workload = f"run {index}: one shared {summary.get('shared_prefix_len', '')}-token system prompt"
        ticks.append(row - (len(entries) + 1) / 2)
        labels.append(workload)
        row += 0.6
    ax.set_yticks(ticks, labels, fontsize=8)
    floor = summary["floor"]["tok_per_s"]
    ax.axvline(floor, color="#c44e52", linestyle="--", label=f"bytes-moved floor, run 0 ({floor:,.0f} tok/s)")
    fp8_floor = summary["floor"].get("fp8_tok_per_s")
    if fp8_floor and any("fp8" in name for name, _ in entries):  # an engine with an 8-bit cache moves fewer bytes
        ax.axvline(fp8_floor, color="#c44e52", linestyle=":", label=f"the same, fp8 KV cache ({fp8_floor:,.0f} tok/s)")
        floor = fp8_floor
    ax.set_xlabel("output tokens/s (bar: median over processes; dots: the timed runs)")
    ax.set_title(
        f"Nano-vLLM's benchmark, {summary.get('model', 'random Qwen3-0.6B bf16')}\none {summary['device']}\n"
        "every timed run on prompts its engine had not served",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8, framealpha=1.0)
    ax.set_xlim(0, floor * 1.08)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", default=[], help="NAME=PYTHONPATH entry (repeatable)")
    parser.add_argument(
        "--alternate", nargs="+", default=["nanoref", "nano-vllm"], help="the engines to run alternately, in turn"
    )
    parser.add_argument("--rounds", type=int, default=2, help="processes of each alternated engine")
    parser.add_argument("--runs-per-process", type=int, default=2)
    parser.add_argument("--hf-seqs", type=int, default=32, help="HF subset size (0: skip HF)")
    parser.add_argument("--hf-tokens", type=int, default=128)
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    parser.add_argument(
        "--shared-prefix-runs",
        type=int,
        nargs="*",
        default=[],
        help="timed run indices whose requests all start with one random system prompt of their own",
    )
    parser.add_argument("--shared-prefix-len", type=int, default=1024, help="that system prompt's tokens")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b", help="the random model's architecture")
    parser.add_argument("--plot", nargs=2, type=Path, metavar=("JSON", "PNG"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plot:
        plot(*args.plot)
    elif args.worker:
        worker(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
