// Decode attention on the CPU straight from the paged HND cache: one query token per sequence,
// the sequence's keys and values read page by page where they lie (never gathered), an online
// softmax per query head, float32 arithmetic for float32 and bfloat16 caches alike.
//
// Why a kernel of our own: torch has no paged decode attention for the CPU. The engine's torch
// paths either gather pages and call SDPA (whose flash kernel runs a 1-3 row query at a few
// GB/s) or use a sampled sparse matmul plus `embedding_bag` (float32 only, and it reads each
// K/V row once per query head of a GQA group). Here a task is one sequence, its pages read
// where they lie, and each K and V row is loaded (and, from a bfloat16 cache, widened) once into
// registers for all query heads of its KV head: up to 4 heads per pass at head size 64, 2 at 128,
// as many as keep their accumulators in registers. Reading a page, the kernel prefetches the next
// one a row per key (the hardware prefetchers do not follow the page table). With fewer
// sequences than 4 per thread a task is one (sequence, KV head) instead, so that every thread
// has work. Tasks run on torch's own intra-op threads (at::parallel_for), so the engine's
// thread settings hold.
//
// Registered as torch.ops.pdserve.paged_decode_attention (out-variant, see the schema below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace pdserve_cpu;

// Folds: x and y each hold equal blocks of partial sums, one block per key; the result holds
// x's keys then y's, each block half as wide (its two halves added). Four rounds (fold1 ..
// fold4) turn 16 vectors of 16 partial sums, one vector per key, into one vector of 16 dot
// products: 15 folds instead of 16 full horizontal sums.
PDSERVE_INLINE v16 fold1(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                 31);
}
PDSERVE_INLINE v16 fold2(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                 31);
}
PDSERVE_INLINE v16 fold3(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                 31);
}
PDSERVE_INLINE v16 fold4(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                 30) +
         __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
}

// Query heads in one pass over a KV head's rows, at most (head size 64; 2 at 128).
constexpr int64_t kPassHeads = 4;
// A pass's parked score folds: its heads x 8 key pairs x 16 lanes.
constexpr int64_t kFoldFloats = kPassHeads * 8 * 16;

struct Shape {
  int64_t planes, value_plane, kv_heads, page_size, head_dim, num_pages, query_heads;
  int64_t table_stride;
  int64_t q_seq_stride, q_head_stride;  // q may be a view (a slice of the fused projection)
  int64_t head_blocks;  // a task is one sequence's KV heads, in this many blocks
  float scale;
};

// A row's values in the kernel's lane order, as pairs of 16-lane vectors per 32 values. For a
// float32 row that is the row's own order. A bfloat16 row is read 32 values (one 64-byte load)
// at a time and split into its even and odd values, each a shift or a mask of the 32-bit lanes:
// two instructions where widening in order takes a cross-lane shuffle and a shift per 16. Dot
// products do not care about the order as long as the query is in the same one, and the output
// is put back in row order once per task (`to_lanes`, `from_lanes`).
PDSERVE_INLINE void load32(const float* p, v16& first, v16& second) {
  first = load16(p);
  second = load16(p + 16);
}

typedef uint32_t u32x16_unaligned __attribute__((vector_size(64), aligned(2)));

PDSERVE_INLINE void load32(const c10::BFloat16* p, v16& even, v16& odd) {
  const u32x16 pairs = *reinterpret_cast<const u32x16_unaligned*>(p);
  const u32x16 low = pairs << 16, high = pairs & 0xFFFF0000u;
  std::memcpy(&even, &low, sizeof even);
  std::memcpy(&odd, &high, sizeof odd);
}

// A query row (D values, D a multiple of 32) as float32 in lane order, and back.
PDSERVE_INLINE void to_lanes(const float* row, int64_t D, float* out) {
  std::memcpy(out, row, D * sizeof(float));
}

