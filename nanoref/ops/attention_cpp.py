"""nanoref's C++ kernels for the CPU, built on first use: the `cpp` backend (the CPU default where it builds).

On a CPU the torch reference (`attention_torch.paged_decode_attention`) is a gather of every sequence's
blocks into one padded `(B, Lmax, Hk, D)` copy and one `scaled_dot_product_attention` call. Both pay per
piece, not per byte: SDPA costs about 4 us per (sequence, KV head) pair however short the history, and the
gather copies the K/V once more before SDPA reads it. In a decode step of 32 short sequences that was
about a third of the step (benchmarks/results/cpu_vs_hf.md). The decode kernel here does what the Triton and
flash-attn decode kernels do on a GPU, on the CPU's cores: one task per (sequence, KV head) walks the
sequence's pages through its block table and reads each key and value row in place (no gather, no
padding), once for all the query heads of the KV head's GQA group (their rows side by side in registers).

    scores[r, t] = scale * q[r] . k[t]               r: the group's query rows, t: the history's tokens
    p[r, t]      = exp(scores[r, t] - max_t scores[r, :]) / sum_t exp(...)
    out[r]       = sum_t p[r, t] * v[t]

Two passes over the pages (scores, then the weighted sum of values) with the scores in a buffer of one
history's length: on a CPU that buffer sits in L1, so the online softmax of the GPU kernels would buy nothing
here. Arithmetic is float32 whatever the cache dtype, in vectors as wide as the machine's registers (8 floats
with AVX2, 16 with AVX-512): a vector type wider than the registers would be split and spilled through the stack
(measured: 4x slower on an AVX2 CPU). Each page asks the memory system for the next page's rows while it is used:
a step's K/V outgrow a small CPU's caches, and pages lie where the block manager put them, out of the hardware
prefetcher's sight. Tasks run on torch's intra-op thread pool (`torch.set_num_threads`).

Prefill (`varlen_attention`) runs the same tiles over each sequence's query rows, its keys flat or, with cached
history, read through the block table; SDPA's CPU path does not take GQA and fell back to its math kernel per
sequence. The rest of the backend are the layers around attention, each one pass where the torch reference runs a
dozen small ops that each cost microseconds on a CPU whatever their size: the KV store (one row copy per token),
RMSNorm and its fused residual add, Qwen3's q/k norm + RoPE, and SwiGLU's gate, with the torch functions' float32
arithmetic and their casts to the model's dtype.

The C++ source is below. `load()` compiles it with `torch.utils.cpp_extension` the first time it is needed (a C++
compiler and ninja must be installed; about 20 s, once per machine) and registers `torch.ops.nanoref_cpp`. The
build is cached under torch's extensions directory (`~/.cache/torch_extensions`, or `$TORCH_EXTENSIONS_DIR`), in a
folder named after a hash of the source, the flags, torch's version and this CPU's instruction sets: processes and
checkouts of other versions never rebuild each other's copy, and a home folder shared between machines never loads
a build for the wrong CPU. Concurrent first uses (pytest-xdist workers) build once: the others wait for it on an OS
file lock, which a build killed mid-way lets go of (its leftover torch lock is then removed; another machine's
build, whose OS lock may not be seen here, is waited for: `_builder`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import math
import os
import platform
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nanoref.utils.tracing import trace

try:
    import fcntl
except ImportError:  # (Windows)
    fcntl = None

CPP_SOURCE = r"""
// Only the headers these kernels need: torch/extension.h (what load_inline includes) would triple the build time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// A check whose message carries values: formatted here with snprintf and handed to TORCH_CHECK as one C string. Given
// several message pieces, TORCH_CHECK formats them itself (c10::str, an ostringstream built in this library); on one
// GPU machine's image (torch 2.11+cu130, GCC 13) that crashed the process with a segmentation fault where one C string
// raised the RuntimeError it should (tests/test_attention_cpp.py checks that no check here passes several pieces).
#define CHECK_WITH_VALUES(cond, ...)                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      char message[384];                                                 \
      std::snprintf(message, sizeof message, __VA_ARGS__);               \
      TORCH_CHECK(false, static_cast<const char*>(message));             \
    }                                                                    \
  } while (0)

