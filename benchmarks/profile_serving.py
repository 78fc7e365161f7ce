"""Where the server's time goes at saturation: py-spy on the server's processes during a round of rate `inf`.

Starts `python -m nanoref.serve` as benchmarks/serving.py does, warms it up with one untimed round at full size,
then runs `--rounds` rounds of `--num-requests` streamed requests sent all at once (fresh prompts each round) and
prints each round's numbers. During round `--profile-round`, py-spy samples the server's process and its children
(the engine process) by thread, and the report lists per process and thread the frames found in the most samples:
inclusive (anywhere on the stack) and self (the innermost frame).

    python benchmarks/profile_serving.py --model qwen3-0.6b-random --device cuda --num-requests 256 \\
        --client-processes 8 --out-dir /tmp/profile           # writes spy_raw.txt and report.txt there
    python benchmarks/profile_serving.py --report /tmp/profile/spy_raw.txt   # the report of an earlier recording

Needs py-spy on the PATH (`pip install py-spy`; not one of nanoref's dependencies) and leave to attach to a
process (root, or kernel.yama.ptrace_scope 0). Reading it: py-spy drops idle threads (blocked in a system call),
so a thread's share is of the samples in which it ran or wanted to. A thread that waits for the GIL shows where it
asked for it, which is often the first line (`def`) of a coroutine or function it was entering: a large "self"
share on such a line is time spent waiting for another thread of the same process, not work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402  (benchmarks/serving.py: the model, the server and its clients)


def report(raw: Path, top: int = 20) -> str:
    """py-spy's raw (collapsed-stack) output -> per process and thread, its busiest frames."""
    threads: dict[str, list] = defaultdict(lambda: [0, Counter(), Counter()])  # -> [samples, inclusive, self]
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        last_process = max(i for i, frame in enumerate(frames) if frame.startswith("process "))
        process, rest = frames[last_process].split(":")[0], frames[last_process + 1 :]
        thread = rest.pop(0) if rest and rest[0].startswith("thread ") else "thread ?"
        entry = threads[f"{process} {thread}"]
        entry[0] += int(count)
        names = {re.sub(r" \(.*\)$", "", frame) for frame in rest}  # a function counts once per sample
        for name in names:
            entry[1][name] += int(count)
        if rest:
            entry[2][rest[-1]] += int(count)
    lines = []
    for name, (samples, inclusive, own) in sorted(threads.items(), key=lambda item: -item[1][0]):
        lines.append(f"=== {name}: {samples} samples")
        lines.append("  inclusive:")
        lines += [f"    {100 * n / samples:5.1f}% {frame}" for frame, n in inclusive.most_common(top)]
        lines.append("  self:")
        lines += [f"    {100 * n / samples:5.1f}% {frame}" for frame, n in own.most_common(top // 2)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin", help="builtin, qwen3-0.6b-random, or a model folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument(
        "--client", choices=["auto", "httpx", "aiohttp"], default="auto", help="auto: aiohttp if installed"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile-round", type=int, default=1, help="the round py-spy records (0-based)")
    parser.add_argument("--seconds", type=int, default=5, help="how long py-spy records")
    parser.add_argument("--rate", type=int, default=400, help="py-spy's samples per second")
    parser.add_argument("--server-flags", default="", help="more flags for python -m nanoref.serve")
    parser.add_argument("--out-dir", type=Path, default=Path("profile_serving"))
    parser.add_argument("--report", type=Path, metavar="RAW", help="only print the report of a raw recording")
    args = parser.parse_args()
    if args.report:
        return print(report(args.report))
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not on the PATH: pip install py-spy")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    raw = args.out_dir / "spy_raw.txt"
    folder, vocab = serving.resolve_model(args.model)
    kind = serving.client_kind(args.client)
    port = serving.free_port()
    server = serving.start_server(folder, port, [f"--device={args.device}", *args.server_flags.split()])
    try:
        import httpx

        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]

        def one_round(seed: int) -> dict:
            prompts = serving.prompts_for(seed, args.num_requests, args.input_len, vocab)
            return asyncio.run(
                serving.run_rate(
                    port, model, prompts, [0.0] * len(prompts), args.output_len, args.client_processes, kind
                )
            )

        one_round(999)  # warm-up at full size, untimed
        for index in range(args.rounds):
            spy = None
            if index == args.profile_round:
                command = ["py-spy", "record", "--pid", str(server.pid), "--subprocesses", "--threads", "--nonblocking"]
                command += ["--rate", str(args.rate), "--duration", str(args.seconds), "--format=raw", "-o", str(raw)]
                spy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                time.sleep(1.0)  # (py-spy attaches to every process of the tree first)
            row = one_round(1000 + index)
            print(json.dumps(dict(round=index, profiled=spy is not None, **row)), flush=True)
            if spy is not None:
                output, _ = spy.communicate()
                if spy.returncode:
                    raise RuntimeError(f"py-spy failed:\n{output[-2000:]}")
    finally:
        server.terminate()
        server.wait(timeout=60)
    text = report(raw)
    (args.out_dir / "report.txt").write_text(text + "\n")
    print(text)
    print(f"wrote {raw} and {args.out_dir / 'report.txt'}")


if __name__ == "__main__":
    main()
