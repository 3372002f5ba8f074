// Prefill attention on the CPU straight from the paged HND cache: each sequence's new tokens (a
// whole prompt, a prefill chunk after cached context, a verify step's drafts) attend causally to
// the sequence's earlier keys and to each other, keys and values read from the cache where they
// lie (the new tokens' K/V are stored before attention runs), float32 arithmetic for float32 and
// bfloat16 caches alike, except that on CPUs with AVX512_BF16 a bfloat16 cache's scores come
// from bfloat16 dot-product instructions (exact products, float32 sums: 18% off the kernel's
// time at SmolLM2's shapes, 512 and 1800 tokens), and so do its weighted sums of values, over
// the softmax weights rounded to bfloat16 as PyTorch's CPU flash attention rounds them for
// bfloat16 (another 15% off; each weight's rounding moves an output by at most 2^-8 of that
// key's weighted |V|, and about 40% of outputs differ in their last bit from the float32 sums').
//
// Why a kernel of our own: torch's SDPA flash kernel for the CPU reaches ~72 GFLOP/s on SmolLM2's
// 64-wide heads on a 2-vCPU AVX-512 VM, a third of what the projections' GEMMs reach there, and
// a chunk after cached context had to gather its pages and build a mask first. Here a task is
// (sequence, KV head, block of kQueryBlock new tokens); its rows are the block's tokens times the
// KV head's query heads (token-major, so positions never decrease along the rows). Keys come in
// blocks of kBlock: a block's K rows are transposed once into [D][kBlock] float32 (bfloat16 V
// rows are widened once too), then each register block of kRows rows gets its scores as
// vectors of 16 from D broadcast FMAs (no horizontal sums), over only the 16-key tiles those
// rows can see; one online-softmax update per row and key block (one max, one rescale), and the
// weighted V rows go into the rows' accumulators with one V load per kRows FMAs. A causal block
// late in a long prompt costs many times an early one, so tasks are handed out heaviest first
// from a shared counter.
//
// Registered as torch.ops.pdserve.paged_prefill_attention (out-variant, see the schema below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

#if defined(__x86_64__)
#include <immintrin.h>
// The instruction set of the functions that use vdpbf16ps (bfloat16 caches on CPUs with
// AVX512_BF16, checked at run time before any is called).
#define PDSERVE_BF16_DOT target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#endif

namespace {

using namespace pdserve_cpu;

constexpr int64_t kQueryBlock = 64;  // new tokens per task
constexpr int64_t kRows = 4;         // rows per register block
constexpr int64_t kBlock = 64;       // keys per softmax step
constexpr int64_t kTiles = kBlock / 16;  // vectors of scores per row and step

struct Shape {
  int64_t planes, value_plane, kv_heads, page_size, head_dim, num_pages, query_heads;
  int64_t table_stride;
  int64_t q_row_stride, q_head_stride;  // q may be a view (a slice of the fused projection)
  float scale;
};

// Per sequence (row of the page table): its new tokens' first row in q and out, how many, and
// its length counting them.
struct Sequences {
  const int64_t* table;
  const int64_t* query_starts;
  const int64_t* query_lens;
  const int64_t* seq_lens;
};

struct Task {
  int64_t seq, head, first, last;  // new tokens [first, last) of the sequence, one KV head
  int64_t cost;                    // rows times keys seen, for the heaviest-first order
};

// Floats a thread needs for one task: queries and accumulators per row, running max and total
// per row, a transposed K block, a register block's softmax weights, one widened K row, and a
// widened V block (bfloat16 only).
int64_t buffer_floats(const Shape& s) {
  const int64_t rows = kQueryBlock * (s.query_heads / s.kv_heads) + kRows;
  return rows * (2 * s.head_dim + 2) + s.head_dim * (2 * kBlock + 1) + kRows * kBlock;
}

// Scores of kRows rows against the first kT tiles of 16 keys of a transposed K block: kRows x
// kT independent FMA chains, each K vector loaded once for all rows.
template <int64_t kT>
PDSERVE_INLINE void block_scores(const float* __restrict queries, int64_t D,
                                 const float* __restrict keys_t, v16 (&scores)[kRows][kTiles]) {
  for (int64_t i = 0; i < kRows; i++) {
    for (int64_t j = 0; j < kT; j++) scores[i][j] = v16{};
  }
  for (int64_t d = 0; d < D; d++) {
    v16 k[kT];
    for (int64_t j = 0; j < kT; j++) k[j] = load16(keys_t + d * kBlock + j * 16);
    for (int64_t i = 0; i < kRows; i++) {
      const float q = queries[i * D + d];
      for (int64_t j = 0; j < kT; j++) scores[i][j] += q * k[j];
    }
  }
}

#if defined(__x86_64__)
// The AVX512_BF16 form of block_scores for a bfloat16 cache: queries and the K block stay
// bfloat16, two adjacent head dimensions per 32-bit lane (queries: [rows][D/2] pairs, keys:
// [D/2][kBlock] pairs), and vdpbf16ps adds both products of a pair to a score at once: half the
// instructions of the float32 FMAs. Products of two bfloat16 values are exact in float32, so the
// scores differ from the float32 path only in the order of their additions. Unscaled: the caller
// multiplies by the softmax scale. Not inlined (its target differs from its callers' templates;
// one call covers 4 rows by 64 keys).
template <int64_t kT>
__attribute__((PDSERVE_BF16_DOT, noinline)) void
block_scores_bf16_dot(const uint32_t* __restrict queries, int64_t D,
                      const uint32_t* __restrict key_pairs, v16 (&scores)[kRows][kTiles]) {
  __m512 acc[kRows][kT];
  for (int64_t i = 0; i < kRows; i++) {
    for (int64_t j = 0; j < kT; j++) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D / 2; d++) {
    __m512bh k[kT];
    for (int64_t j = 0; j < kT; j++) {
      k[j] = (__m512bh)_mm512_loadu_si512(key_pairs + d * kBlock + j * 16);
    }
    for (int64_t i = 0; i < kRows; i++) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(queries[i * D + d]));
      for (int64_t j = 0; j < kT; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], q, k[j]);
    }
  }
  for (int64_t i = 0; i < kRows; i++) {
    for (int64_t j = 0; j < kT; j++) std::memcpy(&scores[i][j], &acc[i][j], sizeof(v16));
  }
}
#endif