namespace {

// Vectors of W floats, W the width of this machine's widest float registers (the build passes -march=native): 16
// with AVX-512, 8 with AVX or AVX2, 4 with SSE or NEON. GCC and clang map these vector types onto those registers;
// a type wider than them would be split, and spilled through the stack, by the compiler.
using v4 = float __attribute__((vector_size(16)));
using v8 = float __attribute__((vector_size(32)));
using v16 = float __attribute__((vector_size(64)));
#if defined(__AVX512F__)
constexpr int W = 16;
using vec = v16;
#elif defined(__AVX__)
constexpr int W = 8;
using vec = v8;
#else
constexpr int W = 4;
using vec = v4;
#endif
using ivec = int32_t __attribute__((vector_size(sizeof(vec))));  // the lanes as int32 (comparison results, bits)

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
template <size_t... lane>
inline vec splat(float x, std::index_sequence<lane...>) {
  return vec{((void)lane, x)...};
}
inline vec splat(float x) {  // x in every lane: one broadcast instruction (vec{} + x would add 0 first)
  return splat(x, std::make_index_sequence<W>{});
}
inline vec select(ivec mask, vec a, vec b) { return (vec)((mask & (ivec)a) | (~mask & (ivec)b)); }  // mask ? a : b

// The lanes' sum as a tree (halves added until four lanes are left): log2(W) dependent adds, not W - 1.
inline float lanes_sum(v4 v) { return (v[0] + v[2]) + (v[1] + v[3]); }
inline float lanes_sum(v8 v) {
  v4 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return lanes_sum(lo + hi);
}
inline float lanes_sum(v16 v) {
  v8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return lanes_sum(lo + hi);
}
inline float lanes_max(vec v) {
  float top = v[0];
  for (int i = 1; i < W; ++i) top = std::max(top, v[i]);
  return top;
}

// exp(x) of each lane, x clamped to [-87, 88] (float32's normal range): x = n ln2 + r with |r| <= ln2 / 2, exp(r)
// by a degree-7 polynomial (Cephes' expf coefficients, float32 accurate), 2^n built in the float's exponent bits.
// std::exp would be a library call per lane.
inline vec exp_clamped(vec x) {
  x = select(x > splat(-87.f), x, splat(-87.f));  // (a comparison of vectors gives -1, all bits set, or 0 per lane)
  x = select(x < splat(88.f), x, splat(88.f));
  const vec magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer, kept in the low mantissa bits
  const vec t = x * 1.44269504088896341f + magic;
  const vec n = t - magic;  // round(x / ln2)
  const vec r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts: the first product is exact
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const ivec two_n = ((ivec)t - (ivec)magic + 127) << 23;  // 2^n as a float's exponent field
  return p * (vec)two_n;
}

// exp(x) for scores minus their row's max (x <= 0); lanes below -87 give 0, as exp underflows there anyway.
inline vec exp_nonpositive(vec x) { return (vec)((ivec)exp_clamped(x) & (x > splat(-87.f))); }

// Softmax in place over a row's first `seen` scores. The weights from `seen` up to `end` (the tile's longest row,
// which pass 2 reads) come out 0; the row has room for `end` rounded up to W.
inline void softmax_row(float* row, int64_t seen, int64_t end) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  const int64_t stop = (std::max(seen, end) + W - 1) / W * W;
  for (int64_t t = seen; t < stop; ++t) row[t] = -inf;  // exp gives 0 there
  vec top_lanes = splat(-inf);
  for (int64_t t = 0; t < stop; t += W) top_lanes = select(load(row + t) > top_lanes, load(row + t), top_lanes);
  const float top = seen > 0 ? lanes_max(top_lanes) : 0.f;
  vec total = {};
  for (int64_t t = 0; t < stop; t += W) {
    const vec e = exp_nonpositive(load(row + t) - top);
    store(row + t, e);
    total += e;
  }
  const vec inv = splat(seen > 0 ? 1.f / lanes_sum(total) : 0.f);  // a row that sees no key outputs zeros
  for (int64_t t = 0; t < stop; t += W) store(row + t, load(row + t) * inv);
}

// One cache or query row as float32: the row itself when it is float32, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < d; ++i) buffer[i] = static_cast<float>(row[i]);
    return buffer;
  }
}

// W values from p as float32 lanes, and back: a plain vector load or store for float32, converted for half types.
template <typename T>
inline vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load(p);
  } else {
    vec v;
    for (int i = 0; i < W; ++i) v[i] = static_cast<float>(p[i]);
    return v;
  }
}
template <typename T>
inline void store_float(T* p, vec v) {
  if constexpr (std::is_same_v<T, float>) {
    store(p, v);
  } else {
    for (int i = 0; i < W; ++i) p[i] = static_cast<T>(v[i]);
  }
}
// x rounded to T and back: where the torch reference casts an intermediate to the model's dtype (a no-op for float32)
template <typename T>
inline float rounded(float x) { return static_cast<float>(static_cast<T>(x)); }
template <typename T>
inline vec rounded(vec v) {
  if constexpr (!std::is_same_v<T, float>) {
    for (int i = 0; i < W; ++i) v[i] = static_cast<float>(static_cast<T>(v[i]));
  }
  return v;
}

// f(T{}) for the tensor dtype's C++ type T: the kernels are compiled for float32, float16 and bfloat16
template <typename F>
void by_dtype(at::ScalarType dtype, const char* name, const F& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default:
      CHECK_WITH_VALUES(false, "%s runs on float32, float16 and bfloat16 tensors, not %s", name, c10::toString(dtype));
  }
}

// One task: a sequence's query rows for one KV head, against that KV head's keys and values. Its rows are the GQA
// group's query heads for each of its Lq query tokens (row i: query token i / group, query head kv_head * group +
// i % group); its keys are read through a block table (key t: row t % page of block blocks[t / page]), the paged
// cache's layout. Flat keys (prefill without history) are one page of the whole sequence.
template <typename T>
struct Task {
  const T* q;  // the sequence's first query token, head 0
  int64_t sq_token, sq_head;
  T* out;  // (the same layout as q's)
  int64_t so_token, so_head;
  const T *k, *v;  // block 0, this KV head
  const int32_t* blocks;
  int64_t page, sk_block, sk_row, sv_block, sv_row;
  int64_t len_q, len, group, kv_head;  // query tokens, keys (the queries are the last len_q of them)
  float scale;
  bool causal;
};

