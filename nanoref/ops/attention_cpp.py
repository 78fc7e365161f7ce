"""A C++ paged decode attention kernel for the CPU, built on first use: the `cpp` backend.

On a CPU the torch reference (`attention_torch.paged_decode_attention`) is a gather of every sequence's
blocks into one padded `(B, Lmax, Hk, D)` copy and one `scaled_dot_product_attention` call. Both pay per
piece, not per byte: SDPA costs about 4 us per (sequence, KV head) pair however short the history, and the
gather copies the K/V once more before SDPA reads it. In a decode step of 32 short sequences that was
about a third of the step (benchmarks/results/cpu_vs_hf.md). This kernel does what the Triton and
flash-attn decode kernels do on a GPU, on the CPU's cores: one task per (sequence, KV head) walks the
sequence's pages through its block table and reads each key and value row in place (no gather, no
padding), for each query head of the KV head's GQA group in turn (the group's second pass finds the rows in
the CPU's cache).

    scores[r, t] = scale * q[r] . k[t]               r: the group's query rows, t: the history's tokens
    p[r, t]      = exp(scores[r, t] - max_t scores[r, :]) / sum_t exp(...)
    out[r]       = sum_t p[r, t] * v[t]

Per query row, two passes over the pages (scores, then the weighted sum of values) with the scores in a
buffer of one history's length: on a CPU that buffer sits in L1, so the online softmax of the GPU kernels
would buy nothing here.
Arithmetic is float32 whatever the cache dtype. Tasks run on torch's intra-op thread pool
(`torch.set_num_threads`).

The C++ source is below, compiled with `torch.utils.cpp_extension.load_inline` the first time it is
needed (a C++ compiler and ninja must be installed; about 30 s once, then cached under
`~/.cache/torch_extensions`) and registered as `torch.ops.nanoref_cpp.paged_decode_attention`.
The torch reference stays the CPU default; this backend is opt-in: `LLM(..., attention_backend="cpp")`.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import shutil
import sys
from pathlib import Path

import torch

CPP_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// 16 floats: one AVX-512 register, two AVX2 ones, four SSE ones; GCC and clang lower these vector types to
// whatever -march offers. The head dim is a compile-time multiple of 16 (NV vectors), so a query row or an
// accumulator row lives in registers for a whole pass.
using vec16 = float __attribute__((vector_size(64)));
using vec8 = float __attribute__((vector_size(32)));
using vec4 = float __attribute__((vector_size(16)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

// The 16 lanes' sum as a tree (16 -> 8 -> 4 -> 2 -> 1): four dependent adds, where adding the lanes one after
// another would be fifteen. __builtin_shufflevector (GCC 12+, clang) keeps the halves in registers.
inline float lanes_sum(vec16 v) {
  const vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x in [-87, 0] (a score minus its row's max), in a form that vectorises: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-7 polynomial (Cephes' expf coefficients, float32 accurate), and 2^n
// built in the float's exponent bits. std::exp is a library call the compiler cannot vectorise.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below, exp underflows to 0 anyway; n must stay a normal float's exponent
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts: exact first product
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float's exponent field
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);  // a bit cast that C++17 allows (std::bit_cast is C++20)
  return p * scale;
}

// Softmax of one row's scores in place over its first `seen` keys (the only ones pass 2 reads).
inline void softmax_row(float* row, int64_t seen) {
  float top = -std::numeric_limits<float>::max();
#pragma omp simd reduction(max : top)
  for (int64_t t = 0; t < seen; ++t) top = std::max(top, row[t]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < seen; ++t) {
    row[t] = exp_nonpositive(row[t] - top);
    total += row[t];
  }
  const float inv = seen > 0 ? 1.f / total : 0.f;  // a row that sees no key outputs zeros
#pragma omp simd
  for (int64_t t = 0; t < seen; ++t) row[t] *= inv;
}

// One cache row as float32: the row itself when the cache is float32, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < d; ++i) buffer[i] = static_cast<float>(row[i]);
    return buffer;
  }
}

struct Problem {  // the shapes and strides every task reads
  int64_t batch, len_q, group, num_kv_heads, page, stride_bt;
  int64_t sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, so0, so1, so2;
  float scale;
  bool causal;
};

// One task: sequence b, KV head kv_head, for its group's query rows (row r: query token r / group, query
// head kv_head * group + r % group), one row after another. scores: a buffer of at least len floats.
template <typename T, int NV>
void attend(const Problem& p, const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t len,
            int64_t b, int64_t kv_head, T* out, float* scores) {
  constexpr int64_t D = 16 * NV;
  float buffer[D];
  for (int64_t r = 0; r < p.len_q * p.group; ++r) {
    const int64_t qi = r / p.group, head = kv_head * p.group + r % p.group;
    // causal: query qi is the history's token len - len_q + qi and sees the keys up to it
    const int64_t seen = p.causal ? std::clamp<int64_t>(len - p.len_q + qi + 1, 0, len) : len;
    float* row = scores;  // this query row's scores, then its softmax weights
    vec16 qv[NV];  // this query row, pre-scaled, in registers
    const float* q_row = as_float(q + b * p.sq0 + qi * p.sq1 + head * p.sq2, buffer, D);
    for (int j = 0; j < NV; ++j) qv[j] = load16(q_row + 16 * j) * p.scale;
    // pass 1: the row's score against each key, walking the pages through the block table
    for (int64_t t0 = 0; t0 < seen; t0 += p.page) {
      const T* page_keys = k_cache + blocks[t0 / p.page] * p.sk0 + kv_head * p.sk2;
      for (int64_t s = 0, n = std::min(p.page, seen - t0); s < n; ++s) {
        const float* key = as_float(page_keys + s * p.sk1, buffer, D);
        vec16 acc = qv[0] * load16(key);
        for (int j = 1; j < NV; ++j) acc += qv[j] * load16(key + 16 * j);
        row[t0 + s] = lanes_sum(acc);
      }
    }
    softmax_row(row, seen);
    // pass 2: out = sum_t p[t] * v[t], in registers. Two accumulators, for even and odd keys: one alone would
    // make every key's multiply-add wait for the previous key's (a chain of FMA latencies).
    vec16 even[NV] = {}, odd[NV] = {};
    for (int64_t t0 = 0; t0 < seen; t0 += p.page) {
      const T* page_values = v_cache + blocks[t0 / p.page] * p.sv0 + kv_head * p.sv2;
      const int64_t n = std::min(p.page, seen - t0);
      int64_t s = 0;
      for (; s + 1 < n; s += 2) {
        const float w0 = row[t0 + s], w1 = row[t0 + s + 1];
        const float* v0 = as_float(page_values + s * p.sv1, buffer, D);
        for (int j = 0; j < NV; ++j) even[j] += w0 * load16(v0 + 16 * j);
        const float* v1 = as_float(page_values + (s + 1) * p.sv1, buffer, D);
        for (int j = 0; j < NV; ++j) odd[j] += w1 * load16(v1 + 16 * j);
      }
      if (s < n) {
        const float* v0 = as_float(page_values + s * p.sv1, buffer, D);
        for (int j = 0; j < NV; ++j) even[j] += row[t0 + s] * load16(v0 + 16 * j);
      }
    }
    vec16 acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = even[j] + odd[j];
    T* dst = out + b * p.so0 + qi * p.so1 + head * p.so2;
    for (int j = 0; j < NV; ++j)
      for (int i = 0; i < 16; ++i) dst[16 * j + i] = static_cast<T>(acc[j][i]);
  }
}

template <typename T, int NV>
void decode_kernel(const Problem& p, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& cache_seqlens, const at::Tensor& block_table, at::Tensor& out) {
  const int32_t* lens = cache_seqlens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t max_len = block_table.size(1) * p.page;
  // one task per (sequence, KV head), spread over torch's intra-op threads
  at::parallel_for(0, p.batch * p.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(std::max<int64_t>(max_len, 1));  // one query row's scores at a time
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.num_kv_heads, kv_head = task % p.num_kv_heads;
      attend<T, NV>(p, q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), table + b * p.stride_bt,
                    std::min<int64_t>(lens[b], max_len), b, kv_head, out.data_ptr<T>(), scores.data());
    }
  });
}

template <typename T>
void dispatch_head_dim(const Problem& p, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& cache_seqlens, const at::Tensor& block_table, at::Tensor& out) {
  switch (q.size(3)) {
    case 16: return decode_kernel<T, 1>(p, q, k_cache, v_cache, cache_seqlens, block_table, out);
    case 32: return decode_kernel<T, 2>(p, q, k_cache, v_cache, cache_seqlens, block_table, out);
    case 64: return decode_kernel<T, 4>(p, q, k_cache, v_cache, cache_seqlens, block_table, out);
    case 128: return decode_kernel<T, 8>(p, q, k_cache, v_cache, cache_seqlens, block_table, out);
    case 256: return decode_kernel<T, 16>(p, q, k_cache, v_cache, cache_seqlens, block_table, out);
    default: TORCH_CHECK(false, "the cpp kernel is built for head_dim 16, 32, 64, 128 or 256, not ", q.size(3));
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const at::Tensor& block_table, double scale,
                                  bool causal) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "the cpp backend runs on the CPU only");
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4, "q must be (B, Lq, H, D) and the caches (blocks, page, Hk, D)");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have the same shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share one dtype");
  TORCH_CHECK(q.size(3) == k_cache.size(3), "q's head_dim differs from the cache's");
  TORCH_CHECK(q.size(2) % k_cache.size(2) == 0, "the query heads must share the KV heads evenly");
  TORCH_CHECK(q.stride(3) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "q and the caches need a contiguous last axis");
  TORCH_CHECK(cache_seqlens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt,
              "cache_seqlens and block_table must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 && block_table.size(0) == q.size(0),
              "block_table must be (B, max_blocks) with contiguous rows");
  const at::Tensor lens = cache_seqlens.contiguous();
  auto out = at::empty(q.sizes(), q.options());
  const Problem p{q.size(0), q.size(1), q.size(2) / k_cache.size(2), k_cache.size(2), k_cache.size(1),
                  block_table.stride(0), q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0),
                  k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                  out.stride(0), out.stride(1), out.stride(2), static_cast<float>(scale), causal};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    dispatch_head_dim<scalar_t>(p, q, k_cache, v_cache, lens, block_table, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoref_cpp, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
        "Tensor block_table, float scale, bool causal) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoref_cpp, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
"""