PDSERVE_INLINE void to_lanes(const c10::BFloat16* row, int64_t D, float* out) {
  for (int64_t c = 0; c < D; c += 32) {
    for (int64_t j = 0; j < 16; j++) {
      out[c + j] = static_cast<float>(row[c + 2 * j]);
      out[c + 16 + j] = static_cast<float>(row[c + 2 * j + 1]);
    }
  }
}

PDSERVE_INLINE void from_lanes(const float* acc, float inv, int64_t D, float* out) {
  store(out, acc, inv, D);
}

PDSERVE_INLINE void from_lanes(const float* acc, float inv, int64_t D, c10::BFloat16* out) {
  for (int64_t c = 0; c < D; c += 32) {
    for (int64_t j = 0; j < 16; j++) {
      out[c + 2 * j] = c10::BFloat16(acc[c + j] * inv);
      out[c + 2 * j + 1] = c10::BFloat16(acc[c + 16 + j] * inv);
    }
  }
}

// Into L2 (prefetcht1), not L1: a request into L1 holds one of L1's few miss buffers until its
// line arrives, and the page's own loads then queue behind the prefetches. Measured on the
// 2-vCPU AMD EPYC VM (AVX-512; SmolLM2's shapes, batch 64): 1.2x (float32) and 1.5x (bfloat16)
// the speed of prefetcht0.
template <typename T>
PDSERVE_INLINE void prefetch_row(const T* row, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < elements * int64_t(sizeof(T)); offset += 64) {
    __builtin_prefetch(bytes + offset, /*rw=*/0, /*locality=*/2);
  }
}

// One KV head's share of one page for kHeads of its query heads (a compiled head size kDim, a
// multiple of 32): n keys and values, the heads' queries in lane order, their running softmax
// state (max, total, accumulators in lane order). Each K and V row is loaded (and widened) once
// for all kHeads heads, which is what keeps a bfloat16 cache from costing more arithmetic than
// a float32 one. `next_keys` / `next_values` (or null): the same head's rows in the page read
// after this one, prefetched a row per key of this page: the hardware prefetchers do not follow
// the page table, and spreading the requests keeps the loads of this page from queueing behind
// them.
template <int64_t kDim, int64_t kHeads, typename T>
PDSERVE_INLINE void attend_rows(int64_t score_stride, float scale,
                                const float* __restrict queries, const T* __restrict keys,
                                const T* __restrict values, int64_t n, const T* next_keys,
                                const T* next_values, float* __restrict scores,
                                float* __restrict folds, float* __restrict max_score,
                                float* __restrict total, float* __restrict acc) {
  constexpr int64_t kVectors = kDim / 16;
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 block_max[kHeads];
  for (int64_t g = 0; g < kHeads; g++) block_max[g] = v16{} + max_score[g];
  // Scores, 16 keys at a time: two keys' partial sums per head are folded into one vector and
  // parked in `folds` (L1) until the block's eight pairs are in, then folded down to one vector
  // of 16 dot products per head.
  v16 qv[kHeads][kVectors];
#pragma GCC unroll 4
  for (int64_t g = 0; g < kHeads; g++) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < kVectors; c++) qv[g][c] = load16(queries + g * kDim + c * 16);
  }
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    for (int64_t pair = 0; pair < 8; pair++) {
      v16 partial[kHeads][2];
#pragma GCC unroll 2
      for (int64_t u = 0; u < 2; u++) {
        const int64_t t = t0 + 2 * pair + u;
        if (t < n) {
          v16 k[kVectors];
#pragma GCC unroll 8
          for (int64_t c = 0; c < kVectors; c += 2) {
            load32(keys + t * kDim + c * 16, k[c], k[c + 1]);
          }
#pragma GCC unroll 4
          for (int64_t g = 0; g < kHeads; g++) {
            v16 sum = qv[g][0] * k[0];
#pragma GCC unroll 8
            for (int64_t c = 1; c < kVectors; c++) sum += qv[g][c] * k[c];
            partial[g][u] = sum;
          }
        } else {
          for (int64_t g = 0; g < kHeads; g++) partial[g][u] = v16{};
        }
      }
#pragma GCC unroll 4
      for (int64_t g = 0; g < kHeads; g++) {
        const v16 folded = fold1(partial[g][0], partial[g][1]);
        std::memcpy(folds + (g * 8 + pair) * 16, &folded, sizeof folded);
      }
    }
    const i16x16 valid = lane < static_cast<float>(n - t0);