// Ask the memory system for the rows of the page after t0 (pass 1: keys, pass 2: values) while this page's are used.
// Pages lie wherever the block manager put them, so the hardware prefetcher, which follows addresses, cannot guess
// the next one: without this each page starts with a wait for memory (measured: 3x slower once a step's K/V outgrow
// the cache, as they do here from four layers of a 32-sequence batch on).
template <typename T>
inline void prefetch_next_page(const T* base, const int32_t* blocks, int64_t t0, int64_t page, int64_t end,
                               int64_t block_stride, int64_t row_stride, int64_t row_bytes) {
  const int64_t next = t0 + page;
  if (next >= end) return;
  const char* rows = reinterpret_cast<const char*>(base + blocks[next / page] * block_stride);
  for (int64_t s = 0, n = std::min(page, end - next); s < n; ++s)
    for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(rows + s * row_stride * sizeof(T) + byte);
}

// R rows of a task, from row `first` on. Each key and value row is loaded once for the R rows, whose scores and
// weighted sums sit side by side in registers. A tile that runs past the task's last row repeats that row (and
// writes nothing of it). scores: R rows of `stride` >= len + W floats.
template <typename T, int NV, int R>
void attend_tile(const Task<T>& task, int64_t first, float* scores, int64_t stride) {
  constexpr int64_t D = W * NV;
  const int64_t rows = task.len_q * task.group, page = task.page;
  float buffer[D];  // one half-precision row as float32
  int64_t token[R], head[R], seen[R], end = 0;
  vec qv[R][NV];  // the R query rows, pre-scaled, in registers
  for (int r = 0; r < R; ++r) {
    const int64_t row = std::min(first + r, rows - 1);
    token[r] = row / task.group;
    head[r] = task.kv_head * task.group + row % task.group;
    // causal: query token i is the sequence's token len - len_q + i and sees the keys up to it
    seen[r] = task.causal ? std::clamp<int64_t>(task.len - task.len_q + token[r] + 1, 0, task.len) : task.len;
    end = std::max(end, seen[r]);
    const float* q_row = as_float(task.q + token[r] * task.sq_token + head[r] * task.sq_head, buffer, D);
    for (int j = 0; j < NV; ++j) qv[r][j] = load(q_row + W * j) * task.scale;
  }
  // pass 1: each row's score against each key, walking the pages through the block table
  for (int64_t t0 = 0; t0 < end; t0 += page) {
    prefetch_next_page(task.k, task.blocks, t0, page, end, task.sk_block, task.sk_row, D * sizeof(T));
    const T* page_keys = task.k + task.blocks[t0 / page] * task.sk_block;
    for (int64_t s = 0, n = std::min(page, end - t0); s < n; ++s) {
      const float* key = as_float(page_keys + s * task.sk_row, buffer, D);
      vec kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = load(key + W * j);
      for (int r = 0; r < R; ++r) {
        vec acc = qv[r][0] * kv[0];
        for (int j = 1; j < NV; ++j) acc += qv[r][j] * kv[j];
        scores[r * stride + t0 + s] = lanes_sum(acc);
      }
    }
  }
  for (int r = 0; r < R; ++r) softmax_row(scores + r * stride, seen[r], end);
  // pass 2: out[r] = sum_t p[r, t] v[t], in R * NV independent accumulators (no chain of dependent FMAs)
  vec acc[R][NV] = {};
  for (int64_t t0 = 0; t0 < end; t0 += page) {
    prefetch_next_page(task.v, task.blocks, t0, page, end, task.sv_block, task.sv_row, D * sizeof(T));
    const T* page_values = task.v + task.blocks[t0 / page] * task.sv_block;
    for (int64_t s = 0, n = std::min(page, end - t0); s < n; ++s) {
      const float* value = as_float(page_values + s * task.sv_row, buffer, D);
      vec vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = load(value + W * j);
      for (int r = 0; r < R; ++r) {
        const vec weight = splat(scores[r * stride + t0 + s]);
        for (int j = 0; j < NV; ++j) acc[r][j] += weight * vv[j];
      }
    }
  }
  for (int r = 0; r < R && first + r < rows; ++r) {
    T* dst = task.out + token[r] * task.so_token + head[r] * task.so_head;
    for (int j = 0; j < NV; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        store(dst + W * j, acc[r][j]);
      } else {
        for (int i = 0; i < W; ++i) dst[W * j + i] = static_cast<T>(acc[r][j][i]);
      }
    }
  }
}

// Rows [first, first + count) of a task, in tiles of R: as many rows as the registers hold (R * NV accumulators)
template <typename T, int NV>
void attend_rows(const Task<T>& task, int64_t first, int64_t count, float* scores, int64_t stride) {
  constexpr int most = NV >= 8 ? 1 : NV >= 4 ? 2 : 4;
  const int64_t end = first + count;
  if constexpr (most >= 4)
    for (; first + 4 <= end; first += 4) attend_tile<T, NV, 4>(task, first, scores, stride);
  if constexpr (most >= 2)
    for (; first + 2 <= end; first += 2) attend_tile<T, NV, 2>(task, first, scores, stride);
  for (; first < end; ++first) attend_tile<T, NV, 1>(task, first, scores, stride);
}