// Four rows' accumulators, kChunks vectors of 16 values each from value column c0, plus the
// block's first n weighted V rows.
template <int64_t kChunks>
PDSERVE_INLINE void add_values(float* __restrict acc, int64_t D, int64_t c0,
                               const float* __restrict weights, const float* const* values,
                               int64_t n) {
  v16 a[kRows][kChunks];
  for (int64_t i = 0; i < kRows; i++) {
    for (int64_t c = 0; c < kChunks; c++) a[i][c] = load16(acc + i * D + c0 + c * 16);
  }
  for (int64_t t = 0; t < n; t++) {
    v16 v[kChunks];
    for (int64_t c = 0; c < kChunks; c++) v[c] = load16(values[t] + c0 + c * 16);
    for (int64_t i = 0; i < kRows; i++) {
      const float w = weights[i * kBlock + t];
      for (int64_t c = 0; c < kChunks; c++) a[i][c] += w * v[c];
    }
  }
  for (int64_t i = 0; i < kRows; i++) {
    for (int64_t c = 0; c < kChunks; c++) {
      std::memcpy(acc + i * D + c0 + c * 16, &a[i][c], sizeof(v16));
    }
  }
}

#if defined(__x86_64__)
// The AVX512_BF16 form of add_values for a bfloat16 cache: the block's V rows taken two keys at
// a time ([pairs][D] 32-bit lanes holding V[2p][d] and V[2p + 1][d]) and the rows' softmax
// weights rounded to bfloat16 pairs ([kRows][kBlock / 2]), so one vdpbf16ps adds two keys'
// weighted values to 16 accumulators: half the instructions of the float32 FMAs, and no
// widening of V. kChunks vectors of 16 from value column c0, as add_values.
template <int64_t kChunks>
__attribute__((PDSERVE_BF16_DOT, noinline)) void
add_values_bf16_dot(float* __restrict acc, int64_t D, int64_t c0,
                    const uint32_t* __restrict weight_pairs,
                    const uint32_t* __restrict value_pairs, int64_t pairs) {
  __m512 a[kRows][kChunks];
  for (int64_t i = 0; i < kRows; i++) {
    for (int64_t c = 0; c < kChunks; c++) a[i][c] = _mm512_loadu_ps(acc + i * D + c0 + c * 16);
  }
  for (int64_t p = 0; p < pairs; p++) {
    __m512bh v[kChunks];
    for (int64_t c = 0; c < kChunks; c++) {
      v[c] = (__m512bh)_mm512_loadu_si512(value_pairs + p * D + c0 + c * 16);
    }
    for (int64_t i = 0; i < kRows; i++) {
      const __m512bh w =
          (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[i * (kBlock / 2) + p]));
      for (int64_t c = 0; c < kChunks; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], w, v[c]);
    }
  }
  for (int64_t i = 0; i < kRows; i++) {
    for (int64_t c = 0; c < kChunks; c++) _mm512_storeu_ps(acc + i * D + c0 + c * 16, a[i][c]);
  }
}