#pragma GCC unroll 4
    for (int64_t g = 0; g < kHeads; g++) {
      const float* f = folds + g * 8 * 16;
      v16 l2[4], l3[2];
      for (int i = 0; i < 4; i++) l2[i] = fold2(load16(f + 32 * i), load16(f + 32 * i + 16));
      for (int i = 0; i < 2; i++) l3[i] = fold3(l2[2 * i], l2[2 * i + 1]);
      const v16 dots = fold4(l3[0], l3[1]) * scale;
      block_max[g] = (valid & (dots > block_max[g])) ? dots : block_max[g];
      std::memcpy(scores + g * score_stride + t0, &dots, sizeof dots);
    }
  }
  // Online softmax per head: the weights replace the scores, and what was accumulated is
  // rescaled when the running maximum grows.
  float correction[kHeads];
#pragma GCC unroll 4
  for (int64_t g = 0; g < kHeads; g++) {
    float* sg = scores + g * score_stride;
    const float page_max = lane_max(block_max[g]);
    v16 sums = {};
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const v16 e = exp16_nonpositive(load16(sg + t0) - page_max);
      const v16 weights = lane < static_cast<float>(n - t0) ? e : v16{};
      sums += weights;
      std::memcpy(sg + t0, &weights, sizeof weights);
    }
    correction[g] = exp_nonpositive(max_score[g] - page_max);
    max_score[g] = page_max;
    total[g] = total[g] * correction[g] + lane_sum(sums);
  }
  // Weighted V rows into the accumulators, kHeads x kVectors of them in registers.
  v16 a[kHeads][kVectors];
#pragma GCC unroll 4
  for (int64_t g = 0; g < kHeads; g++) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < kVectors; c++) {
      a[g][c] = load16(acc + g * kDim + c * 16) * correction[g];
    }
  }
  for (int64_t t = 0; t < n; t++) {
    if (next_keys != nullptr) {
      prefetch_row(next_keys + t * kDim, kDim);
      prefetch_row(next_values + t * kDim, kDim);
    }
    v16 v[kVectors];
#pragma GCC unroll 8
    for (int64_t c = 0; c < kVectors; c += 2) load32(values + t * kDim + c * 16, v[c], v[c + 1]);
#pragma GCC unroll 4
    for (int64_t g = 0; g < kHeads; g++) {
      const float weight = scores[g * score_stride + t];
#pragma GCC unroll 8
      for (int64_t c = 0; c < kVectors; c++) a[g][c] += weight * v[c];
    }
  }
#pragma GCC unroll 4
  for (int64_t g = 0; g < kHeads; g++) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < kVectors; c++) {
      std::memcpy(acc + g * kDim + c * 16, &a[g][c], sizeof(v16));
    }
  }
}