// f(T{}, std::integral_constant<int, NV>{}) for q's dtype and head dim (NV = head_dim / W vectors per row)
template <typename F>
void by_dtype_and_head_dim(const at::Tensor& q, const char* name, const F& f) {
  by_dtype(q.scalar_type(), name, [&](auto zero) {
    switch (q.size(-1)) {
      case 16: return f(zero, std::integral_constant<int, 16 / W>{});
      case 32: return f(zero, std::integral_constant<int, 32 / W>{});
      case 64: return f(zero, std::integral_constant<int, 64 / W>{});
      case 128: return f(zero, std::integral_constant<int, 128 / W>{});
      case 256: return f(zero, std::integral_constant<int, 256 / W>{});
      default:
        CHECK_WITH_VALUES(false, "%s is built for head_dim 16, 32, 64, 128 or 256, not %lld", name,
                          (long long)q.size(-1));
    }
  });
}

// Every block a sequence's length reaches must be one of the cache's: a -1 (padding) or a stale id there would
// read outside the cache. lens[b] (or ends[b + 1] - ends[b], from cu_seqlens) tokens per sequence.
void check_block_tables(const at::Tensor& block_table, const int32_t* lens, const int32_t* ends, int64_t max_len,
                        int64_t page, int64_t num_blocks) {
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < block_table.size(0); ++b) {
    const int64_t len = lens ? lens[b] : ends[b + 1] - ends[b];
    CHECK_WITH_VALUES(0 <= len && len <= max_len,
                      "sequence %lld has %lld tokens: more than its block table's %lld blocks hold (or fewer than 0)",
                      (long long)b, (long long)len, (long long)block_table.size(1));
    for (int64_t i = 0; i < (len + page - 1) / page; ++i) {
      const int32_t block = table[b * block_table.stride(0) + i];
      CHECK_WITH_VALUES(0 <= block && block < num_blocks,
                        "block_table[%lld, %lld] is %d, not one of the cache's %lld blocks, but sequence %lld's %lld "
                        "tokens reach it", (long long)b, (long long)i, (int)block, (long long)num_blocks, (long long)b,
                        (long long)len);
    }
  }
}

void check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "the cpp backend runs on the CPU only");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v (or k_cache and v_cache) must have the same shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k and v (or the caches) must share one dtype");
  TORCH_CHECK(q.size(-1) == k.size(-1), "q's head_dim differs from the keys'");
  TORCH_CHECK(q.size(-2) % k.size(-2) == 0, "the query heads must share the KV heads evenly");
  TORCH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1, "q, k and v need a contiguous last axis");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const at::Tensor& block_table, double scale,
                                  bool causal) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4, "q must be (B, Lq, H, D) and the caches (blocks, page, Hk, D)");
  check_attention_inputs(q, k_cache, v_cache);
  TORCH_CHECK(cache_seqlens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt,
              "cache_seqlens and block_table must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 && block_table.size(0) == q.size(0),
              "block_table must be (B, max_blocks) with contiguous rows");
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == q.size(0), "cache_seqlens must be (B,)");
  const at::Tensor lens = cache_seqlens.contiguous();
  at::Tensor out = q.new_empty(q.sizes());
  const int64_t batch = q.size(0), num_kv_heads = k_cache.size(2), page = k_cache.size(1);
  const int64_t max_len = block_table.size(1) * page;  // what a table row can reach
  check_block_tables(block_table, lens.data_ptr<int32_t>(), nullptr, max_len, page, k_cache.size(0));
  by_dtype_and_head_dim(q, "paged_decode_attention", [&](auto zero, auto nv) {
    using T = decltype(zero);
    constexpr int NV = decltype(nv)::value;
    const int32_t *len_of = lens.data_ptr<int32_t>(), *table = block_table.data_ptr<int32_t>();
    // one task per (sequence, KV head), spread over torch's intra-op threads
    at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(4 * (max_len + W));  // a tile's scores, then its softmax weights
      for (int64_t index = begin; index < end; ++index) {
        const int64_t b = index / num_kv_heads, kv_head = index % num_kv_heads;
        const Task<T> task{q.data_ptr<T>() + b * q.stride(0), q.stride(1), q.stride(2),
                           out.data_ptr<T>() + b * out.stride(0), out.stride(1), out.stride(2),
                           k_cache.data_ptr<T>() + kv_head * k_cache.stride(2),
                           v_cache.data_ptr<T>() + kv_head * v_cache.stride(2), table + b * block_table.stride(0),
                           page, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                           q.size(1), std::clamp<int64_t>(len_of[b], 0, max_len), q.size(2) / num_kv_heads, kv_head,
                           static_cast<float>(scale), causal};
        attend_rows<T, NV>(task, 0, task.len_q * task.group, scores.data(), max_len + W);
      }
    });
  });
  return out;
}

