"""Engine settings: one frozen dataclass, validated once, with defaults derived from the model and device.

`EngineConfig(model, **settings)` checks every setting and fills the device's defaults; `resolved()` then picks
what needs a look at the installed kernels (the concrete attention backend, and the KV block size that follows
from it), before anything is built. The KV block count, when not given, depends on the memory the loaded model
leaves: the model runner measures it and records it with `with_kv_blocks`. Every later part reads this one object.
"""

from __future__ import annotations

import copy
import os
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanoref.models import Qwen3Config, load_model_config
from nanoref.models.generation_config import GenerationDefaults, read_generation_defaults
from nanoref.ops.backends import BACKEND_NAMES, FLASH_ATTN_BACKENDS, choose_backend
from nanoref.sampling_params import MAX_LOGPROBS, check_seed
from nanoref.utils.loader import (
    TOKENIZER_FILES,
    ModelFolderError,
    load_tokenizer,
    resolve_model_folder,
    tokenizer_files,
    weight_files,
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# vLLM's other spellings of the same types (its --dtype choices): code written for vLLM passes them
_DTYPE_ALIASES = {"float": torch.float32, "half": torch.float16}
# vLLM's kv_cache_dtype values: "auto" keeps K/V in the model's dtype; the 8-bit floats halve the cache's bytes (a
# decode step reads every running sequence's K/V, most of its time on a GPU) and round each cached value to 3
# (e4m3) or 2 (e5m2) mantissa bits. "fp8" is e4m3, as in vLLM
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device, checkpoint: str | None = None) -> torch.dtype:
    """The weights' and activations' dtype. "auto" (or None), as vLLM's "auto": on CUDA the checkpoint's float16 (or
    "half") or bfloat16 (config.json's dtype, `checkpoint`) kept, and a float32 checkpoint, or one whose config.json
    names no dtype, in bfloat16; on a GPU without bfloat16 (compute capability below 8.0: a T4, a V100) float16,
    whatever the checkpoint's, where an explicit bfloat16 is vLLM's ValueError. On a CPU float32, whatever the
    checkpoint's, exact against HF in float32 (where vLLM's CPU backend, on x86 and Arm Linux, keeps float16 and
    bfloat16 and runs float32 in bfloat16)."""
    if dtype is None or dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        keep_half = checkpoint in ("float16", "half") or not _runs_bfloat16(device)
        return torch.float16 if keep_half else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    elif not isinstance(dtype, str) or dtype not in {**_DTYPES, **_DTYPE_ALIASES}:  # (a list is unhashable: checked)
        raise ValueError(f"dtype must be one of {['auto', *_DTYPES, *_DTYPE_ALIASES]}, got {dtype!r}")
    dtype = {**_DTYPES, **_DTYPE_ALIASES}.get(dtype, dtype)
    if dtype == torch.bfloat16 and device.type == "cuda" and not _runs_bfloat16(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(  # (vLLM's words)
            "Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your "
            f"{torch.cuda.get_device_name(device)} GPU has compute capability {major}.{minor}. You can use float16 "
            "instead by explicitly setting the `dtype` flag in CLI, for example: --dtype=half."
        )
    return dtype


def _runs_bfloat16(device: torch.device) -> bool:
    """Whether the GPU computes in bfloat16 (Ampere, compute capability 8.0, and later): vLLM's test.
    (torch.cuda.is_bf16_supported() is True on a T4 too: it counts bfloat16 emulated.)"""
    return torch.cuda.get_device_capability(device) >= (8, 0)


# The settings that decide throughput, per device type, when LLM(...) leaves them out. A GPU runs a decode step in
# about the same time for 8 sequences as for 512 (it is bound by reading the weights), so it wants large batches:
# Nano-vLLM's 512 sequences and 16,384 tokens per step (vLLM's LLM: 1,024 and 16,384 on an H100 or H200). A CPU
# computes in proportion to the tokens of a step, so a laptop's memory, not its speed, decides: 64 sequences and
# 4,096 tokens keep a step's activations small.
DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cuda": dict(max_num_seqs=512, max_num_batched_tokens=16384),
    "cpu": dict(max_num_seqs=64, max_num_batched_tokens=4096),
}
DEVICE_ENV = "NANOREF_DEVICE"  # the default device when LLM(device=None): "cpu" on a GPU machine keeps tests on it