// A KV head's whole group, in passes of at most kMaxHeads query heads: as many as keep the
// accumulators in registers (16 vectors; kMaxHeads <= kPassHeads).
template <int64_t kDim, typename T>
PDSERVE_INLINE void attend_group(int64_t group, int64_t score_stride, float scale,
                                 const float* queries, const T* keys, const T* values, int64_t n,
                                 const T* next_keys, const T* next_values, float* scores,
                                 float* folds, float* max_score, float* total, float* acc) {
  constexpr int64_t kMaxHeads = std::min<int64_t>(kPassHeads, 256 / kDim);
  for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads) {
    // Only the first pass prefetches: the rows are the same for every pass.
    const T* nk = g0 == 0 ? next_keys : nullptr;
    const T* nv = g0 == 0 ? next_values : nullptr;
    const float* q = queries + g0 * kDim;
    float *m = max_score + g0, *tot = total + g0, *a = acc + g0 * kDim;
    // No lambda here: it would be a function of its own, compiled for the baseline ISA unless
    // inlined into this clone.
    switch (std::min(kMaxHeads, group - g0)) {
      case 1:
        attend_rows<kDim, 1>(score_stride, scale, q, keys, values, n, nk, nv, scores, folds, m,
                             tot, a);
        break;
      case 2:
        attend_rows<kDim, 2>(score_stride, scale, q, keys, values, n, nk, nv, scores, folds, m,
                             tot, a);
        break;
      case 3:
        if constexpr (kMaxHeads >= 3) {
          attend_rows<kDim, 3>(score_stride, scale, q, keys, values, n, nk, nv, scores, folds, m,
                               tot, a);
        }
        break;
      default:
        if constexpr (kMaxHeads >= 4) {
          attend_rows<kDim, 4>(score_stride, scale, q, keys, values, n, nk, nv, scores, folds, m,
                               tot, a);
        }
        break;
    }
  }
}

// Any head size: one query head at a time over float32 rows (a bfloat16 page widened first).
PDSERVE_INLINE void attend_page_any(int64_t group, int64_t D, float scale,
                                    const float* __restrict queries, const float* __restrict keys,
                                    const float* __restrict values, int64_t n,
                                    float* __restrict scores, float* __restrict max_score,
                                    float* __restrict total, float* __restrict acc) {
  for (int64_t g = 0; g < group; g++) {
    float page_max = max_score[g];
    for (int64_t t = 0; t < n; t++) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; d++) dot += queries[g * D + d] * keys[t * D + d];
      scores[t] = dot * scale;
      page_max = std::max(page_max, scores[t]);
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
      const float e = exp_nonpositive(scores[t] - page_max);
      scores[t] = e;
      sum += e;
    }
    const float correction = exp_nonpositive(max_score[g] - page_max);
    max_score[g] = page_max;
    total[g] = total[g] * correction + sum;
    float* __restrict a = acc + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; d++) a[d] *= correction;
    for (int64_t t = 0; t < n; t++) {
#pragma omp simd
      for (int64_t d = 0; d < D; d++) a[d] += scores[t] * values[t * D + d];
    }
  }
}

