"""Tensor parallelism on the CPU: two gloo ranks give the same tokens as one rank and as HF transformers.

Each test starts real worker processes (spawned, rendezvous on a free port), so the engines here are few and
small. The torchrun test starts the same engine the way many hosts would, with `torchrun` on this one.
"""

from __future__ import annotations

import _thread
import asyncio
import gc
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanoref import LLM, ModelFolderError, SamplingParams
from nanoref.config import EngineConfig
from nanoref.parallel import tensor_parallel
from nanoref.parallel.runner import TensorParallelRunner
from nanoref.parallel.tensor_parallel import CollectiveTimeout, TensorParallelError
from nanoref.testing import make_tiny_qwen3, make_tiny_qwen3_moe

from .helpers import (
    assert_a_failing_worker_is_reported,
    assert_matches_hf,
    assert_no_block_leaked,
    assert_preempted_and_recomputed_from_the_cache,
    hf_greedy,
    listening_sockets,
    random_prompts,
    shared_prefix_prompts,
)
from .tp_faults import (
    fail_to_allocate_the_kv_cache,
    fail_to_build,
    full_weights,
    hang_forward_on_rank,
    kv_cache_shape,
    raise_on_rank,
    rank_and_shapes,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
REPO = Path(__file__).resolve().parents[1]

# name -> (builder, overrides): KV heads split (2 over 2 ranks), replicated (1 KV head on 2 ranks), biases,
# a vocabulary that does not split evenly (the last rank's rows are padding), Qwen3-MoE dense and sparse layers
MODELS = {
    "gqa2": (make_tiny_qwen3, dict()),
    "mqa-tied-odd-vocab": (
        make_tiny_qwen3,
        dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=251),
    ),
    "gqa4-bias": (
        make_tiny_qwen3,
        dict(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3, attention_bias=True),
    ),
    "moe-mixed": (
        make_tiny_qwen3_moe,
        dict(mlp_only_layers=[0], decoder_sparse_step=1, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False),
    ),
    "moe-stacked": (make_tiny_qwen3_moe, dict(save_original_format=False)),
}


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    return {name: build(root / name, seed=20 + i, **kw) for i, (name, (build, kw)) in enumerate(MODELS.items())}


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_match_one_rank_and_hf(tp_models, name):
    folder = tp_models[name]
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(seed=5, lengths=[1, 7, 23, 40], vocab=vocab)
    one = LLM(folder, device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    with LLM(folder, device="cpu", tensor_parallel_size=2) as llm:
        two = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.model_runner.world_size == 2
    assert [o["token_ids"] for o in two] == [o["token_ids"] for o in one]
    assert_matches_hf(folder, prompts, two, GREEDY.max_tokens)


def test_weights_and_kv_cache_are_split(tp_models):
    """Each rank holds its half of every split weight (the halves rebuild tp=1's tensors) and half the KV heads."""
    folder = tp_models["gqa2"]
    whole = dict(LLM(folder, device="cpu").model_runner.model.named_parameters())
    with LLM(folder, device="cpu", tensor_parallel_size=2, num_kvcache_blocks=20) as llm:
        ranks, shapes = zip(*llm.model_runner.run_on_all_ranks(rank_and_shapes))
        weights = llm.model_runner.run_on_all_ranks(full_weights)
        caches = llm.model_runner.run_on_all_ranks(kv_cache_shape)
    assert ranks == (0, 1)
    q = "model.layers.0.self_attn.qkv_proj.weight"  # [q (4 heads x 16) | k (2 x 16) | v (2 x 16)] rows
    halves = [w[q].split([32, 16, 16]) for w in weights]  # each rank: 2 query heads, 1 KV head
    rebuilt = torch.cat([torch.cat([halves[0][i], halves[1][i]]) for i in range(3)])
    assert torch.equal(rebuilt, whole[q])
    o = "model.layers.1.self_attn.o_proj.weight"  # row-parallel: split along its input columns
    assert torch.equal(torch.cat([weights[0][o], weights[1][o]], dim=1), whole[o])
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat([weights[0][down], weights[1][down]], dim=1), whole[down])
    embed = "model.embed_tokens.weight"  # vocab-parallel: rows
    assert torch.equal(torch.cat([weights[0][embed], weights[1][embed]]), whole[embed])
    norm = "model.layers.0.input_layernorm.weight"  # replicated
    assert torch.equal(weights[0][norm], whole[norm]) and torch.equal(weights[1][norm], whole[norm])
    assert caches[0] == caches[1] == (2, 2, 20, 16, 1, 16)  # (k/v, layers, blocks, block size, 1 KV head, D)


