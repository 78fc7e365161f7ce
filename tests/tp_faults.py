"""Functions the tensor-parallel tests send to every rank (importable by name: the workers are other processes)."""

from __future__ import annotations

import torch


def rank_and_shapes(runner) -> tuple[int, dict[str, tuple[int, ...]]]:
    return runner.rank, {name: tuple(p.shape) for name, p in runner.model.named_parameters()}


def kv_cache_shape(runner) -> tuple[int, ...]:
    return tuple(runner.kv_cache.shape)


def break_forward_on_rank(runner, rank: int) -> None:
    """On `rank` only: the next forward raises inside the first decoder layer (rank 0 waits at its all-reduce)."""
    if runner.rank != rank:
        return

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected fault on rank {rank}")

    runner.model.model.layers[0].mlp.forward = broken


def full_weights(runner) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in runner.model.named_parameters()}


def graph_batch_sizes(runner) -> list[int]:
    """The decode batch sizes this rank captured CUDA graphs for (empty: eager)."""
    return sorted(runner.decode_graphs.graphs) if runner.decode_graphs is not None else []


def gpu_index(runner) -> int:
    return runner.device.index


def hang_forward_on_rank(runner, rank: int, seconds: float) -> None:
    """On `rank` only: the next forward sleeps for `seconds` inside the first decoder layer, alive but silent (rank 0
    waits at its all-reduce); a stopped worker ends at once (SIGTERM)."""
    if runner.rank != rank:
        return

    def hung(*args, **kwargs):
        import time

        time.sleep(seconds)
        raise RuntimeError(f"rank {rank} woke up after {seconds} s")

    runner.model.model.layers[0].mlp.forward = hung


def raise_on_rank(runner, rank: int) -> int:
    if runner.rank == rank:
        raise ValueError(f"raised on rank {rank} on purpose")
    return runner.rank


def fail_to_build(config, parallel):
    """A follower's runner builder that fails before the follower joins any collective (its weights fail to load)."""
    raise RuntimeError(f"injected: rank {parallel.rank} could not load its weights")


def fail_to_allocate_the_kv_cache(config, parallel):
    """A follower's runner builder that fails after the ranks agreed on the KV block count (its cache does not fit)."""
    from nanoref.parallel.runner import TensorParallelRunner

    class Runner(TensorParallelRunner):
        def allocate_kv_cache(self) -> None:
            raise RuntimeError(f"injected: rank {self.rank} could not allocate its KV cache")

    return Runner(config, parallel)
