// The decoder layer's element-wise steps on the CPU, each one pass over its rows: RMSNorm (with
// the residual add before it, optionally), SwiGLU's silu(gate) * up, and RoPE in place.
//
// Why: in PyTorch each of these is three to six kernels, each reading and writing the whole
// activation (RMSNorm in bfloat16: cast up, square, mean, rsqrt, multiply, cast down, multiply by
// the weight). At SmolLM2-135M's shapes on a 2-vCPU AVX-512 VM they took ~12% of a 512-token
// bfloat16 prefill and more of a batch-64 decode step, while the projections ran near the
// cores' peak.
//
// Results equal PyTorch's step by step: where HF's modelling code rounds to the activation
// dtype between two operations, so does this code (bfloat16 by round-to-nearest-even, as
// c10::BFloat16 does), and RoPE's multiply-adds are not contracted into FMAs (its function's
// attribute), so a float32 product is rounded before it is added, as in PyTorch's kernels. What can
// differ: the order of the float32 sum of squares in RMSNorm, and the exp inside silu
// (a polynomial here, Sleef's there); both move a result by at most a unit in the last place of
// float32, which bfloat16 rounding hides almost always.
//
// Registered as torch.ops.pdserve.{rms_norm, add_rms_norm, silu_mul, rotate_} (schemas below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../attention/csrc/vec.h"  // the CPU kernels' shared vector helpers

namespace {

using namespace pdserve_cpu;

typedef uint16_t u16x16 __attribute__((vector_size(32)));

PDSERVE_INLINE void store(float* p, v16 x) { *reinterpret_cast<v16_unaligned*>(p) = x; }

// Round to nearest even, as c10::BFloat16's constructor does (NaN stays a quiet NaN).
PDSERVE_INLINE void store(c10::BFloat16* p, v16 x) {
  u32x16 bits;
  std::memcpy(&bits, &x, sizeof bits);
  const u32x16 rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  const u32x16 out = x != x ? u32x16{} + 0x7fc0u : rounded;
  *reinterpret_cast<u16x16_unaligned*>(p) = __builtin_convertvector(out, u16x16);
}

// x as the activation dtype would hold it: a no-op for float32, a round trip for bfloat16 (the
// rounding HF's code does between two bfloat16 operations).
PDSERVE_INLINE v16 rounded(v16 x, const float*) { return x; }

PDSERVE_INLINE v16 rounded(v16 x, const c10::BFloat16*) {
  u32x16 bits;
  std::memcpy(&bits, &x, sizeof bits);
  const u32x16 even = ((bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16) << 16;
  const u32x16 out = x != x ? bits : even;
  v16 result;
  std::memcpy(&result, &out, sizeof result);
  return result;
}

// Scalar tails (widths that are not a multiple of 16).
PDSERVE_INLINE float load(const float* p, int64_t i) { return p[i]; }
PDSERVE_INLINE float load(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
PDSERVE_INLINE void store(float* p, int64_t i, float x) { p[i] = x; }
PDSERVE_INLINE void store(c10::BFloat16* p, int64_t i, float x) { p[i] = c10::BFloat16(x); }
PDSERVE_INLINE float rounded(float x, const float*) { return x; }
PDSERVE_INLINE float rounded(float x, const c10::BFloat16*) {
  return static_cast<float>(c10::BFloat16(x));
}

// e^x on 16 lanes for silu's 1 + e^-g: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes'
// degree-6 polynomial, 2^n through the exponent bits, with n rounded to nearest by adding
// 1.5 * 2^23 (whose float32 bits then hold n in their low bits). Above ln(FLT_MAX) the result is
// +inf, as expf's (silu(g) is then -0, as torch's); below -86 it is e^-86, which 1 + e^x cannot
// tell from 0. The product goes through 2 * 2^(n-1), so that n = 128 (x just below ln(FLT_MAX))
// does not overflow the scale.
PDSERVE_INLINE v16 exp16(v16 x) {
  const v16 lo = v16{} - 86.0f, hi = v16{} + 88.72283935546875f;
  const v16 clamped = x < lo ? lo : (x > hi ? hi : x);
  const v16 shifted = clamped * 1.44269504088896341f + 12582912.0f;
  const v16 n = shifted - 12582912.0f;
  const v16 p = exp_reduced16(clamped - n * 0.693359375f + n * 2.12194440e-4f);
  i16x16 bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits + 126) << 23;  // 2^(n-1); 1.5 * 2^23's own bits shift out
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const v16 result = (p * 2.0f) * scale;
  return x > hi ? v16{} + __builtin_huge_valf() : result;
}

PDSERVE_INLINE float exp1(float x) {
  v16 v = v16{} + x;
  return exp16(v)[0];
}

// Rows per parallel task: enough values that a thread's start-up is paid for.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// --- RMSNorm --------------------------------------------------------------------------------

// One row: sum = residual + x rounded to T (written back when `sum_out`), then
// out = weight * T(sum * rsqrt(mean(sum^2) + eps)) for bfloat16 (HF's order: normalise in
// float32, cast, then the weight), float32: (sum * rsqrt(...)) * weight.
template <typename T>
PDSERVE_INLINE void norm_row(const T* x, const T* residual, T* sum_out, T* out,
                             const T* weight, int64_t H, float eps, float* scratch) {
  v16 squares = {};
  float tail_squares = 0.0f;
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    v16 v = load16(x + i);
    if (residual != nullptr) {
      v = rounded(v + load16(residual + i), x);
      store(sum_out + i, v);
    }
    store(scratch + i, v);
    squares += v * v;
  }
  for (; i < H; i++) {
    float v = load(x, i);
    if (residual != nullptr) {
      v = rounded(v + load(residual, i), x);
      store(sum_out, i, v);
    }
    scratch[i] = v;
    tail_squares += v * v;
  }
  float total = tail_squares;
  for (int lane = 0; lane < 16; lane++) total += squares[lane];
  const float inv = 1.0f / std::sqrt(total / static_cast<float>(H) + eps);
  for (i = 0; i + 16 <= H; i += 16) {
    store(out + i, rounded(load16(scratch + i) * inv, x) * load16(weight + i));
  }
  for (; i < H; i++) store(out, i, rounded(scratch[i] * inv, x) * load(weight, i));
}

// Rows [begin, end). The instruction-set copies are of this function, not of the lambda that
// at::parallel_for runs (a lambda inside a target_clones function is compiled for the baseline).
template <typename T>
PDSERVE_CLONES void norm_rows(const T* x, int64_t x_stride, const T* residual,
                              int64_t r_stride, T* sum_out, T* out, const T* weight,
                              int64_t begin, int64_t end, int64_t H, float eps) {
  float* scratch = static_cast<float*>(__builtin_alloca(H * sizeof(float)));
  for (int64_t r = begin; r < end; r++) {
    norm_row(x + r * x_stride, residual == nullptr ? nullptr : residual + r * r_stride,
             sum_out == nullptr ? nullptr : sum_out + r * H, out + r * H, weight, H, eps,
             scratch);
  }
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.scalar_type() == like.scalar_type() &&
                  t.device().is_cpu(),
              what, ": expected [rows, width] CPU tensors of one dtype with unit-stride rows");
}

