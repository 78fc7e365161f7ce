"""The benchmark scripts' parts that run without a GPU: their help, and figures drawn from results files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_kernel_benchmark_explains_its_options_without_a_gpu():
    result = run_script("benchmarks/kernel_bench.py", "--help")
    assert result.returncode == 0, result.stderr
    assert "--plot JSON" in result.stdout and "--json JSON" in result.stdout


def fake_decode_rows() -> list[dict]:
    methods = ["triton paged, block 16", "triton paged, block 256", "SDPA, gathered from pages"]
    return [
        dict(method=method, batch=batch, ctx=ctx, us=10.0, TBps=0.01 * batch * ctx / 128 / (1 + i))
        for batch in (1, 16)
        for ctx in (128, 1024)
        for i, method in enumerate(methods)
    ]


def test_the_kernel_figure_is_drawn_from_a_results_json(tmp_path):
    pytest.importorskip("matplotlib")
    record = dict(machine="Fake GPU", copy_TBps=4.0, decode=fake_decode_rows())
    (tmp_path / "kernels_fake.json").write_text(json.dumps(record))
    figure = tmp_path / "kernels_fake.png"
    json_path = str(tmp_path / "kernels_fake.json")
    result = run_script("benchmarks/kernel_bench.py", "--plot", json_path, "--figure", str(figure))
    assert result.returncode == 0, result.stderr
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_json_that_is_not_the_kernel_benchmarks_is_named(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    result = run_script(
        "benchmarks/kernel_bench.py", "--plot", str(tmp_path / "other.json"), "--figure", str(tmp_path / "x.png")
    )
    assert result.returncode != 0
    assert "is not a results file of benchmarks/kernel_bench.py" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_the_committed_kernel_figure_has_its_measurements_beside_it():
    record = json.loads((ROOT / "benchmarks/results/kernels_h200.json").read_text())
    assert record["machine"] == "NVIDIA H200" and record["copy_TBps"] > 0
    methods = {row["method"] for row in record["decode"]}
    assert {"triton paged, block 16", "triton paged, block 256", "SDPA, gathered from pages"} <= methods


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_the_serving_benchmark_counts_a_process_and_its_children_cpu_time_apart():
    """cpu_seconds(pid) -> (the process's own CPU time, its descendants'): a child that burns half a second of CPU
    shows up in the second number, not the first."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import serving
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    burn = "import sys, time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE)
    try:
        own_before, _ = serving.cpu_seconds(os.getpid())
        for _ in range(600):  # (at most a minute, on a busy machine)
            _, children = serving.cpu_seconds(os.getpid())
            if children >= 0.5:
                break
            time.sleep(0.1)
        own_after, children = serving.cpu_seconds(os.getpid())
        assert children >= 0.45, f"the child's CPU time was not counted: {children:.2f} s"
        assert own_after - own_before < 0.45  # (this process slept meanwhile)
    finally:
        child.communicate(b"")


@pytest.mark.parametrize(
    "name",
    [
        "beside_peer_h100.json",
        "beside_peer_h200_warmup.json",
        "beside_peer_h100_fp8_abc.json",
        "beside_peer_h100_87219e9.json",
    ],
)
def test_the_beside_peer_figure_is_drawn_from_each_committed_lease(tmp_path, name):
    """The H100 lease's JSON names its model; the older ones do not (the figure then says Qwen3-0.6B); an fp8
    engine's lease adds its cache's floor."""
    pytest.importorskip("matplotlib")
    figure = tmp_path / "beside_peer.png"
    result = run_script("benchmarks/beside_peer.py", "--plot", f"benchmarks/results/{name}", str(figure))
    assert result.returncode == 0, result.stderr
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_beside_peer_offers_qwen3_8b_shapes():
    result = run_script("benchmarks/beside_peer.py", "--help")
    assert result.returncode == 0, result.stderr
    assert "--shape {0.6b,8b}" in result.stdout