def test_moe_experts_are_split_by_intermediate(tp_models):
    """Each rank holds every expert, with its half of each expert's intermediate: gate rows and up rows of gate_up_proj,
    the matching columns of down_proj (the halves rebuild tp=1's stacks); the router and the dense layer stay whole."""
    folder = tp_models["moe-mixed"]
    whole = dict(LLM(folder, device="cpu").model_runner.model.named_parameters())
    with LLM(folder, device="cpu", tensor_parallel_size=2) as llm:
        weights = llm.model_runner.run_on_all_ranks(full_weights)
    gate_up, down = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"
    experts, two_i, hidden = whole[gate_up].shape  # (E, 2 I, hidden)
    assert [w[gate_up].shape for w in weights] == [(experts, two_i // 2, hidden)] * 2
    gates, ups = zip(*(w[gate_up].chunk(2, dim=1) for w in weights))  # each rank: [its gate rows | its up rows]
    assert torch.equal(torch.cat([*gates, *ups], dim=1), whole[gate_up])
    assert torch.equal(torch.cat([w[down] for w in weights], dim=2), whole[down])  # (E, hidden, I): columns
    router = "model.layers.1.mlp.gate.weight"
    assert all(torch.equal(w[router], whole[router]) for w in weights)


def test_replicated_kv_heads_and_padded_vocab_shapes(tp_models):
    with LLM(tp_models["mqa-tied-odd-vocab"], device="cpu", tensor_parallel_size=2) as llm:
        weights = llm.model_runner.run_on_all_ranks(full_weights)
    whole = dict(LLM(tp_models["mqa-tied-odd-vocab"], device="cpu").model_runner.model.named_parameters())
    q = "model.layers.0.self_attn.qkv_proj.weight"  # 1 KV head: both ranks keep the same k and v rows
    assert torch.equal(weights[0][q][32:], whole[q][64:]) and torch.equal(weights[1][q][32:], whole[q][64:])
    embed = weights[1]["model.embed_tokens.weight"]  # rows 126..250 and one zero row of padding
    assert embed.shape[0] == 126 and torch.equal(embed[:125], whole["model.embed_tokens.weight"][126:])
    assert not embed[125].any()


# MoE on two ranks stays in the quick loop through test_two_ranks_match_one_rank_and_hf
@pytest.mark.parametrize("name", ["gqa4-bias", pytest.param("moe-mixed", marks=pytest.mark.slow)])
def test_chunked_prefill_prefix_hits_preemption_and_overlap(tp_models, name):
    """Everything the scheduler decides happens on rank 0; the other rank must follow each kind of step."""
    folder = tp_models[name]
    prompts = shared_prefix_prompts(seed=3, prefix_len=32, suffix_lens=[5, 12, 20, 3])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    settings = dict(num_kvcache_blocks=9, kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=24)
    with LLM(folder, device="cpu", tensor_parallel_size=2, overlap_scheduling=True, **settings) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_preempted_and_recomputed_from_the_cache(llm)
        assert max(step.num_tokens for step in llm.metrics.steps if step.kind == "prefill") <= 24  # chunked
        assert_no_block_leaked(llm)
        again = llm.generate(prompts, params, use_tqdm=False)
        assert sum(step.num_hit_blocks for step in llm.metrics.steps) > 0, "the second call was meant to hit the cache"
    assert_matches_hf(folder, prompts, outputs, params.max_tokens)
    assert again == outputs


def test_seeded_sampling_matches_one_rank(tp_models):
    folder = tp_models["gqa2"]
    prompts = random_prompts(seed=8, lengths=[6, 15])
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=s, ignore_eos=True) for s in (1, 2)]
    one = LLM(folder, device="cpu").generate(prompts, params, use_tqdm=False)
    with LLM(folder, device="cpu", tensor_parallel_size=2) as llm:
        assert llm.generate(prompts, params, use_tqdm=False) == one


def test_bad_request_leaves_the_engine_serving(tp_models):
    folder = tp_models["gqa2"]
    with LLM(folder, device="cpu", tensor_parallel_size=2) as llm:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2, 3], [999]], GREEDY, use_tqdm=False)
        assert llm.scheduler.is_finished()
        outputs = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert_matches_hf(folder, [[1, 2, 3]], outputs, GREEDY.max_tokens)


