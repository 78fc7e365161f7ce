"""How many KV blocks fit: what memory is left once the model is loaded (and, on a GPU, has run its largest step)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from nanoref.utils.context import Context, reset_context, set_context


def cpu_memory_available(fallback: int | None = 4 << 30) -> int | None:
    """Bytes of memory available to new allocations (Linux), else `fallback` (a conservative 4 GiB). Inside a memory
    cgroup's limit (a container's --memory), what the limit still allows, where that is less: /proc/meminfo counts
    the host's memory, and an allocation past the limit ends the process."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limited = cgroup_memory_available()
    if limited is not None:
        available = limited if available is None else min(available, limited)
    return fallback if available is None else available


def release_freed_gpu_memory() -> None:
    """Hand what torch's allocator caches back to the driver before a new engine loads anything on the GPU: an engine
    the caller dropped leaves its KV cache cached there, and the new engine's weights or LoRA slots, carved out of that
    one segment, would pin all of it (the new cache then finds the old one's gigabytes used: `del llm` then
    `LLM(..., enable_lora=True)` on an H100 had no memory left for its cache). A dropped engine in a reference cycle of
    the caller's objects is freed first."""
    gc.collect()
    torch.cuda.empty_cache()


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def cgroup_memory_available() -> int | None:
    """What this process's memory cgroups still allow: each limit less its usage, counting page cache the kernel may
    drop (file pages that are not tmpfs) as free, as MemAvailable does; the least of them, or None where none is set.
    cgroup v2: memory.max of the process's group and of each above it; v1: the memory controller's limits."""
    try:
        own = next((line[3:] for line in PROC_SELF_CGROUP.read_text().splitlines() if line.startswith("0::")), "/")
    except OSError:
        own = "/"
    folders, folder = [CGROUP_ROOT], CGROUP_ROOT / own.strip().lstrip("/")
    while CGROUP_ROOT in folder.parents:  # (inside a cgroup namespace, a container's, its own group is the root)
        folders, folder = [*folders, folder], folder.parent
    limits = [_cgroup_free(folder, "memory.max", "memory.current", "file", "shmem") for folder in folders]
    v1 = CGROUP_ROOT / "memory"  # (v1: memory.stat's hierarchical_memory_limit is the least limit of the groups above)
    limits.append(_cgroup_free(v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache", "total_shmem"))
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _cgroup_free(folder: Path, limit_file: str, usage_file: str, cache: str, shmem: str) -> int | None:
    try:
        text = (folder / limit_file).read_text().strip()
        if text == "max":
            return None
        stat = dict(line.split()[:2] for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
        limit = min(int(text), int(stat.get("hierarchical_memory_limit", text)))
        if limit >= 1 << 60:  # (v1 writes "no limit" as the largest page-aligned int64)
            return None
        usage = int((folder / usage_file).read_text())
        return max(0, limit - usage + int(stat.get(cache, 0)) - int(stat.get(shmem, 0)))
    except (OSError, ValueError):
        return None


def kv_blocks_from_memory(runner) -> int:
    """The KV block count for a model runner whose model is loaded and whose cache is not allocated yet. What its
    `attach_before_kv_cache` hooks allocated (LoRA's slots) already is, and counts as used below.

    CUDA: run the largest prefill once to learn the activations' peak, then give the cache what remains of
    gpu_memory_utilization of the whole GPU (what any process holds counts as used; what this one's allocator
    merely caches does not). CPU: enough for max_num_seqs full-length sequences, never more than a quarter of the
    free RAM (read after those hooks' allocations: a quarter of what they leave). Room for less than one block is a
    ValueError naming what the hooks hold (`hold_before_kv_cache`)."""
    config = runner.config
    per_block = runner.kv_bytes_per_token * config.kvcache_block_size
    if runner.device.type != "cuda":
        wanted = config.max_num_seqs * runner.max_blocks_per_seq
        share = cpu_memory_available() // 4
        if share < per_block:  # (not a 1-block cache: it would not hold one sequence past 16 tokens)
            raise ValueError(no_room_for_kv_cache(runner, f"a quarter of the free RAM is {share / 2**20:.1f} MiB"))
        return min(wanted, share // per_block)
    device = runner.device
    # an engine the caller dropped may still wait in a reference cycle of the caller's objects, which only the cyclic
    # collector frees: collect it first, or its KV cache counts as used here (on an H100, `del llm` then a new LLM()
    # found no memory for its cache)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_largest_prefill(runner.model, config, device)
    # memory this process freed but torch's allocator still caches (loading the weights leaves gigabytes of it) is
    # free for the cache: hand it back first, or mem_get_info counts it as used (an 8B model on an H100: 18 GB)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    budget = int(total * config.gpu_memory_utilization) - (total - free) - (peak - current)
    if budget < per_block:  # (vLLM's ValueError)
        left = f"{max(budget, 0) / 2**20:.1f} MiB"
        share = f"gpu_memory_utilization={config.gpu_memory_utilization} of the GPU leaves {left} after what is held"
        raise ValueError(no_room_for_kv_cache(runner, share, "raise gpu_memory_utilization"))
    return budget // per_block


HELD_BEFORE_KV_CACHE = "held_before_kv_cache"  # the runner's attribute: [(bytes, what holds them, what to lower)]


def hold_before_kv_cache(runner, num_bytes: int, what: str, lower: str) -> None:
    """An `attach_before_kv_cache` hook's note of the memory it took: named by the error of a cache left no room."""
    runner.__dict__.setdefault(HELD_BEFORE_KV_CACHE, []).append((num_bytes, what, lower))


def no_room_for_kv_cache(runner, share: str, fix: str = "") -> str:
    """The error of a KV cache that memory leaves not one block: what was left, what the hooks before it hold, and
    the settings that make room."""
    per_block = runner.kv_bytes_per_token * runner.config.kvcache_block_size
    held = getattr(runner, HELD_BEFORE_KV_CACHE, [])
    took = "".join(f"; {what} hold {num_bytes / 2**30:.2f} GiB of it" for num_bytes, what, _ in held)
    fixes = [lower for _, _, lower in held] + [fix] * bool(fix) + ["set num_kvcache_blocks"]
    return (
        f"no memory left for the KV cache: {share}, less than one KV block ({per_block / 2**20:.2f} MiB){took}: "
        f"{', or '.join(fixes)}"
    )


@torch.inference_mode()
def run_largest_prefill(model: torch.nn.Module, config, device: torch.device) -> None:
    """One prefill of max_num_batched_tokens tokens (the biggest step the scheduler can make), without a cache."""
    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    seq_len = min(config.max_model_len, num_tokens)
    num_seqs = max(1, num_tokens // seq_len)
    cu = torch.arange(0, seq_len * (num_seqs + 1), seq_len, dtype=torch.int32, device=device)  # (num_seqs + 1,)
    set_context(Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq_len, max_seqlen_k=seq_len))
    try:
        ids = torch.zeros(seq_len * num_seqs, dtype=torch.int64, device=device)  # (N,)
        positions = torch.arange(seq_len, device=device).repeat(num_seqs)  # (N,)
        model.compute_logits(model(ids, positions))
    finally:
        reset_context()
