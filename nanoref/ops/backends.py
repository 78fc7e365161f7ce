"""Attention backends behind one interface, with flash-attn's argument names.

A backend is three functions: `store_kvcache(key, value, k_cache, v_cache, slot_mapping)`,
`varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
block_table)` (as `flash_attn_varlen_func`) and `decode(q, k_cache, v_cache, cache_seqlens,
block_table, softmax_scale, causal)` (as `flash_attn_with_kvcache`). The attention layer calls
whichever the engine picked. A backend may also bring kernels of its own for the element-wise layers: `rms_norm`,
`add_rms_norm`, `norm_rotary` (Qwen3's q/k norm and RoPE) and `silu_and_mul` (cpp does; the others leave the
layers their own torch functions, compiled on CUDA: utils/compile.py). The model runner hands its backend to every
layer that holds one (`use_backend`); nothing else in the model knows which one runs.

- torch: `attention_torch` + `store_kvcache_torch`, plain PyTorch: the reference, and the CPU's fallback.
- triton: `attention_triton` + `store_kvcache_triton`, compiled on a GPU, interpreted on a CPU.
- flash_attn: flash-attn's kernels (CUDA, half precision), with the Triton KV store where Triton is installed.
- cpp: nanoref's C++ kernels for the CPU (`attention_cpp`, built on first use): paged decode and varlen prefill
  attention, the KV store and the element-wise layers; CPU only, and the CPU default wherever it builds (a C++
  compiler and ninja). On a CPU the torch reference pays per op, not per byte: per (sequence, head) pair in decode
  attention, and for ~70 small ops per decoder layer around it (benchmarks/results/cpu_vs_hf.md).
- flash_attn+triton: flash-attn's varlen kernel for prefill, nanoref's Triton kernel for decode. Each is
  the faster of the two in its phase on an H200 (benchmarks/results/): flash-attn's prefill is ahead of
  nanoref's Triton prefill, while at a decode step of 256 sequences nanoref's paged decode kernel took
  4.62 ms against flash-attn's 5.00 ms. Both read the same paged cache layout, so they can share it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoref.ops import attention_torch  # a submodule: nanoref.ops itself does not import this file
from nanoref.ops.store_kvcache import store_kvcache_torch
from nanoref.ops.triton_setup import interpreting, triton_available

BACKEND_NAMES = ("auto", "torch", "triton", "cpp", "flash_attn", "flash_attn+triton")
FLASH_ATTN_BACKENDS = ("flash_attn", "flash_attn+triton")  # the ones that need flash-attn and 256-token blocks


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kvcache: Callable[..., None]
    varlen: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]
    # the element-wise layers' fused kernels, where the backend brings its own (cpp), with the arguments of the layers'
    # torch functions they replace (layers/layernorm.py, rotary.py, activation.py). None: the layer runs its own
    # function (compiled on CUDA: utils/compile.py)
    rms_norm: Callable[..., torch.Tensor] | None = None  # (x, weight, eps)
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # (x, residual, weight, eps)
    norm_rotary: Callable[..., torch.Tensor] | None = None  # (x, weight, eps, positions, cos_cache, sin_cache)
    silu_and_mul: Callable[..., torch.Tensor] | None = None  # (x)
    # (cache_seqlens) -> decode's `scheduler_metadata`, made once per decode step and passed to every layer's decode
    # (Triton: the sequences longest context first). None: decode takes no scheduler_metadata
    decode_schedule: Callable[[torch.Tensor], torch.Tensor] | None = None
    # decode takes `shared_prefix_lens` (B,) int32: per sequence, the leading tokens it reads from the same cache
    # blocks as the others, read once for many sequences (cascade attention; Triton's). False: never passed
    decode_shared_prefix: bool = False


def use_backend(model: torch.nn.Module, backend: AttentionBackend) -> None:
    """Hand the engine's backend to every layer of `model` that runs its kernels: each holds one as `.backend`
    (attention, RMSNorm, SiluAndMul; a layer made outside an engine holds the torch backend)."""
    for module in model.modules():
        if isinstance(getattr(module, "backend", None), AttentionBackend):
            module.backend = backend


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _triton_backend() -> AttentionBackend:
    # imported here, not at the top: defining the kernels may switch on the Triton interpreter
    from nanoref.ops import attention_triton
    from nanoref.ops.store_kvcache_triton import store_kvcache_triton

    return AttentionBackend(
        name="triton",
        store_kvcache=store_kvcache_triton,
        varlen=attention_triton.varlen_attention,
        decode=attention_triton.paged_decode_attention,
        decode_schedule=attention_triton.decode_schedule,
        decode_shared_prefix=True,
    )


def _torch_backend() -> AttentionBackend:
    return AttentionBackend(
        name="torch",
        store_kvcache=store_kvcache_torch,
        varlen=attention_torch.varlen_attention,
        decode=attention_torch.paged_decode_attention,
    )


def _cpp_backend() -> AttentionBackend:
    from nanoref.ops import attention_cpp

    attention_cpp.load()  # build now, so that a missing compiler is reported when the engine starts
    return AttentionBackend(
        name="cpp",
        store_kvcache=attention_cpp.store_kvcache,
        varlen=attention_cpp.varlen_attention,
        decode=attention_cpp.paged_decode_attention,
        rms_norm=attention_cpp.rms_norm,
        add_rms_norm=attention_cpp.add_rms_norm,
        norm_rotary=attention_cpp.norm_rotary,
        silu_and_mul=attention_cpp.silu_and_mul,
    )


def _flash_attn_backend() -> AttentionBackend:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    def decode(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
        return flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            softmax_scale=softmax_scale,
            causal=causal,
        )

    store = store_kvcache_torch
    if triton_available():
        from nanoref.ops.store_kvcache_triton import store_kvcache_triton as store

    return AttentionBackend(
        name="flash_attn",
        store_kvcache=store,
        varlen=flash_attn_varlen_func,
        decode=decode,
    )


def _flash_attn_triton_backend() -> AttentionBackend:
    flash, triton = _flash_attn_backend(), _triton_backend()

    def varlen(q, k, v, *args, block_table=None, **kwargs):
        if k.dtype != q.dtype:  # an 8-bit cache (kv_cache_dtype="fp8"): flash-attn reads the model's dtype only
            if block_table is not None:  # the history in the cache (prefix-cache hits, later chunks): Triton reads it
                return triton.varlen(q, k, v, *args, block_table=block_table, **kwargs)
            k, v = k.to(q.dtype), v.to(q.dtype)  # a prompt's own K/V, already rounded to the cache's values: exact
        return flash.varlen(q, k, v, *args, block_table=block_table, **kwargs)

    return dataclasses.replace(
        flash,
        name="flash_attn+triton",
        store_kvcache=triton.store_kvcache,
        varlen=varlen,
        decode=triton.decode,
        decode_schedule=triton.decode_schedule,
        decode_shared_prefix=True,
    )


@functools.cache
def flash_attn_serves(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the installed flash-attn runs this head_dim and dtype: builds can be cut down to a few."""
    try:
        from flash_attn import flash_attn_varlen_func

        q = torch.randn(2, 1, head_dim, device="cuda", dtype=dtype)  # (N, H, D): one sequence of 2 tokens
        cu_seqlens = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q, q, q, cu_seqlens, cu_seqlens, 2, 2, causal=True)
        return True
    except Exception:  # any failure means "not for this model"; the explicit choice reports it below
        return False