// Prefill: flat queries of many sequences (N, H, D), cu_seqlens_q marking where each starts; keys flat (N_k, Hk, D)
// by cu_seqlens_k, or, with a block table, the paged caches (prefix-cache hits and chunked prefill). Sequence b's
// queries are the last of its keys, causal among themselves.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, double scale, bool causal,
                            const std::optional<at::Tensor>& block_table) {
  const bool paged = block_table.has_value() && block_table->defined();
  TORCH_CHECK(q.dim() == 3 && k.dim() == (paged ? 4 : 3),
              "q must be (N, H, D) and k, v (N_k, Hk, D), or the caches (blocks, page, Hk, D) with a block table");
  check_attention_inputs(q, k, v);
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_k.scalar_type() == at::kInt &&
                  cu_seqlens_q.dim() == 1 && cu_seqlens_q.sizes() == cu_seqlens_k.sizes(),
              "cu_seqlens_q and cu_seqlens_k must be int32 (B + 1,)");
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  const int32_t *starts_q = cu_q.data_ptr<int32_t>(), *starts_k = cu_k.data_ptr<int32_t>();
  const int64_t batch = cu_q.size(0) - 1, num_kv_heads = k.size(-2), group = q.size(1) / num_kv_heads;
  const int64_t page = paged ? k.size(1) : 0, width = paged ? block_table->size(1) : 0;
  if (paged) {
    TORCH_CHECK(block_table->scalar_type() == at::kInt && block_table->dim() == 2 && block_table->size(0) == batch &&
                    block_table->stride(1) == 1,
                "block_table must be int32 (B, max_blocks) with contiguous rows");
    check_block_tables(*block_table, nullptr, starts_k, width * page, page, k.size(0));
  }
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {  // the bounds every read relies on
    const int64_t len_q = starts_q[b + 1] - starts_q[b], len = starts_k[b + 1] - starts_k[b];
    TORCH_CHECK(0 <= len_q && len_q <= len && starts_q[0] == 0 && starts_q[batch] <= q.size(0),
                "cu_seqlens_q must rise from 0 within q's tokens, each sequence's queries no more than its keys");
    TORCH_CHECK(paged ? len <= width * page : starts_k[0] >= 0 && starts_k[batch] <= k.size(0),
                "cu_seqlens_k runs past the keys (or a sequence past its block table)");
    max_len = std::max(max_len, len);
  }
  at::Tensor out = q.new_empty(q.sizes());
  // units of work: a sequence's rows for one KV head, cut into runs of at most 64 rows, so that one long prompt still
  // spreads over the threads
  constexpr int64_t run = 64;
  std::vector<std::array<int64_t, 3>> units;  // (sequence, KV head, first row)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
      for (int64_t first = 0; first < (starts_q[b + 1] - starts_q[b]) * group; first += run)
        units.push_back({b, kv_head, first});
  const int32_t zero_block = 0;  // flat keys: one page, block 0 at the sequence's first key
  by_dtype_and_head_dim(q, "varlen_attention", [&](auto zero, auto nv) {
    using T = decltype(zero);
    constexpr int NV = decltype(nv)::value;
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(4 * (max_len + W));
      for (int64_t index = begin; index < end; ++index) {
        const auto [b, kv_head, first] = units[index];
        const int64_t len_q = starts_q[b + 1] - starts_q[b], len = starts_k[b + 1] - starts_k[b];
        Task<T> task{q.data_ptr<T>() + starts_q[b] * q.stride(0), q.stride(0), q.stride(1),
                     out.data_ptr<T>() + starts_q[b] * out.stride(0), out.stride(0), out.stride(1),
                     nullptr, nullptr, &zero_block, std::max<int64_t>(len, 1), 0, k.stride(0), 0, v.stride(0),
                     len_q, len, group, kv_head, static_cast<float>(scale), causal};
        if (paged) {
          task.k = k.data_ptr<T>() + kv_head * k.stride(2);
          task.v = v.data_ptr<T>() + kv_head * v.stride(2);
          task.blocks = block_table->data_ptr<int32_t>() + b * block_table->stride(0);
          task.page = page;
          task.sk_block = k.stride(0), task.sk_row = k.stride(1);
          task.sv_block = v.stride(0), task.sv_row = v.stride(1);
        } else {
          task.k = k.data_ptr<T>() + starts_k[b] * k.stride(0) + kv_head * k.stride(1);
          task.v = v.data_ptr<T>() + starts_k[b] * v.stride(0) + kv_head * v.stride(1);
        }
        attend_rows<T, NV>(task, first, std::min(run, len_q * group - first), scores.data(), max_len + W);
      }
    });
  });
  return out;
}

// Token i's K/V rows (Hk * D values each) into cache row slot_mapping[i] (block * block_size + offset); -1: skip.
void store_kvcache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && k_cache.device().is_cpu(), "the cpp backend runs on the CPU only");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key and value must both be (N, Hk, D)");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key.stride(1) == key.size(2) &&
                  value.stride(1) == value.size(2),
              "key/value: each token's heads must be packed, the last axis contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "k_cache and v_cache must both be contiguous (num_blocks, block_size, Hk, D)");
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "the cache rows' (Hk, D) differ from the key rows'");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type(),
              "key, value and the caches must share one dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int64 with one slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), row = key.size(1) * key.size(2);
  for (int64_t i = 0; i < key.size(0); ++i)
    CHECK_WITH_VALUES(slot[i] < num_slots, "slot %lld is past the cache's %lld slots", (long long)slot[i],
                      (long long)num_slots);
  by_dtype(key.scalar_type(), "store_kvcache", [&](auto zero) {
    using T = decltype(zero);
    const T *k = key.data_ptr<T>(), *v = value.data_ptr<T>();
    T *k_rows = k_cache.data_ptr<T>(), *v_rows = v_cache.data_ptr<T>();
    for (int64_t i = 0; i < key.size(0); ++i) {
      if (slot[i] < 0) continue;
      std::memcpy(k_rows + slot[i] * row, k + i * key.stride(0), row * sizeof(T));
      std::memcpy(v_rows + slot[i] * row, v + i * value.stride(0), row * sizeof(T));
    }
  });
}

// ---- The element-wise layers' fused forms (layers/layernorm.py, rotary.py, activation.py). Each is one pass over
// its rows where the torch reference runs 5 to 10 small ops, each a dispatch and a round trip through memory. The
// arithmetic is the reference's: float32, with its casts to the model's dtype where it has them.