// The register block's weights ([kRows][kBlock] float32, the first `tiles` vectors of 16 of each
// row written) as bfloat16 pairs, rounded to nearest even: key 2p's in a lane's low half, key
// 2p + 1's in its high half.
__attribute__((PDSERVE_BF16_DOT, noinline)) void
weights_to_bf16_pairs(const float* __restrict weights, int64_t tiles,
                      uint32_t* __restrict weight_pairs) {
  for (int64_t i = 0; i < kRows; i++) {
    const float* w = weights + i * kBlock;
    uint32_t* out = weight_pairs + i * (kBlock / 2);
    for (int64_t j = 0; j < tiles; j += 2) {
      const __m512 low = _mm512_loadu_ps(w + 16 * j);
      const __m512 high = j + 1 < tiles ? _mm512_loadu_ps(w + 16 * (j + 1)) : _mm512_setzero_ps();
      _mm512_storeu_si512(out + 8 * j, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
  }
}
#endif

// kDim: the head dimension when known at compile time, 0 for any other multiple of 16. kDot:
// scores by block_scores_bf16_dot (bfloat16 caches on CPUs with AVX512_BF16).
template <int64_t kDim, bool kDot, typename T>
PDSERVE_INLINE void attend(const Shape& s, const T* cache, const T* q, T* out,
                           const Sequences& seqs, const Task& task, float* buffer) {
  const int64_t D = kDim > 0 ? kDim : s.head_dim;
  const int64_t group = s.query_heads / s.kv_heads, P = s.page_size;
  const int64_t seq = task.seq, head = task.head;
  const int64_t context = seqs.seq_lens[seq] - seqs.query_lens[seq];
  const int64_t q_start = seqs.query_starts[seq];
  const int64_t* table = seqs.table + seq * s.table_stride;
  const int64_t rows = (task.last - task.first) * group;
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;  // padding repeats the last row
  float* queries = buffer;
  float* acc = queries + padded * D;
  float* max_score = acc + padded * D;
  float* total = max_score + padded;
  float* keys_t = total + padded;  // [D][kBlock]
  float* weights = keys_t + D * kBlock;  // [kRows][kBlock]
  float* key_row = weights + kRows * kBlock;
  // [kBlock][D] float32 V rows; with kDot, [kBlock / 2][D] pairs of bfloat16 ones instead.
  float* value_rows = key_row + D;
  // With kDot, key t's bfloat16 V values: every other half of pair t / 2's lanes.
  auto value_halves = [&](int64_t t) {
    return reinterpret_cast<uint16_t*>(value_rows) + (t / 2) * 2 * D + t % 2;
  };
  auto position = [&](int64_t r) { return context + task.first + std::min(r, rows - 1) / group; };
  for (int64_t r = 0; r < padded; r++) {
    const int64_t last = std::min(r, rows - 1);
    const int64_t token = task.first + last / group, g = last % group;
    const T* row = q + (q_start + token) * s.q_row_stride + (head * group + g) * s.q_head_stride;
    float* query = queries + r * D;
    if constexpr (kDot) {
      std::memcpy(query, row, D * sizeof(T));  // D / 2 pairs at the start of the row's slot
    } else {
      const float* widened = as_float(row, D, query);
      // The scale goes into the queries once, not into every score.
      for (int64_t d = 0; d < D; d++) query[d] = widened[d] * s.scale;
    }
    max_score[r] = -std::numeric_limits<float>::max();
    total[r] = 0.0f;
  }
  std::memset(acc, 0, padded * D * sizeof(float));
  const int64_t page_elems = s.planes * s.kv_heads * P * D;
  const int64_t value_offset = s.value_plane * s.kv_heads * P * D;
  // V rows as float32: where they lie in a float32 cache; widened once per block from a
  // bfloat16 one (every register block of the task reads them).
  const float* values[kBlock];
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 lowest = v16{} - std::numeric_limits<float>::max();
  const int64_t key_end = context + task.last;  // keys the block's last token sees
  for (int64_t k0 = 0; k0 < key_end; k0 += kBlock) {
    const int64_t n = std::min(kBlock, key_end - k0);
    for (int64_t t = 0; t < kBlock; t++) {
      if (t < n) {
        const int64_t key = k0 + t;
        const T* k_row = cache + table[key / P] * page_elems + (head * P + key % P) * D;
        if constexpr (kDot) {
          uint32_t* pairs = reinterpret_cast<uint32_t*>(keys_t);
          for (int64_t d = 0; d < D / 2; d++) std::memcpy(&pairs[d * kBlock + t], k_row + 2 * d, 4);
        } else {
          const float* k = as_float(k_row, D, key_row);
          for (int64_t d = 0; d < D; d++) keys_t[d * kBlock + t] = k[d];
        }
        if constexpr (kDot) {
          const uint16_t* v = reinterpret_cast<const uint16_t*>(k_row + value_offset);
          uint16_t* halves = value_halves(t);
          for (int64_t d = 0; d < D; d++) halves[2 * d] = v[d];
        } else {
          values[t] = as_float(k_row + value_offset, D, value_rows + t * D);
        }
      } else {
        // Zero bits are 0.0 as a float32 and as a pair of bfloat16 alike.
        for (int64_t d = 0; d < D; d++) keys_t[d * kBlock + t] = 0.0f;
        if constexpr (kDot) {
          uint16_t* halves = value_halves(t);
          for (int64_t d = 0; d < D; d++) halves[2 * d] = 0;
        } else {
          values[t] = values[0];
        }
      }
    }
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
      // Keys this register block's last (latest) row sees, in this block; none: the whole
      // block is in these rows' future.
      const int64_t seen = std::min(n, position(r0 + kRows - 1) - k0 + 1);
      if (seen <= 0) continue;
      const int64_t tiles = (seen + 15) / 16;
      v16 scores[kRows][kTiles];
      const float* qr = queries + r0 * D;
      if constexpr (kDot) {
#if defined(__x86_64__)
        const uint32_t* qp = reinterpret_cast<const uint32_t*>(qr);
        const uint32_t* kp = reinterpret_cast<const uint32_t*>(keys_t);
        switch (tiles) {
          case 1: block_scores_bf16_dot<1>(qp, D, kp, scores); break;
          case 2: block_scores_bf16_dot<2>(qp, D, kp, scores); break;
          case 3: block_scores_bf16_dot<3>(qp, D, kp, scores); break;
          default: block_scores_bf16_dot<4>(qp, D, kp, scores); break;
        }
        for (int64_t i = 0; i < kRows; i++) {
          for (int64_t j = 0; j < tiles; j++) scores[i][j] *= s.scale;
        }
#endif
      } else {
        switch (tiles) {
          case 1: block_scores<1>(qr, D, keys_t, scores); break;
          case 2: block_scores<2>(qr, D, keys_t, scores); break;
          case 3: block_scores<3>(qr, D, keys_t, scores); break;
          default: block_scores<4>(qr, D, keys_t, scores); break;
        }
      }
      for (int64_t i = 0; i < kRows; i++) {
        const int64_t r = r0 + i;
        const float visible = static_cast<float>(std::min(n, position(r) - k0 + 1));
        float* w = weights + i * kBlock;
        if (visible <= 0) {
          std::memset(w, 0, tiles * 16 * sizeof(float));
          continue;
        }
        v16 top = lowest;
        for (int64_t j = 0; j < tiles; j++) {
          const v16 masked = lane + static_cast<float>(16 * j) < visible ? scores[i][j] : lowest;
          top = masked > top ? masked : top;
        }
        const float block_max = std::max(max_score[r], lane_max(top));
        v16 sum = {};
        for (int64_t j = 0; j < tiles; j++) {
          const v16 e = exp16_nonpositive(scores[i][j] - block_max);
          const v16 weight = lane + static_cast<float>(16 * j) < visible ? e : v16{};
          sum += weight;
          std::memcpy(w + 16 * j, &weight, sizeof weight);
        }
        const float correction = exp_nonpositive(max_score[r] - block_max);
        max_score[r] = block_max;
        total[r] = total[r] * correction + lane_sum(sum);
        if (correction != 1.0f) {
          float* a = acc + r * D;
          for (int64_t d = 0; d < D; d++) a[d] *= correction;
        }
      }
      float* a = acc + r0 * D;
      if constexpr (kDot) {
#if defined(__x86_64__)
        uint32_t weight_pairs[kRows * kBlock / 2];
        weights_to_bf16_pairs(weights, tiles, weight_pairs);
        const uint32_t* vp = reinterpret_cast<const uint32_t*>(value_rows);
        const int64_t pairs = (seen + 1) / 2;  // an odd last key pairs with a zero weight
        if (D % 64 == 0) {
          for (int64_t c0 = 0; c0 < D; c0 += 64) {
            add_values_bf16_dot<4>(a, D, c0, weight_pairs, vp, pairs);
          }
        } else {
          for (int64_t c0 = 0; c0 < D; c0 += 16) {
            add_values_bf16_dot<1>(a, D, c0, weight_pairs, vp, pairs);
          }
        }
#endif
      } else if (D % 32 == 0) {
        for (int64_t c0 = 0; c0 < D; c0 += 32) add_values<2>(a, D, c0, weights, values, seen);
      } else {
        for (int64_t c0 = 0; c0 < D; c0 += 16) add_values<1>(a, D, c0, weights, values, seen);
      }
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    const int64_t token = task.first + r / group, g = r % group;
    T* row = out + ((q_start + token) * s.query_heads + head * group + g) * D;
    store(row, acc + r * D, 1.0f / total[r], D);
  }
}

template <bool kDot, typename T>
PDSERVE_INLINE void attend_any_dim(const Shape& s, const T* cache, const T* q, T* out,
                                   const Sequences& seqs, const Task& task, float* buffer) {
  switch (s.head_dim) {
    case 64: return attend<64, kDot>(s, cache, q, out, seqs, task, buffer);
    case 128: return attend<128, kDot>(s, cache, q, out, seqs, task, buffer);
    default: return attend<0, kDot>(s, cache, q, out, seqs, task, buffer);
  }
}

// target_clones takes plain functions, not templates: one per cache dtype.
PDSERVE_CLONES void attend_f32(const Shape& s, const float* cache, const float* q, float* out,
                               const Sequences& seqs, const Task& task, float* buffer) {
  attend_any_dim<false>(s, cache, q, out, seqs, task, buffer);
}

PDSERVE_CLONES void attend_bf16(const Shape& s, const c10::BFloat16* cache,
                                const c10::BFloat16* q, c10::BFloat16* out,
                                const Sequences& seqs, const Task& task, float* buffer) {
  attend_any_dim<false>(s, cache, q, out, seqs, task, buffer);
}

#if defined(__x86_64__)
__attribute__((PDSERVE_BF16_DOT)) void
attend_bf16_dot(const Shape& s, const c10::BFloat16* cache, const c10::BFloat16* q,
                c10::BFloat16* out, const Sequences& seqs, const Task& task, float* buffer) {
  attend_any_dim<true>(s, cache, q, out, seqs, task, buffer);
}
#endif

template <typename T, typename Attend>
void run(const Shape& s, const std::vector<Task>& tasks, const at::Tensor& cache,
         const at::Tensor& q, const at::Tensor& out, const Sequences& seqs, Attend attend) {
  const T* c = cache.data_ptr<T>();
  const T* qp = q.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  std::atomic<int64_t> next{0};
  // One range element per thread; each takes the next task off the shared counter (tasks are
  // sorted heaviest first), so uneven causal blocks do not leave a thread idle at the end.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> buffer(buffer_floats(s));
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      attend(s, c, qp, o, seqs, tasks[i], buffer.data());
    }
  });
}