def test_a_failing_worker_makes_the_caller_raise_within_seconds(tp_models):
    assert_a_failing_worker_is_reported(tp_models["gqa2"], within_s=10, device="cpu")


def test_interrupt_in_a_step_stops_the_workers(tp_models):
    """Ctrl-C while rank 0 is inside a step: KeyboardInterrupt reaches the caller and the workers stop."""
    llm = LLM(tp_models["gqa2"], device="cpu", tensor_parallel_size=2)
    workers = list(llm.model_runner.followers.procs)
    sampler = llm.model_runner.sampler

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    llm.model_runner.sampler = interrupted
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5, "Ctrl-C should hand control back at once, not wait for the workers"
    llm.model_runner.sampler = sampler
    assert all(not proc.is_alive() for proc in workers)
    with pytest.raises(TensorParallelError, match="KeyboardInterrupt"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_close_stops_the_workers(tp_models):
    llm = LLM(tp_models["gqa2"], device="cpu", tensor_parallel_size=2)
    workers = list(llm.model_runner.followers.procs)
    llm.close()
    assert all(not proc.is_alive() for proc in workers)
    assert all(proc.exitcode == 0 for proc in workers)


@pytest.mark.parametrize(
    ("overrides", "size", "match"),
    [
        (dict(), 3, "num_attention_heads"),  # 4 query heads over 3 ranks
        (dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16), 2, "num_key_value_heads"),
        (dict(intermediate_size=102), 4, "intermediate_size"),
        (dict(moe_intermediate_size=30), 4, "moe_intermediate_size"),
    ],
)
def test_splits_that_do_not_come_out_even_are_refused(tmp_path, overrides, size, match):
    build = make_tiny_qwen3_moe if "moe_intermediate_size" in overrides else make_tiny_qwen3
    folder = build(tmp_path / "m", **overrides)
    with pytest.raises(ValueError, match=match):
        LLM(folder, device="cpu", tensor_parallel_size=size)


def test_an_all_sparse_moe_model_splits_whatever_its_unused_intermediate_size(tmp_path):
    """Every layer of this Qwen3-MoE is sparse, so no layer has a dense MLP of intermediate_size (101, odd): HF and
    vLLM split only what a layer has, and so does nanoref (it refused the odd width it never builds)."""
    folder = make_tiny_qwen3_moe(tmp_path / "m", intermediate_size=101, seed=3)
    prompts = random_prompts(seed=4, lengths=[3, 11])
    llm = LLM(folder, device="cpu", tensor_parallel_size=2, num_kvcache_blocks=16)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.close()
    assert_matches_hf(folder, prompts, outputs, GREEDY.max_tokens)