// sum over i < n of (x[i] (+ residual[i]))^2, in float32
template <typename T, bool ADD>
inline float sum_squares(const T* x, const T* residual, int64_t n) {
  vec lanes = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vec v = load_float(x + i);
    if constexpr (ADD) v += load_float(residual + i);
    lanes += v * v;
  }
  float total = lanes_sum(lanes);
  for (; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    if constexpr (ADD) v += static_cast<float>(residual[i]);
    total += v * v;
  }
  return total;
}

// rms_norm and add_rms_norm over rows of n values: residual' = x + residual (ADD), out = weight * x / rms(x)
template <typename T, bool ADD>
void rms_norm_rows(const T* x, const T* residual, const T* weight, float eps, int64_t rows, int64_t n, T* out,
                   T* new_residual) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * n;
      const T* rr = ADD ? residual + row * n : nullptr;
      const float inv = 1.f / std::sqrt(sum_squares<T, ADD>(xr, rr, n) / n + eps);
      T* o = out + row * n;
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        vec v = load_float(xr + i);
        if constexpr (ADD) {
          v += load_float(rr + i);
          store_float(new_residual + row * n + i, v);
        }
        store_float(o + i, load_float(weight + i) * rounded<T>(v * inv));
      }
      for (; i < n; ++i) {
        float v = static_cast<float>(xr[i]);
        if constexpr (ADD) {
          v += static_cast<float>(rr[i]);
          new_residual[row * n + i] = static_cast<T>(v);
        }
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * rounded<T>(v * inv));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == weight.scalar_type() && weight.dim() == 1 &&
                  x.size(-1) == weight.size(0),
              "rms_norm: x (..., n) and weight (n,) must be CPU tensors of one dtype");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = xc.new_empty(xc.sizes());
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  by_dtype(x.scalar_type(), "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows<T, false>(xc.data_ptr<T>(), nullptr, wc.data_ptr<T>(), eps, rows, n, out.data_ptr<T>(), nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == weight.scalar_type() &&
                  x.scalar_type() == residual.scalar_type() && x.sizes() == residual.sizes() && weight.dim() == 1 &&
                  x.size(-1) == weight.size(0),
              "add_rms_norm: x and residual (..., n) and weight (n,) must be CPU tensors of one dtype");
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  at::Tensor out = xc.new_empty(xc.sizes()), new_residual = xc.new_empty(xc.sizes());
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  by_dtype(x.scalar_type(), "add_rms_norm", [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows<T, true>(xc.data_ptr<T>(), rc.data_ptr<T>(), wc.data_ptr<T>(), eps, rows, n, out.data_ptr<T>(),
                           new_residual.data_ptr<T>());
  });
  return {out, new_residual};
}

// Qwen3's q/k RMSNorm then neox RoPE over (N, heads, D): each head's row normalised (weight row per head), then
// element i and i + D/2 rotated by the token's angle: (a, b) -> (a cos - b sin, b cos + a sin).
at::Tensor norm_rotary(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& positions,
                       const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "norm_rotary: x must be (N, heads, D) on the "
              "CPU with a contiguous last axis");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && weight.dim() == 2 && weight.size(0) == heads && weight.size(1) == d &&
                  weight.stride(1) == 1 && weight.scalar_type() == x.scalar_type(),
              "norm_rotary: weight must be (heads, D) of x's dtype, with an even D");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens && positions.scalar_type() == at::kLong,
              "norm_rotary: positions must be (N,) int64");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.dim() == 2 &&
                  cos_cache.size(1) == half && sin_cache.sizes() == cos_cache.sizes(),
              "norm_rotary: the cos/sin tables must be contiguous float32 (positions, D/2)");
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    CHECK_WITH_VALUES(p[t] >= 0 && p[t] < cos_cache.size(0), "norm_rotary: position %lld is outside the tables",
                      (long long)p[t]);
  at::Tensor out = x.new_empty({tokens, heads, d});
  const float *cos_table = cos_cache.data_ptr<float>(), *sin_table = sin_cache.data_ptr<float>();
  by_dtype(x.scalar_type(), "norm_rotary", [&](auto zero) {
    using T = decltype(zero);
    const T *src = x.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, tokens * heads, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
      std::vector<float> y(d);  // one head's normalised row, in float32
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = task / heads, h = task % heads;
        const T* row = src + t * x.stride(0) + h * x.stride(1);
        const T* w_row = w + h * weight.stride(0);
        const float inv = 1.f / std::sqrt(sum_squares<T, false>(row, nullptr, d) / d + static_cast<float>(eps));
        for (int64_t i = 0; i < d; ++i)
          y[i] = rounded<T>(static_cast<float>(w_row[i]) * rounded<T>(static_cast<float>(row[i]) * inv));
        const float *c = cos_table + p[t] * half, *s = sin_table + p[t] * half;
        T* o = dst + task * d;
        for (int64_t i = 0; i < half; ++i) {
          o[i] = static_cast<T>(y[i] * c[i] - y[i + half] * s[i]);
          o[i + half] = static_cast<T>(y[i + half] * c[i] + y[i] * s[i]);
        }
      }
    });
  });
  return out;
}