// kDim: the head dimension when known at compile time (a multiple of 32: registers, lane order,
// no remainders), 0 for any other, read from the shape.
template <int64_t kDim, typename T>
PDSERVE_INLINE void attend(const Shape& s, const T* cache, const T* q, T* out,
                           const int64_t* table, const int64_t* lens, int64_t first,
                           int64_t last) {
  const int64_t group = s.query_heads / s.kv_heads, P = s.page_size;
  const int64_t D = kDim > 0 ? kDim : s.head_dim;
  const int64_t planes = s.planes, kv_heads = s.kv_heads, query_heads = s.query_heads;
  const int64_t stride = s.table_stride;
  const int64_t heads_per_task = kv_heads / s.head_blocks;
  const int64_t head_rows = P * D, value_offset = s.value_plane * kv_heads * head_rows;
  // Per thread: every query head's state, one group's page of scores, the score folds, widened
  // K / V rows (other head sizes).
  const int64_t score_stride = (P + 15) / 16 * 16;  // whole 16-lane blocks
  std::vector<float> buffers(query_heads * (2 * D + 2) + group * score_stride + kFoldFloats +
                             2 * P * D);
  float* acc = buffers.data();
  float* queries = acc + query_heads * D;
  float* max_score = queries + query_heads * D;
  float* total = max_score + query_heads;
  float* scores = total + query_heads;
  float* folds = scores + group * score_stride;
  float* key_rows = folds + kFoldFloats;
  float* value_rows = key_rows + P * D;
  // Where task `task`'s page j starts (its first KV head's K rows).
  auto block_of = [&](int64_t task, int64_t j) {
    const int64_t seq = task / s.head_blocks;
    const int64_t head0 = task % s.head_blocks * heads_per_task;
    return cache + (table[seq * stride + j] * planes * kv_heads + head0) * head_rows;
  };
  for (int64_t task = first; task < last; task++) {
    const int64_t seq = task / s.head_blocks;
    const int64_t head0 = task % s.head_blocks * heads_per_task;
    const int64_t len = lens[seq];
    // State of this task's query heads: [heads_per_task * group], from query head head0 * group.
    const int64_t rows = heads_per_task * group, row0 = head0 * group;
    for (int64_t r = 0; r < rows; r++) {
      const T* row = q + seq * s.q_seq_stride + (row0 + r) * s.q_head_stride;
      if constexpr (kDim > 0) {
        to_lanes(row, D, queries + r * D);
      } else {
        const float* widened = as_float(row, D, queries + r * D);
        if (widened != queries + r * D) std::memcpy(queries + r * D, widened, D * sizeof(float));
      }
      max_score[r] = -std::numeric_limits<float>::max();
      total[r] = 0.0f;
    }
    std::memset(acc, 0, rows * D * sizeof(float));
    const int64_t pages = (len + P - 1) / P;
    for (int64_t j = 0; j < pages; j++) {
      const int64_t n = std::min(P, len - j * P);
      const T* block = block_of(task, j);
      // The page read next: this sequence's next one, else the next task's first.
      const T* next = j + 1 < pages ? block_of(task, j + 1)
                      : task + 1 < last ? block_of(task + 1, 0)
                                        : nullptr;
      for (int64_t h = 0; h < heads_per_task; h++) {
        const T* keys = block + h * head_rows;
        const T* values = block + value_offset + h * head_rows;
        const int64_t r = h * group;
        if constexpr (kDim > 0) {
          const T* next_keys = next == nullptr ? nullptr : next + h * head_rows;
          const T* next_values = next == nullptr ? nullptr : next + value_offset + h * head_rows;
          attend_group<kDim>(group, score_stride, s.scale, queries + r * D, keys, values, n,
                             next_keys, next_values, scores, folds, max_score + r, total + r,
                             acc + r * D);
        } else {
          const float* key_floats = as_float(keys, n * D, key_rows);
          const float* value_floats =
              value_offset == 0 ? key_floats : as_float(values, n * D, value_rows);
          attend_page_any(group, D, s.scale, queries + r * D, key_floats, value_floats, n,
                          scores, max_score + r, total + r, acc + r * D);
        }
      }
    }
    for (int64_t r = 0; r < rows; r++) {
      T* row = out + (seq * query_heads + row0 + r) * D;
      if constexpr (kDim > 0) {
        from_lanes(acc + r * D, 1.0f / total[r], D, row);
      } else {
        store(row, acc + r * D, 1.0f / total[r], D);
      }
    }
  }
}

// The compiled head sizes, else the generic loops.
template <typename T>
PDSERVE_INLINE void attend_any_dim(const Shape& s, const T* cache, const T* q, T* out,
                                   const int64_t* table, const int64_t* lens, int64_t first,
                                   int64_t last) {
  switch (s.head_dim) {
    case 64: return attend<64>(s, cache, q, out, table, lens, first, last);
    case 128: return attend<128>(s, cache, q, out, table, lens, first, last);
    default: return attend<0>(s, cache, q, out, table, lens, first, last);
  }
}

// target_clones takes plain functions, not templates: one per cache dtype.
PDSERVE_CLONES void attend_f32(const Shape& s, const float* cache, const float* q, float* out,
                               const int64_t* table, const int64_t* lens, int64_t first,
                               int64_t last) {
  attend_any_dim(s, cache, q, out, table, lens, first, last);
}