def test_torchrun_one_host_two_processes(tp_models, tmp_path):
    """The many-hosts path (env rendezvous, rank 0 serves generate) on one host, as the README starts it."""
    folder = tp_models["gqa4-bias"]
    prompts = random_prompts(seed=9, lengths=[3, 17, 30])
    out = tmp_path / "tokens.json"
    script = tmp_path / "serve.py"
    script.write_text(
        "import json, os, sys\n"
        "from nanoref import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], device='cpu', tensor_parallel_size=2)\n"
        "# only rank 0 gets here; it spawned no worker of its own (torchrun started rank 1)\n"
        "json.dump(len(llm.model_runner.followers.procs), open(sys.argv[3] + '.rank' + os.environ['RANK'], 'w'))\n"
        "params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)\n"
        "outputs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)\n"
        "json.dump([o['token_ids'] for o in outputs], open(sys.argv[3], 'w'))\n"
        "llm.close()\n"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` command of this environment
    launch = ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*torchrun, *launch, str(script), str(folder), json.dumps(prompts), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "leaked" not in result.stderr, result.stderr[-3000:]  # (see the test below)
    tokens = json.loads(out.read_text())
    assert tokens == [hf_greedy(folder, p, 12) for p in prompts]
    returned = sorted(path.name for path in tmp_path.glob("tokens.json.rank*"))
    assert returned == ["tokens.json.rank0"], f"LLM(...) returned on {returned}: a follower must serve, not return"
    assert json.loads((tmp_path / "tokens.json.rank0").read_text()) == 0, "rank 0 spawned workers under torchrun"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


TWO_HOSTS = {
    # each host names its node rank, node 0's address is the master (torchrun's static rendezvous)
    "node-rank": lambda port, node: [f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}"],
    # the form docs/usage.md gives: the same command on both hosts, a c10d rendezvous on the first host
    "c10d": lambda port, node: ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nanoref-test"],
}


@pytest.mark.parametrize("rendezvous", list(TWO_HOSTS))
def test_torchrun_two_hosts_give_one_ranks_tokens(tp_models, tmp_path, rendezvous):
    """Two torchrun launches with --nnodes=2, one process each, as two hosts start them (here both on this host,
    meeting on 127.0.0.1; gloo on the CPU): the rank on the second node follows, rank 0 serves generate, and the
    tokens equal one rank's. Each launch has its own LOCAL_RANK 0, so nothing may take LOCAL_RANK for the rank."""
    folder = tp_models["gqa4-bias"]
    prompts = random_prompts(seed=10, lengths=[4, 13, 29])
    out = tmp_path / "tokens.json"
    script = tmp_path / "serve.py"
    script.write_text(
        "import json, os, sys\n"
        "from nanoref import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], device='cpu', tensor_parallel_size=2)\n"
        "json.dump(os.environ['LOCAL_RANK'], open(sys.argv[3] + '.rank' + os.environ['RANK'], 'w'))\n"
        "params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)\n"
        "outputs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)\n"
        "json.dump([o['token_ids'] for o in outputs], open(sys.argv[3], 'w'))\n"
        "llm.close()\n"
    )
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    hosts = []
    try:
        for node in (0, 1):
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
            command += [*TWO_HOSTS[rendezvous](port, node), str(script), str(folder), json.dumps(prompts), str(out)]
            with open(tmp_path / f"host{node}.log", "w") as log:
                hosts.append(subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True))
        deadline = time.monotonic() + 240
        for host in hosts:
            host.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for host in hosts:  # a launch that failed or hangs takes its workers with it (a session of its own)
            if host.poll() is None:
                os.killpg(host.pid, signal.SIGKILL)
                host.wait()
    logs = [(tmp_path / f"host{node}.log").read_text()[-3000:] for node in (0, 1)]
    assert [host.returncode for host in hosts] == [0, 0], "\n".join(logs)
    expected = LLM(folder, device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    assert json.loads(out.read_text()) == [o["token_ids"] for o in expected]
    returned = sorted(path.name for path in tmp_path.glob("tokens.json.rank*"))
    assert returned == ["tokens.json.rank0"], f"LLM(...) returned on {returned}: a follower must serve, not return"


def test_a_triton_kernel_seam_that_cannot_travel_stays_on_rank_0_under_the_torch_backend(tp_models):
    """On a GPU machine a learner's @triton.jit kernel holds locks once compiled, and cannot be pickled: an engine
    whose backend never calls the Triton seams does not send them, and serves (the capstone runs every exercise at
    once, on two ranks)."""
    import threading

    from nanoref.utils.seams import use

    class CompiledKernel:  # what cloudpickle meets in a compiled Triton kernel: a lock
        def __init__(self):
            self.lock = threading.RLock()

        def __getitem__(self, grid):
            raise AssertionError("the torch backend never launches the KV-store kernel")

        __call__ = __getitem__

    folder = tp_models["gqa2"]
    prompts = random_prompts(seed=14, lengths=[5, 19])
    with LLM(folder, device="cpu", tensor_parallel_size=2, attention_backend="torch") as llm:
        with use(store_kvcache_kernel=CompiledKernel()):
            got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert got == llm_without_function(folder, prompts)


def test_exercise_functions_run_on_every_rank(tp_models):
    """A learner's function (here a local one, which no worker could import) replaces the seam on every rank:
    two ranks with it give what one rank gives with it, not what the engine gives without it."""
    import torch.nn.functional as F

    from nanoref.utils.seams import use

    def swapped(x):  # gate and up the wrong way round: the output changes if, and only if, every rank uses it
        gate, up = x.chunk(2, dim=-1)
        return F.silu(up) * gate

    folder = tp_models["gqa2"]
    # separate prompts for each phase: K/V cached by a run without the function must not serve a run with it
    prompts = random_prompts(seed=12, lengths=[5, 19])
    other = random_prompts(seed=13, lengths=[6, 21])
    one = LLM(folder, device="cpu")
    with LLM(folder, device="cpu", tensor_parallel_size=2) as llm:
        plain = llm.generate(prompts, GREEDY, use_tqdm=False)
        with use(silu_and_mul=swapped):
            changed = llm.generate(other, GREEDY, use_tqdm=False)
            expected = one.generate(other, GREEDY, use_tqdm=False)
        after = llm.generate(prompts, GREEDY, use_tqdm=False)  # leaving the block restores every rank
    assert changed == expected
    assert changed != llm_without_function(folder, other)
    assert after == plain


def llm_without_function(folder, prompts):
    return LLM(folder, device="cpu").generate(prompts, GREEDY, use_tqdm=False)


def test_an_error_before_the_step_is_sent_keeps_the_engine(tp_models):
    """A learner's prefill_metadata that raises on rank 0 fails the call, but nothing reached rank 1: the engine
    goes on serving, with the same workers."""
    from nanoref.utils.seams import use

    def broken_metadata(*args):
        raise ValueError("not written yet")

    folder = tp_models["gqa2"]
    with LLM(folder, device="cpu", tensor_parallel_size=2) as llm:
        workers = list(llm.model_runner.followers.procs)
        with use(prefill_metadata=broken_metadata), pytest.raises(ValueError, match="not written yet"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert all(proc.is_alive() for proc in workers)
        outputs = llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)
    assert_matches_hf(folder, [[4, 5, 6]], outputs, GREEDY.max_tokens)


# -- the engine's life: close, two engines, failures while starting, calls, hung workers, scripts -----------------


def alive_workers() -> list:
    return [proc for proc in multiprocessing.active_children() if proc.name.startswith("nanoref-tp-rank")]


def test_a_closed_engine_refuses_every_call_with_a_clear_error(tp_models):
    llm = LLM(tp_models["gqa2"], device="cpu", tensor_parallel_size=2)
    llm.close()
    with pytest.raises(TensorParallelError, match="this LLM was closed; create a new LLM"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    with pytest.raises(TensorParallelError, match="this LLM was closed; create a new LLM"):
        llm.model_runner.run_on_all_ranks(rank_and_shapes)
    assert llm.scheduler.is_finished()  # the refused call left nothing queued


def test_two_engines_in_one_process_serve_independently(tp_models):
    """Each engine has its own groups and workers: both serve at once, and closing one leaves the other serving."""
    folder = tp_models["gqa2"]
    first = LLM(folder, device="cpu", tensor_parallel_size=2)
    with LLM(folder, device="cpu", tensor_parallel_size=2) as second:
        both = [engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False) for engine in (first, second)]
        assert both[0] == both[1]
        first.close()
        with pytest.raises(TensorParallelError, match="this LLM was closed"):
            first.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert all(proc.is_alive() for proc in second.model_runner.followers.procs)
        outputs = second.generate([[4, 5, 6]], GREEDY, use_tqdm=False)
    assert_matches_hf(folder, [[4, 5, 6]], outputs, GREEDY.max_tokens)


def test_close_closes_every_socket_the_engine_listens_on(tp_models):
    """The rendezvous store and gloo listen on 127.0.0.1 only, and close() closes them at once (no garbage
    collection needed: it is off here)."""
    gc.collect()
    gc.disable()
    try:
        before = listening_sockets()
        llm = LLM(tp_models["gqa2"], device="cpu", tensor_parallel_size=2)
        opened = listening_sockets() - before
        llm.close()
        after = listening_sockets()
    finally:
        gc.enable()
    assert opened, "a tensor-parallel engine was expected to listen (its rendezvous store, gloo)"
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1 in /proc/net/tcp and as IPv6-mapped
    assert {address for address, _ in opened} <= loopback, f"listening beyond 127.0.0.1: {opened}"
    assert after == before, f"still listening after close(): {after - before}"


def test_a_broken_tokenizer_is_refused_before_any_worker_starts(tp_models, tmp_path, monkeypatch):
    folder = shutil.copytree(tp_models["gqa2"], tmp_path / "m")
    (folder / "tokenizer.json").write_text("{not json")

    def spawn(config, runner):
        raise AssertionError("the workers were spawned before the folder was checked")

    monkeypatch.setattr(tensor_parallel, "_spawn_workers", spawn)
    with pytest.raises(ModelFolderError, match="tokenizer"):
        LLM(folder, device="cpu", tensor_parallel_size=2)


def test_a_failure_after_the_workers_started_stops_them_before_llm_raises(tp_models, monkeypatch):
    """Even while the exception (and so the half-built engine) is still referenced, as a notebook keeps it."""
    from nanoref.engine import llm_engine

    def broken_scheduler(**kwargs):
        raise RuntimeError("injected scheduler failure")

    monkeypatch.setattr(llm_engine, "Scheduler", broken_scheduler)
    with pytest.raises(RuntimeError, match="injected scheduler failure") as caught:
        LLM(tp_models["gqa2"], device="cpu", tensor_parallel_size=2)
    assert caught.value is not None
    assert alive_workers() == []


@pytest.mark.parametrize("build", [fail_to_build, fail_to_allocate_the_kv_cache])
def test_a_worker_that_fails_to_build_its_runner_fails_the_construction_with_its_error(tp_models, build):
    """Not the collective's "Connection closed by peer" (a failure before the KV block count), nor an engine that
    builds and fails its first step (after it): the construction raises the worker's own error, and no worker is
    left."""
    config = EngineConfig(tp_models["gqa2"], device="cpu", tensor_parallel_size=2).resolved()
    with pytest.raises(
        TensorParallelError,
        match=r"(?s)worker failed while the engine was built:\nrank 1: .*RuntimeError: injected: rank 1 could not",
    ):
        TensorParallelRunner(config, build=build)
    assert alive_workers() == []


def test_a_server_whose_worker_failed_reports_its_engine_dead(tp_models):
    """The engine can run no more steps once a rank failed: rather than answer "ok" to health checks and fail every
    request, the AsyncLLM says its engine is dead (vLLM's EngineDeadError, /health 503), naming why."""
    from nanoref.serving.async_llm import AsyncLLM, EngineDeadError

    from .tp_faults import break_forward_on_rank

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)

    async def generate(engine, request_id):
        return [out async for out in engine.generate([1, 2, 3], params, request_id=request_id)]

    engine = AsyncLLM.from_model(tp_models["gqa2"], device="cpu", tensor_parallel_size=2, engine_process=False)
    try:
        engine.llm.model_runner.run_on_all_ranks(break_forward_on_rank, 1)
        with pytest.raises(TensorParallelError, match="injected fault on rank 1"):
            asyncio.run(generate(engine, "first"))
        deadline = time.monotonic() + 10
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_running
        with pytest.raises(EngineDeadError, match="injected fault on rank 1"):
            asyncio.run(engine.check_health())
        with pytest.raises(EngineDeadError):
            asyncio.run(generate(engine, "second"))
    finally:
        engine.close()
    assert alive_workers() == []


def test_run_on_all_ranks_sends_lambdas_and_a_failed_call_leaves_the_engine_serving(tp_models):
    """A lambda goes by value; a call that cannot be pickled is a TypeError naming it, before anything is sent; a
    function raising on rank 1 raises here with rank 1's traceback once every rank is done. After each, the same
    workers go on serving."""
    folder = tp_models["gqa2"]
    with LLM(folder, device="cpu", tensor_parallel_size=2) as llm:
        runner = llm.model_runner
        workers = list(runner.followers.procs)
        assert runner.run_on_all_ranks(lambda r, k: r.rank * k, 10) == [0, 10]
        lock = threading.Lock()

        def holds_a_lock(r):
            return lock.locked()

        with pytest.raises(TypeError, match="holds_a_lock"):
            runner.run_on_all_ranks(holds_a_lock)
        with pytest.raises(TensorParallelError, match="(?s)rank 1.*raised on rank 1 on purpose"):
            runner.run_on_all_ranks(raise_on_rank, 1)
        with pytest.raises(ValueError, match="raised on rank 0 on purpose"):
            runner.run_on_all_ranks(raise_on_rank, 0)
        assert all(proc.is_alive() for proc in workers)
        outputs = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert_matches_hf(folder, [[1, 2, 3]], outputs, GREEDY.max_tokens)


def test_a_hung_worker_makes_rank_0_raise_within_the_timeout(tp_models):
    llm = LLM(tp_models["gqa2"], device="cpu", tensor_parallel_size=2, tensor_parallel_timeout=5)
    workers = list(llm.model_runner.followers.procs)
    llm.model_runner.run_on_all_ranks(hang_forward_on_rank, 1, 60)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="did not join a collective within 5 s"):
        llm.generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 20
    assert all(not proc.is_alive() for proc in workers)
    with pytest.raises(TensorParallelError, match="create a new LLM"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_ctrl_c_reaches_rank_0_waiting_for_a_hung_worker(tp_models):
    """Rank 0 sits in a collective that a silent rank 1 never joins: Ctrl-C (here from a timer thread) still
    interrupts it at once; the workers stop and the engine refuses further steps."""
    llm = LLM(tp_models["gqa2"], device="cpu", tensor_parallel_size=2)
    workers = list(llm.model_runner.followers.procs)
    llm.model_runner.run_on_all_ranks(hang_forward_on_rank, 1, 30)  # before the fix: rank 0 waits all 30 s
    timer = threading.Timer(1.0, _thread.interrupt_main)
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)
    finally:
        timer.cancel()
    assert time.monotonic() - start < 10
    assert all(not proc.is_alive() for proc in workers)
    with pytest.raises(TensorParallelError, match="KeyboardInterrupt"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


@pytest.fixture
def stopped_worker_engine(tp_models):
    """A two-rank engine whose rank 1 is stopped (SIGSTOP: hung, deaf to SIGTERM, its sockets open). A 30 s
    collective timeout, so that the old cleanup (SIGTERM, then gloo's timeout) took ~35 s instead of 600."""
    llm = LLM(tp_models["gqa2"], device="cpu", tensor_parallel_size=2, tensor_parallel_timeout=30)
    workers = list(llm.model_runner.followers.procs)
    os.kill(workers[0].pid, signal.SIGSTOP)
    yield llm, workers
    for proc in workers:  # (only if the engine left it behind)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_ctrl_c_with_a_stopped_worker_returns_within_seconds_and_leaves_no_process(stopped_worker_engine):
    """Ctrl-C reaches rank 0 waiting for a stopped rank 1, and the cleanup after it neither waits for SIGTERM to take
    (a stopped process never acts on it: SIGKILL follows) nor for gloo's collective with the dead rank to time out."""
    llm, workers = stopped_worker_engine
    fired = []

    def ctrl_c():
        fired.append(time.monotonic())
        _thread.interrupt_main()

    timer = threading.Timer(1.0, ctrl_c)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)
        returned = time.monotonic()
    finally:
        timer.cancel()
    assert returned - fired[0] < 5, f"Ctrl-C's cleanup took {returned - fired[0]:.1f} s"
    assert not any(proc.is_alive() for proc in workers) and alive_workers() == []
    with pytest.raises(TensorParallelError, match="KeyboardInterrupt"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_close_with_a_stopped_worker_returns_within_seconds_and_leaves_no_process(stopped_worker_engine):
    """close() on an idle engine whose rank 1 is stopped: the exit handshake is bounded, the worker is killed."""
    llm, workers = stopped_worker_engine
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 8, f"close() took {time.monotonic() - start:.1f} s"
    assert not any(proc.is_alive() for proc in workers) and alive_workers() == []
    with pytest.raises(TensorParallelError, match="this LLM was closed"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_to_add_one(tp_models, tmp_path):
    """Spawned workers re-import the script; one that creates its LLM at the top level would start workers from a
    worker. The caller's error says so and what to do."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        f"from nanoref import LLM\nllm = LLM({str(tp_models['gqa2'])!r}, device='cpu', tensor_parallel_size=2)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "TensorParallelError: tensor-parallel rank 1 re-imported the script" in result.stderr, result.stderr[-3000:]
    assert "under `if __name__ == '__main__':`" in result.stderr


def test_a_script_whose_workers_end_leaves_nothing_for_the_resource_tracker(tp_models, tmp_path):
    """A worker ends without the interpreter's teardown (os._exit), which used to skip releasing the named semaphore
    its weights' progress bar had made: multiprocessing's resource tracker then warned of "leaked semaphore objects"
    at the end of every script that ran a tensor-parallel engine."""
    script = tmp_path / "guarded.py"
    script.write_text(
        "from nanoref import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tp_models['gqa2'])!r}, device='cpu', tensor_parallel_size=2)\n"
        "    print(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)[0]['token_ids'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(json.loads(result.stdout)) == 3
    assert "leaked" not in result.stderr, result.stderr[-3000:]