_warned_cpp_failure = False


def cpp_builds(head_dim: int) -> bool:
    """Whether the cpp backend can serve a CPU model of this head_dim here: its kernels are built (the first call on
    a machine compiles them, then they are loaded from the cache). No compiler or ninja: False, quietly (the torch
    backend serves); a build that fails: False, with one warning per process saying why."""
    global _warned_cpp_failure
    from nanoref.ops import attention_cpp

    if head_dim not in attention_cpp.HEAD_DIMS or attention_cpp.missing_build_tools():
        return False
    try:
        attention_cpp.load()
    except attention_cpp.CppKernelUnavailableError as error:
        if not _warned_cpp_failure:
            _warned_cpp_failure = True
            warnings.warn(
                f"nanoref: {error}. The CPU runs the torch backend instead (slower decode; same tokens). "
                "attention_backend='torch' skips the build.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    return True


def choose_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int | None,
    head_dim: int,
    cache_dtype: torch.dtype | None = None,
) -> str:
    """The concrete backend for a request; "auto" takes the fastest one that can serve the setup.

    auto: on CUDA, flash-attn for prefill when it imports, the dtype is half precision, the block size (if
    one was asked for) is a multiple of 256 and the build runs this head_dim, with nanoref's Triton decode
    kernel beside it where Triton is installed ("flash_attn+triton"); else Triton alone; else torch. On a CPU,
    cpp where its kernels build (see `cpp_builds`), else torch (the Triton interpreter is for reading kernels,
    not speed). cache_dtype (default: dtype) is the KV cache's: an 8-bit one (kv_cache_dtype="fp8") is read by the
    torch and Triton kernels, and by "flash_attn+triton", where flash-attn takes only a prompt's own K/V (widened
    back to the model's dtype): "auto" picks that pair where flash-attn serves (3% faster than Triton alone on an
    H100), else "triton", and "torch" on a CPU. An explicit choice that cannot work raises.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    half = dtype in (torch.float16, torch.bfloat16)
    narrow_cache = cache_dtype is not None and cache_dtype.itemsize == 1  # fp8: converted to `dtype` as it is read
    if narrow_cache and name in ("cpp", "flash_attn"):
        raise ValueError(
            f"attention_backend={name!r} reads a KV cache in the model's dtype only, not {cache_dtype} "
            "(kv_cache_dtype): an 8-bit cache runs on 'triton' or 'flash_attn+triton' (CUDA) or 'torch' (any "
            "device); 'auto' picks one of those"
        )
    if name == "auto":
        if device.type != "cuda":
            return "cpp" if not narrow_cache and cpp_builds(head_dim) else "torch"
        fits = block_size is None or block_size % 256 == 0
        if half and fits and flash_attn_available() and flash_attn_serves(head_dim, dtype):
            if triton_available():
                return "flash_attn+triton"
            if not narrow_cache:  # flash-attn alone: it reads only the model's dtype
                return "flash_attn"
        return "triton" if triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError(
            "attention_backend='triton' but Triton is not installed (it ships Linux wheels only); use 'torch'"
        )
    if name == "triton" and device.type == "cpu" and torch.cuda.is_available() and not interpreting():
        raise ValueError(
            "attention_backend='triton' with device='cpu' on a machine with a GPU: Triton compiles its kernels for "
            "the GPU here and cannot read CPU tensors (its interpreter, which can, is switched on only where no GPU "
            "is present); use device='cuda', or set TRITON_INTERPRET=1 before nanoref loads its kernels"
        )
    if name == "cpp":
        from nanoref.ops import attention_cpp

        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpp' runs on the CPU only, not {device.type}")
        if head_dim not in attention_cpp.HEAD_DIMS:
            raise ValueError(f"attention_backend='cpp' is built for head_dim {attention_cpp.HEAD_DIMS}, not {head_dim}")
        missing = attention_cpp.missing_build_tools()
        if missing:
            raise ValueError("attention_backend='cpp' is built on first use and needs " + " and ".join(missing))
    if name == "flash_attn+triton" and not triton_available():
        raise ValueError("attention_backend='flash_attn+triton' but Triton is not installed; use 'flash_attn'")
    if name in FLASH_ATTN_BACKENDS:
        if device.type != "cuda":
            raise ValueError(f"attention_backend={name!r} needs a CUDA device; use 'torch' or 'triton' on CPU")
        if not flash_attn_available():
            raise ValueError(f"attention_backend={name!r} needs flash-attn, which is not installed: 'nanoref[flash]'")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention_backend={name!r} needs float16 or bfloat16, got {dtype}")
        if block_size is not None and block_size % 256:
            raise ValueError(f"attention_backend={name!r} needs kvcache_block_size a multiple of 256, got {block_size}")
    return name


def resolve_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend's functions by concrete name ("torch", "triton", "cpp", "flash_attn" or "flash_attn+triton")."""
    if name == "flash_attn":
        return _flash_attn_backend()
    if name == "flash_attn+triton":
        return _flash_attn_triton_backend()
    if name == "triton":
        return _triton_backend()
    if name == "torch":
        return _torch_backend()
    if name == "cpp":
        return _cpp_backend()
    raise ValueError(f"unknown attention backend {name!r}")