PDSERVE_CLONES void attend_bf16(const Shape& s, const c10::BFloat16* cache,
                                const c10::BFloat16* q, c10::BFloat16* out,
                                const int64_t* table, const int64_t* lens, int64_t first,
                                int64_t last) {
  attend_any_dim(s, cache, q, out, table, lens, first, last);
}

// The tasks over torch's intra-op threads.
template <typename T, typename Attend>
void run(const Shape& s, int64_t tasks, const at::Tensor& cache, const at::Tensor& q,
         const at::Tensor& out, const int64_t* table, const int64_t* lens, Attend attend) {
  const T* c = cache.data_ptr<T>();
  const T* qp = q.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    attend(s, c, qp, o, table, lens, first, last);
  });
}

// out, q: [Bd, Hq, D]; cache: one layer, [pages, planes, Hk, P, D]; page_table: [Bd, >= pages of
// the longest] int64, row i for query row i; seq_lens: [Bd] int64 (keys of each sequence,
// counting the new token, whose K/V is already in the cache).
void paged_decode_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens,
                            int64_t value_plane, double scale) {
  TORCH_CHECK(cache.dim() == 5 && q.dim() == 3 && out.sizes() == q.sizes(),
              "paged_decode_attention: expected cache [pages, planes, Hk, P, D] and q, out "
              "[Bd, Hq, D]");
  TORCH_CHECK(cache.is_contiguous() && out.is_contiguous() && page_table.is_contiguous() &&
                  seq_lens.is_contiguous() && q.stride(2) == 1,
              "paged_decode_attention: cache, out, page_table and seq_lens must be contiguous, "
              "and q's rows too");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == cache.scalar_type(),
              "paged_decode_attention: q, out and cache must share a dtype");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: page_table and seq_lens must be int64");
  const int64_t rows = q.size(0);
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == rows && seq_lens.numel() == rows,
              "paged_decode_attention: one page-table row and one length per query row");
  // A task reads whole pages (all KV heads: one contiguous block per page) when there are
  // sequences enough to keep every thread busy; with few, one KV head per task.
  const int64_t kv_heads = cache.size(2);
  const int64_t head_blocks = rows >= 4 * at::get_num_threads() ? 1 : kv_heads;
  Shape s{cache.size(1), value_plane,        cache.size(2), cache.size(3), cache.size(4),
          cache.size(0), q.size(1),          page_table.size(1), q.stride(0), q.stride(1),
          head_blocks,
          static_cast<float>(scale)};
  TORCH_CHECK(q.size(2) == s.head_dim && s.query_heads % s.kv_heads == 0,
              "paged_decode_attention: q's head_dim must match the cache's and its heads be a "
              "multiple of the KV heads");
  TORCH_CHECK(value_plane >= 0 && value_plane < s.planes, "paged_decode_attention: bad plane");
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // Every page a task will read is checked here, before any thread starts: the tasks run
  // without checks (an exception cannot leave an OpenMP region).
  for (int64_t i = 0; i < rows; i++) {
    const int64_t pages = (lens[i] + s.page_size - 1) / s.page_size;
    TORCH_CHECK(lens[i] > 0 && pages <= s.table_stride, "paged_decode_attention: length ",
                lens[i], " of row ", i, " does not fit its page-table row");
    for (int64_t j = 0; j < pages; j++) {
      const int64_t page = table[i * s.table_stride + j];
      TORCH_CHECK(page >= 0 && page < s.num_pages, "paged_decode_attention: page ", page,
                  " of row ", i, " is outside the cache's ", s.num_pages, " pages");
    }
  }
  const int64_t tasks = rows * head_blocks;
  if (cache.scalar_type() == at::kFloat) {
    run<float>(s, tasks, cache, q, out, table, lens, attend_f32);
  } else if (cache.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(s, tasks, cache, q, out, table, lens, attend_bf16);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only, got ",
                cache.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor cache, Tensor page_table, "
      "Tensor seq_lens, int value_plane, float scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