void dispatch_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor* sum_out,
                   const at::Tensor& out, const at::Tensor& weight, double eps,
                   const char* name) {
  check_rows(x, x, name);
  check_rows(out, x, name);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), name,
              ": out must be contiguous and shaped like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight must be [width], contiguous, x's dtype");
  if (residual != nullptr) {
    check_rows(*residual, x, name);
    check_rows(*sum_out, x, name);
    TORCH_CHECK(residual->sizes() == x.sizes() && sum_out->is_contiguous() &&
                    sum_out->sizes() == x.sizes(),
                name, ": residual and sum must be shaped like x, sum contiguous");
  }
  const int64_t N = x.size(0), H = x.size(1);
  const int64_t r_stride = residual == nullptr ? 0 : residual->stride(0);
  const float e = static_cast<float>(eps);
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* res = residual == nullptr ? nullptr : residual->data_ptr<T>();
    T* sum = sum_out == nullptr ? nullptr : sum_out->data_ptr<T>();
    at::parallel_for(0, N, grain(H), [&](int64_t begin, int64_t end) {
      norm_rows<T>(x.data_ptr<T>(), x.stride(0), res, r_stride, sum, out.data_ptr<T>(),
                   weight.data_ptr<T>(), begin, end, H, e);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else if (x.scalar_type() == at::kBFloat16) {
    run(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only, got ", x.scalar_type());
  }
}

// out = RMSNorm(x) * weight; x: [N, H] with unit-stride rows.
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  dispatch_norm(x, nullptr, nullptr, out, weight, eps, "rms_norm");
}

// sum = x + residual (rounded to the dtype, as `x + residual` is), out = RMSNorm(sum) * weight.
void add_rms_norm(const at::Tensor& sum, const at::Tensor& out, const at::Tensor& x,
                  const at::Tensor& residual, const at::Tensor& weight, double eps) {
  dispatch_norm(x, &residual, &sum, out, weight, eps, "add_rms_norm");
}

// --- SwiGLU ---------------------------------------------------------------------------------

// out = T(silu(gate)) * up, silu(g) = g / (1 + e^-g) as torch computes it.
template <typename T>
PDSERVE_CLONES void silu_mul_rows(const T* gate_up, int64_t stride, T* out, int64_t begin,
                                  int64_t end, int64_t I) {
  for (int64_t r = begin; r < end; r++) {
    const T* gate = gate_up + r * stride;
    const T* up = gate + I;
    T* o = out + r * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
      const v16 g = load16(gate + i);
      const v16 silu = rounded(g / (1.0f + exp16(v16{} - g)), gate);
      store(o + i, silu * load16(up + i));
    }
    for (; i < I; i++) {
      const float g = load(gate, i);
      store(o, i, rounded(g / (1.0f + exp1(-g)), gate) * load(up, i));
    }
  }
}