// out, q: [T, Hq, D] (rows of every sequence's new tokens; rows not named below are left as
// they are); cache: one layer, [pages, planes, Hk, P, D]; page_table: [S, >= pages of the
// longest] int64; query_starts, query_lens, seq_lens: [S] int64: sequence i's new tokens are
// rows query_starts[i] .. + query_lens[i] of q and out, the last of its seq_lens[i] tokens,
// all of whose K/V are in the cache.
void paged_prefill_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& cache,
                             const at::Tensor& page_table, const at::Tensor& query_starts,
                             const at::Tensor& query_lens, const at::Tensor& seq_lens,
                             int64_t value_plane, double scale) {
  TORCH_CHECK(cache.dim() == 5 && q.dim() == 3 && out.sizes() == q.sizes(),
              "paged_prefill_attention: expected cache [pages, planes, Hk, P, D] and q, out "
              "[T, Hq, D]");
  TORCH_CHECK(cache.is_contiguous() && out.is_contiguous() && page_table.is_contiguous() &&
                  query_starts.is_contiguous() && query_lens.is_contiguous() &&
                  seq_lens.is_contiguous() && q.stride(2) == 1,
              "paged_prefill_attention: cache, out and the int64 tensors must be contiguous, "
              "and q's rows too");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == cache.scalar_type(),
              "paged_prefill_attention: q, out and cache must share a dtype");
  for (const at::Tensor* t : {&page_table, &query_starts, &query_lens, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, "paged_prefill_attention: page_table, "
                "query_starts, query_lens and seq_lens must be int64");
  }
  const int64_t num_seqs = page_table.size(0);
  TORCH_CHECK(page_table.dim() == 2 && query_starts.numel() == num_seqs &&
                  query_lens.numel() == num_seqs && seq_lens.numel() == num_seqs,
              "paged_prefill_attention: one page-table row, query start, query length and "
              "length per sequence");
  Shape s{cache.size(1), value_plane,   cache.size(2), cache.size(3),      cache.size(4),
          cache.size(0), q.size(1),     page_table.size(1), q.stride(0), q.stride(1),
          static_cast<float>(scale)};
  TORCH_CHECK(q.size(2) == s.head_dim && s.head_dim % 16 == 0 &&
                  s.query_heads % s.kv_heads == 0,
              "paged_prefill_attention: q's head_dim must match the cache's and be a multiple "
              "of 16, and its heads a multiple of the KV heads");
  TORCH_CHECK(value_plane >= 0 && value_plane < s.planes, "paged_prefill_attention: bad plane");
  const Sequences seqs{page_table.data_ptr<int64_t>(), query_starts.data_ptr<int64_t>(),
                       query_lens.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>()};
  // Everything a task will read or write is checked here, before any thread starts: the tasks
  // run without checks (an exception cannot leave an OpenMP region).
  const int64_t group = s.query_heads / s.kv_heads;
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_seqs; i++) {
    const int64_t start = seqs.query_starts[i], n = seqs.query_lens[i], len = seqs.seq_lens[i];
    TORCH_CHECK(n > 0 && n <= len && start >= 0 && start + n <= q.size(0),
                "paged_prefill_attention: sequence ", i, " has ", n, " new tokens from row ",
                start, " and length ", len, ", which do not fit q's ", q.size(0), " rows");
    const int64_t pages = (len + s.page_size - 1) / s.page_size;
    TORCH_CHECK(pages <= s.table_stride, "paged_prefill_attention: length ", len,
                " of sequence ", i, " does not fit its page-table row");
    for (int64_t j = 0; j < pages; j++) {
      const int64_t page = seqs.table[i * s.table_stride + j];
      TORCH_CHECK(page >= 0 && page < s.num_pages, "paged_prefill_attention: page ", page,
                  " of sequence ", i, " is outside the cache's ", s.num_pages, " pages");
    }
    for (int64_t first = 0; first < n; first += kQueryBlock) {
      const int64_t last = std::min(n, first + kQueryBlock);
      const int64_t cost = (last - first) * group * (len - n + last);
      for (int64_t head = 0; head < s.kv_heads; head++) tasks.push_back({i, head, first, last, cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  if (tasks.empty()) return;
  if (cache.scalar_type() == at::kFloat) {
    run<float>(s, tasks, cache, q, out, seqs, attend_f32);
  } else if (cache.scalar_type() == at::kBFloat16) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512bf16")) {
      run<c10::BFloat16>(s, tasks, cache, q, out, seqs, attend_bf16_dot);
      return;
    }
#endif
    run<c10::BFloat16>(s, tasks, cache, q, out, seqs, attend_bf16);
  } else {
    TORCH_CHECK(false, "paged_prefill_attention: float32 or bfloat16 only, got ",
                cache.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor cache, Tensor page_table, "
      "Tensor query_starts, Tensor query_lens, Tensor seq_lens, int value_plane, float scale) "
      "-> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}