def test_no_benchmark_script_shadows_a_package_transformers_imports():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path: a script named like an optional package that
    transformers looks for (`kernels` was one: transformers 5.25 then imported it in place of HF's `kernels` and every
    script that builds a Qwen3 model failed) breaks them all."""
    code = "import sys; sys.path.insert(0, 'benchmarks'); from transformers import Qwen3ForCausalLM; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_the_sampling_kernel_benchmark_checks_and_times_on_tiny_shapes(tmp_path):
    """--quick runs anywhere (on a CPU the kernel runs interpreted): the distribution check, then both methods timed."""
    pytest.importorskip("triton")
    out = tmp_path / "sampling.json"
    result = run_script("benchmarks/sampling_kernel.py", "--quick", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [row["batch"] for row in record["rows"]] == [1, 4]
    assert all(row["reference_us"] > 0 and row["kernel_us"] > 0 for row in record["rows"])
    assert len(record["check"]["frequencies"]) == 3 and record["check"]["rows"] == 200


def test_the_shallow_draft_proposes_what_its_silenced_target_decodes(tmp_path):
    """speculative.py's draft-shallow: a target whose layers after the first L add exactly 0 to the residual stream,
    and a draft of its first L layers, give the same greedy tokens, so every proposal of a verify step is accepted
    (what makes it a draft that pays); the target alone differs from the unsilenced model it was made from."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import speculative as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from nanoref import LLM, SamplingParams
    from nanoref.testing import EVERY_STEP, make_tiny_qwen3

    full = make_tiny_qwen3(tmp_path / "full", seed=3, num_hidden_layers=3)
    target = make_tiny_qwen3(tmp_path / "target", seed=3, num_hidden_layers=3)
    bench.silence_layers_after(target, 1)
    draft = bench.first_layers(target, tmp_path / "draft", 1)
    prompts = [bench.random_prompts(seed, 1, length, 64)[0] for seed, length in [(1, 7), (2, 12), (3, 5)]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def tokens(folder, **settings):
        llm = LLM(folder, device="cpu", num_kvcache_blocks=64, **settings)
        return llm, [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]

    assert tokens(target)[1] == tokens(draft)[1]
    assert tokens(full)[1] != tokens(target)[1], "silencing the later layers changed nothing: the test proves nothing"
    spec = {"model": draft, "num_speculative_tokens": 3, **EVERY_STEP}
    llm, speculated = tokens(target, speculative_config=spec)
    assert speculated == tokens(target)[1]
    drafted = sum(step.num_draft_tokens for step in llm.metrics.steps)
    accepted = sum(step.num_accepted_tokens for step in llm.metrics.steps)
    assert drafted > 0 and accepted == drafted, (accepted, drafted)


def test_profile_step_lists_each_matmul_shape_with_its_time(monkeypatch):
    """`profile_step.py --gemm-shapes` attributes time to the matmuls by input shapes (which GEMM is slow): on a CPU
    profile there are no kernels, but each shape still gets its calls' host time, apart from the other shapes."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from profile_step import profile_summary

    x, tall, wide = torch.randn(64, 32), torch.randn(16, 32), torch.randn(48, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            torch.nn.functional.linear(x, tall)
            torch.nn.functional.linear(x, wide)
    rows = {shapes: (kernel, gpu_us, host_us) for shapes, kernel, gpu_us, host_us in profile_summary(prof, 3)["gemms"]}
    assert set(rows) == {"[[64, 32], [32, 16]]", "[[64, 32], [32, 48]]"}
    assert all(gpu_us == 0.0 and host_us > 0 for _, gpu_us, host_us in rows.values())


def test_the_split_decode_probe_explains_itself_and_names_what_it_needs_without_a_gpu():
    assert "two sub-batches" in run_script("benchmarks/split_decode_probe.py", "--help").stdout
    if not torch.cuda.is_available():
        result = run_script("benchmarks/split_decode_probe.py")
        assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr


@pytest.mark.slow
def test_tp_scaling_smoke_runs_its_tensor_parallel_leg_on_a_cpu(tmp_path):
    """tp_scaling.py --smoke, the run docs/benchmarks.md offers for a CPU: its tp=2 leg (here in one process of its own)
    timed the all-reduces reading an attribute the runner does not have, on torch.distributed's default group, which
    nanoref never makes, and counted the layers through another missing attribute: the run failed after its tp=1 leg.
    """
    code = f"""
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from tp_scaling import make_model, run_engine
if __name__ == "__main__":
    folder = make_model(Path({str(tmp_path / "model")!r}), smoke=True)
    print(json.dumps(run_engine(str(folder), 2, 1, False, smoke=True)))
"""
    result = run_script("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[-1])
    assert record["tp"] == 2 and len(record["times"]) == 1
    assert set(record["allreduce_us"]) == {"1", "16", "64", "256", "512", "4096", "16384"}
    assert all(us > 0 for us in record["allreduce_us"].values())
    assert record["allreduces_per_step"] == 2 * 2 + 1  # make_tiny_qwen3's two layers, and the embedding