// out [N, I] = silu(gate_up[:, :I]) * gate_up[:, I:] (the fused gate|up projection's output).
void silu_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(gate_up, gate_up, "silu_mul");
  check_rows(out, gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && out.is_contiguous() &&
                  out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1),
              "silu_mul: gate_up must be [N, 2I] and out a contiguous [N, I]");
  const int64_t N = gate_up.size(0), I = out.size(1);
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    at::parallel_for(0, N, grain(2 * I), [&](int64_t begin, int64_t end) {
      silu_mul_rows<T>(gate_up.data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), begin, end,
                       I);
    });
  };
  if (gate_up.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    run(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, "silu_mul: float32 or bfloat16 only, got ", gate_up.scalar_type());
  }
}

// --- RoPE -----------------------------------------------------------------------------------

// x[t, h] = T(x * cos[t]) + T(roll(x, D/2) * sin_signed[t]), in place: with a = x[:D/2] and
// b = x[D/2:], the first half becomes a cos + b sin_signed, the second b cos + a sin_signed.
template <typename T>
PDSERVE_CLONES __attribute__((optimize("fp-contract=off"))) void rotate_rows(
    T* x, int64_t t_stride, int64_t h_stride, const T* cos, const T* sin, int64_t begin,
    int64_t end, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t t = begin; t < end; t++) {
    const T* c = cos + t * D;
    const T* s = sin + t * D;
    for (int64_t h = 0; h < heads; h++) {
      T* row = x + t * t_stride + h * h_stride;
      int64_t i = 0;
      for (; i + 16 <= half; i += 16) {
        const v16 a = load16(row + i), b = load16(row + half + i);
        store(row + i, rounded(a * load16(c + i), row) + rounded(b * load16(s + i), row));
        store(row + half + i,
              rounded(b * load16(c + half + i), row) + rounded(a * load16(s + half + i), row));
      }
      for (; i < half; i++) {
        const float a = load(row, i), b = load(row, half + i);
        store(row, i, rounded(a * load(c, i), row) + rounded(b * load(s, i), row));
        store(row, half + i,
              rounded(b * load(c, half + i), row) + rounded(a * load(s, half + i), row));
      }
    }
  }
}

// x: [T, heads, D] (any row and head strides, unit stride within a head); cos, sin_signed:
// contiguous [T, 1, D] or [T, D] (`RotaryTables`).
void rotate_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu(),
              "rotate_: x must be a CPU [tokens, heads, head_dim] with unit-stride heads");
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2);
  for (const at::Tensor* t : {&cos, &sin_signed}) {
    TORCH_CHECK(t->is_contiguous() && t->numel() == tokens * D &&
                    t->size(0) == tokens && t->size(-1) == D &&
                    t->scalar_type() == x.scalar_type(),
                "rotate_: cos and sin must be contiguous [tokens, (1,) head_dim] of x's dtype");
  }
  TORCH_CHECK(D % 2 == 0, "rotate_: head_dim must be even");
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    at::parallel_for(0, tokens, grain(heads * D), [&](int64_t begin, int64_t end) {
      rotate_rows<T>(x.data_ptr<T>(), x.stride(0), x.stride(1), cos.data_ptr<T>(),
                     sin_signed.data_ptr<T>(), begin, end, heads, D);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else if (x.scalar_type() == at::kBFloat16) {
    run(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, "rotate_: float32 or bfloat16 only, got ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "add_rms_norm(Tensor(a!) sum, Tensor(b!) out, Tensor x, Tensor residual, Tensor weight, "
      "float eps) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotate_(Tensor(a!) x, Tensor cos, Tensor sin_signed) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.impl("rotate_", c10::DispatchKey::CPU, &rotate_);
}
