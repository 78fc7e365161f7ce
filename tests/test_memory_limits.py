"""On a CPU, memory is read from /proc/meminfo, the host's: inside a container's memory cgroup limit, what the limit
still allows is what an allocation may take (past it the kernel ends the process)."""

from pathlib import Path

import pytest

from nanoref import LLM
from nanoref.engine import kv_budget

GIB = 1 << 30


def fake_cgroups(monkeypatch, tmp_path: Path, own: str = "/") -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (tmp_path / "self_cgroup").write_text(f"0::{own}\n")
    monkeypatch.setattr(kv_budget, "CGROUP_ROOT", root, raising=False)
    monkeypatch.setattr(kv_budget, "PROC_SELF_CGROUP", tmp_path / "self_cgroup", raising=False)
    return root


def limit_group(folder: Path, limit: str, current: int, file: int = 0, shmem: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.max").write_text(f"{limit}\n")
    (folder / "memory.current").write_text(f"{current}\n")
    (folder / "memory.stat").write_text(f"anon {current - file}\nfile {file}\nshmem {shmem}\n")


def test_a_container_memory_limit_bounds_the_available_memory(monkeypatch, tmp_path):
    # docker run --memory=8g on a host of more: the limit less what the container holds (its reclaimable page cache
    # counted free, its tmpfs not), where /proc/meminfo shows the host's memory
    root = fake_cgroups(monkeypatch, tmp_path)
    limit_group(root, str(8 * GIB), current=6 * GIB, file=2 * GIB, shmem=GIB // 2)
    assert kv_budget.cpu_memory_available() == 8 * GIB - 6 * GIB + 2 * GIB - GIB // 2
    assert kv_budget.cpu_memory_available(fallback=None) == 4 * GIB - GIB // 2


def test_a_limit_on_a_group_above_the_process_counts_and_no_limit_leaves_meminfo(monkeypatch, tmp_path):
    root = fake_cgroups(monkeypatch, tmp_path, own="/user.slice/job.scope")
    limit_group(root / "user.slice", str(3 * GIB), current=GIB)
    limit_group(root / "user.slice" / "job.scope", "max", current=GIB)
    assert kv_budget.cpu_memory_available() == 2 * GIB
    (root / "user.slice" / "memory.max").write_text("max\n")
    assert kv_budget.cgroup_memory_available() is None


def test_a_cgroup_v1_memory_limit_counts(monkeypatch, tmp_path):
    root = fake_cgroups(monkeypatch, tmp_path)
    v1 = root / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(f"{9223372036854771712}\n")  # (no limit on the group itself)
    (v1 / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (v1 / "memory.stat").write_text(f"total_cache {GIB // 4}\ntotal_shmem 0\nhierarchical_memory_limit {2 * GIB}\n")
    assert kv_budget.cpu_memory_available() == 2 * GIB - GIB + GIB // 4


def test_a_kv_cache_past_a_container_limit_is_refused_not_allocated(monkeypatch, tmp_path, tiny_model):
    # a container with 64 MiB left under its limit: a KV cache of about 512 MiB would have the kernel end the process
    root = fake_cgroups(monkeypatch, tmp_path)
    limit_group(root, str(GIB), current=GIB - (64 << 20))
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=65536 needs .* GiB for the KV cache on cpu, but 0.1 GiB"):
        LLM(tiny_model, device="cpu", num_kvcache_blocks=1 << 16)


def test_lora_slots_past_a_container_limit_are_refused_naming_the_settings(monkeypatch, tmp_path, tiny_model):
    # 128 slots of rank 512 need about 0.5 GiB: more than the 64 MiB the limit leaves
    root = fake_cgroups(monkeypatch, tmp_path)
    limit_group(root, str(GIB), current=GIB - (64 << 20))
    with pytest.raises(
        ValueError,
        match=r"max_lora_rank=512 with max_loras=128 needs 0.5 GiB for the LoRA slots on cpu, but 0.1 GiB is available",
    ):
        LLM(tiny_model, device="cpu", num_kvcache_blocks=8, enable_lora=True, max_lora_rank=512, max_loras=128)


def tiny_kv_block_bytes(folder: Path) -> int:
    """One KV block's bytes for the tiny model on a CPU (float32, 16 tokens), from its config.json."""
    import json

    c = json.loads((folder / "config.json").read_text())
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4 * 16


def test_memory_for_less_than_one_kv_block_is_an_error_not_a_one_block_cache(monkeypatch, tiny_model):
    # the cache gets a quarter of the free RAM: with less than four blocks free, that is not one block (it was made
    # one block anyway, which holds no sequence past 16 tokens)
    block = tiny_kv_block_bytes(tiny_model)
    monkeypatch.setattr(kv_budget, "cpu_memory_available", lambda fallback=None: 4 * block - 1)
    with pytest.raises(ValueError, match=r"^no memory left for the KV cache: a quarter of the free RAM is .* MiB, less "
                       r"than one KV block \(.* MiB\): set num_kvcache_blocks$"):  # fmt: skip
        LLM(tiny_model, device="cpu")
    monkeypatch.setattr(kv_budget, "cpu_memory_available", lambda fallback=None: 4 * block)
    assert LLM(tiny_model, device="cpu").model_runner.num_kvcache_blocks == 1


def test_lora_slots_that_leave_the_kv_cache_no_block_are_named(monkeypatch, tiny_model):
    """The slots are allocated before the cache is sized: where they leave it nothing, the error says they took
    the memory, how much, and what to lower."""
    import json

    c = json.loads((tiny_model / "config.json").read_text())
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    # every adapted projection's in + out: q, k, v (hidden in each), o, gate and up (hidden in each), down
    per_layer = 3 * hidden + q + 2 * kv + q + hidden + 2 * (hidden + inter) + inter + hidden
    slot_bytes = layers * per_layer * 128 * 512 * 4  # 128 slots of rank 512, float32
    monkeypatch.setattr(kv_budget, "cpu_memory_available", lambda fallback=None: tiny_kv_block_bytes(tiny_model))
    message = (
        r"no memory left for the KV cache: a quarter of the free RAM is .* MiB, less than one KV block \(.* MiB\); "
        rf"the LoRA slots \(max_loras=128, max_lora_rank=512\) hold {slot_bytes / 2**30:.2f} GiB of it: lower "
        r"max_loras or max_lora_rank, or set num_kvcache_blocks$"
    )
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, device="cpu", enable_lora=True, max_loras=128, max_lora_rank=512)
