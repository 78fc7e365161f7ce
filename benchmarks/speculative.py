"""Speculative decoding against plain decoding: tokens per second, per-request latency, acceptance.

    python benchmarks/speculative.py --name speculative_cpu                  # this CPU, the built-in model
    python benchmarks/speculative.py --model qwen3-0.6b-random --name speculative_h200 \\
        --configs none,draft-same,draft-random --batches 1,64 --prompt-len 128 --max-tokens 128
    python benchmarks/speculative.py --plot benchmarks/results/speculative_cpu.json figures/speculative_cpu.png

Configurations (each its own engine, all built once in this process; requests greedy, `ignore_eos`, exactly
`--max-tokens` output tokens):
- `none`: no speculation (the baseline);
- `ngram`: n-gram prompt lookup, k = `--k`, lookup tails of up to 3 tokens, with the default policy (verify steps
  only where they pay: `nanoref/speculative/policy.py`);
- `ngram-every-step`: the same with every decode step a verify step;
- `draft-same`: a draft model identical to the target (every proposal accepted: the mechanism's ceiling);
- `draft-random`: a draft with the target's shapes but other random weights (acceptance near 0: its overhead);
  as large as the target, it can never pay (nanoref/speculative/policy.py): it is not loaded, and the engine runs
  without speculation;
- `draft-shallow`: a draft made of the target's first 4 layers (`qwen3-0.6b-random`, whose later 24 layers add
  nothing to the residual stream: their o_proj and down_proj are zero, the same work at the same cost), so it
  proposes what the target would: a small draft that pays, 0.37 of the target's weights (its embedding included).
Prompts: `--workload repeat` (the built-in model: docstring-like texts that repeat their own phrases, what
n-gram lookup is for) or `random` (random ids: `qwen3-0.6b-random`, where only the drafts matter). Every timed
run sends prompts that engine has not served (fresh seeds), so the prefix cache answers nothing; each batch size
is run `--runs` times per configuration, the configurations' order reversed on every other run; the table
gives medians. Per-request latency is a request's wall time from `generate`'s start to its last token.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.llm import DEFAULT_MODEL  # noqa: E402
from nanoref.testing import EVERY_STEP  # noqa: E402

PHRASES = [
    "Return the value of the key.",
    "If the key is not found, return the default.",
    "The default is None.",
    "Raise ValueError if the value is negative.",
    "    >>> f(1)\n    1\n",
    "Each item is a tuple of (name, value).",
]


def repeat_prompts(seed: int, count: int) -> list[str]:
    """Docstring-like texts that repeat some of their own sentences (as code and docs do)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrases = rng.sample(PHRASES, 3)
        text = " ".join(rng.choice(phrases) for _ in range(rng.randrange(4, 8)))
        prompts.append(f'def f{rng.randrange(1000)}(key, default=None):\n    """{text}')
    return prompts


def random_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def make_models(name: str) -> dict[str, Path]:
    """-> {"target": folder, "random": a folder with the same shapes and other weights (or None)}."""
    if name == "builtin":
        return {"target": DEFAULT_MODEL, "random": None}
    if name == "qwen3-0.6b-random":
        from nanoref.testing import QWEN3_0_6B, make_random_qwen3

        root = Path(tempfile.mkdtemp())
        device = "cuda" if torch.cuda.is_available() else "cpu"
        target = make_random_qwen3(root / "target", QWEN3_0_6B, seed=0, dtype=torch.bfloat16, device=device)
        silence_layers_after(target, SHALLOW_LAYERS)
        return {
            "target": target,
            "random": make_random_qwen3(root / "draft", QWEN3_0_6B, seed=1, dtype=torch.bfloat16, device=device),
            "shallow": first_layers(target, root / "shallow", SHALLOW_LAYERS),
        }
    return {"target": Path(name), "random": None, "shallow": None}


SHALLOW_LAYERS = 4  # draft-shallow's layers


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to ("model.layers.3.mlp.down_proj.weight" -> 3), or None."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def silence_layers_after(folder: Path, num_layers: int) -> None:
    """Zero the attention output and MLP down projections of every layer from num_layers on: each adds exactly 0
    to the residual stream, so the model's output is that of its first num_layers layers (at the full model's cost)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in tensors.items():
        layer = layer_of(name)
        if layer is not None and layer >= num_layers and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(tensors, path, metadata={"format": "pt"})


def first_layers(folder: Path, dest: Path, num_layers: int) -> Path:
    """A model folder of folder's first num_layers layers (its embedding, final norm and head too)."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True)
    tensors = {
        name: tensor
        for name, tensor in load_file(folder / "model.safetensors").items()
        if layer_of(name) is None or layer_of(name) < num_layers
    }
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def speculative_config(config: str, models: dict, k: int) -> dict | None:
    if config == "none":
        return None
    if config == "ngram":  # (the default policy: speculation only where it pays, nanoref/speculative/policy.py)
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    if config == "ngram-every-step":  # every decode step verifies, whatever the batch and the acceptance
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, **EVERY_STEP}
    if config == "draft-same":
        return {"model": models["target"], "num_speculative_tokens": k}
    if config == "draft-random":
        if models["random"] is None:
            raise SystemExit("draft-random needs --model qwen3-0.6b-random")
        return {"model": models["random"], "num_speculative_tokens": k}
    if config == "draft-shallow":
        if models["shallow"] is None:
            raise SystemExit("draft-shallow needs --model qwen3-0.6b-random")
        return {"model": models["shallow"], "num_speculative_tokens": k}
    raise SystemExit(f"unknown configuration {config!r}")