// SwiGLU's gate: x = [gate | up] (N, 2I) -> silu(gate) * up (N, I), silu(g) = g / (1 + exp(-g))
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) % 2 == 0, "silu_and_mul: x must be (..., 2I) on the CPU");
  const at::Tensor xc = x.contiguous();
  const int64_t width = x.size(-1) / 2, rows = width ? x.numel() / (2 * width) : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = width;
  at::Tensor out = xc.new_empty(shape);
  by_dtype(x.scalar_type(), "silu_and_mul", [&](auto zero) {
    using T = decltype(zero);
    const T* src = xc.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const T *gate = src + row * 2 * width, *up = gate + width;
        T* o = dst + row * width;
        int64_t i = 0;
        for (; i + W <= width; i += W) {
          const vec g = load_float(gate + i);
          store_float(o + i, rounded<T>(g / (1.f + exp_clamped(-g))) * load_float(up + i));
        }
        for (; i < width; ++i) {
          const float g = static_cast<float>(gate[i]);
          o[i] = static_cast<T>(rounded<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoref_cpp, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
        "Tensor block_table, float scale, bool causal) -> Tensor");
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
        "bool causal, Tensor? block_table) -> Tensor");
  m.def("store_kvcache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("norm_rotary(Tensor x, Tensor weight, float eps, Tensor positions, Tensor cos_cache, Tensor sin_cache) "
        "-> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoref_cpp, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("varlen_attention", &varlen_attention);
  m.impl("store_kvcache", &store_kvcache);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("norm_rotary", &norm_rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
"""

# -O3 vectorises the loops; -march=native lets the vector types use this CPU's widest registers (the build is
# cached per CPU: see build_name)
HEAD_DIMS = (16, 32, 64, 128, 256)  # the head dims the kernels are compiled for (the register tiles are per head dim)
CFLAGS = ["-O3", "-march=native"]


class CppKernelUnavailableError(RuntimeError):
    """The C++ kernels cannot be built here (no compiler, no ninja, or the build failed)."""


def missing_build_tools() -> list[str]:
    """What `torch.utils.cpp_extension` needs and this machine lacks: a C++ compiler and ninja."""
    missing = []
    if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
        missing.append("ninja (pip install ninja)")
    return missing


def cpu_signature() -> str:
    """This CPU's instruction sets (a build with -march=native runs only where they all are)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line for line in cpuinfo if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        return platform.machine() + platform.processor()


def build_name() -> str:
    """The build's folder under torch's extensions directory: a new name for any change that needs a new build."""
    key = "\n".join([CPP_SOURCE, *CFLAGS, torch.__version__, sys.version, cpu_signature()])
    return "nanoref_cpp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def extensions_root() -> Path:
    """torch's extensions directory: $TORCH_EXTENSIONS_DIR, else `cpp_extension.get_default_build_root()`'s folder
    (computed as it does: importing torch.utils.cpp_extension takes a second, which a cached build never needs)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    from torch import _appdirs  # (cpp_extension's own source of the folder)

    return Path(root or os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")))


_failure: CppKernelUnavailableError | None = None  # a failed build, remembered: never retried in this process
_loaded = False  # torch.ops.nanoref_cpp is registered (what the kernels' wrappers check on every call)


def load() -> None:
    """Build (or load from the cache) the kernels and register `torch.ops.nanoref_cpp`. Raises
    CppKernelUnavailableError if it cannot, every time, without building again."""
    global _loaded
    if _failure is not None:
        raise _failure
    _load()
    _loaded = True


STALE_LOCK_SECONDS = 600  # another host's build lock (or any without OS file locks) this old: a killed build's


_lock = threading.Lock()  # two threads making their first engines at once load (or build) once


@functools.cache
def _load() -> None:
    with _lock:
        _load_or_build()


@contextlib.contextmanager
def _builder(folder: Path) -> Iterator[bool]:
    """Be the one process building in `folder` -> whether torch's build lock there was a dead build's (and is gone).

    An OS file lock on `nanoref.lock` there, which another process's build holds until it ends (waited for, saying
    so) and which the OS lets go of when a process dies. So torch's own `lock` file, found while this is held, is no
    live build's when the last build that held it ran on this host (the file names that host): a build killed mid-way
    left it (a Jupyter kernel restarted during the first build), and torch would wait for it forever, and its library
    may be half written. It is removed (and the library built again). A torch lock of another host's build (a home
    folder shared between machines, whose OS locks may be each machine's own), or any where there are no OS file locks
    (Windows, a network folder without them), is waited for: until it goes (that build's library is then loaded), or,
    once it is STALE_LOCK_SECONDS old, taken for a killed build's."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    with open(folder / "nanoref.lock", "a+") as handle:
        try:
            locked = _os_lock(handle, folder)
        except OSError:  # (no lock to take here)
            locked = False
        try:
            handle.seek(0)
            ours = locked and handle.read() in ("", _HOST)  # (the last build that took it ran here)
            handle.truncate(0)
            handle.write(_HOST)
            handle.flush()
            if not ours:
                _wait_while_fresh(lock)
            stale = lock.exists()
            if stale:
                lock.unlink(missing_ok=True)
            yield stale
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


_HOST = socket.gethostname()


def _wait_while_fresh(lock: Path) -> None:
    """Wait while torch's build lock `lock` is there and younger than STALE_LOCK_SECONDS (a build that may be live)."""
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # (that build ended)
            return
        if age > STALE_LOCK_SECONDS:
            return
        if not said:
            print(f"nanoref: waiting for the build that holds {lock} (another machine's?) to end...", file=sys.stderr)
            said = True
        time.sleep(0.5)


def _os_lock(handle: Any, folder: Path) -> bool:
    """Take the OS lock on the open file `handle` (waiting, and saying so, while another process holds it) -> False
    where this system has none."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        waiting = f"nanoref: waiting for another process's build of the cpp backend's kernels in {folder}..."
        print(waiting, file=sys.stderr)
        fcntl.flock(handle, fcntl.LOCK_EX)
    return True


def _load_or_build() -> None:
    global _failure
    missing = missing_build_tools()
    if missing:
        raise CppKernelUnavailableError("the cpp backend needs " + " and ".join(missing))
    name = build_name()
    folder = extensions_root() / name
    library, lock = folder / f"{name}.so", folder / "lock"
    if library.exists() and not lock.exists():  # built before (and no build under way): just load it
        _load_library(library)
        return
    path_before = list(sys.path)
    try:
        with _builder(folder) as stale:
            if library.exists() and not stale:  # another process built it while this one waited
                _load_library(library)
                return
            print(
                f"nanoref: compiling the cpp backend's C++ kernels into {folder} (once per machine, about 20 s)...",
                file=sys.stderr,
            )
            start = time.perf_counter()
            _build(name, folder)
    except CppKernelUnavailableError:
        raise
    except Exception as error:  # compiler errors, a broken toolchain, a folder it cannot write: say which backend
        # failed and why
        _failure = CppKernelUnavailableError(f"building the cpp backend's kernels failed: {error}")
        raise _failure from error
    finally:
        # torch's cpp_extension imports setuptools, whose first import appends its _vendor folder to sys.path: the
        # caller's import path is theirs, so take back what the build added (the modules it imported stay loaded)
        sys.path[:] = [entry for entry in sys.path if entry in path_before]
    print(f"nanoref: the cpp backend's kernels are built ({time.perf_counter() - start:.0f} s)", file=sys.stderr)


def _load_library(library: Path) -> None:
    global _failure
    try:
        torch.ops.load_library(str(library))
    except OSError as error:  # a damaged library: say where it is (deleting the folder makes the next use rebuild it)
        _failure = CppKernelUnavailableError(f"loading the cpp backend's kernels from {library} failed: {error}")
        raise _failure from error


def _build(name: str, folder: Path) -> None:
    from torch.utils.cpp_extension import load as build_and_load

    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "nanoref_cpp.cpp"
    if not source.exists() or source.read_text() != CPP_SOURCE:  # (rewritten only when it differs: ninja's mtimes)
        source.write_text(CPP_SOURCE)
    path = os.environ.get("PATH")
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is not None:
        # `pip install ninja` put it in the environment's bin folder, which a Jupyter kernel started by its full path
        # may not have on PATH: torch runs `ninja` by name. Put the folder on PATH for the build, and take it off after
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *([path] if path else [])])
    try:
        # is_python_module=False: torch.ops.load_library registers torch.ops.nanoref_cpp; nothing is imported by name
        build_and_load(name, [str(source)], extra_cflags=CFLAGS, build_directory=str(folder), is_python_module=False)
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


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
    if not _loaded:
        load()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.nanoref_cpp.paged_decode_attention.default(
        q, k_cache, v_cache, cache_seqlens, block_table, scale, causal
    )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (N, H, D). Without block_table k, v: (N_k, Hk, D) flat; with it, the paged caches. cu_seqlens: (B + 1,)
    int32. -> (N, H, D). The arguments and meaning of `attention_torch`'s version (max_seqlen_*: unused, the kernel
    reads the lengths from cu_seqlens)."""
    if not _loaded:
        load()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.nanoref_cpp.varlen_attention.default(
        q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, block_table
    )


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value: (N, Hk, D); caches: (num_blocks, block_size, Hk, D); slot_mapping: (N,) int64, -1 = skip. What
    `store_kvcache_torch` does, one row copy per token (key, value and the caches of one dtype)."""
    if not _loaded:
        load()
    torch.ops.nanoref_cpp.store_kvcache.default(key, value, k_cache, v_cache, slot_mapping)
    trace("store_kvcache", key=key, slot_mapping=slot_mapping, k_cache=k_cache)


# The element-wise layers' fused forms, with the arguments and results of the torch functions they stand for (x and
# the weights of one dtype; float32 arithmetic, with the reference's casts to that dtype).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.layernorm.rms_norm`: x (..., n) -> x * rsqrt(mean(x^2) + eps) * weight."""
    if not _loaded:
        load()
    return torch.ops.nanoref_cpp.rms_norm.default(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers.layernorm.add_rms_norm`: (rms_norm(x + residual), x + residual)."""
    if not _loaded:
        load()
    return torch.ops.nanoref_cpp.add_rms_norm.default(x, residual, weight, eps)


def norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> torch.Tensor:
    """`layers.rotary.norm_rotary`: x (N, heads, D), weight (heads, D), positions (N,) int64, caches (P, D/2) float32
    -> each head's RMSNorm, then RoPE (N, heads, D)."""
    if not _loaded:
        load()
    return torch.ops.nanoref_cpp.norm_rotary.default(x, weight, eps, positions, cos_cache, sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`ops.activation.silu_and_mul`: x (..., 2I) = [gate | up] -> silu(gate) * up (..., I)."""
    if not _loaded:
        load()
    return torch.ops.nanoref_cpp.silu_and_mul.default(x)