# -O3 vectorises the dot product's lanes and the weighted sum; -march=native lets it use this CPU's widest
# vectors (the build is cached per machine, under torch's extensions directory)
EXTENSION = "nanoref_cpp_attention"  # the build's name: its folder under torch's extensions directory
HEAD_DIMS = (16, 32, 64, 128, 256)  # the head dims the kernel is compiled for (the register tiles are per head dim)
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd"]


class CppKernelUnavailableError(RuntimeError):
    """The C++ kernel cannot be built here (no compiler, no ninja, or the build failed)."""


def missing_build_tools() -> list[str]:
    """What `load_inline` needs and this machine lacks: a C++ compiler and ninja."""
    missing = []
    if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
        missing.append("ninja (pip install ninja)")
    return missing


@functools.cache
def load() -> None:
    """Build (or load from the cache) the kernel and register `torch.ops.nanoref_cpp`. Raises if it cannot."""
    missing = missing_build_tools()
    if missing:
        raise CppKernelUnavailableError("the cpp attention backend needs " + " and ".join(missing))
    path_before = list(sys.path)
    try:
        _build_and_register()
    finally:
        # torch's cpp_extension imports setuptools, whose first import appends its _vendor folder to sys.path: the
        # caller's import path is theirs, so take back what the build added (the modules it imported stay loaded)
        sys.path[:] = [entry for entry in sys.path if entry in path_before]


def _build_and_register() -> None:
    from torch.utils.cpp_extension import get_default_build_root, load_inline

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    if not any(root.glob(f"*/{EXTENSION}/{EXTENSION}.so")):  # nothing cached: say why the wait
        print(f"nanoref: building the cpp attention kernel under {root} (once, about 30 s)...", file=sys.stderr)
    try:
        # is_python_module=False: torch.ops.load_library registers torch.ops.nanoref_cpp; nothing is imported by name
        load_inline(name=EXTENSION, cpp_sources=[CPP_SOURCE], extra_cflags=CFLAGS, is_python_module=False)
    except Exception as error:  # compiler errors, a broken toolchain: say which backend failed and why
        raise CppKernelUnavailableError(f"building the cpp attention kernel failed: {error}") from error


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """q: (B, Lq, H, D); caches: (num_blocks, block_size, Hk, D); cache_seqlens: (B,) and block_table
    (B, max_blocks) int32. -> (B, Lq, H, D). The arguments and meaning of `attention_torch`'s version."""
    load()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.nanoref_cpp.paged_decode_attention(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal)