def timed_run(llm: LLM, prompts: list, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, return_metrics=True)
    elapsed = time.perf_counter() - start
    steps = llm.metrics.steps
    drafted = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    decode_steps = [s for s in steps if s.kind == "decode"]
    tokens = sum(len(o["token_ids"]) for o in outputs)
    return {
        "tok_s": tokens / elapsed,
        "latency_s": statistics.median(o["metrics"].latency for o in outputs),
        "acceptance": accepted / drafted if drafted else None,
        # tokens a sequence gained per decode (verify) step: 1 without speculation
        "tokens_per_step": (sum(s.num_seqs + s.num_accepted_tokens for s in decode_steps))
        / max(1, sum(s.num_seqs for s in decode_steps)),
        "decode_steps": len(decode_steps),
    }


def run(args) -> dict:
    models = make_models(args.model)
    configs = args.configs.split(",")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engines = {}
    for index, config in enumerate(configs):
        settings = dict(device=device, speculative_config=speculative_config(config, models, args.k))
        if args.num_kvcache_blocks:
            settings["num_kvcache_blocks"] = args.num_kvcache_blocks
        elif device == "cuda":  # the engines share the card: engine i of n fills it up to 0.9 x (i + 1) / n (each
            # sizes its KV cache from the memory left, so the first would otherwise take it all)
            settings["gpu_memory_utilization"] = 0.9 * (index + 1) / len(configs)
        engines[config] = LLM(models["target"], **settings)
    vocab = engines[configs[0]].config.hf_config.vocab_size
    seed = 1000
    results: dict = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        for llm in engines.values():  # warm-up: first calls compile and fill caches
            timed_run(llm, make_prompts(args, seed, min(batch, 4), vocab), 8)
            seed += 1
        runs: dict[str, list[dict]] = {config: [] for config in configs}
        for index in range(args.runs):
            order = configs if index % 2 == 0 else configs[::-1]
            for config in order:
                runs[config].append(timed_run(engines[config], make_prompts(args, seed, batch, vocab), args.max_tokens))
                seed += 1
        for config in configs:
            median = {key: _median([r[key] for r in runs[config]]) for key in runs[config][0]}
            results.setdefault(str(batch), {})[config] = {**median, "runs": runs[config]}
            print(
                f"batch {batch:>3} {config:>13}: {median['tok_s']:8.1f} tok/s, latency {median['latency_s']:.3f} s,"
                f" acceptance {_fmt(median['acceptance'])}, tokens/step {median['tokens_per_step']:.2f}",
                flush=True,
            )
    return {
        "machine": args.machine or (torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
                                    or platform.machine()),
        "model": args.model, "workload": args.workload, "k": args.k, "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len, "runs": args.runs, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "results": results,
    }  # fmt: skip


def make_prompts(args, seed: int, count: int, vocab: int) -> list:
    if args.workload == "repeat":
        return repeat_prompts(seed, count)
    return random_prompts(seed, count, args.prompt_len, vocab)


def _median(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(report: dict) -> str:
    lines = [
        f"{report['machine']}; model {report['model']}; workload {report['workload']}; k = {report['k']}; "
        f"{report['max_tokens']} greedy output tokens per request; medians of {report['runs']} runs per cell, "
        f"order alternated; torch {report['torch']}; {report['date']}",
        "",
        "| batch | speculation | output tok/s | vs none | latency per request (s) | acceptance | tokens per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, row in report["results"].items():
        base = row.get("none", {}).get("tok_s")
        for config, cell in row.items():
            ratio = f"{cell['tok_s'] / base:.2f}x" if base else "-"
            lines.append(
                f"| {batch} | {config} | {cell['tok_s']:.0f} | {ratio} | {cell['latency_s']:.3f} | "
                f"{_fmt(cell['acceptance'])} | {cell['tokens_per_step']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict, figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(report["results"])
    configs = list(report["results"][batches[0]])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        ratios = [report["results"][b][config]["tok_s"] / report["results"][b]["none"]["tok_s"] for b in batches]
        bars = ax.bar([j + i * width for j in range(len(batches))], ratios, width, label=config)
        for bar, b in zip(bars, batches):
            acceptance = report["results"][b][config]["acceptance"]
            if acceptance is not None:
                ax.annotate(f"acc {acceptance:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("output tok/s relative to no speculation")
    ax.set_title(f"Speculative decoding, k = {report['k']}: {report['machine']}, {report['model']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin", help="builtin, qwen3-0.6b-random, or a model folder")
    parser.add_argument("--configs", default="none,ngram,draft-same")
    parser.add_argument("--workload", choices=["repeat", "random"], default=None, help="default: repeat for builtin")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128, help="random workload: prompt ids per request")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--num-kvcache-blocks", type=int, default=0, help="0: derived from memory (on a GPU, an equal share each)"
    )
    parser.add_argument("--machine", default="", help="the machine's name for the table (default: probed)")
    parser.add_argument("--name", default="speculative_cpu", help="results/<name>.{json,md} and figures/<name>.png")
    parser.add_argument("--plot", nargs=2, type=Path, metavar=("JSON", "PNG"), help="only redraw a figure")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot[0].read_text()), args.plot[1])
        return
    if args.workload is None:
        args.workload = "repeat" if args.model == "builtin" else "random"
    report = run(args)
    results = REPO / "benchmarks" / "results"
    (results / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (results / f"{args.name}.md").write_text(markdown(report))
    plot(report, REPO / "figures" / f"{args.name}.png")
    print(markdown(report))


if __name__ == "__main__":
    main()