def parse_device(device: str | torch.device | None) -> torch.device:
    if device == "auto":  # vLLM's default device, and its --device's: the platform's
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device is None:
        device = os.environ.get(DEVICE_ENV) or None
        if device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return parse_device(device)
        except ValueError as error:
            raise ValueError(f"{DEVICE_ENV}={device!r} in the environment: {error}") from None
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError:  # torch's own message lists two dozen device types nanoref does not serve
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is available to this PyTorch build; use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {str(device)!r}")
    return device


def _is_int(value: object) -> bool:
    """An integer that is not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    model: str | Path
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    enforce_eager: bool = False
    max_num_seqs: int | None = None  # default: DEVICE_DEFAULTS (512 on CUDA, 64 on a CPU)
    max_num_batched_tokens: int | None = None  # default: DEVICE_DEFAULTS (16,384 on CUDA, 4,096 on a CPU)
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 4096
    kvcache_block_size: int | None = None  # default: 16, or 256 where flash-attn serves
    num_kvcache_blocks: int | None = None  # None: derived from memory
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    # the KV cache's element type (vLLM's name): "auto" = the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2"
    # stores K/V as 8-bit floats, saturated at the format's largest value, with no scale (vLLM's default scale of
    # 1.0): half a bf16 cache's memory and half of what decode attention reads, at the price of rounding every
    # cached K/V value. Served by the torch and Triton backends and by flash_attn+triton (what "auto" picks on CUDA
    # where flash-attn serves)
    kv_cache_dtype: str = "auto"
    # cascade attention (vLLM's name for the switch): where at least 48 sequences of a decode step start with the
    # same 256+ cached tokens (a system prompt the prefix cache gives them all), those K/V are read once for many
    # sequences instead of once per sequence (nanoref/cascade.py, ops/attention_triton.py). The same tokens;
    # Triton's decode only
    disable_cascade_attn: bool = False
    tensor_parallel_size: int = 1
    # tensor parallel: the longest rank 0 waits (seconds) for the other ranks to join any one collective before it
    # stops them and raises. A worker that dies is reported within seconds whatever this is; this bounds a
    # worker that hangs. Generous, because the first step of a big model (loading its shard, compiling, capturing
    # graphs) may keep one rank busy for minutes while another waits
    tensor_parallel_timeout: float = 600.0
    # schedule and launch decode step n+1 while the device runs step n (overlap.py). None: on for CUDA, where
    # it takes the host's ~1-2 ms per step off the critical path (measured on an H200, benchmarks/results/); off
    # on a CPU, where the "device" is the host itself and nothing can overlap
    overlap_scheduling: bool | None = None
    # the engine's generator for unseeded requests: the same seed and requests give the same tokens (as vLLM's
    # LLM(seed=...)); None: fresh entropy per engine. Never the global RNG, either way
    seed: int | None = None
    # speculative decoding (nanoref/speculative/), vLLM's dict: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 3} or {"model": DRAFT_FOLDER, "num_speculative_tokens": 4}; parsed into a
    # SpeculativeConfig. None: off
    speculative_config: dict | SpeculativeConfig | None = None
    # LoRA adapters (nanoref/lora/), vLLM's names: requests may name a PEFT adapter (LoRARequest); one batch mixes
    # at most max_loras adapters (the device slots, each of rank max_lora_rank), and max_cpu_loras stay read and
    # checked on the host (None: max_loras). Off by default: the slots' delta costs every forward a little
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's engine arguments under vLLM's names (docs/usage.md, "vLLM's engine arguments"). Honoured:
    # the prefix cache (off: every request, and each of its n samples, computes its own prompt, as vLLM's)
    enable_prefix_caching: bool = True
    # None or True: a prompt longer than what is left of a step's token budget is prefilled in chunks; False: every
    # prompt in one step, whole (max_num_batched_tokens then defaults to at least max_model_len, and may not be less)
    enable_chunked_prefill: bool | None = None
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs / prompt_logprobs a request may ask for (at most 20)
    tokenizer: str | Path | None = None  # a local folder whose tokenizer serves in place of the model folder's
    tokenizer_mode: str = "auto"  # "auto" or "hf": the fast tokenizer where the folder has one; "slow": the slow one
    # vLLM's: load no tokenizer (prompts are token ids; outputs carry token ids and no text, as from a folder without
    # one): for a caller that tokenizes and detokenizes itself
    skip_tokenizer_init: bool = False
    served_model_name: str | list[str] | None = None  # the model's name(s) in the API (the server's)
    # the model's recommended sampling (models/generation_config.py): "auto" reads the model folder's
    # generation_config.json (the defaults of a request that names none, and its extra EOS ids); "vllm": SamplingParams'
    # own defaults (the file's EOS ids still stop); or a folder whose generation_config.json serves instead (or defaults
    # already read: a speculative draft's engine takes its target's)
    generation_config: str | Path | GenerationDefaults = "auto"
    override_generation_config: dict | None = None  # sampling defaults laid over the file's ({"temperature": 0.7})
    # accepted and checked, and nothing in nanoref changes (see VLLM_NO_OPS below for why)
    trust_remote_code: bool = False
    download_dir: str | Path | None = None
    disable_log_stats: bool = False
    swap_space: float | None = None
    max_seq_len_to_capture: int | None = None
    load_format: str = "auto"  # "auto" or "safetensors": nanoref reads *.safetensors, and nothing else
    # refused unless None: what they ask for nanoref does not have (VLLM_REFUSED)
    revision: str | None = None
    tokenizer_revision: str | None = None
    quantization: str | None = None
    compilation_config: int | dict | None = None
    # vLLM's names for settings nanoref has under its own (VLLM_ALIASES): either name, not both with two values
    block_size: InitVar[int | None] = None
    num_gpu_blocks_override: InitVar[int | None] = None
    async_scheduling: InitVar[bool | None] = None
    # filled in by __post_init__: the folder and its parsed config.json (read once, here)
    model_folder: Path = field(init=False)
    architecture: str = field(init=False)  # the HF class name the model is built from
    hf_config: Qwen3Config = field(init=False)
    tokenizer_folder: Path = field(init=False)  # the tokenizer's folder: `tokenizer`, or the model folder
    generation_defaults: GenerationDefaults = field(init=False, compare=False)  # read from generation_config

    def __post_init__(
        self, block_size: int | None, num_gpu_blocks_override: int | None, async_scheduling: bool | None
    ) -> None:
        aliases = {"block_size": block_size, "num_gpu_blocks_override": num_gpu_blocks_override}
        for alias, value in {**aliases, "async_scheduling": async_scheduling}.items():
            name = VLLM_ALIASES[alias]
            if value is None:
                continue
            if getattr(self, name) is not None and getattr(self, name) != value:
                raise ValueError(
                    f"{alias}={value!r} and {name}={getattr(self, name)!r} are one setting (vLLM's name and "
                    "nanoref's): give one of them"
                )
            _set(self, **{name: value})
        self._check_vllm_arguments()
        folder, architecture, hf_config = load_model_config(self.model)
        _set(self, model_folder=folder, architecture=architecture, hf_config=hf_config)
        _set(self, tokenizer_folder=folder if self.tokenizer is None else _tokenizer_folder(self.tokenizer))
        defaults = read_generation_defaults(
            self.generation_config, self.override_generation_config, folder, hf_config.vocab_size
        )
        _set(self, generation_defaults=defaults)
        _set(self, device=parse_device(self.device))
        _set(self, dtype=parse_dtype(self.dtype, self.device, hf_config.dtype))
        for name in ("enforce_eager", "disable_cascade_attn", "skip_tokenizer_init"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.overlap_scheduling is None:  # (speculative decoding has its own loop: see _check_speculative)
            _set(self, overlap_scheduling=self.device.type == "cuda" and self.speculative_config is None)
        if not isinstance(self.overlap_scheduling, bool):
            raise ValueError(f"overlap_scheduling must be True, False or None, got {self.overlap_scheduling!r}")
        budget_given = self.max_num_batched_tokens is not None
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is None:
                value = DEVICE_DEFAULTS[self.device.type][name]
                _set(self, **{name: value})
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        block = self.kvcache_block_size
        if block is not None and (not _is_int(block) or block < 16 or block > 256 or block & (block - 1)):
            raise ValueError(f"kvcache_block_size must be a power of two from 16 to 256, got {block!r}")
        # the concrete backend (and the block size that follows from it) is chosen by resolved(), which may have
        # to run a flash-attn kernel to learn whether the installed build serves the model
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {self.attention_backend!r}")
        if self.kv_cache_dtype != "auto" and (
            not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES
        ):
            raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_CACHE_DTYPES]}, got {self.kv_cache_dtype!r}")
        limit = self.hf_config.max_position_embeddings
        if self.max_model_len is None:
            _set(self, max_model_len=min(limit, 4096))
        if not _is_int(self.max_model_len) or not 1 < self.max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be an integer in [2, {limit}] (the model's limit), got {self.max_model_len!r}"
            )
        if self.enable_chunked_prefill is False and self.max_num_batched_tokens < self.max_model_len:
            if budget_given:  # (vLLM's rule: a prompt must fit one step whole)
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({self.max_model_len}): with enable_chunked_prefill=False every prompt is prefilled whole, in "
                    "one step; raise max_num_batched_tokens or lower max_model_len"
                )
            _set(self, max_num_batched_tokens=self.max_model_len)  # (as vLLM raises its default)
        blocks = self.num_kvcache_blocks
        if blocks is not None and (not _is_int(blocks) or blocks <= 0):
            raise ValueError(f"num_kvcache_blocks must be a positive integer or None, got {self.num_kvcache_blocks!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check_seed(self.seed)
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        timeout = self.tensor_parallel_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"tensor_parallel_timeout must be a positive number of seconds, got {timeout!r}")
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.speculative_config is not None:
            self._check_speculative()
        self._check_lora()

    def _check_vllm_arguments(self) -> None:
        """vLLM's engine arguments (before the model folder is read: a bad one is the error, whatever the folder)."""
        for name in ("enable_prefix_caching", "trust_remote_code", "disable_log_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.enable_chunked_prefill is not None and not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be True, False or None, got {self.enable_chunked_prefill!r}")
        if not _is_int(self.max_logprobs) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}]: nanoref returns at most the top "
                f"{MAX_LOGPROBS} logprobs (vLLM's -1, the whole vocabulary, is not served), got {self.max_logprobs!r}"
            )
        if self.tokenizer is not None and not isinstance(self.tokenizer, (str, os.PathLike)):
            raise ValueError(f"tokenizer must be the path of a tokenizer folder or None, got {self.tokenizer!r}")
        if self.tokenizer_mode in ("mistral", "custom"):
            raise ValueError(
                f"tokenizer_mode={self.tokenizer_mode!r} is not available in nanoref: it loads Hugging Face tokenizers "
                "only (Qwen3's); use 'auto' (or 'hf'), or 'slow'"
            )
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {list(TOKENIZER_MODES)}, got {self.tokenizer_mode!r}")
        names = self.served_model_name
        names = [names] if isinstance(names, str) else names
        if names is not None and (
            not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names)
        ):
            raise ValueError(
                f"served_model_name must be a non-empty name or list of names, or None, got {self.served_model_name!r}"
            )
        if self.download_dir is not None and not isinstance(self.download_dir, (str, os.PathLike)):
            raise ValueError(f"download_dir must be a folder's path or None, got {self.download_dir!r}")
        space = self.swap_space
        if space is not None and (isinstance(space, bool) or not isinstance(space, (int, float)) or not space >= 0):
            raise ValueError(f"swap_space must be a number of GiB >= 0 or None, got {space!r}")
        length = self.max_seq_len_to_capture
        if length is not None and (not _is_int(length) or length <= 0):
            raise ValueError(f"max_seq_len_to_capture must be a positive integer or None, got {length!r}")
        if self.load_format not in ("auto", "safetensors"):
            raise ValueError(
                f"load_format={self.load_format!r} is not available in nanoref: it reads a local folder's "
                "*.safetensors weights only; use 'auto' or 'safetensors'"
            )
        for name, why in VLLM_REFUSED.items():
            if getattr(self, name) is not None:
                raise ValueError(f"{name}={getattr(self, name)!r} is not available in nanoref: {why}")

    @property
    def has_tokenizer(self) -> bool:
        """Whether the engine loads a tokenizer (its tokenizer folder has one, and skip_tokenizer_init is off)."""
        return not self.skip_tokenizer_init and bool(tokenizer_files(self.tokenizer_folder))

    @property
    def no_tokenizer(self) -> str:
        """The start of an error about a tokenizer the engine lacks: its folder has none, or none was loaded."""
        if self.skip_tokenizer_init:
            return f"{self.tokenizer_folder}: skip_tokenizer_init=True loads no tokenizer"
        return f"{self.tokenizer_folder} has no tokenizer"

    def load_tokenizer(self) -> Any | None:
        """The engine's tokenizer: the tokenizer folder's (tokenizer_mode's kind), or None where that folder has
        none or skip_tokenizer_init asks for none."""
        if self.skip_tokenizer_init:
            return None
        return load_tokenizer(self.tokenizer_folder, use_fast=self.tokenizer_mode != "slow")

    def resolved(self) -> EngineConfig:
        """This config with the concrete attention backend and KV block size. "auto" may run a tiny flash-attn
        kernel to learn whether the installed build serves this model, or on a CPU build (or load) nanoref's C++
        kernels, so it is a step of its own, taken once before the engine builds anything (an EngineConfig itself
        runs and builds nothing)."""
        backend = choose_backend(
            self.attention_backend,
            self.device,
            self.dtype,
            self.kvcache_block_size,
            self.hf_config.head_dim,
            cache_dtype=self.cache_dtype,
        )
        block_size = self.kvcache_block_size
        if block_size is None:  # flash-attn's paged kernels want multiples of 256
            block_size = 256 if backend in FLASH_ATTN_BACKENDS else 16
        return self._replace(attention_backend=backend, kvcache_block_size=block_size)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: kv_cache_dtype's, or the model's dtype for "auto"."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.dtype)

    def with_kv_blocks(self, num_kvcache_blocks: int) -> EngineConfig:
        """This config with the KV block count the model runner measured (see `kv_budget.py`)."""
        return self._replace(num_kvcache_blocks=num_kvcache_blocks)

    def _replace(self, **changes: object) -> EngineConfig:
        """A copy with resolved values in place of these fields (not dataclasses.replace: that would read and
        check the model folder again)."""
        new = copy.copy(self)
        _set(new, **changes)
        return new

    def _check_tensor_parallel(self) -> None:
        """Every split tensor parallelism makes must come out even, and each rank needs its own GPU."""
        from nanoref.layers.linear import local_heads  # (not at the top: layers import this package's parts)

        size, c = self.tensor_parallel_size, self.hf_config
        local_heads(c.num_attention_heads, c.num_key_value_heads, size)  # raises ValueError naming the heads
        # (Qwen3-MoE: only the widths its layers have; intermediate_size of a model whose every layer is sparse
        # splits nothing)
        sizes = c.mlp_sizes_used() if hasattr(c, "mlp_sizes_used") else {"intermediate_size": c.intermediate_size}
        for name, value in sizes.items():
            if value % size:
                raise ValueError(f"{name} ({value}) must be a multiple of tensor_parallel_size ({size})")
        if self.device.type == "cuda":
            if "LOCAL_RANK" not in os.environ and (self.device.index or 0) + size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={size} needs {size} GPUs from {self.device}, but this machine has "
                    f"{torch.cuda.device_count()}"
                )

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        if not _is_int(self.max_loras) or self.max_loras <= 0:
            raise ValueError(f"max_loras must be a positive integer, got {self.max_loras!r}")
        if not _is_int(self.max_lora_rank) or self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {list(MAX_LORA_RANKS)}, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is None:
            _set(self, max_cpu_loras=self.max_loras)
        if not _is_int(self.max_cpu_loras) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= max_loras ({self.max_loras}): the "
                "adapters in the device slots are kept on the host too"
            )
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_lora runs on one device: LoRA adapters are not split across tensor-parallel ranks; use "
                "tensor_parallel_size=1"
            )

    def _check_speculative(self) -> None:
        spec = self.speculative_config
        if not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.from_dict(spec)
            _set(self, speculative_config=spec)
        if self.overlap_scheduling:
            raise ValueError(
                "overlap_scheduling=True cannot run with speculative_config: a verify step's input tokens are its "
                "accepted drafts, which the host must know before it can schedule the next step"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative_config runs on one device: use tensor_parallel_size=1")
        if spec.method == "draft_model":
            if spec.draft_config.vocab_size != self.hf_config.vocab_size:
                raise ValueError(
                    f'speculative_config "model": the draft model {spec.model_folder} has a vocabulary of '
                    f"{spec.draft_config.vocab_size} tokens "
                    f"but {self.model_folder} has {self.hf_config.vocab_size}: a draft must share the target's "
                    "vocabulary (its proposals are the target's token ids)"
                )
            if spec.draft_config.max_position_embeddings < self.max_model_len:
                raise ValueError(
                    f'speculative_config "model": the draft model {spec.model_folder} reaches '
                    f"{spec.draft_config.max_position_embeddings} positions, fewer than "
                    f"max_model_len={self.max_model_len}: lower max_model_len"
                )


# the max_lora_rank values vLLM takes (its LoRA kernels' widths; any other is its ValueError): the slots' width, which
# an adapter's rank r may not exceed
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's names for settings nanoref has under its own: LLM(block_size=32) is LLM(kvcache_block_size=32)
VLLM_ALIASES = {
    "block_size": "kvcache_block_size",
    "num_gpu_blocks_override": "num_kvcache_blocks",
    "async_scheduling": "overlap_scheduling",
}
TOKENIZER_MODES = ("auto", "hf", "slow")  # vLLM's "auto" and "hf" both load the fast tokenizer where there is one
# vLLM's arguments that change nothing in nanoref, and why (docs/usage.md says the same)
VLLM_NO_OPS = {
    "trust_remote_code": "nanoref runs no code from a model folder, trusted or not: its models are its own classes, "
    "and tokenizers load without the folder's code",
    "download_dir": "nanoref loads local folders only and never downloads",
    "disable_log_stats": "nanoref logs no stats; its metrics are always kept (llm.metrics, the server's /metrics)",
    "swap_space": "a preempted sequence is recomputed, never swapped out (as in vLLM's V1 engine, where it is unused)",
    "max_seq_len_to_capture": "a decode CUDA graph reads each sequence's length and block table as inputs, so one "
    "graph serves every length up to max_model_len",
}
# vLLM's arguments nanoref refuses unless they are None, and why
VLLM_REFUSED = {
    "revision": "it names a version on the Hugging Face Hub, and nanoref loads local folders only: download that "
    "revision (`hf download MODEL --revision REV --local-dir DIR`) and pass the folder",
    "tokenizer_revision": "it names a version on the Hugging Face Hub, and nanoref loads local folders only: download "
    "that revision and pass its folder as tokenizer",
    "quantization": "nanoref runs unquantized weights only (its 8-bit option is the KV cache's: kv_cache_dtype='fp8')",
    "compilation_config": "nanoref has no compilation settings: on CUDA it always compiles its element-wise layers "
    "with torch.compile and records decode CUDA graphs (enforce_eager=True turns the graphs off)",
}


def _tokenizer_folder(tokenizer: str | os.PathLike) -> Path:
    """The `tokenizer` setting's folder, checked: it exists and holds a tokenizer."""
    try:
        folder = resolve_model_folder(tokenizer)
    except ModelFolderError as error:
        raise ModelFolderError(f"tokenizer: {error}") from None
    if not tokenizer_files(folder):
        raise ModelFolderError(f"tokenizer: {folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return folder


SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "disable_by_batch_size",
    "min_tokens_per_step",
    "draft_tensor_parallel_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings (vLLM's names): who proposes, and how many tokens per step.

    method: "ngram" (prompt lookup in the sequence's own tokens) or "draft_model" (a smaller model with the
        target's vocabulary; implied by "model").
    num_speculative_tokens: k, the tokens proposed (and verified in one target forward) per sequence and step.
    prompt_lookup_max / prompt_lookup_min: ngram: the longest and shortest tail of the sequence that is looked
        up in its earlier tokens (the longest that occurs wins); default 3 and 1, and a prompt_lookup_min above 3
        given alone raises the default max to it (as vLLM takes a bound given alone for the other); None: the
        default. Only for "ngram": a draft model looks nothing up, so either bound with it is a ValueError.
    model: draft_model: the draft's folder (with the target's vocabulary and, where both folders have one, the same
        tokenizer: its proposals are the target's token ids). "ngram" (or "[ngram]") is method "ngram", as in
        vLLM.
    draft_tensor_parallel_size: vLLM's; 1 (or None) only: speculative decoding runs on one device.
    disable_by_batch_size: a decode step with more running sequences than this runs plain, without proposals (a
        verify step of B * (k + 1) tokens costs more, the larger B, than its extra tokens are worth); vLLM's name.
        Default (None): 32 on CUDA, 4 on a CPU (measured: docs/benchmarks.md); 0 never disables.
    min_tokens_per_step: while the tokens a sequence gains per verify step (a moving average over the engine's
        steps, 1 + its accepted proposals) stay below this, decode steps run plain, with a verify step now and then
        (after 8 plain steps, doubling to 64 while those do not pay) to see whether the text became predictable;
        default 1.5, 0 never disables. With a draft model the bar is raised by k x the draft's parameters over the
        target's (its k forwards per step); a draft whose bar passes k + 1 never pays, and the engine warns and
        decodes without speculation.
    """

    method: str
    num_speculative_tokens: int
    # None: not given (vLLM's default value); resolved in __post_init__ for "ngram", refused for "draft_model"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | Path | None = None
    disable_by_batch_size: int | None = None
    min_tokens_per_step: float = 1.5
    draft_tensor_parallel_size: int | None = None
    # draft_model: the folder and its parsed config.json
    model_folder: Path | None = field(default=None, compare=False)
    architecture: str | None = field(default=None, compare=False)
    draft_config: Qwen3Config | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_dict(cls, settings: object) -> SpeculativeConfig:
        if not isinstance(settings, dict):
            raise ValueError(f"speculative_config must be a dict of {list(SPECULATIVE_KEYS)}, got {settings!r}")
        unknown = sorted(set(settings) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; its keys: {list(SPECULATIVE_KEYS)}")
        settings = dict(settings)
        method = settings.pop("method", None)
        if method in (None, "ngram", "[ngram]") and settings.get("model") in ("ngram", "[ngram]"):
            method, settings["model"] = "ngram", None  # (vLLM's older spelling of the method, which it still takes)
        method = "ngram" if method == "[ngram]" else method
        if method is None:
            method = "draft_model" if settings.get("model") is not None else None
        if method not in ("ngram", "draft_model"):
            raise ValueError(
                'speculative_config needs "method": "ngram", or "model": a draft folder (method "draft_model"); '
                f"got method {method!r}"
            )
        if "num_speculative_tokens" not in settings:
            raise ValueError("speculative_config needs num_speculative_tokens (the tokens proposed per step)")
        return cls(method=method, **settings)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        tp = self.draft_tensor_parallel_size
        if tp is not None and (not _is_int(tp) or tp != 1):
            raise ValueError(
                f"speculative_config: draft_tensor_parallel_size must be 1 (speculative decoding runs on one device), "
                f"got {tp!r}"
            )
        size = self.disable_by_batch_size
        if size is not None and (not _is_int(size) or size < 0):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 0, got {size!r}")
        gain = self.min_tokens_per_step
        if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 <= gain <= k + 1:
            raise ValueError(
                f"speculative_config: min_tokens_per_step must be a number in [0, num_speculative_tokens + 1], "
                f"got {gain!r}"
            )
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if value is not None and (not _is_int(value) or value < 1):
                    raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
            # a bound given alone never conflicts with the other's default (vLLM takes it for the other): only two
            # bounds the user gave can be out of order
            low = 1 if low is None else low
            high = max(3, low) if high is None else high
            if low > high:
                raise ValueError(f"speculative_config: prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})")
            _set(self, prompt_lookup_min=low, prompt_lookup_max=high)
            if self.model is not None:
                raise ValueError('speculative_config: "model" is for method "draft_model", not "ngram"')
        else:
            if self.model is None:
                raise ValueError('speculative_config: method "draft_model" needs "model": the draft\'s folder')
            given = [name for name in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, name) is not None]
            if given:  # (a draft model looks nothing up: the setting would be dropped without a word)
                raise ValueError(f'speculative_config: {given[0]} is for method "ngram", not "draft_model"')
            try:  # the folder's problems name the key it came from, and are found before anything is built
                folder, architecture, draft_config = load_model_config(self.model)
                if not weight_files(folder):
                    raise ModelFolderError(f"{folder} holds no *.safetensors weights")
            except ModelFolderError as error:
                raise ModelFolderError(f'speculative_config "model": {error}') from None
            _set(self, model_folder=folder, architecture=architecture, draft_config=draft_config)


def _set(config: EngineConfig | SpeculativeConfig, **values: object) -> None:
    """Fill in fields of a frozen config while it is being made (the only writes it ever sees)."""
    for name, value in values.items():
        object.__setattr__(config, name, value)
