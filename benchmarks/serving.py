"""The server under load: Poisson arrivals at several rates, TTFT / TPOT percentiles and throughput per rate.

Starts `python -m nanoref.serve` in its own process (the clients must not share its interpreter), waits for
`/health`, then for each rate sends `--num-requests` streamed completion requests whose arrival times are a
Poisson process of that rate (exponential gaps; `inf`: all at once, the saturation point). Every request is
`--input-len` random prompt ids (fresh for each rate: the prefix cache must not answer a prompt it served) and
exactly `--output-len` tokens (`ignore_eos`), so throughput counts the same work at every rate.

The clients (`--client-processes` of them) are aiohttp where it is installed, else httpx (`--client`): httpx spends
more time per request and per streamed line, and a slow client measures itself. Per request the client records
when its first streamed token arrived (TTFT, from its send time) and the mean gap
after it (TPOT = (last - first) / (tokens - 1)); per rate the table gives p50 / p99 of both and the output
tokens per second over the whole rate's wall time. The server is warmed up first with one untimed round at full
size, and the last rate (the saturation point: put `inf` last) runs `--repeats` times on fresh prompts; its row
is the median run. Offline `LLM.generate` with the same settings serves those same prompt sets, one timed run
each, in a fresh process before the server starts (the first set) and in another after it stops (the rest): the
ratio of the medians is the server's own overhead (HTTP, JSON, server-sent events, detokenizing every token, the
hand-offs between the engine's process and the server's).

    python benchmarks/serving.py --out-dir benchmarks/results --name serving_cpu              # the built-in model
    python benchmarks/serving.py --model qwen3-0.6b-random --device cuda --name serving_h200 \\
        --rates 16,64,inf --num-requests 256 --input-len 256 --output-len 256 --client-processes 8 --repeats 3
    python benchmarks/serving.py --plot benchmarks/results/serving_cpu.json figures/serving_cpu.png

`qwen3-0.6b-random`: Qwen3-0.6B's shapes with random bf16 weights, built on the device, and a word-level
tokenizer with one word per id of its 151,936 (so every token the random model makes is text to stream).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# -- the workload -------------------------------------------------------------------------------
def prompts_for(rate_index: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """Random prompt ids, a fresh stream for each rate (seed = its index), the saturation run's too."""
    rng = random.Random(rate_index)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def arrival_gaps(rate: float, count: int, seed: int) -> list[float]:
    """Seconds between consecutive arrivals of a Poisson process of `rate` per second (0 for rate inf)."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(1000 + seed)
    return [rng.expovariate(rate) for _ in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# -- the model folder ---------------------------------------------------------------------------
def make_random_model(folder: Path) -> Path:
    """Qwen3-0.6B's shapes, random bf16 weights, and a word-level tokenizer covering its whole vocabulary."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    sys.path.insert(0, str(REPO))
    from nanoref.testing import QWEN3_0_6B, make_random_qwen3

    make_random_qwen3(folder, QWEN3_0_6B, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    vocab = {f"w{i}": i for i in range(QWEN3_0_6B["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def resolve_model(name: str) -> tuple[Path, int]:
    """-> (folder, vocabulary size)."""
    if name == "builtin":
        folder = REPO / "nanoref" / "default_model"
    elif name == "qwen3-0.6b-random":
        folder = make_random_model(Path(tempfile.mkdtemp()) / "qwen3-0.6b-random")
    else:
        folder = Path(name)
    return folder, json.loads((folder / "config.json").read_text())["vocab_size"]


# -- the server and its clients -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(folder: Path, port: int, settings: list[str]) -> subprocess.Popen:
    import httpx

    command = [sys.executable, "-m", "nanoref.serve", str(folder), "--port", str(port), *settings]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    server = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not answer /health within 600 s")


def client_kind(choice: str) -> str:
    """auto: aiohttp where it is installed (less time per request and per line than httpx), else httpx."""
    if choice != "auto":
        return choice
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "httpx"
    return "aiohttp"


def open_client(kind: str, connections: int):
    """An HTTP client session of `kind` for `connections` concurrent streams (an async context manager)."""
    if kind == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=connections)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
    import httpx

    return httpx.AsyncClient(limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def response_lines(client, url: str, body: dict):
    """POST body, then the response's lines as they arrive (httpx or aiohttp)."""
    if hasattr(client, "stream"):  # httpx.AsyncClient
        async with client.stream("POST", url, json=body, timeout=None) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                yield line
    else:  # aiohttp.ClientSession
        async with client.post(url, json=body) as response:
            response.raise_for_status()
            async for raw in response.content:  # (one line at a time, with its newline)
                yield raw.decode().rstrip("\r\n")


async def one_request(client, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    """Stream one completion -> its send time, token arrival times and token count (from `usage`)."""
    body = dict(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0.6, ignore_eos=True, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    sent, arrivals, tokens = time.perf_counter(), [], 0
    async for line in response_lines(client, url, body):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            arrivals.append(time.perf_counter())
    return dict(sent=sent, arrivals=arrivals, tokens=tokens)


async def send_all(
    port: int, model: str, prompts: list, arrivals: list[float], output_len: int, t0: float, kind: str = "httpx"
) -> list:
    """Send each prompt at its arrival time (seconds after the wall-clock time t0) through a `kind` client -> each
    request's record."""
    # a full garbage collection in the client walks everything it imported (25-90 ms measured on a 2-core CPU), and
    # that pause would count as the server's latency: freeze what exists now, as the server does (nanoref/utils/heap.py)
    gc.collect()
    gc.freeze()
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with open_client(kind, len(prompts)) as client:
        tasks = []
        for prompt, arrival in zip(prompts, arrivals):
            await asyncio.sleep(max(0.0, t0 + arrival - time.time()))
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, output_len)))
        results = await asyncio.gather(*tasks)
    offset = time.time() - time.perf_counter()
    for record, arrival in zip(results, arrivals):  # as wall-clock times, comparable across client processes
        record["sent"] += offset
        record["arrivals"] = [t + offset for t in record["arrivals"]]
        record["due"] = t0 + arrival  # when it should have been sent
    return results


def engine_timings(port: int) -> dict[str, float]:
    """The server's own TTFT and TPOT histograms' sums and counts (/metrics), measured in the engine: its TTFT runs
    from the request's arrival in the engine, so the client's TTFT less it is the HTTP side's share."""
    import httpx

    names = ("nanoref_time_to_first_token_seconds", "nanoref_time_per_output_token_seconds")
    values = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        key, _, value = line.partition(" ")
        if key.removesuffix("_sum").removesuffix("_count") in names and key.endswith(("_sum", "_count")):
            values[key] = float(value)
    return values


def cpu_seconds(pid: int) -> tuple[float, float] | None:
    """CPU time (user + system) used so far by the server's process and by its descendants together (the engine
    process), from Linux's /proc -> (server, descendants); None where there is no /proc."""

    def own(p: int) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def children(p: int) -> list[int]:
        return [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]

    try:
        server, descendants, todo = own(pid), 0.0, children(pid)
        while todo:
            child = todo.pop()
            try:
                descendants += own(child)
                todo += children(child)
            except (FileNotFoundError, ProcessLookupError):  # (one that just ended)
                pass
    except OSError:
        return None
    return server, descendants


def client_process(args: tuple) -> list:
    return asyncio.run(send_all(*args))


async def run_rate(
    port: int,
    model: str,
    prompts: list[list[int]],
    gaps: list[float],
    output_len: int,
    processes: int = 1,
    kind: str = "httpx",
    server_pid: int | None = None,
) -> dict:
    """One rate's requests, from `processes` client processes (request i from process i % processes): one
    process parsing hundreds of event streams can fall behind a fast server and measure itself instead.
    server_pid: also measure the CPU time of the server's process and of the engine's during the round."""
    arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    before = await asyncio.to_thread(engine_timings, port)
    cpu_before = cpu_seconds(server_pid) if server_pid else None
    t0 = time.time() + (2.0 if processes > 1 else 0.0)  # (time for the processes to start)
    if processes == 1:
        results = await send_all(port, model, prompts, arrivals, output_len, t0, kind)
    else:
        import multiprocessing

        shares = [
            (port, model, prompts[k::processes], arrivals[k::processes], output_len, t0, kind) for k in range(processes)
        ]
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = [r for share in await asyncio.to_thread(pool.map, client_process, shares) for r in share]
    start = t0
    wall = max(r["arrivals"][-1] for r in results if r["arrivals"]) - start
    ttft = [r["arrivals"][0] - r["sent"] for r in results]
    # per token, not per chunk: a stream that fell behind sends several tokens in one chunk
    gaps = [(r["arrivals"][-1] - r["arrivals"][0], r["tokens"] - 1) for r in results]
    tpot = [span / count for span, count in gaps if count > 0]
    tokens = sum(r["tokens"] for r in results)
    assert tokens == len(prompts) * output_len, f"{tokens} tokens streamed, {len(prompts) * output_len} asked for"
    after = await asyncio.to_thread(engine_timings, port)
    cpu_after = cpu_seconds(server_pid) if server_pid else None
    cpu = {}
    if cpu_before and cpu_after:  # busy cores over the round (1.0: one core all the time), and per streamed chunk
        server_s, engine_s = cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1]
        chunks = sum(len(r["arrivals"]) for r in results)
        cpu = dict(server_cpu=server_s / wall, engine_cpu=engine_s / wall, server_cpu_per_chunk=server_s / chunks)

    def engine_mean(name: str) -> float | None:  # over this round's requests
        count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        return (after[f"{name}_sum"] - before[f"{name}_sum"]) / count if count else None

    return dict(
        wall_s=wall, output_tokens=tokens, tok_per_s=tokens / wall,
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99),
        # where the time went: the client's mean TTFT beside the engine's own (arrival in the engine to first
        # token), and how late the latest request left its client (a client that fell behind measures itself)
        ttft_mean=sum(ttft) / len(ttft), engine_ttft_mean=engine_mean("nanoref_time_to_first_token_seconds"),
        engine_tpot_mean=engine_mean("nanoref_time_per_output_token_seconds"),
        client_late_max=max(r["sent"] - r["due"] for r in results), **cpu,
    )  # fmt: skip


# -- offline, for the server's overhead ---------------------------------------------------------
OFFLINE = """
import json, sys, time
import torch
from nanoref import LLM, SamplingParams
spec = json.loads(open(sys.argv[1]).read())
llm = LLM(spec["folder"], **spec["settings"])
params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=spec["output_len"])
# warm-up on other prompts of the same shapes (the server has served every earlier rate by its saturation run)
llm.generate(spec["warmup_prompts"], params, use_tqdm=False)
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
results = []
for prompts in spec["prompt_sets"]:
    sync(); start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync(); wall = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outputs)
    results.append(dict(wall_s=wall, output_tokens=tokens, tok_per_s=tokens / wall))
print("RESULT " + json.dumps(results))
"""


def run_offline(folder: Path, settings: dict, prompt_sets: list, warmup: list, output_len: int) -> list[dict]:
    """One fresh process: warm up, then one timed `generate` per prompt set -> each one's numbers."""
    spec = dict(folder=str(folder), settings=settings, prompt_sets=prompt_sets, warmup_prompts=warmup)
    spec["output_len"] = output_len
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:  # (too long for a command line)
        json.dump(spec, file)
        file.flush()
        proc = subprocess.run([sys.executable, "-c", OFFLINE, file.name], env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the offline run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# -- report -------------------------------------------------------------------------------------
def table(summary: dict) -> str:
    lines = [
        f"{summary['machine']}; model {summary['model']}; {summary['num_requests']} requests per rate of "
        f"{summary['input_len']} prompt + {summary['output_len']} output tokens; clients: "
        f"{summary.get('client_processes', 1)} process(es) of {summary.get('client', 'httpx')}",
        "",
        "| rate (req/s) | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | output tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary["rates"]:
        lines.append(
            f"| {row['rate']} | {row['ttft_p50'] * 1e3:.0f} | {row['ttft_p99'] * 1e3:.0f} "
            f"| {row['tpot_p50'] * 1e3:.1f} | {row['tpot_p99'] * 1e3:.1f} | {row['tok_per_s']:.0f} |"
        )
    offline, saturated = summary.get("offline"), summary["rates"][-1]
    runs = saturated.get("runs", [saturated])
    if len(runs) > 1:
        lines += ["", f"rate {saturated['rate']}: the median of {len(runs)} runs on fresh prompts, each: "
                  + ", ".join(f"{run['tok_per_s']:.0f}" for run in runs) + " tok/s"]  # fmt: skip
    if saturated.get("engine_ttft_mean") is not None:
        lines += [
            "",
            f"rate {saturated['rate']}, the median run: mean TTFT {saturated['ttft_mean'] * 1e3:.0f} ms at the client, "
            f"{saturated['engine_ttft_mean'] * 1e3:.0f} ms in the engine (from the request's arrival there); the "
            f"latest request left its client {saturated['client_late_max'] * 1e3:.0f} ms after its time",
        ]
    if saturated.get("server_cpu") is not None:
        lines += [
            "",
            f"rate {saturated['rate']}, the median run: the server's process used {saturated['server_cpu']:.2f} "
            f"cores over the run ({saturated['server_cpu_per_chunk'] * 1e6:.0f} us per streamed chunk), the engine's "
            f"{saturated['engine_cpu']:.2f}",
        ]
    if offline:
        each = ", ".join(f"{run['tok_per_s']:.0f}" for run in offline["runs"])
        lines += [
            "",
            f"offline `generate` on the same requests (one run per prompt set, the first before the server started, "
            f"the others after it stopped): {each} tok/s, median {offline['tok_per_s']:.0f}; the server at rate "
            f"{saturated['rate']}: {saturated['tok_per_s']:.0f} tok/s = "
            f"{saturated['tok_per_s'] / offline['tok_per_s']:.2f}x of offline",
        ]
    return "\n".join(lines)


def plot(source: Path, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(source.read_text())
    rows = summary["rates"]
    labels = [str(row["rate"]) for row in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, metric, title in [(axes[0], "ttft", "time to first token"), (axes[1], "tpot", "time per output token")]:
        ax.plot(x, [row[f"{metric}_p50"] * 1e3 for row in rows], "o-", label="p50")
        ax.plot(x, [row[f"{metric}_p99"] * 1e3 for row in rows], "s--", label="p99")
        ax.set(title=title, xlabel="arrival rate (requests/s)", ylabel="ms", xticks=list(x), xticklabels=labels)
        ax.legend()
    axes[2].bar(x, [row["tok_per_s"] for row in rows], color="tab:blue", label="server")
    if summary.get("offline"):
        axes[2].axhline(summary["offline"]["tok_per_s"], color="tab:orange", ls="--", label="offline generate")
    axes[2].set(title="throughput", xlabel="arrival rate (requests/s)", ylabel="output tokens/s", xticks=list(x))
    axes[2].set_xticklabels(labels)
    axes[2].legend(loc="lower right")
    fig.suptitle(f"nanoref's server, {summary['model']} on {summary['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"one {torch.cuda.get_device_name()}"
    return f"CPU, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin", help="builtin, qwen3-0.6b-random, or a model folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rates", default="1,2,4,inf", help="arrival rates in requests/s; inf: all at once")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--name", default="serving")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline comparison")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the last rate (fresh prompts each): median")
    parser.add_argument("--client-processes", type=int, default=1, help="processes sending the requests")
    parser.add_argument(
        "--client", choices=["auto", "httpx", "aiohttp"], default="auto", help="auto: aiohttp if installed"
    )
    parser.add_argument("--server-flags", default="", help="more flags for python -m nanoref.serve, e.g. '--x=1'")
    parser.add_argument("--plot", nargs=2, type=Path, metavar=("JSON", "PNG"))
    args = parser.parse_args()
    if args.plot:
        return plot(*args.plot)
    folder, vocab = resolve_model(args.model)
    kind = client_kind(args.client)
    settings = {"device": args.device}
    if args.max_num_seqs:
        settings["max_num_seqs"] = args.max_num_seqs
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()] + args.server_flags.split()
    rates = [float(rate) for rate in args.rates.split(",")]
    # the last rate's runs, each on prompts of its own; offline `generate` serves the same prompt sets, the first in
    # a process before the server starts and the others after it stops (the order alternates)
    saturation_sets = [prompts_for(1000 + k, args.num_requests, args.input_len, vocab) for k in range(args.repeats)]
    warmup = prompts_for(999, args.num_requests, args.input_len, vocab)  # prompts no timed run sends
    offline_runs = []
    if not args.no_offline:
        offline_runs += run_offline(folder, settings, saturation_sets[:1], warmup, args.output_len)
    port = free_port()
    server = start_server(folder, port, flags)
    try:
        import httpx

        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        # a warm-up at full size, all at once (compiles, CUDA graphs, the large prefills): untimed, on its own prompts
        asyncio.run(run_rate(port, model, warmup, [0.0] * len(warmup), args.output_len, args.client_processes, kind))
        rows = []
        for index, rate in enumerate(rates):
            last = index == len(rates) - 1
            runs = []
            for prompts in saturation_sets if last else [prompts_for(index, args.num_requests, args.input_len, vocab)]:
                gaps = arrival_gaps(rate, len(prompts), index)
                row = run_rate(port, model, prompts, gaps, args.output_len, args.client_processes, kind, server.pid)
                runs.append(asyncio.run(row))
                print(json.dumps(runs[-1]), flush=True)
            median = sorted(runs, key=lambda run: run["tok_per_s"])[(len(runs) - 1) // 2]  # (the lower of two)
            rows.append(dict(rate="inf" if math.isinf(rate) else rate, **median, runs=runs if last else [median]))
    finally:
        server.terminate()
        server.wait(timeout=60)
    summary = dict(
        machine=machine(), model=args.model, settings=settings, server_flags=args.server_flags,
        client_processes=args.client_processes, client=kind,
        num_requests=args.num_requests,
        input_len=args.input_len, output_len=args.output_len, rates=rows,
    )  # fmt: skip
    if not args.no_offline:
        if len(saturation_sets) > 1:
            offline_runs += run_offline(folder, settings, saturation_sets[1:], warmup, args.output_len)
        median = sorted(run["tok_per_s"] for run in offline_runs)[(len(offline_runs) - 1) // 2]
        summary["offline"] = dict(tok_per_s=median, runs=offline_runs)
    report = table(summary)
    print(report)
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out_dir / f"{args.name}.md").write_text(report + "\n")
        print(f"wrote {args.out_dir / args.name}.json and .md")


if __name__ == "__main__":
    main()
